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


def test_a_stale_estimate_lets_one_plan_probe_and_the_next_batch_starts_a_new_window() -> None:
    from kvcached.store.reads import DeliveryRates
    now = [100.0]
    rates = DeliveryRates(clock=lambda: now[0])
    for _ in range(DeliveryRates.WINDOW):                # a throttled source: 1 MiB/s
        rates.took("peer", MIB, 1.0)
    assert rates.current(["peer", "ssd"])["peer"].bytes_per_s == pytest.approx(MIB)
    now[0] += DeliveryRates.STALE_S + 1                  # skipped since: nothing measured it again
    assert "peer" not in rates.current(["ssd"])          # a plan that does not need it probes nothing
    assert "peer" not in rates.current(["peer"])         # the first that does: no estimate, a probe
    assert rates.current(["peer"])["peer"].bytes_per_s == pytest.approx(MIB)   # the rest: the old one
    assert rates.estimates()["peer"].bytes_per_s == pytest.approx(MIB)         # and the metrics show it
    rates.took("peer", MIB, 0.01)                        # the probe: the throttle is gone
    assert rates.current(["peer"])["peer"].bytes_per_s == pytest.approx(100 * MIB)
    now[0] += 2 * DeliveryRates.STALE_S                  # stale again, and the probe granted long ago
    assert "peer" not in rates.current(["peer"])


def test_a_batch_far_from_the_estimate_starts_a_new_window() -> None:
    """A link lifted from 1 MiB/s to 100 MiB/s shows in the next batch, not after eight."""
    from kvcached.store.reads import DeliveryRates
    rates = DeliveryRates(clock=lambda: 0.0)
    for _ in range(DeliveryRates.WINDOW):
        rates.took("peer", MIB, 1.0)
    rates.took("peer", MIB, 0.5)                          # within CHANGE of the estimate: one of the window
    assert rates.current(["peer"])["peer"].bytes_per_s == pytest.approx(8 * MIB / 7.5)
    rates.took("peer", MIB, 0.01)                         # 75x faster than it said: a new window
    assert rates.current(["peer"])["peer"].bytes_per_s == pytest.approx(100 * MIB)


def test_batches_of_other_sizes_on_a_latency_bound_link_keep_their_fit() -> None:
    """20 ms to start, then 10 GB/s: batches of 1 to 64 MiB differ 60x in size, not in what
    the link is; the window keeps them and learns the latency."""
    from kvcached.store.reads import DeliveryRates
    rates = DeliveryRates(clock=lambda: 0.0)
    for n in (1, 64, 8, 32, 2, 16, 4, 48):
        rates.took("peer", n * MIB, 0.02 + n * MIB / 10e9)
    fitted = rates.current(["peer"])["peer"]
    assert fitted.latency_s == pytest.approx(0.02) and fitted.bytes_per_s == pytest.approx(10e9)


def test_a_batch_that_delivered_nothing_counts_as_a_very_slow_one() -> None:
    from kvcached.store.reads import DeliveryRates
    rates = DeliveryRates(clock=lambda: 0.0)
    rates.nothing("peer", 2.0)                            # a pull that timed out
    assert rates.current(["peer"])["peer"].bytes_per_s == pytest.approx(0.5)
