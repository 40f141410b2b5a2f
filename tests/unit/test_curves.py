"""The live miss-ratio curves (kvcached.policies.curves) against the simulator's exact replay of
the same stream: the production trace and synthetic workloads, the tier's policy at 0.5x to 4x
its size within 0.02 of exact, MIN over the window within 0.03 of exact MIN over the same
stretch of accesses. Also the sample's bound, its rescaling and what the curves hold."""

from __future__ import annotations

import asyncio
import os
import random
import tracemalloc
from pathlib import Path

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.policies.belady import belady_hits
from kvcached.policies.curves import BUSY_WINDOW_S, MAX_PENDING, MAX_RATE, MULTIPLES, KeySample, MissRatioCurves, TierSpec, adjusted_rate
from kvcached.sim.replay import accesses_of, replay_hits
from kvcached.sim.traces import load_trace
from kvcached.sim.workloads import make_trace
from kvcached.store.curves import DRAIN_SLICE, LiveCurves

FULL_TRACES = [Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl",
               Path("/work/shared/traces/conversation_trace.jsonl")]
SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"


def accesses(workload: str, scale: float) -> tuple[list[bytes], float]:
    """The workload's block uses, and the most of its keys to sample: the production trace where
    it is at hand (MAX_RATE), else its first 1,500 requests (tests/data), a seventh of its uses,
    sampled at a quarter so the sample holds as many uses as the whole trace's does."""
    if workload == "trace":
        full = next((t for t in FULL_TRACES if t.exists()), None)
        return accesses_of(load_trace(str(full or SLICE)).requests), MAX_RATE if full else 0.25
    return accesses_of(make_trace(workload, scale)), MAX_RATE


@pytest.mark.parametrize(("workload", "scale", "policy", "share"), [
    ("trace", 1.0, "slru", 0.1), ("batch_summarization", 8.0, "s3fifo", 0.1),
])
@pytest.mark.slow
def test_live_curves_match_the_exact_replay(workload: str, scale: float, policy: str, share: float) -> None:
    """Fed as the daemon feeds them (every use of a block, beside the tier's own policy, whose
    tuned setting the copies follow), the curves match the exact replay at each size. Every
    synthetic workload and policy, and lru on the trace: bench/bench_curves.py (its accuracy
    table)."""
    stream, rate = accesses(workload, scale)
    size = int(len(set(stream)) * share)
    tier = make_keyed_policy(policy)
    curves = MissRatioCurves([TierSpec("ram", policy, tier.policy, size * 4096, lambda n: n)], lambda: 0.0,
                             min_every_s=0.0, sampled_per_s=None, max_rate=rate)
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


@pytest.mark.slow
def test_a_sample_whose_rate_fell_far_estimates_as_one_that_started_near_its_rate() -> None:
    """Fixed-size sampling starts at the rate cap and falls as keys come: the same final sample
    (the keys under the same threshold) reached from a cap of 1/2 and from one of 1/32 gives
    the same curves, within the sample's noise. Copies whose slru kept ghosts for the size they
    had at the start came out 0.015 apart here (rag: 0.02-0.05 under the exact replay)."""
    stream = accesses_of(make_trace("rag", 1.0))
    size = len(set(stream)) // 10
    rates = []
    for cap in (1 / 2, 1 / 32):
        tier = make_keyed_policy("slru")
        curves = MissRatioCurves([TierSpec("ram", "slru", tier.policy, size * 4096, lambda n: n)], lambda: 0.0,
                                 sample_keys=2048, max_rate=cap, sampled_per_s=None)
        for _hit, key in zip(replay_hits(tier, size, stream), stream):
            curves.access(key, 4096)
        assert curves.sample.rate < 1 / 40
        rates.append([p.hit_rate for p in curves.points(with_min=False)])
    assert all(abs(a - b) <= 0.008 for a, b in zip(*rates)), rates


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


