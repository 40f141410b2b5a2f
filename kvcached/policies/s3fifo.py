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
O(1) per operation; ``candidates`` is amortised O(1) per eviction.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Iterator

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, resident_keys

__all__ = ["S3FifoPolicy"]

SMALL_SHARE = 0.1      # S's share of the resident keys (the paper's 10%)
MAX_FREQ = 3           # two bits of frequency, as in the paper


class S3FifoPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self.small: OrderedDict[bytes, int] = OrderedDict()   # key -> hits while resident; oldest first
        self.main: OrderedDict[bytes, int] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)
        if self.ghost.pop(key, 0) is None:
            self.main[key] = 0
        else:
            self.small[key] = 0

    def touch(self, key: bytes) -> None:
        if key in self.small:
            self.small[key] = min(MAX_FREQ, self.small[key] + 1)
        elif key in self.main:
            self.main[key] = min(MAX_FREQ, self.main[key] + 1)

    def remove(self, key: bytes) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)

    def evicted(self, key: bytes) -> None:
        if self.small.pop(key, None) is not None:
            self.ghost[key] = None
            while len(self.ghost) > max(1, len(self.main)):
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        """Keys to evict, S3-FIFO's order. Promotions and second chances happen as the queues
        are walked; a yielded key the caller skips (in use) goes to the young end of its queue,
        and once every key of one queue was offered the walk turns to the other, so a walk
        offers every resident key before it ends (about two passes at most)."""
        small, main = self.small, self.main
        from_small = from_main = 0           # keys offered (and skipped) from each queue in this walk
        for _ in range(2 * (len(small) + len(main)) + 2):
            small_left, main_left = from_small < len(small), from_main < len(main)
            if small_left and (not main_left or len(small) > SMALL_SHARE * (len(small) + len(main))):
                key, hits = next(iter(small.items()))
                if hits:
                    del small[key]
                    main[key] = 0            # proved itself in S: into M, its counter spent
                    continue
                small.move_to_end(key)
                from_small += 1
                yield key
            elif main_left:
                key, hits = next(iter(main.items()))
                main.move_to_end(key)
                if hits:
                    main[key] = hits - 1
                    continue
                from_main += 1
                yield key
            else:
                return

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __iter__(self) -> Iterator[bytes]:
        return itertools.chain(self.small, self.main)

    def __contains__(self, key: bytes) -> bool:
        return key in self.small or key in self.main

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot("s3fifo", {"small": list(self.small), "main": list(self.main), "ghost": list(self.ghost)},
                              {"small": list(self.small.values()), "main": list(self.main.values())})

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """Queues and counters as they were. A key of S or M that is not resident any more
        goes to the ghost FIFO, so when it comes back it enters M: it had been kept (or was
        still being judged) before the restart, unlike a new key."""
        lists = snapshot.lists
        for key in lists.get("ghost", ()):
            if not resident(key):
                self.ghost[key] = None
        for name in ("small", "main"):
            kept, gone = resident_keys(snapshot.items(name), resident)
            queue = getattr(self, name)
            for key, hits in kept:
                queue[key] = min(MAX_FREQ, hits)
            for key in gone:
                self.ghost[key] = None
        while len(self.ghost) > max(1, len(self.main), len(lists.get("main", ()))):
            self.ghost.popitem(last=False)
