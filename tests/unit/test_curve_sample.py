"""The live curves' sample and its budget (kvcached.policies.curve_sample): which keys are in it,
and a rate that follows what the sampled uses cost, falling when over the budget and rising
again when the traffic falls (a rate that could only fall kept 40 keys of a trace a daemon
served at full speed, issue 60)."""

from __future__ import annotations

import os

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.policies.curve_sample import SPACE, KeySample, RateBudget, bound_key
from kvcached.policies.curves import MissRatioCurves, TierSpec


def test_the_sample_holds_the_keys_below_its_threshold_used_lately() -> None:
    sample = KeySample(rate=0.5)
    keys = [os.urandom(32) for _ in range(4000)]
    for n, key in enumerate(keys, 1):
        if key < sample.bound:
            sample.take(key, n)
    assert all((key in sample) == (int.from_bytes(key[:8], "big") < SPACE // 2) for key in keys)
    assert 1800 < len(sample) < 2200
    before = len(sample)
    retired = sample.retire(3000)                 # no use since 3,000: they leave, the threshold stays
    assert sample.rate == 0.5 and len(sample) == before - retired and retired > 1000
    assert all(key not in sample for key in keys[:2999])
    with pytest.raises(ValueError):
        KeySample(0.0)


def test_a_sample_lowered_drops_keys_and_raised_takes_more() -> None:
    sample = KeySample(0.25)
    keys = [os.urandom(32) for _ in range(2000)]
    for n, key in enumerate(keys):
        if key < sample.bound:
            sample.take(key, n)
    dropped = sample.lower(SPACE // 16)
    assert sample.rate == 1 / 16 and all(int.from_bytes(k[:8], "big") >= SPACE // 16 for k in dropped)
    assert all(int.from_bytes(k[:8], "big") < SPACE // 16 for k in keys if k in sample)
    sample.raise_to(SPACE // 4)
    assert sample.rate == 0.25 and sample.bound == bound_key(SPACE // 4)
    sample.raise_to(SPACE * 4)                          # never past every key
    assert sample.threshold == SPACE and sample.bound == b"\xff" * 33


def budget() -> RateBudget:
    return RateBudget(0.01, 0.125, window_s=2.0, floor=0.001)


def test_over_the_budget_the_rate_falls_in_proportion_at_the_end_of_a_window() -> None:
    b = budget()
    assert b.observe(0.0, 0.0, 0.0, 0.125) is None          # the first window starts
    assert b.observe(1.0, 0.02, 0.9, 0.125) is None           # within the window: not yet
    rate = b.observe(2.0, 0.04, 1.8, 0.125)                   # 0.04 s of 1.8 s: 2.2%, the budget 1%
    assert rate == pytest.approx(0.125 * 0.8 * 0.018 / 0.04)


def test_a_burst_is_answered_before_the_window_ends() -> None:
    b = budget()
    b.observe(0.0, 0.0, 0.0, 0.125)
    rate = b.observe(0.5, 0.1, 0.5, 0.125)                    # 0.1 s of 0.5 s: 20%, four times a full window's
    assert rate == 0.125 / RateBudget.FALL                    # a fourth at once, however far over


def test_well_under_the_budget_for_a_while_the_rate_doubles_up_to_its_cap() -> None:
    """Three windows in a row under half the allowance, then twice the rate, no more; one heavy
    window between starts the count again."""
    b = budget()
    b.observe(0.0, 0.0, 0.0, 0.01)
    assert b.observe(2.0, 0.001, 1.8, 0.01) is None           # a tenth of the budget spent: once
    assert b.observe(4.0, 0.002, 3.6, 0.01) is None           # twice
    assert b.observe(6.0, 0.003, 5.4, 0.01) == 0.02           # three times: twice the rate, no more
    assert b.observe(8.0, 0.020, 7.2, 0.02) is None           # near the allowance: the count starts again
    for t in (10.0, 12.0):
        assert b.observe(t, 0.020 + (t - 8.0) * 0.0005, t * 0.9, 0.1) is None
    assert b.observe(14.0, 0.023, 12.6, 0.1) == 0.125         # never past the cap
    for t in (16.0, 18.0, 20.0):
        assert b.observe(t, 0.023 + (t - 14.0) * 0.0005, t * 0.9, 0.125) is None


def test_near_the_budget_the_rate_stays() -> None:
    b = budget()
    b.observe(0.0, 0.0, 0.0, 0.05)
    assert b.observe(2.0, 0.014, 1.8, 0.05) is None           # 0.78% of 1%: a move of less than a quarter


def test_an_idle_daemon_keeps_its_sample() -> None:
    """Below ``floor`` of a core the uses are left alone, however little CPU the process used."""
    b = budget()
    b.observe(0.0, 0.0, 0.0, 0.125)
    assert b.observe(2.0, 0.0015, 0.002, 0.125) is None       # 0.75 ms a second: under the floor's 2 ms
    with pytest.raises(ValueError):
        RateBudget(0.0, 0.125)


def test_the_curves_sample_fewer_keys_in_a_burst_and_more_again_when_the_traffic_falls() -> None:
    """Curves with timers: each timed call reads as 20 us of CPU a sampled use, the process's
    CPU is 100 us a use. At 5,000 uses a second (half a core) the budget of 1% holds the rate near
    1/25; at 100 a second it climbs back to the cap, doubling every few windows; the copies and
    the sample follow it both ways."""
    now, cpu = [0.0], [0.0]
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 24, lambda n: n)],
                             lambda: now[0], timer=lambda: 20e-6 * curves.sampled, process_timer=lambda: cpu[0],
                             busy_share=0.01)
    rates = []

    def serve(uses_per_s: float, seconds: float) -> None:
        for _ in range(int(uses_per_s * seconds)):
            curves.access(os.urandom(32), 4096)
            now[0] += 1 / uses_per_s
            cpu[0] += 100e-6
            rates.append(curves.sample.rate)

    serve(5000, 20)
    low = curves.sample.rate
    assert 1 / 40 < low < 1 / 15, low              # 1% of 0.5 cores at 20 us a sampled use: 1/20, less the margin
    assert curves.busy_s == pytest.approx(20e-6 * curves.sampled)
    serve(100, 40)
    assert curves.sample.rate == 0.125 and max(rates) == 0.125
    assert len(curves.sample) > 500 and curves.bands[0].steps[-1][1] == SPACE // 8


def test_keys_no_longer_in_use_leave_the_sample_so_its_rate_holds_on_endless_new_keys() -> None:
    """Traffic that brings new keys all day (each used twice, close together): keys leave the
    sample once the window holds no use of theirs, so after sixteen times the traffic the rate
    is where it was and the sample holds no more than the window's keys. (A sample of the
    smallest hashes ever seen, as it was, fell sixteenfold: one over the keys seen.)"""
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 22, lambda n: n)],
                             lambda: 0.0, sample_keys=512, window=2048, max_rate=1.0, busy_share=None)
    rates = []
    for part in range(16):
        for _ in range(20_000):
            key = os.urandom(32)
            curves.access(key, 4096)
            curves.access(key, 4096)
        rates.append(curves.sample.rate)
    assert rates[-1] == rates[0] == 512 / (7.5 * 1024), rates     # the copies' memory: 512 keys over 7.5 x 1,024 blocks
    assert len(curves.sample) <= 2048
