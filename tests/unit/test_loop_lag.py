"""The event loop's lag recorder (kvcached/host/loop_lag.py): times passed in by hand, then the
asyncio watcher on a real loop held by a blocking step."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvcached.api.metrics import LoopLagCollector
from kvcached.host.loop_lag import LAG_BUCKETS, LoopLag, Stalls, watch_loop


def test_each_tick_records_how_late_it_ran_and_the_next_is_due_a_period_after() -> None:
    lag = LoopLag(period_s=0.005)
    assert lag.start(100.0) == 100.005
    assert lag.woke(100.005) is None             # on time
    assert lag.due == pytest.approx(100.010)
    lag.woke(100.013)                            # 3 ms late
    assert lag.due == pytest.approx(100.018)
    lag.woke(100.018 + 0.040)                    # 40 ms late
    assert lag.ticks == 3
    assert lag.max == pytest.approx(0.040)
    assert lag.lags.sum == pytest.approx(0.043)
    buckets, total = lag.lags.cumulative()
    assert total == pytest.approx(0.043)
    by_bound = dict(buckets)
    assert by_bound["0.001"] == 1 and by_bound["0.002"] == 1 and by_bound["0.005"] == 2
    assert by_bound["0.03"] == 2 and by_bound["0.05"] == 3 and by_bound["+Inf"] == 3
    assert [b for b, _ in buckets] == [*map(repr, LAG_BUCKETS), "+Inf"]


def test_a_clock_that_ran_early_counts_as_no_lag_and_a_first_wake_without_start_starts() -> None:
    lag = LoopLag(period_s=0.01)
    assert lag.woke(5.0) is None and lag.ticks == 0 and lag.due == pytest.approx(5.01)
    lag.woke(5.0)                                # woke before it was due
    assert lag.ticks == 1 and lag.max == 0.0 and lag.lags.sum == 0.0


def test_stalls_are_counted_each_and_reported_at_most_once_per_interval_with_the_longest() -> None:
    lag = LoopLag(period_s=0.25, stall_s=0.125, report_every_s=10.0)     # binary fractions: exact lags
    lag.start(0.0)                                         # due at 0.25
    assert lag.woke(0.75) == Stalls(1, 0.5)                # the first is reported at once; due at 1.0
    assert lag.woke(1.25) is None                          # within 10 s of that report: kept; due at 1.5
    assert lag.woke(1.5625) is None                        # not a stall
    lag.due = 20.0
    assert lag.woke(20.125) == Stalls(2, 0.25)             # the one kept and this one; the longest
    assert lag.stalls == 3 and lag.max == 0.5


def test_the_collector_exports_the_histogram_the_max_and_the_stalls() -> None:
    lag = LoopLag(period_s=0.005)
    lag.start(0.0)
    lag.woke(0.005 + 0.25)
    metrics = {m.name: m for m in LoopLagCollector(lag).collect()}
    assert set(metrics) == {"kvcached_event_loop_lag_seconds", "kvcached_event_loop_lag_max_seconds",
                            "kvcached_event_loop_stalls"}
    samples = {(s.name, s.labels.get("le")): s.value for s in metrics["kvcached_event_loop_lag_seconds"].samples}
    assert samples[("kvcached_event_loop_lag_seconds_bucket", "0.2")] == 0
    assert samples[("kvcached_event_loop_lag_seconds_bucket", "0.5")] == 1
    assert samples[("kvcached_event_loop_lag_seconds_count", None)] == 1
    assert metrics["kvcached_event_loop_lag_max_seconds"].samples[0].value == pytest.approx(0.25)
    assert metrics["kvcached_event_loop_stalls"].samples[0].value == 1


def test_the_watcher_sees_a_step_that_holds_the_loop() -> None:
    async def body() -> LoopLag:
        lag = LoopLag(period_s=0.002)
        task = asyncio.create_task(watch_loop(lag))
        await asyncio.sleep(0.02)
        time.sleep(0.08)                 # a blocking step on the loop
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return lag

    lag = asyncio.run(body())
    assert lag.ticks >= 3
    assert 0.06 <= lag.max < 1.0
