"""slru (kvcached/policies/slru.py) and its tuner (kvcached/policies/tuning.py): the age-ratio
rule on hand-made traces, the ghosts, the tuner's choices on workloads with a known best
setting, and what a restart keeps."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvcached.policies import KeyedPolicy, PolicySettings, PolicySnapshot, make_eviction_policy
from kvcached.policies.slru import SlruPolicy
from kvcached.policies.tuning import GRID, MIN_RATE, RatioTuner, ShadowCache, rate_for
from kvcached.sim.replay import replay_hits


def k(name: str | int) -> bytes:
    return str(name).encode()


def hits(policy: KeyedPolicy, capacity: int, trace: list[bytes]) -> list[bool]:
    return list(replay_hits(policy, capacity, trace))


def test_ratio_one_is_exact_lru() -> None:
    rng = random.Random(5)
    trace = [k(int(rng.paretovariate(1.0)) % 500) for _ in range(20_000)]
    assert hits(KeyedPolicy(SlruPolicy(1.0)), 80, trace) == hits(KeyedPolicy(make_eviction_policy("lru")), 80, trace)


def test_a_block_used_once_goes_before_an_older_reused_one() -> None:
    p = KeyedPolicy(SlruPolicy(4.0))
    p.insert(k("hot"))
    p.touch(k("hot"))                    # reused: protected, last use at tick 2
    for n in range(3):
        p.insert(k(n))                   # ticks 3, 4, 5: used once, probation
    slru = p.policy
    assert isinstance(slru, SlruPolicy)
    assert len(slru.protected) == 1 and len(slru.probation) == 3
    # now (tick 5): "0" is 2 ticks old, counted 4x = 8 >= hot's 3: "0" goes first though younger
    assert next(iter(p.candidates())) == k(0)
    lru = KeyedPolicy(SlruPolicy(1.0))
    lru.insert(k("hot"))
    lru.touch(k("hot"))
    for n in range(3):
        lru.insert(k(n))
    assert next(iter(lru.candidates())) == k("hot")          # ratio 1: plain LRU


def test_reused_blocks_survive_a_scan_that_flushes_lru() -> None:
    hot = [k(f"h{n}") for n in range(20)]
    trace = hot * 3
    for round_ in range(20):
        trace += [k(f"scan{round_}-{n}") for n in range(30)] + hot
    tail = len(hot) * 3
    slru = hits(KeyedPolicy(SlruPolicy(32.0)), 40, trace)[tail:]
    lru = hits(KeyedPolicy(make_eviction_policy("lru")), 40, trace)[tail:]
    assert sum(lru) == 0                     # 30 new blocks between two uses of the 20 hot ones
    assert sum(slru) >= 19 * 20 * 0.9


def test_an_evicted_block_that_returns_is_protected() -> None:
    p = KeyedPolicy(SlruPolicy(2.0))
    slru = p.policy
    assert isinstance(slru, SlruPolicy)
    p.insert(k("a"))
    p.evicted(k("a"))
    assert k("a") in slru.ghosts
    p.insert(k("a"))
    assert len(slru.protected) == 1
    p.insert(k("b"))
    p.remove(k("b"))                         # deleted, not evicted: no ghost
    assert k("b") not in slru.ghosts


def test_ghosts_are_bounded_by_the_most_entries_ever_resident() -> None:
    """About the last ``c`` evicted keys are ghosts (between c and 2c of them), older ones are
    forgotten; a key never evicted is a ghost only by the filter's rare false "yes"."""
    p = KeyedPolicy(SlruPolicy(2.0))
    slru = p.policy
    assert isinstance(slru, SlruPolicy)
    hits(p, 100, [k(n) for n in range(10_000)])                 # keys 0..9899 evicted, in order
    assert slru.c == 100
    assert all(k(n) in slru.ghosts for n in range(9850, 9900))
    assert sum(k(n) in slru.ghosts for n in range(9000)) < 9000 * 0.02
    assert sum(k(f"never{n}") in slru.ghosts for n in range(10_000)) < 10_000 * 0.02


def test_bad_ratios_are_refused() -> None:
    for bad in (0.5, 1001.0):
        with pytest.raises(ValueError, match="slru ratio must be in 1..1000"):
            SlruPolicy(bad)
    assert make_eviction_policy("slru", PolicySettings(slru_ratio=3)).ratio == 3    # type: ignore[attr-defined]
    assert make_eviction_policy("slru").tuner is not None                          # type: ignore[attr-defined]


def test_the_sampling_rate_follows_the_cache_size() -> None:
    assert rate_for(50) == 1 and rate_for(10_000) == MIN_RATE
    sizes = [rate_for(n) for n in range(1, 200_000, 997)]
    assert sizes == sorted(sizes) and rate_for(1 << 22) * 2048 >= 1 << 22
    tuner = RatioTuner(lambda r: SlruPolicy(r))
    sampled = [key for key in (k(n) for n in range(20_000)) if tuner.samples(key)]
    assert len(sampled) == 20_000            # rate 1 until the cache has grown
    tuner.access(k(0), 10_000)
    assert tuner.rate == MIN_RATE and 20_000 / MIN_RATE * 0.8 < sum(map(tuner.samples, map(k, range(20_000))))


