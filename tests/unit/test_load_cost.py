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
    assert plan.load == 4 and plan.skipped == {"ssd": 4}
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
    assert plan.load == 2 and plan.skipped == {}


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
