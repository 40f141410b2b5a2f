"""Where blocks are, kept by their home nodes (sans-I/O; the clock is passed in).

Three parts, one per role a daemon plays for a block:

- :class:`HomeRecords`, the home's side: for the buckets this daemon is a home of
  (:mod:`kvcached.cluster.placement`), which members hold which block. Filled by the holders'
  announcements (gained, dropped, and a full listing when a holder (re)connects), emptied of a
  member the moment its lease ends (:meth:`HomeRecords.forget`), and of the buckets it is no
  longer a home of once the move's grace is over.
- :class:`Publisher`, the holder's side: the blocks this daemon gained and dropped, batched per
  home; after the homes of some buckets changed, its blocks in them, for their new homes.
- :class:`LookupPlan`, the asker's side: which home to ask for which key, one request per home.

Keys are wire keys (``digest | u32 layer``, :func:`kvcached.peers.directory.wire_key`), the
bytes the peer protocol carries: no hashing on receipt. A record costs one dict entry (the key
and a small int, or a tuple of ints where several members hold the block; members are interned
as ints).

During a move (a member joined or left), a lookup of a moved bucket asks both its first usable
new home and its first usable old home, for ``grace_s`` after the change: the old home still has
the records until the holders have re-published to the new one (one announcement round, plus a
connection), and asking both costs one more request only for the moved buckets. Why not a
grace period alone: for a join, the new home is empty until the holders re-publish, and a
lookup in that window would miss blocks that are there.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from kvcached.cluster.listing import OUT_OF_ORDER, PartedListings
from kvcached.cluster.placement import Moves, Placement

__all__ = ["HomeRecords", "Publisher", "LookupPlan", "MOVE_GRACE_S", "MAX_HOLDERS"]

MOVE_GRACE_S = 10.0          # a moved bucket is asked of its old home too, this long after the move
MAX_HOLDERS = 64             # holders a Located answer names per block (the peer protocol's limit)
TUPLE_MAX = 8                # a record of more holders is a set

Holders = int | tuple[int, ...] | set[int]


def _has(have: Holders, ident: int) -> bool:
    return have == ident if isinstance(have, int) else ident in have


class HomeRecords:
    """The location records a home keeps (see the module). ``bucket_of(key)`` says a wire
    key's bucket (:meth:`Placement.bucket_of_key`), used to drop what this home no longer homes."""

    def __init__(self, bucket_of: Callable[[bytes], int]) -> None:
        self.bucket_of = bucket_of
        self._records: dict[bytes, Holders] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next = 0
        self._listings = PartedListings()                              # each holder's listing in progress
        self.forgotten = 0          # records dropped because their holder left

    def __len__(self) -> int:
        return len(self._records)

    def _id(self, name: str) -> int:
        ident = self._ids.get(name)
        if ident is None:
            ident = self._ids[name] = self._next
            self._names[ident] = name
            self._next += 1
        return ident

    # -- what holders say --

    def gained(self, holder: str, keys: Iterable[bytes]) -> None:
        """``holder`` holds ``keys``. A record is a small int (one holder), a tuple (a few), or,
        past TUPLE_MAX holders, a set: a block every member holds costs O(1) per gain and drop,
        not a copy of N ids (an answer names at most MAX_HOLDERS of them)."""
        ident, records = self._id(holder), self._records
        for key in keys:
            have = records.get(key)
            if have is None:
                records[key] = ident
            elif isinstance(have, int):
                if have != ident:
                    records[key] = (have, ident)
            elif isinstance(have, tuple):
                if ident not in have:
                    records[key] = have + (ident,) if len(have) < TUPLE_MAX else {*have, ident}
            else:
                have.add(ident)

    def dropped(self, holder: str, keys: Iterable[bytes]) -> None:
        ident = self._ids.get(holder)
        if ident is None:
            return
        for key in keys:
            self._without(key, ident)

    def listing(self, holder: str, listing_id: int, part: int, last: bool, keys: Sequence[bytes]) -> bool:
        """One part of a holder's full listing of its blocks homed here. When the last part is
        in, it replaces all that was recorded of that holder (the parts before stay unused till
        then). Parts must come in order under one listing id; returns False (and abandons the
        listing) for a part out of order."""
        listed = self._listings.part(holder, listing_id, part, last, keys)
        if listed is OUT_OF_ORDER:
            return False
        if not isinstance(listed, set):
            return True
        ident = self._id(holder)
        stale = [key for key, have in self._records.items() if key not in listed and _has(have, ident)]
        for key in stale:
            self._without(key, ident)
        self.gained(holder, listed)
        return True

    def forget(self, holder: str) -> int:
        """Drop every record of ``holder`` (its lease ended); returns how many keys it held."""
        ident = self._ids.pop(holder, None)
        self._listings.forget(holder)
        if ident is None:
            return 0
        del self._names[ident]
        mine = [key for key, have in self._records.items() if _has(have, ident)]
        for key in mine:
            self._without(key, ident)
        self.forgotten += len(mine)
        return len(mine)

    def keep_buckets(self, homed: Callable[[int], bool]) -> int:
        """Drop the records of every bucket ``homed`` says this home no longer homes; returns how many."""
        gone = [key for key in self._records if not homed(self.bucket_of(key))]
        for key in gone:
            del self._records[key]
        return len(gone)

    def _without(self, key: bytes, ident: int) -> None:
        have = self._records.get(key)
        if have is None:
            return
        if isinstance(have, int):
            if have == ident:
                del self._records[key]
            return
        if isinstance(have, set):
            have.discard(ident)
            if len(have) > TUPLE_MAX // 2:
                return
        rest = tuple(i for i in have if i != ident)
        if not rest:
            del self._records[key]
        else:
            self._records[key] = rest[0] if len(rest) == 1 else rest

    # -- what askers want --

    def holders(self, key: bytes, limit: int | None = MAX_HOLDERS) -> tuple[str, ...]:
        """The members that hold ``key``: at most ``limit`` of them (what one answer names;
        None: all, for checks)."""
        have = self._records.get(key)
        if have is None:
            return ()
        names = self._names
        if isinstance(have, int):
            return (names[have],)
        return tuple(names[i] for i in itertools.islice(have, limit))

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        return [self.holders(key) for key in keys]

    def keys_of(self, holder: str) -> list[bytes]:
        """Every key recorded for ``holder`` (tests, Stats)."""
        ident = self._ids.get(holder)
        if ident is None:
            return []
        return [key for key, have in self._records.items() if _has(have, ident)]


