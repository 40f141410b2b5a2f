"""The live curves' figures from their window (kvcached.policies.curve_window): MIN from the
copies' state never below the policy, the tier's own hit rate at 1x, the error each figure
states, the bands of keys that count, and the gap adjustment."""

from __future__ import annotations

import random
import statistics

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.policies.belady import belady_hits
from kvcached.policies.curve_sample import SPACE
from kvcached.policies.curve_window import Bands, adjusted_rate
from kvcached.policies.curves import MULTIPLES, MissRatioCurves, TierSpec
from kvcached.policies.tuning import make_shadow
from kvcached.sim.replay import replay_hits


def skewed(seed: int, n: int, keys: int = 3000) -> list[bytes]:
    rng = random.Random(seed)
    pool = [rng.randbytes(32) for _ in range(keys)]
    return [pool[min(int(rng.paretovariate(0.6)) - 1, keys - 1)] if rng.random() < 0.6 else rng.choice(pool)
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["lru", "slru", "s3fifo", "arc"])
def test_min_from_a_caches_state_never_hits_less_than_the_cache(policy: str, seed: int) -> None:
    """A copy warmed on a stream's first half, then run over its second: MIN over the second
    half, starting with the keys the copy's first use of them hit (those it held at the start),
    hits at least as often as the copy, at every size."""
    stream = skewed(seed, 20_000)
    for capacity in (20, 200, 1500):
        copy = make_shadow(make_keyed_policy(policy).policy.miniature(), capacity)
        for key in stream[:10_000]:
            copy.access(key)
        window = stream[10_000:]
        hits = [copy.access(key) for key in window]
        first: dict[bytes, bool] = {}
        for key, hit in zip(window, hits):
            first.setdefault(key, hit)
        initial = [k for k, hit in first.items() if hit]
        assert len(initial) <= capacity
        assert sum(belady_hits(capacity, window, initial)) >= sum(hits) > 0
    assert sum(belady_hits(3, [b"a", b"b", b"a"], [b"b"])) == 2
    with pytest.raises(ValueError):
        belady_hits(1, [b"a"], [b"a", b"b"])


def curves_of(stream: list[bytes], policy: str, size: int, **kw: object) -> tuple[MissRatioCurves, list[bool]]:
    """Curves fed ``stream`` beside the tier itself (``size`` blocks), with its own hit count."""
    tier = make_keyed_policy(policy)
    own = [0]
    curves = MissRatioCurves([TierSpec("ram", policy, tier.policy, size * 4096, lambda n: n)], lambda: 0.0,
                             busy_share=None, own_hits=lambda: (own[0],), **kw)   # type: ignore[arg-type]
    hits = []
    for hit, key in zip(replay_hits(tier, size, stream), stream):
        own[0] += hit
        hits.append(hit)
        curves.access(key, 4096)
    return curves, hits


@pytest.mark.parametrize("seed", range(3))
def test_min_is_never_below_the_policy_nor_above_one_and_1x_is_the_tiers_own(seed: int) -> None:
    """However small the sample (a window of 300 uses, 40 keys), at each size MIN's figure is
    at or above the policy's and at most 1; at 1x the policy's figure is the tier's own hit rate
    over the window's span, with no error of the sample's."""
    stream = skewed(seed, 30_000, keys=400)
    for keys, window in ((40, 300), (400, 4096)):
        curves, hits = curves_of(stream, "slru", 100, sample_keys=keys, window=window, max_rate=1.0)
        points = curves.points()
        assert all(p.min_hit_rate is not None and p.hit_rate is not None for p in points)
        assert all(p.hit_rate <= p.min_hit_rate <= 1.0 for p in points), [(p.hit_rate, p.min_hit_rate) for p in points]
        first, last = curves.min_span
        one = next(p for p in points if p.multiple == 1.0)
        assert one.hit_rate == pytest.approx(sum(hits[first:last]) / (last - first), abs=1e-9)
        assert one.error == 0.0 and one.uses == len([e for e in curves.window() if e[0] in curves.sample])


def test_the_error_covers_what_the_sample_gets_wrong() -> None:
    """Over twelve keyings of one stream (other keys fall in the sample), the figures at 0.5x, 2x
    and 4x are within their stated error (about 95%) in at least 80% of the points, and the
    error shrinks as the sample grows."""
    base = skewed(7, 60_000, keys=20_000)
    size = 2000
    exact = {m: sum(replay_hits(make_keyed_policy("lru"), round(m * size), base)) / len(base) for m in MULTIPLES}
    inside, errors = 0, {}
    for salt in range(12):
        rng = random.Random(salt)
        rename = {k: rng.randbytes(32) for k in sorted(set(base))}     # sorted: a set of bytes iterates by PYTHONHASHSEED
        stream = [rename[k] for k in base]
        for rate in (1 / 4, 1 / 16):
            curves, _ = curves_of(stream, "lru", size, max_rate=rate, window=1 << 17)
            for p in curves.points():
                if p.multiple != 1.0:
                    assert p.error is not None and p.hit_rate is not None
                    errors.setdefault(rate, []).append(p.error)
                    inside += rate == 1 / 4 and abs(p.hit_rate - exact[p.multiple]) <= p.error
    assert inside >= 0.8 * 36, inside
    assert statistics.median(errors[1 / 4]) < statistics.median(errors[1 / 16]) / 1.5


def test_uses_count_again_once_the_copies_caught_up_with_a_rise() -> None:
    bands = Bands(SPACE // 8)
    bands.fell(SPACE // 16)                  # falls reach back: those keys left the copies
    assert bands.bound_at(0) == SPACE // 16
    bands.rose(SPACE // 8, at=1000, warm=500)
    assert bands.bound_at(999) == SPACE // 16 and bands.bound_at(1000) == 0 and bands.bound_at(1499) == 0
    assert bands.bound_at(1500) == SPACE // 8
    assert bands.expected(1, 2000) == pytest.approx(999 / 16 + 501 / 8)
    bands.fell(SPACE // 32)
    assert bands.bound_at(5000) == SPACE // 32 and bands.bound_at(1200) == 0
    bands.prune(1600)
    assert bands.steps == [(1500, SPACE // 32)]


def test_the_gap_is_weighed_by_the_hits_per_use_unless_hotter_keys_are_missing() -> None:
    """adjusted_rate: 1,000 sampled keys of 10 uses, 4 of them hits each (4,000 hits in 10,000
    uses). A shortfall within the sampled keys' own spread (variance (1 - rate) x 100,000) is the
    luck of how many keys fell in the sample, and those hit as the rest: the rate stays 0.4, where
    counting the gap as hits (SHARDS-adj) reads 0.415. A shortfall far beyond that spread is keys
    hotter than any sampled, which hit at every size: counted as hits, as SHARDS-adj does. A
    surplus is taken off at the sampled keys' hits per use."""
    rate, uses_squared, uses_hits = 1 / 16, 1000 * 10 * 10, 1000 * 10 * 4
    assert adjusted_rate(4000, 10_000, 10_250, uses_squared, uses_hits, rate) == pytest.approx(0.4)
    assert adjusted_rate(4000, 10_000, 15_000, uses_squared, uses_hits, rate) == pytest.approx(9000 / 15_000, abs=0.002)
    assert adjusted_rate(4000, 10_000, 9_000, uses_squared, uses_hits, rate) == pytest.approx(0.4)
    assert adjusted_rate(0, 0, 0, 0, 0, rate) == 0.0
