"""Segmented LRU with an age ratio: recency first, frequency as a tie-breaker that the workload
sets (``slru``).

Two LRU lists of resident entries: *probation* (seen once, as far as the policy knows) and
*protected* (seen at least twice: hit while resident, or inserted again while a ghost
remembers its key). Each entry keeps the tick of its last use (a tick is one insert or
touch). Room is made from the older of the two lists' oldest entries, with probation's age
counted ``ratio`` times:

    evict probation's oldest if  ratio * age(probation's oldest) >= age(protected's oldest)

- ``ratio = 1`` is exact LRU (the two lists merged by age): nothing is lost where recency is
  all there is.
- ``ratio = r > 1``: a block seen once is evicted at ``1/r`` of the age a reused block may
  reach. Blocks used once (most of a request's new tail) cannot flush reused prefixes, yet a
  once-seen block still lives as long as recency alone would give it while nothing reused
  competes (a scan meets ``r`` as high as it likes, S3-FIFO's small FIFO in effect).

Evicted keys are remembered as ghosts (about as many as the most entries ever resident, in a
:class:`~kvcached.policies.ghosts.GhostFilter`: 12 bytes a ghost), so a block that returns
after its eviction enters protected: it has been used twice.

Which ratio pays depends on the workload and on the cache size (on the Mooncake conversation
trace 2-3 at 5-10% of its blocks, 1 at 20%; a scan mix wants 30 and more), so by default
(``ratio=None``) the policy tunes it online: :class:`~kvcached.policies.tuning.RatioTuner`
replays a sample of the keys through small copies of this policy, one per ratio of a grid, and
the ratio whose copy hits most lately is the one used (miniature simulations, Waldspurger et
al., USENIX ATC 2017). A fixed ratio (``kv.slru_ratio``) skips the tuner.

Per resident entry: links and list tag (10 bytes), last-use tick (8 bytes); per ghost 12 to
24 bytes of filter cells (ARC's ghosts, a dict entry and the key, cost some 170). O(1) per
operation; the tuner adds, for the sampled keys only (1 in ``RatioTuner.rate``), one operation
per copy.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from typing import Callable, Iterator

from kvcached.policies.base import (
    EvictionPolicy,
    PolicySettings,
    PolicySnapshot,
    ShadowBase,
    Steps,
    blob,
    finished,
    through,
)
from kvcached.policies.ghosts import GhostFilter
from kvcached.policies.links import STEP, IdLinks, IdQueue, column, frozen, gathered, grown
from kvcached.policies.tuning import RatioTuner

__all__ = ["SlruPolicy", "MAX_RATIO"]

MAX_RATIO = 1000.0


class SlruPolicy(EvictionPolicy):
    """See the module docstring. ``ratio``: a fixed age ratio (1..MAX_RATIO); None tunes it
    online."""

    def __init__(self, ratio: float | None = None) -> None:
        if ratio is not None and not 1.0 <= ratio <= MAX_RATIO:
            raise ValueError(f"slru ratio must be in 1..{MAX_RATIO:g}, got {ratio}")
        self._links = IdLinks()
        self.probation = IdQueue(self._links, 1)    # oldest first
        self.protected = IdQueue(self._links, 2)
        self.ghosts = GhostFilter()
        self._last: array[int] | memoryview = array("q")     # id -> tick of its last use
        self.tick = 0
        self.c = 1                              # the most entries ever resident: bounds the ghosts
        self.tuner: RatioTuner | None = None
        if ratio is None:
            self.tuner = RatioTuner(lambda r: SlruPolicy(r))
            ratio = self.tuner.ratio
        self.ratio = ratio
        self._sampled: dict[int, bytes] = {}    # resident ids whose keys the tuner samples

    @classmethod
    def configured(cls, settings: PolicySettings) -> "SlruPolicy":
        return cls(settings.slru_ratio or None)

    def miniature(self) -> "SlruPolicy":
        return SlruPolicy(self.ratio)

    def follow(self, tier: EvictionPolicy) -> None:
        if isinstance(tier, SlruPolicy):
            self.ratio = tier.ratio

    def miniature_tuner(self) -> RatioTuner | None:
        return RatioTuner(lambda r: SlruPolicy(r), presampled=True) if self.tuner is not None else None

    def tuned_to(self, value: float) -> None:
        self.ratio = value

    def resized(self, entries: int) -> None:
        self.c = max(1, entries)

    def shadow(self, capacity: int) -> "SlruShadow":
        return SlruShadow(self.ratio, capacity)

    def size_for(self, capacity: int) -> None:
        self._links.size_for(capacity)
        if capacity > len(self._last):
            new = column("q", capacity)
            if len(self._last):
                new[:len(self._last)] = memoryview(self._last).cast("B").cast("q")
            self._last = new

    def _grow(self, entry: int) -> None:
        last = self._last
        if entry >= len(last):
            assert isinstance(last, array), "an id beyond size_for's capacity (push raised first)"
            grown(last, entry + 1)

    # -- the calls of the tier ------------------------------------------------------------------

    def insert(self, entry: int, key: bytes) -> None:
        tag = self._links.tag_of(entry)
        if tag:
            (self.probation if tag == 1 else self.protected).remove(entry)
        if key in self.ghosts:
            self.protected.push(entry)
        else:
            self.probation.push(entry)
        self._grow(entry)
        self.tick += 1
        self._last[entry] = self.tick
        resident = len(self.probation) + len(self.protected)
        if resident > self.c:
            self.c = resident
        tuner = self.tuner
        if tuner is not None and tuner.samples(key):
            self._sampled[entry] = key
            rate = tuner.rate
            tuner.access(key, self.c)
            self.ratio = tuner.ratio
            if tuner.rate != rate:          # the tier grew: fewer keys are sampled from now on
                self._sampled = {e: k for e, k in self._sampled.items() if tuner.samples(k)}

    def touch(self, entry: int) -> None:
        tag = self._links.tag_of(entry)
        if not tag:
            return
        if tag == 1:
            self.probation.remove(entry)
            self.protected.push(entry)
        else:
            self.protected.move_to_back(entry)
        self.tick += 1
        self._last[entry] = self.tick
        if self._sampled:
            key = self._sampled.get(entry)
            if key is not None:
                tuner = self.tuner
                assert tuner is not None
                tuner.access(key, self.c)
                self.ratio = tuner.ratio

    def remove(self, entry: int) -> None:
        """Deleted, not evicted: no ghost is kept."""
        tag = self._links.tag_of(entry)
        if tag:
            (self.probation if tag == 1 else self.protected).remove(entry)
            self._sampled.pop(entry, None)

    def evicted(self, entry: int, key: bytes) -> None:
        tag = self._links.tag_of(entry)
        if not tag:
            return
        (self.probation if tag == 1 else self.protected).remove(entry)
        self._sampled.pop(entry, None)
        self.ghosts.add(key, self.c)

    def candidates(self) -> Iterator[int]:
        """The older of the two oldest entries, probation's age counted ``ratio`` times; an
        entry the caller skips (in use) is used: young again in its list."""
        probation, protected, last = self.probation, self.protected, self._last
        for _ in range(len(probation) + len(protected)):
            if probation and (not protected or self.ratio * (self.tick - last[probation.head])
                              >= self.tick - last[protected.head]):
                queue = probation
            elif protected:
                queue = protected
            else:
                return
            entry = queue.head
            queue.move_to_back(entry)
            self.tick += 1
            last[entry] = self.tick
            yield entry

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __iter__(self) -> Iterator[int]:
        yield from self.probation
        yield from self.protected

    def __contains__(self, entry: int) -> bool:
        return self._links.tag_of(entry) != 0

    # -- what survives a restart ----------------------------------------------------------------

    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        """The resident keys in the order of their last use, oldest first (value: the list,
        1 probation, 2 protected), the tick of each use (``ticks``: one string of 8-byte
        native integers, in the same order), the ghosts, the ratio in use, ``c`` and the tick
        now: a restored policy with its keys resident decides as this one would. The tuner's
        copies are not kept: they learn again, from the ratio saved."""
        return finished(self.snapshot_steps(key_of))

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        """The lists, last uses and numbers are copied now; the lists are walked and merged by
        last use in steps (each list is already in last-use order, so the order is one merge,
        done a slice at a time); the ghost filter's cells are copied in a step of their own
        (tens of MB at a million entries: a key evicted in between is in both, which a restore
        takes as it took it before)."""
        links = self._links.frozen()
        probation, protected = self.probation.frozen(links), self.protected.frozen(links)
        last = frozen(self._last)
        numbers = {"ratio": self.ratio, "c": float(self.c), "tick": float(self.tick)}
        ghosts = self.ghosts

        def steps() -> Steps[PolicySnapshot]:
            older, younger, entries = array("i"), array("i"), array("i")
            yield from probation.entries_steps(older)
            yield from protected.entries_steps(younger)
            yield from _merged(older, younger, last.__getitem__, entries)
            keys: list[bytes] = []
            tags: list[int] = []
            yield from gathered(entries, key_of, keys)
            yield from gathered(entries, links.where.__getitem__, tags)
            ticks = column("q", len(entries))        # filled a step at a time (see base.blob)
            for start in range(0, len(entries), STEP):
                ticks[start:start + STEP] = array("q", map(last.__getitem__, entries[start:start + STEP]))
                yield None
            state = yield from through(ghosts.state_steps())
            yield PolicySnapshot("slru", {"order": keys, "ticks": [blob(ticks.cast("B")[:8 * len(entries)])],
                                          "ghosts": [blob(state)]},
                                 values={"order": tags}, numbers=numbers)
        return steps()

    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """Lists, last uses, ghosts, ratio and ``c`` as they were. A listed key that is not
        resident any more becomes a ghost: it did leave the tier, and if it comes back it has
        been used twice."""
        numbers = snapshot.numbers
        self.c = max(1, int(numbers.get("c", 1)))
        ratio = numbers.get("ratio", self.ratio)
        if self.tuner is not None and 1.0 <= ratio <= MAX_RATIO:
            self.ratio = self.tuner.ratio = ratio
        for raw in snapshot.lists.get("ghosts", ())[:1]:
            self.ghosts.restore(raw)
        ticks = array("q")
        for stamps in snapshot.lists.get("ticks", ()):
            ticks.frombytes(stamps[:len(stamps) // 8 * 8])
        self.tick = max(self.tick, int(numbers.get("tick", 0)), *ticks[-1:])
        for i, (key, tag) in enumerate(snapshot.items("order")):
            entry = entry_of(key)
            if entry is None:
                self.ghosts.add(key, self.c)
            elif entry not in self:
                (self.protected if tag == 2 else self.probation).push(entry)
                self._grow(entry)
                self._last[entry] = ticks[i] if i < len(ticks) else self.tick


def _merged(first: array[int], then: array[int], tick: Callable[[int], int], out: array[int]) -> Iterator[None]:
    """``first + then`` sorted by ``tick``, stably (``first``'s entries before ``then``'s on a
    tie), into ``out``, a slice at a time (yields between slices): both are in ``tick`` order
    already, so each slice takes a run of one and what of the other comes before its end, and
    sorts only those (C-level, a few thousand entries)."""
    i = j = 0
    while i < len(first) or j < len(then):
        a, b = first[i:i + STEP], then[j:j + STEP]
        if a and b and tick(a[-1]) <= tick(b[-1]):
            # all of a; of b, what comes before a's last (strictly older: first wins a tie)
            b = b[:bisect_left(list(map(tick, b)), tick(a[-1]))]
        elif a and b:
            # all of b; of a, what comes before b's last (as old or older)
            a = a[:bisect_right(list(map(tick, a)), tick(b[-1]))]
        out.extend(sorted(a + b, key=tick))
        i += len(a)
        j += len(b)
        yield None


class SlruShadow(ShadowBase):
    """:class:`SlruPolicy` at a fixed ratio as a miniature copy over keys
    (kvcached.policies.base.Shadow): its two lists as dicts of key to the tick of its last use
    (oldest first), the same ghosts, and the same ticks (one per use, one per eviction, as the
    policy's candidates count the one they offer), so that its hits are the policy's, hit for
    hit, at a third of the time (tests/unit/test_shadows.py)."""

    def __init__(self, ratio: float, capacity: int) -> None:
        super().__init__(capacity)
        self.ratio = ratio
        self.probation: dict[bytes, int] = {}
        self.protected: dict[bytes, int] = {}
        self.ghosts = GhostFilter()
        self.tick = 0
        self.c = 1

    def shrunk(self, entries: int) -> None:
        self.c = entries                    # SlruPolicy.resized

    def follow(self, tier: EvictionPolicy) -> None:
        if isinstance(tier, SlruPolicy):
            self.ratio = tier.ratio

    def tuned_to(self, value: float) -> None:
        self.ratio = value

    def __contains__(self, key: bytes) -> bool:
        return key in self.probation or key in self.protected

    def access(self, key: bytes) -> bool:
        protected, probation = self.protected, self.probation
        if key in protected:
            del protected[key]
        elif key in probation:
            del probation[key]
        else:
            while self.size >= self._capacity:
                self._evict()
            self.tick += 1
            (protected if key in self.ghosts else probation)[key] = self.tick
            self.size += 1
            if self.size > self.c:
                self.c = self.size
            return False
        self.tick += 1
        protected[key] = self.tick
        self.hits += 1
        return True

    def _evict(self) -> None:
        probation, protected, tick = self.probation, self.protected, self.tick
        if probation and (not protected or self.ratio * (tick - next(iter(probation.values())))
                          >= tick - next(iter(protected.values()))):
            queue = probation
        else:
            queue = protected
        victim = next(iter(queue))
        del queue[victim]
        self.tick = tick + 1                # the policy's candidates count the one they offer as a use
        self.size -= 1
        self.ghosts.add(victim, self.c)

    def remove(self, key: bytes) -> None:
        if self.probation.pop(key, None) is not None or self.protected.pop(key, None) is not None:
            self.size -= 1