@pytest.mark.parametrize(("ram", "ssd", "per_key"), [("lru", "lru", 2048), ("slru", "lru", 5120), ("slru", "slru", 8192)])
def test_what_the_curves_hold_is_bounded_by_the_sample_not_the_keys(ram: str, ssd: str, per_key: int) -> None:
    """A hundred thousand distinct keys through curves of two tiers (every copy with room for
    all of the sample): what stays allocated is the sample's keys and the window, as
    docs/operations.md states (a sampled key under 2 KiB where no tier tunes, 5 KiB with a
    tuned slru RAM tier, the default, 8 KiB with both; 100 bytes a window entry): a tuned
    tier's tuners at 0.5x, 2x and 4x hold at most the sample's size each, however many keys
    left the sample since."""
    def tier(name: str, policy: str) -> TierSpec:
        return TierSpec(name, policy, make_keyed_policy(policy).policy, 1 << 40, lambda n: n)
    tracemalloc.start()
    try:
        curves = MissRatioCurves([tier("ram", ram), tier("ssd", ssd)], lambda: 0.0, sample_keys=1024, window=4096,
                                 max_rate=1.0, sampled_per_s=None)
        for i in range(100_000):
            curves.access(os.urandom(32), 4096)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(curves.sample) == 1024 and curves.accesses == 100_000
    assert held < 1024 * per_key + 4096 * 100, held


def mib_tier(policy: str) -> TierSpec:
    """A 1 MiB tier of ``policy`` whose blocks take their own bytes."""
    return TierSpec("ram", policy, make_keyed_policy(policy).policy, 1 << 20, lambda n: n)


def reused_stream(seed: int) -> tuple[list[bytes], dict[bytes, int]]:
    """3,000 keys, then 20,000 uses of them at random; each key's payload bytes."""
    rng = random.Random(seed)
    stream = [os.urandom(32) for _ in range(3000)]
    stream += [rng.choice(stream) for _ in range(20_000)]
    return stream, {key: rng.choice((1024, 4096, 65536)) for key in stream}


def test_a_call_of_many_uses_counts_as_the_same_uses_one_by_one() -> None:
    """Store.put, get, pin and reserve hand the curves a call's keys at once (``uses``: a call
    none of whose keys is sampled costs one ``min``). Fed in calls of 16 or one at a time, the
    curves are the same: every use counted, each sampled use numbered where it stands in the
    stream (MIN's window) and sized by its own bytes (the tier's size in blocks)."""
    stream, sizes = reused_stream(5)
    one, batched = (MissRatioCurves([mib_tier("lru")], lambda: 0.0, max_rate=0.25, sample_keys=256, sampled_per_s=None)
                    for _ in range(2))
    for key in stream:
        one.access(key, sizes[key])
    for start in range(0, len(stream), 16):
        keys = stream[start:start + 16]
        batched.uses(keys, lambda i: sizes[keys[i]])
    assert batched.accesses == one.accesses == len(stream) and batched.sampled == one.sampled > 1000
    assert batched.window() == one.window() and batched.sample.rate < 0.25
    assert all(stream[n - 1] == key for key, n in batched.window())    # numbered as in the stream, from 1
    assert batched.points() == one.points()
    assert one.tiers[0].blocks != (1 << 20) // 4096          # the mean of the sampled sizes, not one size


