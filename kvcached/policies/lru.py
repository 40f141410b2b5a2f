"""LRU: evict the block used longest ago.

The baseline every cache is compared with, and what vLLM's kv_offload offers first. Exact
recency order in one :class:`~kvcached.policies.links.IdQueue`: a hit moves the entry to the
young end, eviction takes from the old end. O(1) per operation, 9 bytes an entry.
"""

from __future__ import annotations

from array import array
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, ShadowBase, Steps, finished
from kvcached.policies.links import IdLinks, IdQueue, gathered


class LruPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order = IdQueue(IdLinks(), 1)      # oldest first

    def size_for(self, capacity: int) -> None:
        self._order.links.size_for(capacity)

    def insert(self, entry: int, key: bytes) -> None:
        if entry in self._order:
            self._order.move_to_back(entry)
        else:
            self._order.push(entry)

    def touch(self, entry: int) -> None:
        if entry in self._order:
            self._order.move_to_back(entry)

    def remove(self, entry: int) -> None:
        if entry in self._order:
            self._order.remove(entry)

    def shadow(self, capacity: int) -> "LruShadow":
        return LruShadow(capacity)

    def candidates(self) -> Iterator[int]:
        order = self._order
        for _ in range(len(order)):
            if not order:
                return
            entry = order.head
            order.move_to_back(entry)       # an entry the caller skips (in use) is used: young again
            yield entry

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __contains__(self, entry: int) -> bool:
        return entry in self._order

    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        return finished(self.snapshot_steps(key_of))

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        order = self._order.frozen(self._order.links.frozen())

        def steps() -> Steps[PolicySnapshot]:
            entries = array("i")
            yield from order.entries_steps(entries)
            keys: list[bytes] = []
            yield from gathered(entries, key_of, keys)
            yield PolicySnapshot("lru", {"order": keys})
        return steps()

    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """Recency of the keys still resident; LRU has no ghosts, so nothing of the others."""
        for key in snapshot.lists.get("order", ()):
            entry = entry_of(key)
            if entry is not None and entry not in self._order:
                self._order.push(entry)


class LruShadow(ShadowBase):
    """:class:`LruPolicy` as a miniature copy over keys (kvcached.policies.base.Shadow): one
    dict in recency order, oldest first; hit for hit the policy's (tests/unit/test_shadows.py)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: dict[bytes, None] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def access(self, key: bytes) -> bool:
        order = self._order
        if key in order:
            del order[key]
            order[key] = None
            self.hits += 1
            return True
        while len(order) >= self._capacity:
            del order[next(iter(order))]
        order[key] = None
        self.size = len(order)
        return False

    def remove(self, key: bytes) -> None:
        if self._order.pop(key, 0) is None:
            self.size -= 1
