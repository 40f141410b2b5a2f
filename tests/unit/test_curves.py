"""The live miss-ratio curves (kvcached.policies.curves) against the simulator's exact replay of
the same stream: the production trace and synthetic workloads, the tier's policy at 0.5x to 4x
its size within 0.02 of exact, MIN over the window within 0.03 of exact MIN over the same
stretch of accesses. Also the sample's bound, its rescaling and what the curves hold."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.policies.belady import belady_hits
from kvcached.policies.curves import MULTIPLES, KeySample, MissRatioCurves, TierSpec
from kvcached.sim.replay import accesses_of, replay_hits
from kvcached.sim.traces import load_trace
from kvcached.sim.workloads import make_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def accesses(workload: str, scale: float) -> list[bytes]:
    if workload == "trace":
        if not TRACE.exists():
            pytest.skip(f"no production trace at {TRACE}")
        return accesses_of(load_trace(str(TRACE)).requests)
    return accesses_of(make_trace(workload, scale))


@pytest.mark.parametrize(("workload", "scale", "policy", "share"), [
    ("trace", 1.0, "slru", 0.1), ("trace", 1.0, "lru", 0.03), ("batch_summarization", 8.0, "s3fifo", 0.1),
])
def test_live_curves_match_the_exact_replay(workload: str, scale: float, policy: str, share: float) -> None:
    """Fed as the daemon feeds them (every use of a block, beside the tier's own policy, whose
    tuned setting the copies follow), the curves match the exact replay at each size. Every
    synthetic workload and policy: bench/bench_curves.py (its accuracy table)."""
    stream = accesses(workload, scale)
    size = int(len(set(stream)) * share)
    tier = make_keyed_policy(policy)
    curves = MissRatioCurves([TierSpec("ram", policy, tier.policy, size * 4096, lambda n: n)], lambda: 0.0,
                             min_every_s=0.0)
    for _hit, key in zip(replay_hits(tier, size, stream), stream):      # the tier runs beside the curves
        curves.access(key, 4096)
    points = {p.multiple: p for p in curves.points()}
    first, last = curves.min_span
    window = stream[first - 1:last]
    for m in MULTIPLES:
        at = round(m * size)
        exact = sum(replay_hits(make_keyed_policy(policy), at, stream)) / len(stream)
        least = sum(belady_hits(at, window)) / len(window)
        assert points[m].blocks == at or abs(points[m].blocks - at) <= 1
        assert abs(points[m].hit_rate - exact) <= 0.02, (m, points[m].hit_rate, exact)
        assert abs(points[m].min_hit_rate - least) <= 0.03, (m, points[m].min_hit_rate, least)


def test_the_sample_holds_at_most_its_limit_and_its_threshold_only_falls() -> None:
    sample = KeySample(100, rate=0.5)
    thresholds = [sample.threshold]
    dropped: list[bytes] = []
    for _ in range(5000):
        key = os.urandom(32)
        hashed = int.from_bytes(key[:8], "little")
        if hashed < sample.threshold:
            dropped += sample.take(key, hashed)
            thresholds.append(sample.threshold)
    assert len(sample) == 100 and thresholds == sorted(thresholds, reverse=True)
    assert thresholds[0] == 1 << 63 and 0 < sample.rate < 0.05
    assert all(key not in sample and int.from_bytes(key[:8], "little") >= sample.threshold for key in dropped)
    with pytest.raises(ValueError):
        KeySample(0)


def test_what_the_curves_hold_is_bounded_by_the_sample_not_the_keys() -> None:
    """A hundred thousand distinct keys through curves of two tiers (every copy with room for
    all of the sample): what stays allocated is the sample's keys and the window, as
    docs/operations.md states (under 2 KiB a sampled key, 100 bytes a window entry)."""
    def tier(name: str) -> TierSpec:
        return TierSpec(name, "lru", make_keyed_policy("lru").policy, 1 << 40, lambda n: n)
    tracemalloc.start()
    try:
        curves = MissRatioCurves([tier("ram"), tier("ssd")], lambda: 0.0, sample_keys=1024, window=4096, max_rate=1.0)
        for i in range(100_000):
            curves.access(os.urandom(32), 4096)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(curves.sample) == 1024 and curves.accesses == 100_000
    assert held < 1024 * 2048 + 4096 * 100, held


def test_nothing_sampled_yet_says_so() -> None:
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 20, lambda n: n)],
                             lambda: 0.0)
    assert all(p.hit_rate is None and p.min_hit_rate is None for p in curves.points())
