"""Miss-ratio curves, live: what each tier would hit at other sizes, and what Belady's MIN would
(no I/O; the clock is passed in). docs/operations.md says how to read them.

Sampling (SHARDS, Waldspurger et al., FAST 2015, its fixed-size variant): a key is in the sample
while its hash is below a threshold. The hash is the key's first 8 bytes, big-endian: index keys
are BLAKE3 digests, uniform already, and a key compares with the threshold as bytes (one memcmp,
no number made for the fifteen keys in sixteen that are not sampled). The threshold starts above every hash (every key sampled) and drops to
the largest sampled hash whenever more than ``sample_keys`` distinct keys are in the sample,
that key leaving it. So what the curves hold is bounded by ``sample_keys`` keys however many
keys the traffic has, and the sampling rate R (the threshold over 2^64) follows the traffic.

Policies at other sizes (miniature simulations, Waldspurger et al., USENIX ATC 2017): per tier,
one copy of its eviction policy per size multiple m (:class:`kvcached.policies.tuning.ShadowCache`,
the copies slru's tuner runs), with room for m x C x R keys, C the tier's size in blocks (its
bytes over the mean footprint of the blocks sampled); every sampled access goes to every copy.
A copy's hits over the sampled accesses estimate the tier's hit rate at m x C, counted from the
daemon's start. A policy's tuned setting (slru's ratio) depends on the size: the 1x copy
follows the tier's own tuner (EvictionPolicy.miniature and follow); the others each run the
tuner a tier of their size would (EvictionPolicy.miniature_tuner: its grid of copies at the
copy's size, fed every sampled use, as the sample is one already), whose choice they take.
Following the 1x tuner instead put rag's curve 0.011 under the exact replay at 0.5x and 0.017
over it at 4x on average over seven keyings (a larger tier tunes later); with their own tuners
within 0.020 everywhere, 0.006 on average. The cost: a tuned tier's copies do seven times the
work at each multiple but 1x, and hold up to 4 KiB more per sampled key (bounded as below).
The copies shrink as the rate falls, and each tells its policy so (ShadowCache.capacity,
EvictionPolicy.resized): slru's ghosts kept for the size a copy once had put rag's curve up to
0.055 under the exact replay after a tenfold fall, where the same final sample reached from
near its rate was 0.025 under; resized, the two agree.

The sample's accesses differ from their expected share of all accesses by the luck of which
keys fell in it: on skewed traffic mostly by the very hottest keys, sampled or not (one system
prompt's blocks may carry a tenth of the traffic), which hit at every size; on uniform traffic
by how many keys it holds, which hit as the others do. :func:`adjusted_rate` adds the hits that
difference stands for, telling the two apart by the sample's own spread. Unadjusted, the curves
of the production trace came out 0.02 to 0.06 off.

MIN: the last ``window`` sampled accesses are kept; Belady's MIN over them with room for
m x C x R keys estimates what MIN would hit at m x C over the same stretch of traffic. It is
computed when asked, at most once per ``min_every_s`` (about a second of CPU per million
window entries and size), and kept until then.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcached.policies.base import EvictionPolicy
from kvcached.policies.belady import belady_hits
from kvcached.policies.tuning import ShadowCache

__all__ = ["MAX_PENDING", "MAX_RATE", "MULTIPLES", "SAMPLE_KEYS", "WINDOW", "CurvePoint", "KeySample", "MissRatioCurves",
           "TierSpec", "adjusted_rate"]

MULTIPLES = (0.5, 1.0, 2.0, 4.0)
SAMPLE_KEYS = 32768         # distinct keys in the sample at most
MAX_RATE = 1 / 8            # the share of keys sampled at most: what every access may cost
WINDOW = 65536              # sampled accesses MIN looks at
SAMPLED_PER_S = 200         # sampled uses a second at most: past that the sampling rate halves (see _within_budget)
BUSY_SHARE = 0.01           # with timers: the share of the process's CPU time the sampled uses may take (_within_budget)
BUSY_FLOOR = 0.001          # ... once they took this share of one core (an idle daemon's few uses cost nothing)
BUSY_WINDOW_S = 10          # ... both measured over this many seconds of the clock (one slow call is not a trend)
SPACE = 1 << 64
RESIZE_EVERY = 256          # sampled accesses between two looks at the tiers' size in blocks
RESIZE_MOVE = 128           # ... or sooner, once the sampling rate fell by 1/128
MAX_PENDING = 256           # deferred: sampled uses waiting for drain() at most (past that, uses() counts the oldest)


class KeySample:
    """The fixed-size spatial sample: which keys are in it, at most ``limit``."""

    def __init__(self, limit: int, rate: float = 1.0) -> None:
        if limit < 1 or not 0 < rate <= 1:
            raise ValueError(f"a sample of {limit} keys at most, at a rate of {rate} at most")
        self.limit = limit
        self.threshold = int(SPACE * rate)      # a key is sampled while its hash is below this
        self._hashes: dict[bytes, int] = {}
        self._largest: list[tuple[int, bytes]] = []    # (-hash, key): a heap, the largest first

    @property
    def rate(self) -> float:
        """The share of the key space sampled."""
        return self.threshold / SPACE

    @property
    def bound(self) -> bytes:
        """The threshold as a key: a key is sampled exactly when it compares below this."""
        return self.threshold.to_bytes(8, "big") + bytes(24) if self.threshold < SPACE else b"\xff" * 33

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._hashes

    def lower(self, threshold: int) -> list[bytes]:
        """Sample fewer keys: those with hashes below ``threshold`` only; returns the keys that
        left the sample."""
        if threshold >= self.threshold:
            return []
        self.threshold = threshold
        dropped = [key for key, hashed in self._hashes.items() if hashed >= threshold]
        for key in dropped:
            del self._hashes[key]
        self._largest = [(-h, k) for k, h in self._hashes.items()]
        heapq.heapify(self._largest)
        return dropped

    def take(self, key: bytes, hashed: int) -> list[bytes]:
        """``key`` (its hash below the threshold) is in the sample; returns the keys that left it
        to keep it within its limit (the key itself among them when its hash is the largest)."""
        if key in self._hashes:
            return []
        self._hashes[key] = hashed
        heapq.heappush(self._largest, (-hashed, key))
        dropped = []
        while len(self._hashes) > self.limit:
            neg, out = heapq.heappop(self._largest)
            del self._hashes[out]
            self.threshold = -neg
            dropped.append(out)
        return dropped


@dataclass(frozen=True)
class TierSpec:
    """A tier the curves model: its name, its policy's name and the policy itself (the tier's
    own, whose copies run at other sizes; or one like it, for a tier ordered otherwise), its
    capacity in bytes, and the bytes a block of n payload bytes takes in it."""

    name: str
    policy_name: str
    policy: EvictionPolicy
    capacity_bytes: int
    footprint: Callable[[int], int]


@dataclass(frozen=True)
class CurvePoint:
    """One size of one tier: ``multiple`` of its configured size, ``blocks`` at the mean block
    size seen; the hit rate its policy would have there (None: nothing sampled yet), and MIN's
    over the window (None: not computed)."""

    tier: str
    policy: str
    multiple: float
    blocks: int
    hit_rate: float | None
    min_hit_rate: float | None


class _TierCopies:
    """One tier's policy at each multiple, as miniature copies: at 1x following the tier's tuned
    setting, elsewhere each tuned by a tuner of its own (EvictionPolicy.miniature_tuner), where
    the policy has one."""

    def __init__(self, spec: TierSpec, multiples: Sequence[float], sample_keys: int) -> None:
        self.spec = spec
        self.multiples = tuple(multiples)
        self.copies = [ShadowCache(spec.policy.miniature(), 1) for _ in self.multiples]
        self.tuners = [None if m == 1.0 else spec.policy.miniature_tuner() for m in self.multiples]
        self._most = sample_keys            # entries a tuner's copies hold at most (their keys may have left the sample)
        self._hits = [0.0] * len(self.multiples)    # per copy, in units of 1 / _scale
        self._scale = 1.0                   # what one unit of _hits weighs at the current sampling rate
        self.footprint_sum = 0
        self.footprint_n = 0
        self.blocks = 0                     # the tier's size in blocks of the mean footprint seen

    def seen(self, nbytes: int) -> None:
        self.footprint_sum += self.spec.footprint(nbytes)
        self.footprint_n += 1

    def resize(self, rate: float) -> None:
        if self.footprint_n:
            self.blocks = int(self.spec.capacity_bytes * self.footprint_n / self.footprint_sum)
        for m, copy, tuner in zip(self.multiples, self.copies, self.tuners):
            copy.capacity = max(1, round(m * self.blocks * rate))
            if tuner is None:
                copy.policy.policy.follow(self.spec.policy)

    @property
    def hits(self) -> list[float]:
        """Per copy, its hits scaled to the current sampling rate."""
        return [h * self._scale for h in self._hits]

    def access(self, key: bytes) -> list[bool]:
        hits, unit = self._hits, 1.0 / self._scale
        for copy, tuner in zip(self.copies, self.tuners):
            if tuner is not None:
                tuner.access(key, min(copy.capacity, self._most))
                copy.policy.policy.tuned_to(tuner.ratio)
        out = [copy.access(key) for copy in self.copies]
        for i, hit in enumerate(out):
            if hit:
                hits[i] += unit
        return out

    def scale(self, factor: float) -> None:
        self._scale *= factor               # one multiplication, not one per copy, at each new key

    def forget(self, key: bytes) -> None:
        for copy in self.copies:
            if key in copy.policy:
                copy.policy.remove(key)


class _KeyUses:
    """Per sampled key, its uses and each copy's hits on it while it has been in the sample; and
    over the keys in the sample, the sums the adjustment weighs the sample's gap with
    (:func:`adjusted_rate`): uses squared, and uses times hits per copy."""

    def __init__(self, copies: int) -> None:
        self._counts: dict[bytes, list[int]] = {}
        self._copies = copies
        self.uses_squared = 0
        self.uses_hits = [0] * copies

    def used(self, key: bytes, hits: Sequence[bool]) -> None:
        """One more use of ``key``, ``hits`` per copy whether it hit."""
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0] * (self._copies + 1)
        uses = counts[0]
        counts[0] = uses + 1
        self.uses_squared += 2 * uses + 1
        sums = self.uses_hits
        for i, hit in enumerate(hits, 1):
            before = counts[i]
            if hit:
                counts[i] = before + 1
                sums[i - 1] += uses + before + 1      # (uses + 1)(before + 1) - uses x before
            else:
                sums[i - 1] += before                 # (uses + 1) x before - uses x before

    def forget(self, key: bytes) -> None:
        """``key`` left the sample: its counts leave the sums."""
        counts = self._counts.pop(key, None)
        if counts is None:
            return
        uses = counts[0]
        self.uses_squared -= uses * uses
        for i in range(self._copies):
            self.uses_hits[i] -= uses * counts[i + 1]


class MissRatioCurves:
    """The curves of ``tiers`` (see the module). The owner calls :meth:`access` for every use of
    a block (a hit it serves, a block it stores or finds stored), reads :meth:`points`."""

    def __init__(self, tiers: Sequence[TierSpec], clock: Callable[[], float], *, sample_keys: int = SAMPLE_KEYS,
                 max_rate: float = MAX_RATE, sampled_per_s: float | None = SAMPLED_PER_S, window: int = WINDOW,
                 multiples: Sequence[float] = MULTIPLES, min_every_s: float = 60.0,
                 timer: Callable[[], float] | None = None, process_timer: Callable[[], float] | None = None,
                 busy_share: float | None = BUSY_SHARE, deferred: bool = False) -> None:
        self.sample = KeySample(sample_keys, max_rate)
        #: ``deferred``: :meth:`uses` only queues the sampled uses (a few hundred us each: every
        #: copy of every tier) and the owner counts them with :meth:`drain` once the request that
        #: made them is answered. The counts come out as if each were counted at once: the queue
        #: is counted in order and each use keeps its access number. At most MAX_PENDING wait.
        self.deferred = deferred
        self._pending: deque[tuple[bytes, int, int]] = deque()     # (key, its access number, payload bytes)
        #: With ``timer`` (the thread's CPU clock: time.thread_time), what the curves cost is
        #: counted: ``busy_s`` in counting sampled uses (:meth:`drain`: the copies' work, which
        #: the budget bounds; a :meth:`uses` call with none costs one ``min`` of its keys and is not
        #: timed, as reading that clock costs about as much), ``min_busy_s`` in MIN's counts (the thread that
        #: asks for them). Two counters, each added to by one thread only.
        self.timer = timer
        self.busy_s = 0.0
        self.min_busy_s = 0.0
        #: With ``process_timer`` too (the process's CPU clock: time.process_time), the sampled
        #: uses may take ``busy_share`` of the process's CPU time (see :meth:`_within_budget`).
        self.process_timer = process_timer
        self.busy_share = busy_share if timer is not None and process_timer is not None else None
        self._window_busy = (-1, 0.0, 0.0)  # (the window of BUSY_WINDOW_S being counted, busy_s and CPU at its start)
        self.sampled_per_s = sampled_per_s
        self._second = (-1.0, 0)                # (the second being counted, sampled uses in it)
        self.tiers = [_TierCopies(spec, multiples, sample_keys) for spec in tiers]
        self.multiples = tuple(multiples)
        self._key_uses = _KeyUses(len(self.tiers) * len(self.multiples))
        self.clock = clock
        self.min_every_s = min_every_s
        self.accesses = 0                   # every access offered
        self.sampled = 0                    # of those, sampled
        self.weight = 0.0                   # the sampled, scaled to the current sampling rate
        self._window: list[tuple[bytes, int]] = [(b"", 0)] * window   # (key, its access number): a ring
        self._at = 0
        self._min: dict[str, list[float]] = {}
        self._min_at = -float("inf")
        self._min_sampled = 0               # the sampled accesses counted when MIN was
        self._min_span = (0, 0)
        self._resized_at = self.sample.rate

    def access(self, key: bytes, nbytes: int) -> None:
        """One use of the block at ``key`` (an index key) of ``nbytes`` payload bytes."""
        self.uses((key,), lambda _: nbytes)

    def uses(self, keys: Sequence[bytes], nbytes: Callable[[int], int]) -> None:
        """:meth:`access` for each of ``keys`` in order, ``nbytes(i)`` the payload bytes of the
        i-th (asked of the sampled ones only). Runs for every block served or saved: a call
        none of whose keys is sampled costs one ``min`` over them (a C loop); the others are
        counted (or queued, ``deferred``) one by one."""
        bound = self.sample.bound
        start = self.accesses
        self.accesses = start + len(keys)
        if not keys or min(keys) >= bound:
            return
        pending = self._pending
        pending.extend((key, start + i + 1, nbytes(i)) for i, key in enumerate(keys) if key < bound)
        if not self.deferred:
            self.drain()
        elif len(pending) > MAX_PENDING:
            self.drain(len(pending) - MAX_PENDING)

    @property
    def pending(self) -> int:
        """Sampled uses queued and not counted yet (``deferred``)."""
        return len(self._pending)

    def drain(self, limit: int | None = None) -> int:
        """Count the queued sampled uses, oldest first, ``limit`` of them at most; returns how
        many are left. A use whose key left the sample while it waited is dropped, as it would
        have been had it been counted at once (the threshold only falls)."""
        pending = self._pending
        if not pending:
            return 0
        timer = self.timer
        started = timer() if timer is not None else 0.0
        sample = self.sample
        for _ in range(len(pending) if limit is None else min(limit, len(pending))):
            key, number, nbytes = pending.popleft()
            if key < sample.bound:
                self._sampled(key, int.from_bytes(key[:8], "big"), nbytes, number)
        if timer is not None:
            self.busy_s += timer() - started
        return len(pending)

    def _sampled(self, key: bytes, hashed: int, nbytes: int, number: int) -> None:
        before = self.sample.threshold
        dropped = self.sample.take(key, hashed)
        if self.sampled_per_s is not None or self.busy_share is not None:
            dropped += self._within_budget()
        changed = self.sample.threshold != before
        if changed:
            # Counts taken at a higher rate weigh what they would at the new one (SHARDS' rescaling),
            # so traffic from before and after a drop of the threshold counts alike.
            factor = self.sample.threshold / before
            self.weight *= factor
            for tier in self.tiers:
                tier.scale(factor)
                for out in dropped:
                    tier.forget(out)
            for out in dropped:
                self._key_uses.forget(out)
            if key not in self.sample:
                self._resize_if_moved()
                return
        self.sampled += 1
        self.weight += 1.0
        for tier in self.tiers:
            tier.seen(nbytes)
        if self.sampled % RESIZE_EVERY == 1:
            self._resize()
        elif changed:
            self._resize_if_moved()
        hits: list[bool] = []
        for tier in self.tiers:
            hits += tier.access(key)
        self._key_uses.used(key, hits)
        window = self._window
        window[self._at] = (key, number)
        self._at = (self._at + 1) % len(window)

    def _within_budget(self) -> list[bytes]:
        """Past ``sampled_per_s`` sampled uses in one second of the clock, or (with timers) once
        the sampled uses took more than ``busy_share`` of the process's CPU time in a window of
        BUSY_WINDOW_S seconds (and BUSY_FLOOR of a core's: an idle daemon's are left alone),
        the rate halves (the keys above the new threshold leave the sample): what the curves
        take of a busy daemon stays bounded (each sampled use is one access to every copy of
        every tier, and what that costs depends on the machine and the policies: the share of
        the CPU is the bound that holds on any, and the one a daemon's throughput feels), and a
        busy daemon has uses enough to sample fewer."""
        now = self.clock()
        second, count = self._second
        count = count + 1 if int(now) == second else 1
        self._second = (int(now), count)
        over = self.sampled_per_s is not None and count > self.sampled_per_s
        if self.busy_share is not None and self.process_timer is not None:
            window, busy, cpu = self._window_busy
            if int(now // BUSY_WINDOW_S) != window:
                self._window_busy = window, busy, cpu = (int(now // BUSY_WINDOW_S), self.busy_s, self.process_timer())
            took = self.busy_s - busy
            if took > BUSY_FLOOR * BUSY_WINDOW_S and took > self.busy_share * (self.process_timer() - cpu):
                over = True
                self._window_busy = (window, self.busy_s, self.process_timer())
        if not over:
            return []
        self._second = (int(now), 0)
        return self.sample.lower(self.sample.threshold // 2)

    def _resize(self) -> None:
        rate = self.sample.rate
        self._resized_at = rate
        for tier in self.tiers:
            tier.resize(rate)

    def _resize_if_moved(self) -> None:
        """The copies resized to a lower rate once it is 1/RESIZE_MOVE below the last they were
        sized for: a full sample's threshold falls a little with each new key (fixed-size
        SHARDS), and resizing every copy each time cost more than the copies' own work."""
        if self.sample.rate < self._resized_at * (1 - 1 / RESIZE_MOVE):
            self._resize()

    def points(self, with_min: bool = True) -> list[CurvePoint]:
        """Every tier at every multiple; with ``with_min``, MIN's too (computed if the last is
        older than ``min_every_s``)."""
        mins = self.min_rates() if with_min else {}
        out = []
        for t, tier in enumerate(self.tiers):
            spec = tier.spec
            for i, m in enumerate(tier.multiples):
                rate = self._adjusted(tier.hits[i], self._key_uses.uses_hits[t * len(self.multiples) + i])
                least = mins.get(spec.name)
                out.append(CurvePoint(spec.name, spec.policy_name, m, int(m * tier.blocks), rate,
                                      least[i] if least else None))
        return out

    def _adjusted(self, hits: float, uses_hits: int) -> float | None:
        """The hit rate of a copy's ``hits`` (:func:`adjusted_rate`), its sums over the keys in
        the sample scaled as the counts are to the current sampling rate."""
        expected = self.accesses * self.sample.rate
        if not self.weight or expected <= 0:
            return None
        scale = self.weight / self.sampled if self.sampled else 1.0
        return adjusted_rate(hits, self.weight, expected, self._key_uses.uses_squared * scale * scale,
                             uses_hits * scale * scale, self.sample.rate)

    def window(self) -> list[tuple[bytes, int]]:
        """The sampled accesses of the window still in the sample, oldest first, each with its
        access number (1 for the first access offered): what MIN is computed over."""
        ring = self._window[:]                 # one copy, atomic under the GIL: a reader thread is safe
        at = self._at
        sample = self.sample
        return [(key, n) for key, n in ring[at:] + ring[:at] if n and key in sample]

    def min_rates(self) -> dict[str, list[float]]:
        """MIN's hit rate over the window per tier and multiple, recomputed once per
        ``min_every_s`` at most (each call of Stats and each scrape asks): sooner only while the
        window is young, less than a full window of sampled uses, and an eighth of it is new."""
        now = self.clock()
        young = self.sampled < len(self._window) and self.sampled - self._min_sampled >= max(16, self.sampled // 8)
        if now - self._min_at < self.min_every_s and not young:
            return self._min
        started = self.timer() if self.timer is not None else 0.0
        entries = self.window()
        keys = [key for key, _ in entries]
        rate = self.sample.rate
        # The window's stretch of traffic held this many sampled accesses by expectation; the
        # difference is adjusted for as the curves' (adjusted_rate).
        expected = (entries[-1][1] - entries[0][1] + 1) * rate if entries else 0.0
        uses: dict[bytes, int] = {}
        for key in keys:
            uses[key] = uses.get(key, 0) + 1
        uses_squared = sum(n * n for n in uses.values())
        out: dict[str, list[float]] = {}
        for tier in self.tiers:
            out[tier.spec.name] = [
                _min_rate(belady_hits(max(1, round(m * tier.blocks * rate)), keys), keys, uses, uses_squared, expected,
                          rate) for m in tier.multiples] if expected > 0 else []
        self._min, self._min_at, self._min_sampled = out, now, self.sampled
        self._min_span = (entries[0][1], entries[-1][1]) if entries else (0, 0)
        if self.timer is not None:
            self.min_busy_s += self.timer() - started
        return out

    @property
    def min_span(self) -> tuple[int, int]:
        """The access numbers of the first and last sampled access the last MIN counted."""
        return self._min_span


def _min_rate(hits: Sequence[bool], keys: Sequence[bytes], uses: dict[bytes, int], uses_squared: int,
              expected: float, rate: float) -> float:
    """MIN's hit rate over the window from its per-access ``hits`` (:func:`adjusted_rate`, the
    window's keys and their ``uses`` standing for the sample)."""
    hits_by_key: dict[bytes, int] = {}
    for key, hit in zip(keys, hits):
        if hit:
            hits_by_key[key] = hits_by_key.get(key, 0) + 1
    uses_hits = sum(uses[key] * n for key, n in hits_by_key.items())
    return adjusted_rate(sum(hits), len(keys), expected, uses_squared, uses_hits, rate)


def adjusted_rate(hits: float, sampled: float, expected: float, uses_squared: float, uses_hits: float,
                  rate: float) -> float:
    """A hit rate from the sample: ``hits`` of ``sampled`` uses, where the traffic held
    ``expected`` uses of sampled keys by expectation (every use times the sampling ``rate``).

    The gap between ``sampled`` and ``expected`` is the luck of which keys fell in the sample,
    and the hits it stands for are added (or taken off): a regression estimator, the gap weighed
    by the hits per use of the keys that make such gaps, each key weighed by its uses squared
    (``uses_hits / uses_squared`` over the sampled keys), as a key's share of the gap grows with
    its uses. Where the sample holds too few uses and by far more than the sampled keys' own
    spread explains (its variance, (1 - rate) x ``uses_squared``), keys hotter than any sampled
    are missing, and those hit at every size: that share of the gap counts as hits, as SHARDS-adj
    counts all of it. Measured (bench/bench_curves.py's accuracy streams): SHARDS-adj alone was
    0.02 off on uniform traffic (random), the slope alone 0.03-0.05 off where one hot prefix
    carries much of the traffic (the Mooncake trace, batch_summarization); this is within 0.013
    on both."""
    if expected <= 0:
        return 0.0
    gap = sampled - expected
    slope = min(1.0, max(0.0, uses_hits / uses_squared)) if uses_squared else 1.0
    missing = 0.0
    if gap < 0:
        missing = max(0.0, 1 - (1 - rate) * uses_squared / (gap * gap))
    weight = slope + (1 - slope) * missing
    return min(1.0, max(0.0, (hits - weight * gap) / expected))
