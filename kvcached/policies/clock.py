"""CLOCK (second chance): the approximate LRU of the RAM tier.

A hit only sets a reference bit, so the hot path never reorders anything. When room is needed
the hand sweeps from the oldest entry: one with its bit set loses the bit and goes round once
more; one without it is offered for eviction. Corbató's CLOCK (1968); the FIFO-with-second-
chance form here has the same behaviour and O(1) amortised steps. The ring is an
:class:`~kvcached.policies.links.IdQueue`, the bit its per-id value: 9 bytes an entry.
"""

from __future__ import annotations

from array import array
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, Steps, finished
from kvcached.policies.links import IdLinks, IdQueue, gathered


class ClockPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._links = IdLinks()
        self._ring = IdQueue(self._links, 1)     # value: referenced since the hand last passed

    def size_for(self, capacity: int) -> None:
        self._links.size_for(capacity)

    def insert(self, entry: int, key: bytes) -> None:
        if entry in self._ring:
            self._ring.remove(entry)
        self._ring.push(entry)

    def touch(self, entry: int) -> None:
        where = self._links.where
        if entry < len(where) and where[entry]:
            self._links.value[entry] = 1

    def remove(self, entry: int) -> None:
        if entry in self._ring:
            self._ring.remove(entry)

    def candidates(self) -> Iterator[int]:
        ring, bits = self._ring, self._links.value
        for _ in range(2 * len(ring)):
            if not ring:
                return
            entry = ring.head
            ring.move_to_back(entry)
            if bits[entry]:
                bits[entry] = 0
                continue
            yield entry

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ring)

    def __contains__(self, entry: int) -> bool:
        return entry in self._ring

    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        return finished(self.snapshot_steps(key_of))

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        links = self._links.frozen()
        ring = self._ring.frozen(links)

        def steps() -> Steps[PolicySnapshot]:
            entries = array("i")
            yield from ring.entries_steps(entries)
            keys: list[bytes] = []
            bits: list[int] = []
            yield from gathered(entries, key_of, keys)
            yield from gathered(entries, links.value.__getitem__, bits)
            yield PolicySnapshot("clock", {"ring": keys}, {"ring": bits})
        return steps()

    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """The ring and reference bits of the keys still resident (CLOCK keeps no ghosts)."""
        for key, bit in snapshot.items("ring"):
            entry = entry_of(key)
            if entry is not None and entry not in self._ring:
                self._ring.push(entry, 1 if bit else 0)
