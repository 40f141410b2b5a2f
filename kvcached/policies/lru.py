"""LRU: evict the block used longest ago.

The baseline every cache is compared with, and what vLLM's kv_offload offers first. Exact
recency order in one OrderedDict: a hit moves the key to the young end, eviction takes from the
old end. O(1) per operation.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot


class LruPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()     # oldest first

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        order = self._order
        for _ in range(len(order)):
            if not order:
                return
            key = next(iter(order))
            order.move_to_end(key)      # a key the caller skips (in use) is used: young again
            yield key

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot("lru", {"order": list(self._order)})

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """Recency of the keys still resident; LRU has no ghosts, so nothing of the others."""
        for key in snapshot.lists.get("order", ()):
            if resident(key):
                self._order[key] = None
