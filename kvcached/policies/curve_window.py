"""The live curves' figures from their window of sampled uses (no I/O): each tier's policy and
Belady's MIN at each size, over the same sampled uses, with the error each figure may have.
kvcached.policies.curves keeps the window; this turns it into numbers.

A window entry is one sampled use: its key, its access number (1 for the first use the curves
were offered), which copies hit it (one bit per tier and size), and the tiers' own counts of
their hits so far (None where the owner keeps none).

Per tier, over the entries that count (:class:`Bands`: keys in the sample from the start of the
window, or from when a band of keys that joined it is caught up with):

- **the policy** at each size: the copy's hits, the gap between the sampled uses and their
  expected number weighed in (:func:`adjusted_rate`); then, where the tier counts its own hits,
  corrected by what the sample got wrong at 1x, where the truth is known (a control variate:
  which keys fell in the sample moves every size's figure the same way, so what the sample made
  of the tier's own size says how far it is off at the others; the coefficient per size from the
  keys' own counts, :func:`control`). At 1x the figure is then the tier's own hit rate.
- **MIN** at each size: Belady's MIN over the same entries with room for as many keys as the
  copy, starting from the keys MIN itself held where the window begins (a MIN run behind the
  window, kvcached.policies.belady.TrailingMin) and those the copy held (its hits on a key's
  first use in the window: MIN from a cache's state beats that cache's policy from the same
  state); estimated the same way; never below the policy's figure, which it bounds, and never
  above 1.
- **the error**: twice the standard error of the figure (about 95%), from the spread of the
  sampled keys' own hits about it (the linearized variance of a ratio estimator under Bernoulli
  sampling of keys: (1 - R) x the sum over sampled keys of the squared residual, over the
  sampled uses squared). It covers which keys fell in the sample, not how well a miniature copy
  stands for a full-size tier (tested against the exact replay: tests/unit/test_curves.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvcached.policies.belady import belady_hits
from kvcached.policies.curve_sample import SPACE, bound_key

__all__ = ["Bands", "Entry", "TierWindow", "WindowFigures", "adjusted_rate", "control", "estimate_tier"]

#: (key, access number, hit bits, the tiers' own hit counts so far or None)
Entry = tuple[bytes, int, int, "tuple[int, ...] | None"]


class Bands:
    """Which sampled uses of a tier count: a key counts from the access number where its band
    of hashes does. The sample's rate falling takes keys out everywhere, back to the start (their
    copies forgot them: SHARDS' rescaling); its rate rising adds a band of keys the copies have
    not seen before, which counts once the copies have seen ``warm`` more uses (until then their
    first uses look like misses that a tier running all along would have hit)."""

    def __init__(self, threshold: int) -> None:
        self.steps: list[tuple[int, int]] = [(0, threshold)]      # (from access number, threshold)

    def fell(self, threshold: int) -> None:
        self.steps = [(n, min(t, threshold)) for n, t in self.steps]

    def rose(self, threshold: int, at: int, warm: int) -> None:
        """The threshold rose to ``threshold`` at access number ``at``: no use counts until the
        copies have seen ``warm`` more (the new keys' first uses in them are misses a tier running
        all along might have hit, and the room the rise gave the copies is the old keys' until the
        new ones take their share: counted through it, the trace's curve came out 0.04 off)."""
        self.steps = [step for step in self.steps if step[0] < at] + [(at, 0), (at + warm, threshold)]

    def copy(self) -> "Bands":
        out = Bands(0)
        out.steps = list(self.steps)
        return out

    def prune(self, before: int) -> None:
        """Forget the steps no entry from access number ``before`` on needs."""
        steps = self.steps
        while len(steps) > 1 and steps[1][0] <= before:
            steps.pop(0)

    def bound_at(self, number: int) -> int:
        """The threshold a key's hash must be below for its use numbered ``number`` to count
        (0: no use that early counts)."""
        bound = 0
        for at, threshold in self.steps:
            if at > number:
                break
            bound = threshold
        return bound

    def expected(self, first: int, last: int) -> float:
        """The sampled uses that accesses ``first`` to ``last`` held by expectation."""
        total = 0.0
        steps = self.steps
        for i, (at, threshold) in enumerate(steps):
            end = steps[i + 1][0] - 1 if i + 1 < len(steps) else last
            lo, hi = max(first, at), min(last, end)
            if hi >= lo:
                total += (hi - lo + 1) * threshold / SPACE
        return total

    def counted(self, entries: Sequence[Entry]) -> list[Entry]:
        """The entries that count, in order."""
        if len(self.steps) == 1:
            start, bound = self.steps[0][0], bound_key(self.steps[0][1])
            return [e for e in entries if e[0] < bound and e[1] >= start]
        return [e for e in entries if e[0] < bound_key(self.bound_at(e[1]))]


@dataclass(frozen=True)
class TierWindow:
    """What :func:`estimate_tier` needs of a tier: the bit of its first copy, its copies'
    capacities (entries, one per size), which of them is 1x (or None), its :class:`Bands`, the
    index of its own hit count in an entry's counts (or None), the sampling rate now, and per size
    the keys MIN held where the window begins (kvcached.policies.belady.TrailingMin; none: MIN
    starts from the keys the copy held)."""

    first_bit: int
    capacities: Sequence[int]
    one: int | None
    bands: Bands
    real: int | None
    rate: float
    least_start: Sequence[Sequence[bytes]] = ()


@dataclass(frozen=True)
class WindowFigures:
    """A tier's figures over the window: per size, the policy's hit rate, MIN's and their errors
    (None: nothing counted); how many sampled uses and distinct keys they stand on; the span of
    access numbers; and the tier's own hit rate over it (None: not counted)."""

    policy: Sequence[float | None]
    least: Sequence[float | None]
    error: Sequence[float | None]
    min_error: Sequence[float | None]
    uses: int
    keys: int
    span: tuple[int, int]
    own: float | None


def estimate_tier(entries: Sequence[Entry], tier: TierWindow) -> WindowFigures:
    """The tier's figures over ``entries`` (the window, oldest first; see the module)."""
    sizes = len(tier.capacities)
    counted = tier.bands.counted(entries)
    if not counted:
        return WindowFigures([None] * sizes, [None] * sizes, [None] * sizes, [None] * sizes, 0, 0, (0, 0), None)
    first, last = counted[0][1], counted[-1][1]
    expected = tier.bands.expected(first, last)
    own = _own_rate(entries, tier.bands, tier.real) if tier.real is not None else None
    keys = [e[0] for e in counted]
    uses: dict[bytes, int] = {}
    for key in keys:
        uses[key] = uses.get(key, 0) + 1
    policy_hits, least_hits = [], []
    for i, capacity in enumerate(tier.capacities):
        bit = 1 << (tier.first_bit + i)
        hits = [bool(e[2] & bit) for e in counted]
        policy_hits.append(hits)
        least_hits.append(belady_hits(capacity, keys, _least_start(keys, hits, capacity, tier.least_start[i]
                                                                   if tier.least_start else ())))
    rate = tier.rate
    uses_squared = sum(n * n for n in uses.values())
    policy = [_KeyHits.of(keys, hits, uses) for hits in policy_hits]
    least = [_KeyHits.of(keys, hits, uses) for hits in least_hits]
    base = policy[tier.one] if tier.one is not None else None
    out_policy, out_error, out_least, out_min_error = [], [], [], []
    for i in range(sizes):
        p, e = control(policy[i], base, own, len(keys), expected, uses_squared, rate)
        m, me = control(least[i], base, own, len(keys), expected, uses_squared, rate)
        p = min(1.0, max(0.0, p))
        out_policy.append(p)
        out_error.append(e)
        out_least.append(min(1.0, max(p, m)))
        out_min_error.append(me)
    return WindowFigures(out_policy, out_least, out_error, out_min_error, len(keys), len(uses), (first, last), own)


def _least_start(keys: Sequence[bytes], hits: Sequence[bool], capacity: int, held: Sequence[bytes]) -> list[bytes]:
    """The keys MIN holds as the counted uses begin: of those MIN held where the window began
    (``held``) and those the copy held (its hits on a key's first counted use: MIN from the
    copy's state never hits less than the copy), the ones used first, room allowing. The copy's
    count where MIN's state has not caught up (a band of keys new to the sample: MIN's state
    follows the window's start)."""
    first: dict[bytes, bool] = {}
    for key, hit in zip(keys, hits):
        if key not in first:
            first[key] = hit
    held_set = set(held)
    return [key for key, hit in first.items() if hit or key in held_set][:capacity]


def _own_rate(entries: Sequence[Entry], bands: Bands, real: int) -> float | None:
    """The tier's own hit rate over the stretches of the window where uses count (its own hit
    count, index ``real`` of each entry's counts, from the first to the last entry of each)."""
    hits = uses = 0
    steps = bands.steps
    for i, (at, threshold) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else None
        inside = [e for e in entries if e[1] >= at and (end is None or e[1] < end) and e[3] is not None]
        if threshold and len(inside) > 1:
            first, last = inside[0], inside[-1]
            assert first[3] is not None and last[3] is not None
            hits += last[3][real] - first[3][real]
            uses += last[1] - first[1]
    return hits / uses if uses else None


@dataclass(frozen=True)
class _KeyHits:
    """One copy's hits over the counted entries: per key, and the sums the estimate weighs."""

    hits: int                       # in all
    uses_hits: int                  # the sum over keys of uses x hits
    hits_squared: int
    by_key: dict[bytes, int]

    @classmethod
    def of(cls, keys: Sequence[bytes], hits: Sequence[bool], uses: dict[bytes, int]) -> "_KeyHits":
        by_key: dict[bytes, int] = {}
        for key, hit in zip(keys, hits):
            if hit:
                by_key[key] = by_key.get(key, 0) + 1
        return cls(sum(by_key.values()), sum(uses[k] * h for k, h in by_key.items()),
                   sum(h * h for h in by_key.values()), by_key)

    def cross(self, other: "_KeyHits") -> int:
        """The sum over keys of this copy's hits x the other's."""
        small, large = (self.by_key, other.by_key) if len(self.by_key) <= len(other.by_key) else (other.by_key, self.by_key)
        return sum(h * large.get(k, 0) for k, h in small.items())


def control(copy: _KeyHits, base: _KeyHits | None, own: float | None, sampled: int, expected: float,
            uses_squared: int, rate: float) -> tuple[float, float]:
    """A copy's hit rate from the sample and its error (see the module): adjusted for the gap
    between ``sampled`` and ``expected`` uses (``uses_squared``: the sum over the sampled keys
    of their uses squared); with ``base`` (the 1x copy's hits) and ``own`` (the tier's own hit
    rate over the same span), corrected by what the 1x copy got wrong.

    A key k's residual is d_k = h_k - p u_k (its hits, less its uses at the copy's raw rate p);
    the error is twice sqrt((1 - R) x sum d_k^2) over the sampled uses, with the control variate
    sum (d_k - beta x d1_k)^2, beta = sum d_k d1_k / sum d1_k^2 (clamped to 0..2)."""
    estimate = adjusted_rate(copy.hits, sampled, expected, uses_squared, copy.uses_hits, rate)
    p = copy.hits / sampled
    spread = copy.hits_squared - 2 * p * copy.uses_hits + p * p * uses_squared
    if base is None or own is None:
        return estimate, 2 * math.sqrt(max(0.0, (1 - rate) * spread)) / sampled
    q = base.hits / sampled
    base_spread = base.hits_squared - 2 * q * base.uses_hits + q * q * uses_squared
    together = copy.cross(base) - q * copy.uses_hits - p * base.uses_hits + p * q * uses_squared
    beta = min(2.0, max(0.0, together / base_spread)) if base_spread > 1e-9 else 0.0
    left = spread - 2 * beta * together + beta * beta * base_spread
    base_estimate = adjusted_rate(base.hits, sampled, expected, uses_squared, base.uses_hits, rate)
    return estimate - beta * (base_estimate - own), 2 * math.sqrt(max(0.0, (1 - rate) * left)) / sampled


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
