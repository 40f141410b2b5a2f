"""The cost rule of loads (kvcached.policies.load_cost): RAM always, SSD and peers where they
beat recomputing, the longest prefix that saves most, never slower than the better of loading
all and recomputing all."""

from __future__ import annotations

import random

import pytest

from kvcached.policies.load_cost import Delivery, plan_loads

MIB = 1 << 20


def test_ram_is_always_loaded_and_a_slow_ssd_is_skipped() -> None:
    slow = {"ssd": Delivery(0.002, 50 * MIB)}             # 64 KiB: 1.25 ms a block, 2 ms to start
    plan = plan_loads(["ram"] * 4 + ["ssd"] * 4, [64 << 10] * 8, 0.0005, slow)
    assert plan.load == 4 and plan.skipped == {"ssd": 4} and plan.loaded == {"ram": 4}
    assert plan.seconds == pytest.approx(4 * 0.0005) and plan.recompute_all == pytest.approx(8 * 0.0005)


def test_a_fast_ssd_is_loaded_and_the_choice_flips_with_its_speed() -> None:
    fast = {"ssd": Delivery(0.0001, 4000 * MIB)}
    assert plan_loads(["ssd"] * 8, [64 << 10] * 8, 0.0005, fast).load == 8
    assert plan_loads(["ssd"] * 8, [64 << 10] * 8, 0.0005, {"ssd": Delivery(0.0001, 20 * MIB)}).load == 0


def test_latency_is_paid_once_so_long_runs_pay_where_short_ones_do_not() -> None:
    peer = {"peer": Delivery(0.010, 1000 * MIB)}           # 10 ms to start, then fast
    assert plan_loads(["peer"] * 2 + [None] * 30, [64 << 10] * 32, 0.001, peer).load == 0
    assert plan_loads(["peer"] * 30 + [None] * 2, [64 << 10] * 32, 0.001, peer).load == 30


def test_a_source_not_measured_yet_is_taken_and_the_held_prefix_ends_at_the_first_gap() -> None:
    plan = plan_loads(["ssd", "ssd", None, "ram"], [1, 1, 1, 1], 0.001, {})
    assert plan.load == 2 and plan.skipped == {} and plan.loaded == {"ssd": 2}


def test_never_slower_than_the_better_of_load_all_and_recompute_all() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 40)
        sources = [rng.choice(["ram", "ssd", "peer", None]) for _ in range(n)]
        sizes = [rng.randint(1, 4 * MIB) for _ in range(n)]
        deliveries = {"ssd": Delivery(rng.uniform(0, 0.01), rng.uniform(1, 4000) * MIB),
                      "peer": Delivery(rng.uniform(0, 0.02), rng.uniform(1, 2000) * MIB)}
        plan = plan_loads(sources, sizes, rng.uniform(1e-5, 1e-2), deliveries)
        assert plan.seconds <= min(plan.load_all, plan.recompute_all) + 1e-12


def test_delivery_rates_fit_latency_and_rate_from_the_batches_a_source_delivered() -> None:
    from kvcached.store.reads import DeliveryRates
    rates = DeliveryRates()
    assert rates.estimate("ssd") is None
    for n in (1, 4, 16, 2, 8, 32):                       # 2 ms to start, 100 MiB/s
        rates.took("ssd", n * MIB, 0.002 + n * MIB / (100 * MIB))
    fitted = rates.estimate("ssd")
    assert fitted is not None and fitted.latency_s == pytest.approx(0.002) and fitted.bytes_per_s == pytest.approx(100 * MIB)
    for _ in range(DeliveryRates.WINDOW):                # batches of one size: all of it taken as rate
        rates.took("ssd", MIB, 0.1)
    fitted = rates.estimate("ssd")
    assert fitted is not None and fitted.latency_s == 0 and fitted.bytes_per_s == pytest.approx(10 * MIB)
    rates.took("peer", 0, 1.0)                           # nothing delivered: nothing learnt
    assert set(rates.estimates()) == {"ssd"}


def test_a_stale_estimate_is_not_planned_by_and_the_next_batch_starts_a_new_window() -> None:
    from kvcached.store.reads import DeliveryRates
    now = [100.0]
    rates = DeliveryRates(clock=lambda: now[0])
    for _ in range(DeliveryRates.WINDOW):                # a throttled source: 1 MiB/s
        rates.took("peer", MIB, 1.0)
    assert rates.current()["peer"].bytes_per_s == pytest.approx(MIB)
    now[0] += DeliveryRates.STALE_S + 1                  # skipped since: nothing measured it again
    assert "peer" not in rates.current()                 # so a plan takes it (and measures it) again
    assert rates.estimates()["peer"].bytes_per_s == pytest.approx(MIB)   # the metrics still show the last
    rates.took("peer", MIB, 0.01)                        # the throttle is gone: one batch says so
    assert rates.current()["peer"].bytes_per_s == pytest.approx(100 * MIB)


def test_a_batch_far_from_the_estimate_starts_a_new_window() -> None:
    """A link lifted from 1 MiB/s to 100 MiB/s shows in the next batch, not after eight."""
    from kvcached.store.reads import DeliveryRates
    rates = DeliveryRates(clock=lambda: 0.0)
    for _ in range(DeliveryRates.WINDOW):
        rates.took("peer", MIB, 1.0)
    rates.took("peer", MIB, 0.5)                          # within CHANGE of the estimate: one of the window
    assert rates.current()["peer"].bytes_per_s == pytest.approx(8 * MIB / 7.5)
    rates.took("peer", MIB, 0.01)                         # 75x faster than it said: a new window
    assert rates.current()["peer"].bytes_per_s == pytest.approx(100 * MIB)
    rates.took("peer", MIB, 1.0)                          # and throttled again
    assert rates.current()["peer"].bytes_per_s == pytest.approx(MIB)