def _scan_mix(n: int) -> list[bytes]:
    rng = random.Random(7)
    out: list[bytes] = []
    hot = [k(f"hot{i}") for i in range(300)]
    while len(out) < n:
        if rng.random() < 0.3:
            out += [k(f"scan{len(out)}-{i}") for i in range(400)]
        else:
            out += hot[rng.randrange(0, 300, 10):][:10]
    return out


def _recency(n: int) -> list[bytes]:
    """Each key used twice, the second time about 900 uses after the first, once each: only
    recency can catch the second use, and only if once-used keys live long enough."""
    rng = random.Random(3)
    out: list[bytes] = []
    pending: list[tuple[int, bytes]] = []
    for i in range(n):
        if pending and pending[0][0] <= i:
            out.append(pending.pop(0)[1])
        else:
            key = k(f"r{i}")
            out.append(key)
            pending.append((i + 900 + rng.randrange(-50, 50), key))
            pending.sort()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workload, capacity, best", [(_scan_mix, 1000, GRID[-2:]), (_recency, 1000, GRID[:1])])
def test_the_tuner_finds_the_setting_the_workload_rewards(workload, capacity: int, best: tuple[float, ...]) -> None:
    trace = workload(120_000)
    tuned = KeyedPolicy(make_eviction_policy("slru"))
    tuned_hits = sum(hits(tuned, capacity, trace))
    assert tuned.policy.ratio in best                                               # type: ignore[attr-defined]
    fixed = {r: sum(hits(KeyedPolicy(SlruPolicy(r)), capacity, trace)) for r in GRID}
    assert tuned_hits >= 0.9 * max(fixed.values()), (tuned_hits, fixed)


def test_a_restart_keeps_the_ratio_and_the_ghosts() -> None:
    p = KeyedPolicy(make_eviction_policy("slru"))
    hits(p, 1000, _scan_mix(40_000))
    slru = p.policy
    assert isinstance(slru, SlruPolicy) and slru.ratio > 1
    raw = p.snapshot().encode()
    fresh = KeyedPolicy(make_eviction_policy("slru"))
    fresh.restore(PolicySnapshot.decode(raw), lambda key: False)     # RAM is empty after a restart
    restored = fresh.policy
    assert isinstance(restored, SlruPolicy)
    assert len(fresh) == 0 and restored.ratio == slru.ratio and restored.c == slru.c
    assert k("hot0") in restored.ghosts
    fresh.insert(k("hot0"))                                          # proven before the restart
    assert len(restored.protected) == 1


def test_the_ids_fed_to_the_tuner_follow_its_rate_as_the_tier_grows() -> None:
    p = SlruPolicy()
    for n in range(100_000):
        p.insert(n, k(f"grow{n}"))
    assert p.tuner is not None and p.tuner.rate == 64
    assert 0.8 * 100_000 / 64 < len(p._sampled) < 1.2 * 100_000 / 64     # not the 1-in-16 of its youth


def test_a_miniatures_tuner_takes_every_key_it_is_given_and_tunes_at_the_miniatures_size() -> None:
    """The live curves' copies of a tuned slru at other sizes run the tuner a tier of their size
    would (EvictionPolicy.miniature_tuner), fed keys that are a sample already: it samples none
    away, its copies have the miniature's room, and its choice is the copy's (tuned_to). A fixed
    ratio has nothing to tune."""
    assert SlruPolicy(4.0).miniature_tuner() is None
    tuner = SlruPolicy().miniature_tuner()
    assert isinstance(tuner, RatioTuner) and tuner.presampled
    for key in _scan_mix(60_000):
        tuner.access(key, 1000)
    assert tuner.rate == 1 and all(tuner.samples(k(n)) for n in range(1000))   # a tier of 1,000 would sample 1 in 8
    assert tuner.ratio in GRID[-2:]                                            # the scan mix's setting, as above
    copy = SlruPolicy(1.0)
    copy.tuned_to(tuner.ratio)
    assert copy.ratio == tuner.ratio


def test_a_copy_made_smaller_remembers_evictions_as_a_cache_of_its_new_size() -> None:
    """A miniature copy whose sampling rate fell (kvcached.policies.curves) shrinks
    (ShadowCache.capacity, EvictionPolicy.resized): its ghosts then span what a cache of the new
    size remembers (its last 100 to 200 evictions), not what the 1,000 it held once would.
    Ghosts kept for the size it once had put slru's curves 0.02-0.05 under the exact replay on
    rag after a tenfold fall of the rate (bench/bench_curves.py, docs/operations.md)."""
    copy = ShadowCache(SlruPolicy(4.0), 1000)
    keys = [hashlib.blake2b(k(i)).digest() for i in range(3000)]        # digests, as the daemon's keys
    for key in keys[:1000]:
        copy.access(key)
    copy.capacity = 100
    for key in keys[1000:]:
        copy.access(key)                    # 2,000 keys more, one eviction each
    policy = copy.policy.policy
    assert isinstance(policy, SlruPolicy) and policy.c == 100 and len(copy.policy) == 100
    assert sum(key in policy.ghosts for key in keys[-200:-100]) >= 95          # evicted last: remembered
    assert sum(key in policy.ghosts for key in keys[1000:2500]) <= 30          # 500 evictions ago and more: gone
    copy.capacity = 400                     # made larger again: the copy grows, the ghosts follow what it holds
    assert policy.c == 100
