"""Miss-ratio curves, live: what each tier would hit at other sizes, and what Belady's MIN would
(no I/O; the clocks are passed in). docs/operations.md says how to read them.

Sampling: a spatial sample of the keys (kvcached.policies.curve_sample.KeySample: a key is in
it while its hash is below a threshold, one key in 1/R), R at most ``max_rate``, at most what
keeps each tier's copies within ``sample_keys`` keys in all (their memory: R x C x the sum of
the multiples, C the tier's blocks), and moved by what the sampled uses cost (RateBudget: at
most ``busy_share`` of the process's CPU, falling at once when over it, rising again when well
under it).

Policies at other sizes (miniature simulations, Waldspurger et al., USENIX ATC 2017): per tier,
one copy of its eviction policy per size multiple m (kvcached.policies.tuning.make_shadow: the policy's own Shadow where it has one),
with room for m x C x R keys, C the tier's size in blocks (its bytes over the mean footprint of
the blocks sampled); every sampled use goes to every copy. A policy's tuned setting (slru's
ratio) depends on the size: the 1x copy follows the tier's own tuner (EvictionPolicy.miniature
and follow); the others each run the tuner a tier of their size would
(EvictionPolicy.miniature_tuner), over a nested sample of the sampled keys (one in as many as
leaves the tuner's copies TUNER_ROOM keys, within TUNER_SHARES: the tuners' copies were most of
a sampled use's work, and choosing a setting needs fewer keys than estimating a hit rate), and
follow the tier's setting while their tuner's copies are too small to choose by. Copies shrink as the rate falls and tell their policy
(Shadow.capacity).

The window: the last ``window`` sampled uses, each with which copies hit it and the tiers' own
hit counts at the time (``own_hits``: the owner's count of the uses each tier held). Every
figure comes from it, the policy's and MIN's over the same uses (kvcached.policies.curve_window:
the policy's corrected by the tier's own hit rate where it is counted; MIN from its own state
where the window begins, kvcached.policies.belady.TrailingMin, fed as uses leave the window;
the error of each). They are computed when asked, at most once per ``min_every_s`` once the
window is full (sooner while it fills), and only while what computing them took is at most
ESTIMATE_SHARE of the process's CPU since the last time, the window filling too, or where the
last ones stood on next to nothing (asked as the daemon started, a quiet daemon's next would
wait for a second of its CPU). Looser rules cost: a filling window's figures computed at every
Stats took 3.9% of the daemon's CPU in a benchmark asking each second; computed whenever they
took under 5 ms, 0.5%; whenever the filling window had doubled, 0.4%.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcached.policies.base import EvictionPolicy
from kvcached.policies.belady import TrailingMin
from kvcached.policies.curve_sample import SPACE, KeySample, RateBudget, bound_key
from kvcached.policies.curve_window import Bands, TierWindow, WindowFigures, estimate_tier
from kvcached.policies.tuning import MIN_ENTRIES, make_shadow

__all__ = ["ACCURACY", "MIN_COPY", "MAX_PENDING", "MAX_RATE", "MULTIPLES", "SAMPLE_KEYS", "WINDOW", "CurvePoint", "MissRatioCurves",
           "TierSpec"]

MULTIPLES = (0.5, 1.0, 2.0, 4.0)
SAMPLE_KEYS = 32768         # keys a tier's copies hold at most, in all
MAX_RATE = 1 / 8            # the share of keys sampled at most: what every access may cost
WINDOW = 65536              # sampled uses the figures stand on
ACCURACY = 0.03             # a tier's curve is shown where every figure's error is within this (kvcached mrc)
MIN_COPY = 64               # ... and every copy has room for this many keys: smaller miniatures stray past their error
BUSY_SHARE = 0.009          # with timers: the share of the process's CPU time counting sampled uses may take
ESTIMATE_SHARE = 0.001      # ... and computing the figures from the window (together: 1%)
TUNER_ROOM = 64             # the tuners of the copies at other sizes see one sampled key in as many as leaves them this room,
TUNER_SHARES = (4, 16)      # ... one in 4 at least (a tuner is six copies), one in 16 at most
WARM_TURNS = 2              # a band of keys that joined the sample counts after this many times the largest copy's blocks
RESIZE_EVERY = 256          # sampled uses between two looks at the tiers' size in blocks
MAX_PENDING = 256           # deferred: sampled uses waiting for drain() at most (past that, uses() counts the oldest)


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
    size seen; the hit rate its policy would have there and MIN's, each with its ``error``
    (about 95%: kvcached.policies.curve_window), all None while nothing counts; the sampled
    ``uses`` and distinct ``keys`` of the window they stand on; ``entries``, the room of the
    copy that stands for this size."""

    tier: str
    policy: str
    multiple: float
    blocks: int
    hit_rate: float | None
    min_hit_rate: float | None
    error: float | None = None
    min_error: float | None = None
    uses: int = 0
    keys: int = 0
    entries: int = 0

    @property
    def shown(self) -> bool:
        """The figures are within ACCURACY, from a copy of MIN_COPY keys at least (a curve worth
        printing). Copies of 50 keys (a 3,000-block tier's at 0.5x, sampled at 1/32) put slru's
        figure up to 0.033 off on the Mooncake trace where its error said 0.015; of 100, 0.02;
        of 200, 0.006: how a miniature of a few dozen keys evicts depends on which few dozen."""
        return (self.error is not None and self.min_error is not None and max(self.error, self.min_error) <= ACCURACY
                and self.entries >= MIN_COPY)


