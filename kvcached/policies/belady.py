"""Belady's MIN: the hits no online policy can beat (no I/O). Offline: it needs the accesses to
come, so it runs over a recorded sequence (the simulator's trace, the live curves' window).
"""

from __future__ import annotations

import heapq
from typing import Collection, Sequence

__all__ = ["belady_hits"]


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
