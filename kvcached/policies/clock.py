"""CLOCK (second chance): the approximate LRU of the RAM tier.

A hit only sets a reference bit, so the hot path never reorders anything. When room is needed
the hand sweeps from the oldest key: a key with its bit set loses the bit and goes round once
more; a key without it is offered for eviction. Corbató's CLOCK (1968); the FIFO-with-second-
chance form here has the same behaviour and O(1) amortised steps.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot


class ClockPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._ring: OrderedDict[bytes, bool] = OrderedDict()   # key -> referenced since last pass

    def insert(self, key: bytes) -> None:
        self._ring[key] = False
        self._ring.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._ring:
            self._ring[key] = True

    def remove(self, key: bytes) -> None:
        self._ring.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        ring = self._ring
        for _ in range(2 * len(ring)):
            if not ring:
                return
            key, referenced = next(iter(ring.items()))
            ring.move_to_end(key)
            if referenced:
                ring[key] = False
                continue
            yield key

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._ring)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ring

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot("clock", {"ring": list(self._ring)}, {"ring": list(self._ring.values())})

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """The ring and reference bits of the keys still resident (CLOCK keeps no ghosts)."""
        for key, bit in snapshot.items("ring"):
            if resident(key):
                self._ring[key] = bool(bit)
