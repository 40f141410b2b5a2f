"""S3-FIFO: scan-resistant eviction with three FIFO queues (Yang et al., "FIFO queues are all
you need for cache eviction", SOSP 2023).

New keys enter a small FIFO S (a tenth of the resident keys); keys in the main FIFO M are the
ones that proved themselves. Each key has a frequency counter (0..3) that a hit raises and
that costs nothing else on the hot path. When room is needed:

- while S holds more than its tenth, S's oldest key moves to M if it was hit while in S, else
  it is evicted and remembered in a ghost FIFO G (keys only, as many as M holds);
- otherwise M's oldest key is reinserted at M's young end with its counter lowered by one if
  it was hit, else it is evicted.

A key that comes back while G remembers it goes straight to M. A scan of one-off blocks only
ever passes through S, so it cannot flush the hot blocks in M: most new KV blocks are used once
(one request's tail) and the reused ones are prefixes, which is the workload S3-FIFO is for.
S and M are :class:`~kvcached.policies.links.IdQueue` over the tier's ids, the counter their
per-id value (9 bytes a resident entry); G holds keys, since their ids went back to the tier.
O(1) per operation; ``candidates`` is amortised O(1) per eviction.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, Steps, finished, resident_keys
from kvcached.policies.links import IdLinks, IdQueue, gathered

__all__ = ["S3FifoPolicy"]

SMALL_SHARE = 0.1      # S's share of the resident keys (the paper's 10%)
MAX_FREQ = 3           # two bits of frequency, as in the paper


class S3FifoPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._links = IdLinks()                               # value: hits while resident
        self.small = IdQueue(self._links, 1)                  # oldest first
        self.main = IdQueue(self._links, 2)
        self.ghost: OrderedDict[bytes, None] = OrderedDict()

    def _unlink(self, entry: int) -> None:
        tag = self._links.tag_of(entry)
        if tag:
            (self.small if tag == self.small.tag else self.main).remove(entry)

    def size_for(self, capacity: int) -> None:
        self._links.size_for(capacity)

    def insert(self, entry: int, key: bytes) -> None:
        self._unlink(entry)
        if self.ghost.pop(key, 0) is None:
            self.main.push(entry)
        else:
            self.small.push(entry)

    def touch(self, entry: int) -> None:
        if self._links.tag_of(entry):
            value = self._links.value
            value[entry] = min(MAX_FREQ, value[entry] + 1)

    def remove(self, entry: int) -> None:
        self._unlink(entry)

    def evicted(self, entry: int, key: bytes) -> None:
        if entry in self.small:
            self.small.remove(entry)
            self.ghost[key] = None
            while len(self.ghost) > max(1, len(self.main)):
                self.ghost.popitem(last=False)
        elif entry in self.main:
            self.main.remove(entry)

    def candidates(self) -> Iterator[int]:
        """Entries to evict, S3-FIFO's order. Promotions and second chances happen as the
        queues are walked; a yielded entry the caller skips (in use) goes to the young end of
        its queue, and once every entry of one queue was offered the walk turns to the other,
        so a walk offers every resident entry before it ends (about two passes at most)."""
        small, main, hits_of = self.small, self.main, self._links.value
        from_small = from_main = 0           # entries offered (and skipped) from each queue in this walk
        for _ in range(2 * (len(small) + len(main)) + 2):
            small_left, main_left = from_small < len(small), from_main < len(main)
            if small_left and (not main_left or len(small) > SMALL_SHARE * (len(small) + len(main))):
                entry = small.head
                if hits_of[entry]:
                    small.remove(entry)
                    main.push(entry)         # proved itself in S: into M, its counter spent
                    continue
                small.move_to_back(entry)
                from_small += 1
                yield entry
            elif main_left:
                entry = main.head
                main.move_to_back(entry)
                hits = hits_of[entry]
                if hits:
                    hits_of[entry] = hits - 1
                    continue
                from_main += 1
                yield entry
            else:
                return

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __iter__(self) -> Iterator[int]:
        yield from self.small
        yield from self.main

    def __contains__(self, entry: int) -> bool:
        return self._links.tag_of(entry) != 0

    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        return finished(self.snapshot_steps(key_of))

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        """S and M with their counters from a copy of their links, walked in steps; the ghost
        FIFO's keys copied now."""
        links = self._links.frozen()
        queues = {"small": self.small.frozen(links), "main": self.main.frozen(links)}
        lists: dict[str, list[bytes]] = {"small": [], "main": [], "ghost": list(self.ghost)}
        values: dict[str, list[int]] = {"small": [], "main": []}

        def steps() -> Steps[PolicySnapshot]:
            for name, queue in queues.items():
                entries = array("i")
                yield from queue.entries_steps(entries)
                yield from gathered(entries, key_of, lists[name])
                yield from gathered(entries, links.value.__getitem__, values[name])
            yield PolicySnapshot("s3fifo", {"small": lists["small"], "main": lists["main"], "ghost": lists["ghost"]},
                                 values)
        return steps()

    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """Queues and counters as they were. A key of S or M that is not resident any more
        goes to the ghost FIFO, so when it comes back it enters M: it had been kept (or was
        still being judged) before the restart, unlike a new key."""
        lists = snapshot.lists
        for key in lists.get("ghost", ()):
            if entry_of(key) is None:
                self.ghost[key] = None
        for name, queue in (("small", self.small), ("main", self.main)):
            kept, gone = resident_keys(snapshot.items(name), entry_of)
            for entry, hits in kept:
                if entry not in self:
                    queue.push(entry, min(MAX_FREQ, hits))
            for key in gone:
                self.ghost[key] = None
        while len(self.ghost) > max(1, len(self.main), len(lists.get("main", ()))):
            self.ghost.popitem(last=False)
