"""Belady's MIN: the hits no online policy can beat (no I/O). Offline: it needs the accesses to
come, so it runs over a recorded sequence (the simulator's trace, the live curves' window), or
behind one (:class:`TrailingMin`: the live curves' MIN at their window's start).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Collection, Sequence

__all__ = ["TrailingMin", "belady_hits"]


def belady_hits(capacity: int, accesses: Sequence[bytes], initial: Collection[bytes] = ()) -> list[bool]:
    """Per access, whether Belady's MIN with room for ``capacity`` blocks had it: on a miss with
    a full cache, evict the resident block used again furthest in the future (or never).

    ``initial``: blocks resident before the first access (at most ``capacity`` of them; the
    rest of the room empty). MIN from a cache's state beats that cache's own policy from the
    same state, which a cold start does not (kvcached.policies.curve_window)."""
    never = len(accesses)
    next_use = [never] * len(accesses)
    last: dict[bytes, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = last.get(accesses[i], never)
        last[accesses[i]] = i
    if len(initial) > capacity:
        raise ValueError(f"{len(initial)} blocks resident at the start, room for {capacity}")
    resident: dict[bytes, int] = {key: last.get(key, never) for key in initial}     # key -> its next use
    heap: list[tuple[int, bytes]] = [(-n, key) for key, n in resident.items()]   # (-next use, key); stale skipped
    heapq.heapify(heap)
    hits = [False] * len(accesses)
    for i, key in enumerate(accesses):
        if key in resident:
            hits[i] = True
        elif len(resident) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits


class TrailingMin:
    """Belady's MIN run over a stream as its uses leave a window of the uses to come, so that
    it sees as far ahead as the window reaches: what MIN holds where the window begins.

    The live curves run MIN over their window from this state (kvcached.policies.curve_window).
    Started from the keys the policy's copy held instead, MIN missed the first use in the window
    of every key the policy had let go and MIN would have kept: on workloads whose keys come back
    after long gaps (rag, code completion) it came out up to 0.13 under MIN over the whole
    stream at 4x; from this state within 0.035, and nearer the smaller the size.

    The owner tells it each use that leaves the window (:meth:`leave`, with the number of the
    key's next use in the window, 0 where it has none) and each use that enters the window
    while its key has none there (:meth:`seen`: a resident waiting for its next use now has
    one). On a use of a key not resident with no room left, the resident with no next use in
    sight that was used least recently goes first, else the one used again furthest ahead (as
    :func:`belady_hits`, the key used is always taken in). State: one entry per resident key
    (at most ``capacity``), plus stale heap entries (at most about as many)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._next: dict[bytes, int] = {}           # resident -> the number of its next use in the window (0: none)
        self._waiting: OrderedDict[bytes, None] = OrderedDict()    # residents with no next use in sight, oldest first
        self._heap: list[tuple[int, bytes]] = []    # (-next use, key) of the others; stale entries skipped

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: bytes) -> bool:
        return key in self._next

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = max(1, value)
        while len(self._next) > self._capacity:
            self._evict()

    def leave(self, key: bytes, next_use: int) -> None:
        """A use of ``key`` leaves the window; ``next_use``: the number of its next use in the
        window, 0 where it has none."""
        resident = self._next
        if key in resident:
            self._waiting.pop(key, None)
        elif len(resident) >= self._capacity:
            self._evict()
        resident[key] = next_use
        if next_use:
            heap = self._heap
            heapq.heappush(heap, (-next_use, key))
            if len(heap) > 2 * len(resident) + 64:
                self._compact()
        else:
            self._waiting[key] = None

    def seen(self, key: bytes, number: int) -> None:
        """A use of ``key`` numbered ``number`` entered the window, which held none of it."""
        if key in self._waiting:
            del self._waiting[key]
            self._next[key] = number
            heapq.heappush(self._heap, (-number, key))

    def remove(self, key: bytes) -> None:
        """``key`` leaves the stream (it left the sample)."""
        if self._next.pop(key, None) is not None:
            self._waiting.pop(key, None)

    def residents(self) -> list[bytes]:
        """The keys MIN holds where the window begins."""
        return list(self._next)

    def _evict(self) -> None:
        if self._waiting:
            victim, _ = self._waiting.popitem(last=False)   # O(1): a dict's first key is found by a scan
            del self._next[victim]
            return
        heap, resident = self._heap, self._next
        while heap:
            neg, victim = heapq.heappop(heap)
            if resident.get(victim) == -neg:
                del resident[victim]
                return

    def _compact(self) -> None:
        self._heap = [(-n, key) for key, n in self._next.items() if n]
        heapq.heapify(self._heap)
