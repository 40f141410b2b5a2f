"""Read accounting (kvcached.store.reads): per-tier hits and misses, and the latency histograms."""

from __future__ import annotations

import time

from kvcached.store.reads import LATENCY_BUCKETS, LatencyHistogram, ReadStats, outcome


def test_a_block_counts_once_per_tier_it_reached() -> None:
    r = ReadStats()
    # 10 asked: 5 in RAM, 2 promoted from SSD, 1 pulled, 2 found nowhere
    assert r.blocks(10, 8, 2, 1, ssd=True, peers=True) == "peer"
    assert r.hits == {"ram": 5, "ssd": 2, "peer": 1}
    assert r.misses == {"ram": 5, "ssd": 3, "peer": 2}


def test_the_deepest_tier_reached() -> None:
    r = ReadStats()
    assert r.blocks(4, 4, 0, 0, ssd=True, peers=True) == "ram"
    assert r.blocks(4, 4, 1, 0, ssd=True, peers=False) == "ssd"
    assert r.blocks(4, 3, 0, 0, ssd=False, peers=False) == "ram"      # a miss with nowhere else to look
    assert r.blocks(4, 3, 0, 0, ssd=True, peers=False) == "ssd"       # the SSD index was asked
    assert r.blocks(4, 3, 0, 0, ssd=True, peers=True) == "peer"
    assert r.hits["peer"] == 0 and r.misses["peer"] == 1


def test_outcome() -> None:
    assert [outcome(3, 3), outcome(3, 1), outcome(3, 0), outcome(0, 0)] == ["hit", "partial", "miss", "hit"]


def test_latencies_go_to_the_tiers_timed_only() -> None:
    r = ReadStats()
    r.took("ram", "hit", time.perf_counter())          # not timing yet: nothing kept
    assert r.latency is None
    r.time_reads(["ram", "ssd"])
    r.took("ram", "hit", time.perf_counter())
    r.took("peer", "hit", time.perf_counter())         # no peer tier: dropped, not exported empty-handed
    assert set(r.latency or {}) == {(t, o) for t in ("ram", "ssd") for o in ("hit", "partial", "miss")}
    assert sum(r.latency[("ram", "hit")].counts) == 1   # type: ignore[index]


def test_histogram_buckets_are_cumulative_with_inf_last() -> None:
    h = LatencyHistogram()
    for seconds in (5e-6, 30e-6, 31e-6, 150e-6, 4e-3, 10.0):
        h.observe(seconds)
    buckets, total = h.cumulative()
    as_dict = dict(buckets)
    assert as_dict["1e-05"] == 1 and as_dict["3e-05"] == 2 and as_dict["5e-05"] == 3   # a bound is inclusive
    assert as_dict["0.0002"] == 4 and as_dict["0.005"] == 5 and buckets[-1] == ("+Inf", 6)
    assert len(buckets) == len(LATENCY_BUCKETS) + 1 and abs(total - 10.004216) < 1e-9
