"""Choosing a policy's parameter online by miniature simulations (no I/O).

Which setting of a policy pays depends on the workload and on the cache's size, both of which
change under a daemon. :class:`RatioTuner` runs, beside the real policy, one small copy of it
per setting of a grid (:class:`ShadowCache`), each over the same sample of keys at the same
share of the capacity: a key is sampled when its CRC-32 has its low bits zero, one key in
``rate``, so a sampled key is always sampled and its every use reaches the copies (spatial
sampling: Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
USENIX ATC 2017, show a miniature of a cache ``rate`` times smaller, fed one key in ``rate``,
predicts the full cache's hit rate). The setting whose copy hit most lately is the one used.

Cost: for one use in ``rate``, one operation per copy. The rate follows the cache's size
(:func:`rate_for`): ``MIN_RATE`` once the copies hold ``MIN_COPY`` keys at that rate, more as
the cache grows so that each copy holds ``TARGET_ENTRIES`` to twice that; a cache too small for
that samples more keys (every key below ``2 * MIN_COPY`` entries), since copies of a few keys say
little. Copies of fewer than ``MIN_ENTRIES`` keys say nothing: the setting is left alone.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

from kvcached.policies.base import EvictionPolicy, Shadow, ShadowBase
from kvcached.policies.keyed import KeyedPolicy

__all__ = ["RatioTuner", "ShadowCache", "GRID", "make_shadow", "rate_for"]

GRID = (1.0, 2.0, 4.0, 16.0, 128.0, 1000.0)
MIN_RATE = 16
MIN_COPY = 64
TARGET_ENTRIES = 1024
MIN_ENTRIES = 32
DECAY = 0.9             # each round's hits count 0.9 times as much the round after
SWITCH_MARGIN = 0.02    # another setting takes over when it scores 2% more than the current one


def rate_for(capacity: int) -> int:
    """One key in how many the copies of a cache of ``capacity`` entries see (a power of two,
    growing with ``capacity``)."""
    rate = 1
    while rate < MIN_RATE and capacity >= 2 * MIN_COPY * rate:
        rate *= 2
    while capacity > 2 * TARGET_ENTRIES * rate:
        rate *= 2
    return rate


class ShadowCache(ShadowBase):
    """``policy`` over keys with room for ``capacity`` of them: what a tier does with its
    policy (touch on a hit; on a miss, evict the first candidates until there is room, then
    insert), with keys only and no bytes. Keys leave it through :meth:`remove` alone (it counts
    the keys it holds: asking the policy costs three calls, on every miss of every copy)."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        super().__init__(capacity)
        self.policy = KeyedPolicy(policy)

    def shrunk(self, entries: int) -> None:
        """A copy made smaller (its sampling rate fell) tells its policy
        (EvictionPolicy.resized): one that remembered as many evictions as the copy ever held
        kept them several times too long for its new size, which in slru's copies of a rate
        that fell tenfold cost 0.02-0.03 of hit rate at 0.5x-1x."""
        self.policy.policy.resized(entries)

    def access(self, key: bytes) -> bool:
        policy = self.policy
        if policy.touched(key):
            self.hits += 1
            return True
        while self.size >= self._capacity:
            victim = next(iter(policy.candidates()), None)
            if victim is None:
                break
            policy.evicted(victim)
            self.size -= 1
        policy.insert(key)
        self.size += 1
        return False

    def remove(self, key: bytes) -> None:
        """``key`` leaves the copy (deleted, not evicted) if it holds it."""
        if key in self.policy:
            self.policy.remove(key)
            self.size -= 1

    def follow(self, tier: EvictionPolicy) -> None:
        self.policy.policy.follow(tier)

    def tuned_to(self, value: float) -> None:
        self.policy.policy.tuned_to(value)

    def __contains__(self, key: bytes) -> bool:
        return key in self.policy


def make_shadow(policy: EvictionPolicy, capacity: int) -> Shadow:
    """``policy`` (fresh) as a miniature copy with room for ``capacity`` keys: its own
    :meth:`EvictionPolicy.shadow` where it has one, else a :class:`ShadowCache` of it."""
    return policy.shadow(capacity) or ShadowCache(policy, capacity)


class RatioTuner:
    """Picks the setting of ``grid`` whose miniature copy (``make(setting)``) hits most.

    The owner asks :meth:`samples` for each new key and calls :meth:`access` for every use of
    a sampled key (its insert and each touch), with the number of entries the real cache holds
    at most (``capacity``); then reads :attr:`ratio`. ``presampled``: the keys given are a
    spatial sample already (the live curves' miniature of a cache, kvcached.policies.curves),
    so every one counts and the copies have ``capacity`` entries, the miniature's own; rounds
    then span as many of the miniature's uses as the full cache's tuner's span of its own."""

    def __init__(self, make: Callable[[float], EvictionPolicy], grid: Sequence[float] = GRID, *,
                 presampled: bool = False) -> None:
        self.presampled = presampled
        self.grid = tuple(grid)
        self._make = make
        self.ratio = self.grid[0]
        self.decided = 0                    # rounds that had copies large enough to choose by
        self.rate = 1
        self._mask = 0
        self._copies: list[Shadow] = []
        self._scores = [0.0] * len(self.grid)
        self._uses = 0
        self._room = 0                      # the copies' capacity now

    def samples(self, key: bytes) -> bool:
        return zlib.crc32(key) & self._mask == 0

    def access(self, key: bytes, capacity: int) -> None:
        if not self.presampled:
            rate = rate_for(capacity)
            if rate > self.rate:
                self.rate = rate
                self._mask = rate - 1      # a subset of the keys sampled so far: the others age out
            if not self.samples(key):
                return
        size = capacity // self.rate
        if not self._copies:
            self._copies = [make_shadow(self._make(r), size) for r in self.grid]
        room = max(1, size)
        if room != self._room:               # resized when the size moves only: this runs on every sampled use
            self._room = room
            for copy in self._copies:
                copy.capacity = room
        for copy in self._copies:
            copy.access(key)
        self._uses += 1
        if self._uses >= max(size, 4 * MIN_ENTRIES):
            self._decide(size)

    def _decide(self, size: int) -> None:
        """End of a round: scores decay, this round's hits are added, and the best setting
        takes over if it beats the current one by ``SWITCH_MARGIN`` (sampling noise alone
        must not move a cache off a setting that serves it: on the Mooncake trace at 20%,
        where LRU is best, a margin of 1% still cost 0.4 point of hit rate; 2% costs none)."""
        current = self.grid.index(self.ratio) if self.ratio in self.grid else -1
        for i, copy in enumerate(self._copies):
            self._scores[i] = self._scores[i] * DECAY + copy.hits
            copy.hits = 0
        self._uses = 0
        if size < MIN_ENTRIES:
            return
        self.decided += 1
        best = max(range(len(self.grid)), key=self._scores.__getitem__)
        if current < 0 or self._scores[best] > self._scores[current] * (1 + SWITCH_MARGIN):
            self.ratio = self.grid[best]