def test_uses_queued_and_counted_later_make_the_same_curves_as_uses_counted_at_once() -> None:
    """``deferred`` (the daemon's: kvcached.store.curves.LiveCurves): a request only queues its
    sampled uses and the event loop counts them after its answer, a few at a time. Counted in
    order, each with its access number, they give the very curves of uses counted at once,
    while the sample's threshold falls under them; the queue holds MAX_PENDING at most."""
    stream, sizes = reused_stream(7)
    rng = random.Random(7)
    now, later, never = (MissRatioCurves([mib_tier("slru")], lambda: 0.0, max_rate=0.25, sample_keys=256,
                                         sampled_per_s=None, deferred=deferred) for deferred in (False, True, True))
    waited = most = 0
    for start in range(0, len(stream), 16):
        keys = stream[start:start + 16]
        for curves in (now, later, never):
            curves.uses(keys, lambda i: sizes[keys[i]])
        waited, most = max(waited, later.pending), max(most, never.pending)
        if rng.random() < 0.1:
            later.drain(rng.choice((1, 4, None)))
        assert later.pending <= MAX_PENDING and never.pending <= MAX_PENDING and now.pending == 0
    assert waited > 16 and later.pending > 0           # some waited over several requests
    assert most == MAX_PENDING                          # never drained: past the bound, uses() counted the oldest
    assert later.accesses == now.accesses and later.sampled < now.sampled
    assert later.drain() == 0 and never.drain() == 0
    for curves in (later, never):
        assert curves.sampled == now.sampled > 1000 and curves.sample.rate == now.sample.rate < 0.25
        assert curves.window() == now.window() and curves.points() == now.points()


def test_the_daemons_curves_count_queued_uses_on_the_event_loop_after_the_request() -> None:
    keys = [os.urandom(32) for _ in range(64)]
    alone = LiveCurves([mib_tier("lru")], lambda: 0.0, max_rate=1.0, sample_keys=1024, sampled_per_s=None)
    alone.uses(keys, lambda i: 4096)                      # no event loop: counted at once
    assert alone.pending == 0 and alone.sampled == 64

    async def request() -> tuple[int, int, int]:
        curves = LiveCurves([mib_tier("lru")], lambda: 0.0, max_rate=1.0, sample_keys=1024, sampled_per_s=None)
        curves.uses(keys, lambda i: 4096)
        queued = curves.pending                             # what the request left for later
        await asyncio.sleep(0)                              # one turn of the loop: one slice
        after_one = curves.pending
        for _ in range(64):
            await asyncio.sleep(0)
        return queued, after_one, curves.sampled

    queued, after_one, sampled = asyncio.run(request())
    assert queued == 64 and after_one == 64 - DRAIN_SLICE and sampled == 64

    shared = LiveCurves([mib_tier("lru")], lambda: 0.0, max_rate=1.0, sample_keys=1024, sampled_per_s=None)

    async def uses_and_leaves(n: int) -> int:
        shared.uses(keys[:n], lambda i: 4096)
        return shared.pending

    assert asyncio.run(uses_and_leaves(8)) == 8           # that loop ended before its turn came
    assert asyncio.run(request_on(shared, keys[8:])) == 0   # the next loop counts what it left too
    assert shared.sampled == 64


async def request_on(curves: LiveCurves, keys: list[bytes]) -> int:
    curves.uses(keys, lambda i: 4096)
    for _ in range(64):
        await asyncio.sleep(0)
    return curves.pending


def test_what_the_curves_take_is_counted_where_a_timer_is_given() -> None:
    """With a timer, a call of ``uses`` with a sampled key adds its time to ``busy_s`` (one with
    none costs a ``min`` and is not timed), and each MIN count its own to ``min_busy_s`` (Stats
    and the metrics carry both); without, nothing is timed. The timer here ticks once a
    reading, so each timed call counts one tick."""
    ticks = iter(range(10**6))

    def make(**timer: object) -> MissRatioCurves:
        return MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 20, lambda n: n)],
                               lambda: 0.0, max_rate=0.5, sampled_per_s=None, min_every_s=3600.0, **timer)
    curves, untimed = make(timer=lambda: float(next(ticks))), make()
    sampled = [b"\x00" + os.urandom(31) for _ in range(64)]        # below a rate of 1/2: sampled
    unsampled = [b"\xff" + os.urandom(31) for _ in range(64)]
    for start in range(0, 64, 8):
        for c in (curves, untimed):
            c.uses(sampled[start:start + 8], lambda i: 4096)
            c.uses(unsampled[start:start + 8], lambda i: 4096)
    assert curves.busy_s == 8.0 and curves.min_busy_s == 0.0 and curves.sampled == 64
    assert curves.accesses == untimed.accesses == 128
    curves.points()
    curves.points()          # MIN kept from the first count: not counted again
    assert curves.min_busy_s == 1.0 and curves.busy_s == 8.0
    untimed.points()
    assert untimed.busy_s == untimed.min_busy_s == 0.0


