"""ARC, the Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

Two lists of resident keys: T1 (seen once recently) and T2 (seen at least twice), and two ghost
lists of keys evicted from them, B1 and B2 (keys only, no bytes). A target size ``p`` for T1
moves with the workload: a miss that hits ghost B1 means T1 was too small (recency pays), so
``p`` grows by max(1, |B2| / |B1|); a miss that hits ghost B2 means T2 was too small (frequency
pays), so ``p`` shrinks by max(1, |B1| / |B2|). Eviction takes T1's oldest key while T1 is over
its target, T2's otherwise. vLLM's ARC manager (../shared/seeds/003) works the same way.

The tier's capacity is in bytes and blocks vary in size, so ``c`` (the cache size in keys that
bounds ``p`` and the ghost lists) is the most keys ever resident at once.
T1 and T2 are :class:`~kvcached.policies.links.IdQueue` over the tier's ids (9 bytes a resident
entry); the ghosts are keys, since their ids went back to the tier. O(1) per operation;
``candidates`` yields at most every resident entry once.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, Steps, finished, resident_keys
from kvcached.policies.links import IdLinks, IdQueue, gathered

__all__ = ["ArcPolicy"]


class ArcPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._links = IdLinks()
        self.t1 = IdQueue(self._links, 1)                   # resident, seen once; oldest first
        self.t2 = IdQueue(self._links, 2)                   # resident, seen twice or more
        self.b1: OrderedDict[bytes, None] = OrderedDict()   # ghosts evicted from T1 (keys)
        self.b2: OrderedDict[bytes, None] = OrderedDict()   # ghosts evicted from T2
        self.p = 0.0                                        # target size of T1, in entries
        self.c = 1                                          # the cache size in entries (high-water mark)

    def _unlink(self, entry: int) -> bool:
        """Take ``entry`` out of T1 or T2; whether it was in one."""
        for queue in (self.t1, self.t2):
            if entry in queue:
                queue.remove(entry)
                return True
        return False

    def resized(self, entries: int) -> None:
        self.c = max(1, entries)
        self.p = min(self.p, float(self.c))
        self._trim_ghosts()

    def size_for(self, capacity: int) -> None:
        self._links.size_for(capacity)

    def insert(self, entry: int, key: bytes) -> None:
        self._unlink(entry)
        if key in self.b1:                   # evicted from T1 too soon: give recency more room
            self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2.push(entry)
        elif key in self.b2:                 # evicted from T2 too soon: give frequency more room
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2.push(entry)
        else:
            self.t1.push(entry)
        self.c = max(self.c, len(self.t1) + len(self.t2))
        self._trim_ghosts()

    def touch(self, entry: int) -> None:
        if entry in self.t1:
            self.t1.remove(entry)
            self.t2.push(entry)
        elif entry in self.t2:
            self.t2.move_to_back(entry)

    def remove(self, entry: int) -> None:
        """Deleted, not evicted: no ghost is kept."""
        self._unlink(entry)

    def evicted(self, entry: int, key: bytes) -> None:
        if entry in self.t1:
            self.t1.remove(entry)
            self.b1[key] = None
        elif entry in self.t2:
            self.t2.remove(entry)
            self.b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """|T1| + |B1| <= c and the whole directory <= 2c, as in the paper."""
        c = self.c
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def candidates(self) -> Iterator[int]:
        """REPLACE: T1's oldest while T1 is over its target (or T2 is empty), else T2's oldest;
        when the caller skips an entry (in use) the next one, then the other list."""
        first, second = (self.t1, self.t2) if self.t1 and (len(self.t1) > self.p or not self.t2) else (self.t2, self.t1)
        for queue in (first, second):
            for _ in range(len(queue)):
                if not queue:
                    break
                entry = queue.head
                queue.move_to_back(entry)    # skipped (in use): young again in its own list
                yield entry

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[int]:
        yield from self.t1
        yield from self.t2

    def __contains__(self, entry: int) -> bool:
        return self._links.tag_of(entry) != 0

    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        return finished(self.snapshot_steps(key_of))

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        """T1 and T2 from a copy of their links, walked in steps; the ghosts copied now (their
        keys: one C-level pass over each)."""
        links = self._links.frozen()
        queues = {"t1": self.t1.frozen(links), "t2": self.t2.frozen(links)}
        lists: dict[str, list[bytes]] = {"t1": [], "t2": [], "b1": list(self.b1), "b2": list(self.b2)}
        numbers = {"p": self.p, "c": float(self.c)}

        def steps() -> Steps[PolicySnapshot]:
            for name, queue in queues.items():
                entries = array("i")
                yield from queue.entries_steps(entries)
                yield from gathered(entries, key_of, lists[name])
            yield PolicySnapshot("arc", lists, numbers=numbers)
        return steps()

    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """Lists, target and size as they were. A T1 (T2) key that is not resident any more
        becomes the youngest ghost of B1 (B2): it did leave the tier, and if it comes back
        ARC learns from it as from any ghost hit."""
        lists = snapshot.lists
        self.p = snapshot.numbers.get("p", 0.0)
        self.c = max(1, int(snapshot.numbers.get("c", 1)))
        for live, ghosts, target, memory in (("t1", "b1", self.t1, self.b1), ("t2", "b2", self.t2, self.b2)):
            kept, gone = resident_keys(snapshot.items(live), entry_of)
            for key in lists.get(ghosts, ()):
                if entry_of(key) is None:
                    memory[key] = None
            for key in gone:
                memory[key] = None
            for entry, _ in kept:
                if entry not in self:
                    target.push(entry)
        self._trim_ghosts()
