"""Which members are the homes of a block: rendezvous hashing over buckets (sans-I/O).

A block's location record is kept by ``replicas`` home nodes. The homes of a key are its
bucket's homes: the key's index key (BLAKE3, uniform) picks one of ``2**bits`` buckets by its
first bytes, and each bucket's homes are the ``replicas`` live members with the highest
rendezvous score ``mix64(bucket * golden ^ seed(member))`` (highest random weight). Every node
that sees the same members computes the same homes, whatever order it learnt them in.

Why buckets: a per-key rendezvous pass costs one hash per member per key (1,000 members, 64
keys: 64,000 hashes a lookup); over buckets the table is computed once per membership change
(vectorised, numpy) and a lookup is one row read. Rendezvous keeps its property per bucket: a
member that joins takes only the buckets where it scores in the top ``replicas``, one that
leaves gives up only the buckets it was a home of, so only those buckets' records move.
``bits`` sets the balance: each member homes about ``2**bits * replicas / members`` buckets,
and the spread around that shrinks with the count (18 bits: about 524 buckets a member at
1,000 members with 2 replicas, the busiest about 1.15x the mean).

Scores are 64-bit: two members tie on a bucket with probability about 2**-64 per pair, and a
tie goes to the lower seed, so it is still the same on every node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, overload

import blake3
import numpy as np

from kvcached_agent.address import index_key_of_wire

__all__ = ["Placement", "Move", "Moves", "member_seed", "score", "MAX_BITS"]

MAX_BITS = 24
REBUILD_JOINS = 16           # more members joining at once than this: the table is computed afresh
CHUNK_SCORES = 1 << 22       # scores computed at once in a rebuild (32 MiB of uint64)
ROWS_KEPT = 1 << 16          # buckets whose homes are kept as names between changes
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def member_seed(name: str) -> int:
    """A member's 64-bit rendezvous seed: the first 8 bytes of BLAKE3 of its name."""
    return int.from_bytes(blake3.blake3(b"kvcached-member\x00" + name.encode()).digest()[:8], "little")


def score(bucket: int, seed: int) -> int:
    """The rendezvous score of a member (by its seed) for a bucket: splitmix64's finaliser of
    ``bucket * golden ^ seed``. The reference for the vectorised table (tests compare them)."""
    z = ((bucket * _GOLDEN) & _MASK) ^ seed
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _scores(buckets: np.ndarray, seed: int | np.ndarray) -> np.ndarray:
    """:func:`score` over an array of ``bucket * golden`` values (uint64, wrapping); ``seed``
    one seed, or an array broadcast against ``buckets``."""
    z = buckets ^ (seed if isinstance(seed, np.ndarray) else np.uint64(seed))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class Move:
    """A bucket whose homes changed: what they were and what they are (best first)."""

    bucket: int
    old: tuple[str, ...]
    new: tuple[str, ...]


class Moves(Sequence[Move]):
    """The buckets whose homes changed in one membership change. Kept as arrays, not Move
    objects: a start moves every bucket (262,144 at 18 bits), and building a Move for each took
    a daemon's event loop a second. Indexing or iterating still gives Moves (tests, the
    simulation); the daemon's paths use :meth:`position`, :meth:`old_homes` and :meth:`gains`.
    ``old_ids``/``new_ids`` are the homes' seeds (0 for an empty place): how members compare."""

    def __init__(self, buckets: np.ndarray, old: np.ndarray, new: np.ndarray, old_names: list[str | None],
                 new_names: list[str | None], old_ids: np.ndarray, new_ids: np.ndarray) -> None:
        self.buckets, self.old, self.new = buckets, old, new            # sorted buckets; (k, r) slots
        self._old_names, self._new_names = old_names, new_names
        self.old_ids, self.new_ids = old_ids, new_ids

    def __len__(self) -> int:
        return int(self.buckets.size)

    @overload
    def __getitem__(self, i: int) -> Move: ...
    @overload
    def __getitem__(self, i: slice) -> list[Move]: ...

    def __getitem__(self, i: int | slice) -> Move | list[Move]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Move(int(self.buckets[i]), self.old_homes(i), self.new_homes(i))

    def position(self, bucket: int) -> int | None:
        """Where ``bucket`` is in these moves, or None if it did not move."""
        i = int(np.searchsorted(self.buckets, bucket))
        return i if i < self.buckets.size and self.buckets[i] == bucket else None

    def old_homes(self, i: int) -> tuple[str, ...]:
        names = self._old_names
        return tuple(names[s] for s in self.old[i].tolist() if s >= 0)

    def new_homes(self, i: int) -> tuple[str, ...]:
        names = self._new_names
        return tuple(names[s] for s in self.new[i].tolist() if s >= 0)

    def gains(self) -> np.ndarray:
        """(k, replicas) bool: which of each moved bucket's new homes were not among its old ones."""
        fresh = (self.new_ids[:, :, None] != self.old_ids[:, None, :]).all(axis=2)
        return fresh & (self.new >= 0)

    def gained_homes(self, i: int, gains: np.ndarray) -> list[str]:
        """The homes bucket ``i`` gained (``gains`` from :meth:`gains`)."""
        names = self._new_names
        return [names[s] for s, g in zip(self.new[i].tolist(), gains[i].tolist()) if g]