def test_the_sampled_uses_share_of_the_process_cpu_is_bounded_where_timers_are_given() -> None:
    """With timers, once the sampled uses took more than ``busy_share`` of the process's CPU time
    in a window of BUSY_WINDOW_S seconds (and more than BUSY_FLOOR of a core's), the rate
    halves, whatever the count. Here each timed call reads as 2 ms and the process used 5 s of
    CPU in the window: 1.05% of it is 52.5 ms, so the 28th call halves the rate; the next window
    starts again, and a process that used 1,000 s in it leaves them alone."""
    now, reading, process = [0.0], [0.0], [0.0]

    def timer() -> float:
        reading[0] += 0.002
        return reading[0]
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 30, lambda n: n)],
                             lambda: now[0], max_rate=1.0, sampled_per_s=None, timer=timer,
                             process_timer=lambda: process[0], busy_share=0.0105)
    keys = [b"\x00" + os.urandom(31) for _ in range(400)]
    curves.uses([keys[0]], lambda _: 1)                 # the window starts: the process's CPU is read
    process[0] = 5.0
    for key in keys[1:27]:
        curves.uses([key], lambda _: 1)
    assert curves.sample.rate == 1.0 and abs(curves.busy_s - 0.054) < 1e-9
    curves.uses([keys[27]], lambda _: 1)
    assert curves.sample.rate == 0.5
    now[0] = BUSY_WINDOW_S + 1.0
    curves.uses([keys[28]], lambda _: 1)
    process[0] = 1005.0
    for key in keys[29:400]:
        curves.uses([key], lambda _: 1)
    assert curves.sample.rate == 0.5, "0.74 s of 1,000 s: under 1.05%"


def test_nothing_sampled_yet_says_so() -> None:
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 20, lambda n: n)],
                             lambda: 0.0)
    assert all(p.hit_rate is None and p.min_hit_rate is None for p in curves.points())


def test_a_busy_daemon_samples_fewer_keys_so_the_curves_cost_stays_bounded() -> None:
    """Past ``sampled_per_s`` sampled uses in a second the rate halves, keys leave the sample
    and the counts are rescaled: the curves stay an estimate (here of a loop every size holds)."""
    now = [0.0]
    curves = MissRatioCurves([TierSpec("ram", "lru", make_keyed_policy("lru").policy, 1 << 30, lambda n: n)],
                             lambda: now[0], max_rate=1.0, sampled_per_s=100)
    keys = [os.urandom(32) for _ in range(64)]
    for _ in range(10):
        curves.uses(keys, lambda _: 1)               # 640 uses within one second
    assert curves.sample.rate < 1.0 and len(curves.sample) < 64
    assert all(key not in curves.sample or int.from_bytes(key[:8], "big") < curves.sample.threshold for key in keys)
    rate = curves.sample.rate
    now[0] = 5.0
    for _ in range(10):
        now[0] += 1.0                                # 64 uses a second: within the budget
        curves.uses(keys, lambda _: 1)
    assert curves.sample.rate == rate
    hit = next(p for p in curves.points(with_min=False) if p.multiple == 1.0).hit_rate
    assert hit is not None and hit > 0.8, hit


@pytest.mark.parametrize(("override", "says"), [
    ("kv.curve_sample_keys=10", "kv.curve_sample_keys"), ("kv.curve_sample_keys=1.5", "kv.curve_sample_keys"),
    ('kv.curves="yes"', "kv.curves"),
])
def test_bad_curve_settings_are_refused_at_start(override: str, says: str) -> None:
    from kvcached.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=says):
        load_config(None, [override])


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