class _TierCopies:
    """One tier's policy at each multiple, as miniature copies: at 1x following the tier's tuned
    setting, elsewhere each tuned by a tuner of its own over a nested sample, where the policy
    has one (following the tier's until that tuner has chosen)."""

    def __init__(self, spec: TierSpec, multiples: Sequence[float]) -> None:
        self.spec = spec
        self.multiples = tuple(multiples)
        self.copies = [make_shadow(spec.policy.miniature(), 1) for _ in self.multiples]
        self.least = [TrailingMin(1) for _ in self.multiples]       # MIN at each size where the window begins
        self.tuners = [None if m == 1.0 else spec.policy.miniature_tuner() for m in self.multiples]
        self._tuning: list[tuple[bytes, int] | None] = [None] * len(self.multiples)   # per copy: (its tuner's bound, room)
        self.footprint_sum = 0
        self.footprint_n = 0
        self.blocks = 0                     # the tier's size in blocks of the mean footprint seen

    def seen(self, nbytes: int) -> None:
        self.footprint_sum += self.spec.footprint(nbytes)
        self.footprint_n += 1

    def resize(self, threshold: int) -> None:
        """The copies sized for the sampling ``threshold``, and their tuners' nested samples:
        one key in as many as leaves a tuner's copies TUNER_ROOM keys (a power of two within
        TUNER_SHARES); a tuner whose copies would hold fewer than MIN_ENTRIES is silent."""
        if self.footprint_n:
            self.blocks = int(self.spec.capacity_bytes * self.footprint_n / self.footprint_sum)
        rate = threshold / SPACE
        for i, (m, copy, tuner) in enumerate(zip(self.multiples, self.copies, self.tuners)):
            copy.capacity = max(1, round(m * self.blocks * rate))
            self.least[i].capacity = copy.capacity
            share = TUNER_SHARES[0]
            while share < TUNER_SHARES[1] and copy.capacity // (2 * share) >= TUNER_ROOM:
                share *= 2
            room = copy.capacity // share
            self._tuning[i] = (bound_key(threshold // share), room) if tuner is not None and room >= MIN_ENTRIES else None
            if not self._tuned(i):
                copy.follow(self.spec.policy)

    def _tuned(self, i: int) -> bool:
        """Copy ``i`` takes its own tuner's setting: it has one, whose copies are large enough to
        choose by now, and it has chosen. Otherwise it follows the tier's (a choice made while the
        copy was larger, kept after its tuner fell silent, put rag's curve 0.07-0.1 under the
        exact replay at 0.5x; the trace's at 0.5x, following the tier's where a tuner of one key
        in 16 was silent, came out 0.02 under)."""
        tuner = self.tuners[i]
        return self._tuning[i] is not None and tuner is not None and tuner.decided > 0

    @property
    def warm(self) -> int:
        """Accesses after which copies have taken in a band of keys new to them."""
        return WARM_TURNS * round(max(self.multiples) * self.blocks)

    def access(self, key: bytes) -> int:
        """One sampled use of ``key``; one bit per copy, set where it hit."""
        for tuning, copy, tuner in zip(self._tuning, self.copies, self.tuners):
            if tuning is not None and key < tuning[0]:
                assert tuner is not None
                tuner.access(key, tuning[1])
                if tuner.decided:
                    copy.tuned_to(tuner.ratio)
        bits = 0
        for i, copy in enumerate(self.copies):
            if copy.access(key):
                bits |= 1 << i
        return bits

    def forget(self, key: bytes) -> None:
        for copy in self.copies:
            copy.remove(key)
        for least in self.least:
            least.remove(key)

    def left_window(self, key: bytes, next_use: int) -> None:
        """A sampled use of ``key`` left the window (see TrailingMin.leave)."""
        for least in self.least:
            least.leave(key, next_use)

    def entered_window(self, key: bytes, number: int) -> None:
        """A sampled use of ``key`` entered the window, which held none of it."""
        for least in self.least:
            least.seen(key, number)


class MissRatioCurves:
    """The curves of ``tiers`` (see the module). The owner calls :meth:`uses` for every use of
    a block (a hit it serves, a block it stores or finds stored), reads :meth:`points`.
    ``own_hits``: the tiers' own counts of the uses they held so far, in the order of ``tiers``
    (None: not counted)."""

    def __init__(self, tiers: Sequence[TierSpec], clock: Callable[[], float], *, sample_keys: int = SAMPLE_KEYS,
                 max_rate: float = MAX_RATE, window: int = WINDOW, multiples: Sequence[float] = MULTIPLES,
                 min_every_s: float = 60.0, timer: Callable[[], float] | None = None,
                 process_timer: Callable[[], float] | None = None, busy_share: float | None = BUSY_SHARE,
                 deferred: bool = False, own_hits: Callable[[], tuple[int, ...]] | None = None) -> None:
        self.sample = KeySample(max_rate)
        self.max_rate = max_rate
        #: The copies of a tier hold at most ``sample_keys`` keys in all (their memory): the rate
        #: is at most that over the sum of the multiples times the tier's blocks (:meth:`_allowed`).
        self.sample_keys = sample_keys
        self._budget_rate = max_rate        # what the budget allows (RateBudget)
        #: What holds the rate where it is: "cap" (``max_rate``), "budget" or "memory" (``sample_keys``).
        self.limited_by = "cap"
        #: ``deferred``: :meth:`uses` only queues the sampled uses and the owner counts them with
        #: :meth:`drain` once the request that made them is answered. Counted in order, each
        #: with its access number, they come out as if counted at once. At most MAX_PENDING wait.
        self.deferred = deferred
        self._pending: deque[tuple[bytes, int, int, tuple[int, ...] | None]] = deque()
        #: With ``timer`` (the thread's CPU clock), what the curves take is counted: ``busy_s``
        #: counting sampled uses (:meth:`drain`), ``min_busy_s`` computing the figures.
        self.timer = timer
        self.busy_s = 0.0
        self.min_busy_s = 0.0
        #: With ``process_timer`` too (the process's CPU clock), the rate follows the budget.
        self.process_timer = process_timer
        self.budget = (RateBudget(busy_share, max_rate) if busy_share is not None and timer is not None
                       and process_timer is not None else None)
        self.own_hits = own_hits
        self.tiers = [_TierCopies(spec, multiples) for spec in tiers]
        self.multiples = tuple(multiples)
        self.bands = [Bands(self.sample.threshold) for _ in self.tiers]
        self.clock = clock
        self.min_every_s = min_every_s
        self.accesses = 0                   # every use offered
        self.sampled = 0                    # of those, counted as sampled
        self._window: list[tuple[bytes, int, int, tuple[int, ...] | None]] = [(b"", 0, 0, None)] * window   # a ring
        self._next_use = array("q", bytes(8 * window))  # beside it: the sampled number of the entry's key's next use (0: none yet)
        self._at = 0
        self._figures: list[WindowFigures] | None = None
        self._figures_at = (-float("inf"), 0, 0.0, 0.0)     # (clock, sampled, process CPU, what they took)

    # -- feeding ---------------------------------------------------------------------------------

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
        own = self.own_hits() if self.own_hits is not None else None
        pending = self._pending
        pending.extend((key, start + i + 1, nbytes(i), own) for i, key in enumerate(keys) if key < bound)
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
        have been had it been counted at once."""
        pending = self._pending
        if not pending:
            return 0
        timer = self.timer
        started = timer() if timer is not None else 0.0
        sample = self.sample
        for _ in range(len(pending) if limit is None else min(limit, len(pending))):
            key, number, nbytes, own = pending.popleft()
            if key < sample.bound:
                self._sampled(key, nbytes, number, own)
        if timer is not None:
            self.busy_s += timer() - started
            if self.budget is not None and self.process_timer is not None:
                rate = self.budget.observe(self.clock(), self.busy_s, self.process_timer(), sample.rate)
                if rate is not None:
                    self.set_rate(rate)
        return len(pending)

    def set_rate(self, rate: float) -> None:
        """The budget allows sampling ``rate`` of the keys from now on: the rate moves there,
        within the cap and the copies' memory (:meth:`_allowed`)."""
        self._budget_rate = rate
        self._move_to(self._allowed())

    def _allowed(self) -> int:
        """The threshold the cap, the budget and the copies' memory allow together; what holds
        it there is kept in :attr:`limited_by`."""
        rate, self.limited_by = self.max_rate, "cap"
        if self._budget_rate < rate:
            rate, self.limited_by = self._budget_rate, "budget"
        for tier in self.tiers:
            if tier.blocks and self.sample_keys / (sum(tier.multiples) * tier.blocks) < rate:
                rate, self.limited_by = self.sample_keys / (sum(tier.multiples) * tier.blocks), "memory"
        return max(1, int(SPACE * rate))

    def _move_to(self, threshold: int) -> None:
        before = self.sample.threshold
        if threshold < before:
            self._forget(self.sample.lower(threshold))
        elif threshold > before:
            self.sample.raise_to(threshold)
            for bands, tier in zip(self.bands, self.tiers):
                bands.rose(threshold, self.accesses, tier.warm)
        if threshold != before:
            self._resize()

    def _forget(self, dropped: list[bytes]) -> None:
        for bands in self.bands:
            bands.fell(self.sample.threshold)
        for tier in self.tiers:
            for key in dropped:
                tier.forget(key)

    def _sampled(self, key: bytes, nbytes: int, number: int, own: tuple[int, ...] | None) -> None:
        for tier in self.tiers:
            tier.seen(nbytes)
        if self.sampled % RESIZE_EVERY == 0:
            self._resize()
            allowed = self._allowed()
            if self.sampled and (allowed < self.sample.threshold or allowed >= self.sample.threshold * 2):
                self._move_to(allowed)          # the tiers' size in blocks moved what the copies' memory allows
                if key >= self.sample.bound:
                    return
        self.sampled += 1
        seq, at, size = self.sampled, self._at, len(self._window)
        previous = self.sample.last(key)
        if previous is not None and previous >= seq - size:
            self._next_use[(previous - 1) % size] = seq     # the window holds a use of the key: this is the next
        self.sample.take(key, seq)
        old = self._window[at]
        entered = previous is None or previous < seq - size
        left = old[1] and old[0] < self.sample.bound
        for tier in self.tiers:                          # a use leaves the window, MIN's state follows
            if entered:
                tier.entered_window(key, seq)
            if left:
                tier.left_window(old[0], self._next_use[at])
        bits, shift = 0, 0
        for tier in self.tiers:
            bits |= tier.access(key) << shift
            shift += len(self.multiples)
        self._window[at] = (key, number, bits, own)
        self._next_use[at] = 0
        self._at = (at + 1) % size

    def _resize(self) -> None:
        """The copies sized for the rate and the tiers' size in blocks now; keys with no use
        left in the window leave the sample."""
        oldest = self._window[self._at][1]          # the access number of the window's oldest entry
        if oldest:
            self.sample.retire(self.sampled - len(self._window) + 1)
        for tier, bands in zip(self.tiers, self.bands):
            tier.resize(self.sample.threshold)
            bands.prune(oldest)

    # -- reading ---------------------------------------------------------------------------------

    def window(self) -> list[tuple[bytes, int, int, tuple[int, ...] | None]]:
        """The sampled uses of the window, oldest first: (key, access number, hit bits, the
        tiers' own hit counts)."""
        ring = self._window[:]                 # one copy, atomic under the GIL: a reader thread is safe
        at = self._at
        return [e for e in ring[at:] + ring[:at] if e[1]]

    def points(self) -> list[CurvePoint]:
        """Every tier at every multiple, from the window (:meth:`figures`)."""
        figures = self.figures()
        out = []
        for tier, f in zip(self.tiers, figures):
            spec = tier.spec
            for i, m in enumerate(tier.multiples):
                out.append(CurvePoint(spec.name, spec.policy_name, m, int(m * tier.blocks), f.policy[i], f.least[i],
                                      f.error[i], f.min_error[i], f.uses, f.keys, tier.copies[i].capacity))
        return out

    def figures(self) -> list[WindowFigures]:
        """Each tier's figures over the window, computed again if due (see the module)."""
        now = self.clock()
        at, sampled, cpu, took = self._figures_at
        process = self.process_timer() if self.process_timer is not None else 0.0
        young = self.sampled < len(self._window) and self.sampled - sampled >= max(16, sampled // 8)
        started_empty = sampled < 16 <= self.sampled
        paid = self.budget is None or took <= ESTIMATE_SHARE * (process - cpu)
        if self._figures is not None and not (started_empty or paid and (young or now - at >= self.min_every_s)):
            return self._figures
        started = self.timer() if self.timer is not None else 0.0
        least = [[m.residents() for m in tier.least] for tier in self.tiers]     # where the window begins, then the window
        entries = self.window()
        rate = self.sample.rate
        out = []
        for t, (tier, bands) in enumerate(zip(self.tiers, self.bands)):
            one = tier.multiples.index(1.0) if 1.0 in tier.multiples else None
            out.append(estimate_tier(entries, TierWindow(t * len(self.multiples), [c.capacity for c in tier.copies],
                                                         one, bands.copy(), t if self.own_hits is not None else None,
                                                         rate, least[t])))
        took = (self.timer() - started) if self.timer is not None else 0.0
        self.min_busy_s += took
        self._figures, self._figures_at = out, (now, self.sampled, process, took)
        return out

    @property
    def figures_age(self) -> float:
        """Seconds since the figures were last computed (0 before the first time)."""
        return max(0.0, self.clock() - self._figures_at[0]) if self._figures is not None else 0.0

    @property
    def min_span(self) -> tuple[int, int]:
        """The access numbers of the first and last sampled use the last figures counted (the
        first tier's)."""
        return self._figures[0].span if self._figures else (0, 0)