@dataclass
class Publisher:
    """What this daemon (``me``) tells the homes of its blocks (see the module).

    :meth:`changed` takes what the index gained and dropped (wire key -> held); :meth:`take`
    hands out, per home, what is due to it. After a membership change, :meth:`moved` queues this
    daemon's blocks of each moved bucket for the homes that bucket gained."""

    me: str
    placement: Placement
    pending: dict[str, dict[bytes, bool]] = field(default_factory=lambda: defaultdict(dict))

    def changed(self, changes: dict[bytes, bool]) -> None:
        homes_of, bucket_of, pending = self.placement.homes_of, self.placement.bucket_of_key, self.pending
        for key, held in changes.items():
            for home in homes_of(bucket_of(key)):
                pending[home][key] = held

    def moved(self, moves: Moves, held: Iterable[bytes]) -> int:
        """Queue this daemon's blocks (``held``, its wire keys) of the moved buckets for their
        new homes; returns how many announcements that made."""
        due = self.announcements_for(moves, held)
        for home, keys in due.items():
            self.pending[home].update(dict.fromkeys(keys, True))
        return sum(map(len, due.values()))

    def announcements_for(self, moves: Moves, held: Iterable[bytes]) -> dict[str, list[bytes]]:
        """Per new home, this daemon's blocks of the buckets that gained it. Reads only
        ``moves`` and the placement's bucket function, so a worker thread may run it (a daemon
        holds a million blocks: a BLAKE3 hash each)."""
        if not len(moves):
            return {}
        gains = moves.gains()
        rows = gains.any(axis=1)
        if not rows.any():
            return {}
        gained = np.zeros(self.placement.buckets, dtype=bool)
        gained[moves.buckets[rows]] = True
        bucket_of = self.placement.bucket_of_key
        homes: dict[int, list[str]] = {}
        due: dict[str, list[bytes]] = defaultdict(list)
        for key in held:
            bucket = bucket_of(key)
            if gained[bucket]:
                names = homes.get(bucket)
                if names is None:
                    i = moves.position(bucket)
                    names = homes[bucket] = moves.gained_homes(i, gains) if i is not None else []
                for home in names:
                    due[home].append(key)
        return dict(due)

    def forget_home(self, home: str) -> None:
        """``home`` left: nothing more is due to it."""
        self.pending.pop(home, None)

    def take(self, home: str) -> dict[bytes, bool]:
        return self.pending.pop(home, {})

    def due(self) -> list[str]:
        return [home for home, keys in self.pending.items() if keys]


