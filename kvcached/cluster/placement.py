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
from typing import Iterable

import blake3
import numpy as np

from kvcached_agent.address import index_key

__all__ = ["Placement", "Move", "member_seed", "score", "bucket_of_index_key", "MAX_BITS"]

MAX_BITS = 24
REBUILD_JOINS = 16           # more members joining at once than this: the table is computed afresh
CHUNK_SCORES = 1 << 22       # scores computed at once in a rebuild (32 MiB of uint64)
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


def bucket_of_index_key(key: bytes, bits: int) -> int:
    """The bucket of a 32-byte index key: its first 4 bytes, little-endian, top ``bits`` dropped."""
    return int.from_bytes(key[:4], "little") & ((1 << bits) - 1)


@dataclass(frozen=True)
class Move:
    """A bucket whose homes changed: what they were and what they are (best first)."""

    bucket: int
    old: tuple[str, ...]
    new: tuple[str, ...]


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

    # -- what it says --

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._slots)

    def bucket(self, address_digest: bytes, layer: int) -> int:
        """The bucket of a block, from its address (its index key's first bytes)."""
        return bucket_of_index_key(index_key(address_digest, layer), self.bits)

    def bucket_of_key(self, key: bytes) -> int:
        """The bucket of a 36-byte wire key (``digest | u32 layer``, little-endian)."""
        return bucket_of_index_key(index_key(key[:32], int.from_bytes(key[32:36], "little")), self.bits)

    def homes_of(self, bucket: int) -> tuple[str, ...]:
        """The bucket's homes, best first (empty while there are no members)."""
        names = self._names
        return tuple(names[i] for i in self._homes[bucket].tolist() if i >= 0)

    def homes(self, digest: bytes, layer: int) -> tuple[str, ...]:
        return self.homes_of(self.bucket(digest, layer))

    def buckets_of(self, member: str) -> np.ndarray:
        """The buckets ``member`` is a home of (for measuring balance)."""
        slot = self._slots.get(member)
        if slot is None:
            return np.zeros(0, dtype=np.int64)
        return np.nonzero((self._homes == slot).any(axis=1))[0]

    # -- changes --

    def set_members(self, names: Iterable[str]) -> list[Move]:
        """Make the members ``names``: the ones gone leave, the new ones join. Returns every
        bucket whose homes changed, once, with its homes before and after."""
        wanted = set(names)
        before, names_before = self._homes.copy(), list(self._names)
        changed: set[int] = set()
        for name in sorted(self._slots.keys() - wanted):
            changed.update(self._leave(name))
        joining = sorted(wanted - self._slots.keys())
        if len(joining) > REBUILD_JOINS:             # many at once (a start): one pass over every bucket
            for name in joining:
                self._take_slot(name, member_seed(name))
            self._recompute(np.arange(self.buckets))
            changed.update(range(self.buckets))
        else:
            for name in joining:
                changed.update(self._join(name))
        moves = []
        for bucket in sorted(changed):
            old = before[bucket].tolist()
            if old != self._homes[bucket].tolist():
                moves.append(Move(bucket, tuple(names_before[i] for i in old if i >= 0),
                                  self.homes_of(bucket)))
        return moves

    def join(self, name: str) -> list[Move]:
        return self.set_members(self.members | {name})

    def leave(self, name: str) -> list[Move]:
        return self.set_members(self.members - {name})

    def _join(self, name: str) -> list[int]:
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
        return rows.tolist()

    def _leave(self, name: str) -> list[int]:
        slot = self._slots.pop(name)
        self._names[slot] = None
        rows = np.nonzero((self._homes == slot).any(axis=1))[0]
        if rows.size:
            self._recompute(rows)
        return rows.tolist()

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