class Placement:
    """The homes of every bucket for one set of members, kept up to date as members join and
    leave (:meth:`join`, :meth:`leave`, :meth:`set_members`, each returning the buckets that
    moved). ``replicas`` homes per bucket, or every member where there are fewer."""

    def __init__(self, replicas: int = 2, bits: int = 18) -> None:
        if not 1 <= replicas <= 16:
            raise ValueError(f"replicas must be in 1..16, got {replicas}")
        if not 1 <= bits <= MAX_BITS:
            raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
        self.replicas, self.bits = replicas, bits
        self.buckets = 1 << bits
        self._keys = np.arange(self.buckets, dtype=np.uint64) * np.uint64(_GOLDEN)
        self._slots: dict[str, int] = {}                # member -> column of its seed
        self._names: list[str | None] = []              # slot -> member (None: free)
        self._seeds: list[int] = []
        self._seed_array = np.zeros(1, dtype=np.uint64)  # slot -> seed, and one more for slot -1
        # per bucket, its homes (slots) and their scores, best first; -1 / 0 where fewer members
        self._homes = np.full((self.buckets, replicas), -1, dtype=np.int32)
        self._score = np.zeros((self.buckets, replicas), dtype=np.uint64)
        self._mask = self.buckets - 1
        self._rows: dict[int, tuple[str, ...]] = {}      # bucket -> its homes as names, until the next change

    # -- what it says --

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._slots)

    def bucket_of_key(self, key: bytes) -> int:
        """The bucket of a 36-byte wire key (``digest | u32 layer``, little-endian)."""
        return int.from_bytes(index_key_of_wire(key)[:4], "little") & self._mask

    def homes_of(self, bucket: int) -> tuple[str, ...]:
        """The bucket's homes, best first (empty while there are no members). Kept per bucket
        asked until the members change (a lookup asks the same buckets again)."""
        homes = self._rows.get(bucket)
        if homes is None:
            names = self._names
            homes = tuple(names[i] for i in self._homes[bucket].tolist() if i >= 0)
            if len(self._rows) < ROWS_KEPT:
                self._rows[bucket] = homes
        return homes

    def buckets_of(self, member: str) -> np.ndarray:
        """The buckets ``member`` is a home of (for measuring balance)."""
        slot = self._slots.get(member)
        if slot is None:
            return np.zeros(0, dtype=np.int64)
        return np.nonzero((self._homes == slot).any(axis=1))[0]

    # -- changes --

    def set_members(self, names: Iterable[str]) -> Moves:
        """Make the members ``names``: the ones gone leave, the new ones join. Returns every
        bucket whose homes changed, with its homes before and after (as arrays: see Moves)."""
        wanted = set(names)
        self._rows = {}
        before, seeds_before, names_before = self._homes.copy(), self._seed_array.copy(), list(self._names)
        for name in sorted(self._slots.keys() - wanted):
            self._leave(name)
        joining = sorted(wanted - self._slots.keys())
        if len(joining) > REBUILD_JOINS:             # many at once (a start): one pass over every bucket
            for name in joining:
                self._take_slot(name, member_seed(name))
            self._recompute(np.arange(self.buckets))
        else:
            for name in joining:
                self._join(name)
        # compare members by seed, not slot: a slot freed by a leave may be taken by a join
        old_ids, new_ids = seeds_before[before], self._seed_array[self._homes]      # slot -1: the sentinel 0
        rows = np.nonzero((old_ids != new_ids).any(axis=1))[0]
        return Moves(rows, before[rows], self._homes[rows], names_before, list(self._names),
                     old_ids[rows], new_ids[rows])

    def join(self, name: str) -> Moves:
        return self.set_members(self.members | {name})

    def leave(self, name: str) -> Moves:
        return self.set_members(self.members - {name})

    def _join(self, name: str) -> None:
        seed = member_seed(name)
        slot = self._take_slot(name, seed)
        s = _scores(self._keys, seed)
        last, last_home = self._score[:, -1], self._homes[:, -1]
        beaten = (last_home < 0) | (s > last) | ((s == last) & (np.uint64(seed) < self._seed_array[last_home]))
        rows = np.nonzero(beaten)[0]
        if rows.size:
            homes = np.concatenate([self._homes[rows], np.full((rows.size, 1), slot, dtype=np.int32)], axis=1)
            scores = np.concatenate([self._score[rows], s[rows, None]], axis=1)
            self._homes[rows], self._score[rows] = self._best(homes, scores)

    def _leave(self, name: str) -> None:
        slot = self._slots.pop(name)
        self._names[slot] = None
        rows = np.nonzero((self._homes == slot).any(axis=1))[0]
        if rows.size:
            self._recompute(rows)

    def _recompute(self, rows: np.ndarray) -> None:
        """Those buckets' homes from every member, from scratch (in chunks of rows: a chunk's
        scores are rows x members)."""
        slots = np.array(list(self._slots.values()), dtype=np.int32)
        seeds = self._seed_array[slots]
        width = max(slots.size, self.replicas)
        step = max(1, CHUNK_SCORES // max(slots.size, 1))
        for start in range(0, rows.size, step):
            chunk = rows[start:start + step]
            homes = np.full((chunk.size, width), -1, dtype=np.int32)
            scores = np.zeros(homes.shape, dtype=np.uint64)
            if slots.size:
                homes[:, :slots.size] = slots
                scores[:, :slots.size] = _scores(self._keys[chunk, None], seeds[None, :])
            if width > 2 * self.replicas:              # keep the best few (argmax r + 1 times) before the exact sort
                keep = np.empty((chunk.size, self.replicas + 1), dtype=np.int64)
                left, row = scores.copy(), np.arange(chunk.size)
                for k in range(self.replicas + 1):
                    keep[:, k] = left.argmax(axis=1)
                    left[row, keep[:, k]] = 0
                homes, scores = np.take_along_axis(homes, keep, axis=1), np.take_along_axis(scores, keep, axis=1)
            self._homes[chunk], self._score[chunk] = self._best(homes, scores)

    def _best(self, homes: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the ``replicas`` best (home, score) pairs, best first: the highest score,
        then (a tie) the lower seed; empty places (-1) last."""
        empty = homes < 0
        seeds = self._seed_array[homes]                 # -1 reads the sentinel at the end: never used
        order = np.lexsort((seeds, ~scores, empty), axis=1)[:, :self.replicas]   # last key is primary
        return np.take_along_axis(homes, order, axis=1), np.take_along_axis(scores, order, axis=1)

    def _take_slot(self, name: str, seed: int) -> int:
        if None in self._names:
            slot = self._names.index(None)
            self._names[slot], self._seeds[slot] = name, seed
        else:
            slot = len(self._names)
            self._names.append(name)
            self._seeds.append(seed)
        self._slots[name] = slot
        self._seed_array = np.array(self._seeds + [0], dtype=np.uint64)
        return slot