@dataclass
class LookupPlan:
    """Which home to ask for which key (see the module). ``usable(name)`` says whether a member
    may be asked now (alive, not backed off); the moves of the last ``grace_s`` say which
    buckets are also asked of their old homes."""

    placement: Placement
    grace_s: float = MOVE_GRACE_S
    _batches: deque[tuple[float, Moves]] = field(default_factory=deque)   # (when, moves), oldest first

    def moved(self, moves: Moves, now: float) -> None:
        if len(moves):
            self._batches.append((now, moves))

    @property
    def moving(self) -> int:
        """Buckets moved within the grace (counted once per move)."""
        return sum(len(moves) for _, moves in self._batches)

    def old_homes(self, bucket: int, now: float) -> tuple[str, ...]:
        """The homes ``bucket`` had before the moves of the last ``grace_s``, the latest move's
        first; () if it did not move."""
        out: dict[str, None] = {}
        for at, moves in reversed(self._batches):
            if now - at >= self.grace_s:
                break
            i = moves.position(bucket)
            if i is not None:
                out.update(dict.fromkeys(moves.old_homes(i)))
        return tuple(out)

    def expire(self, now: float) -> int:
        """Forget the moves older than the grace; returns how many buckets that was (a home
        then drops the records of those it no longer homes). Costs nothing while no move is
        due (it is called every announcement round)."""
        gone = 0
        while self._batches and now - self._batches[0][0] >= self.grace_s:
            gone += len(self._batches.popleft()[1])
        return gone

    def plan(self, keys: Sequence[bytes], usable: Callable[[str], bool], now: float,
             asked: dict[bytes, set[str]] | None = None) -> dict[str, list[bytes]]:
        """Per home, the keys to ask it for: each key of the first usable home of its bucket,
        and, for a bucket moved within the grace, of its first usable old home as well. With
        ``asked`` (key -> homes asked for it already: a retry, a hedge), those homes are passed
        over for that key, and the homes chosen now are added to it. A key no usable home is
        left for is in no list (a miss: nobody can say where it is)."""
        asks: dict[str, list[bytes]] = defaultdict(list)
        homes_of, bucket_of, moving = self.placement.homes_of, self.placement.bucket_of_key, bool(self._batches)
        none: set[str] = set()
        for key in keys:
            skip = asked.setdefault(key, set()) if asked is not None else none
            bucket = bucket_of(key)
            first = next((h for h in homes_of(bucket) if h not in skip and usable(h)), None)
            if first is not None:
                asks[first].append(key)
            old = None
            if moving:
                old = next((h for h in self.old_homes(bucket, now) if h != first and h not in skip and usable(h)), None)
                if old is not None:
                    asks[old].append(key)
            if asked is not None:
                skip.update(h for h in (first, old) if h is not None)
        return dict(asks)
