"""Eviction policies (LRU, ARC, S3-FIFO) against hand-made traces with known outcomes, and the
rules every policy keeps (the tier's side of them is in test_ram.py, run with each policy)."""

from __future__ import annotations

import itertools
from typing import Iterable

import pytest

from kvcached.policies import EVICTION_POLICIES, KeyedPolicy, PolicySettings, PolicySnapshot, SnapshotError, make_eviction_policy
from kvcached.policies.arc import ArcPolicy
from kvcached.policies.lru import LruPolicy
from kvcached.policies.s3fifo import S3FifoPolicy
from kvcached.sim.replay import replay_hits
from tests.unit.conftest import Keyed


def k(name: str | int) -> bytes:
    return str(name).encode()


def run(policy: KeyedPolicy, capacity: int, trace: Iterable[str | int]) -> list[bool]:
    """Drive ``policy`` as a tier of ``capacity`` keys does; True per access that hit."""
    return list(replay_hits(policy, capacity, (k(name) for name in trace)))


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_every_policy_keeps_the_common_rules(name: str) -> None:
    p = Keyed(make_eviction_policy(name))
    for n in range(10):
        p.insert(k(n))
    p.touch(k(3))
    assert len(p) == 10
    offered = list(itertools.islice(p.candidates(), 4))      # offered, skipped (in use): all stay
    assert len(set(offered)) == 4 and len(p) == 10
    seen = set(p.candidates())                               # a walk ends, and offers every key
    assert seen == {k(n) for n in range(10)}
    p.remove(k(5))
    assert len(p) == 9 and k(5) not in set(p.candidates())
    p.remove(b"never-there")                                 # unknown keys are ignored
    for key in list(p.candidates()):
        p.evicted(key)
    assert len(p) == 0 and list(p.candidates()) == []


def test_lru_evicts_the_least_recently_used() -> None:
    p = Keyed(LruPolicy())
    assert run(p, 3, "abcad") == [False, False, False, True, False]
    assert next(iter(p.candidates())) == k("c")             # b went for d; c is now oldest


def test_arc_a_b1_ghost_hit_grows_the_target_of_t1() -> None:
    p = Keyed(ArcPolicy())
    assert run(p, 4, "abcdde") == [False] * 4 + [True, False]   # d seen twice: T2; e evicts T1's oldest
    assert list(p.t1) == [k("b"), k("c"), k("e")] and list(p.t2) == [k("d")] and list(p.b1) == [k("a")]
    assert p.p == 0
    p.insert(k("a"))                 # a comes back while B1 remembers it: recency pays
    assert p.p == 1 and k("a") in p.t2 and not p.b1


def arc_state(t1: str, t2: str, b1: str, b2: str, target: float, c: int) -> Keyed:
    p = Keyed(ArcPolicy())
    for attr, names in (("t1", t1), ("t2", t2), ("b1", b1), ("b2", b2)):
        for name in names:
            getattr(p, attr)[k(name)] = None
    p.p, p.c = target, c
    return p


@pytest.mark.parametrize("ghost, b1, b2, before, after", [
    ("g", "g", "xyz", 1.0, 4.0),     # B1 hit: p += max(1, |B2| / |B1|) = 3
    ("g", "gh", "x", 1.0, 2.0),      # B1 hit: p += max(1, 1/2) = 1
    ("g", "gh", "x", 5.0, 6.0),      # ... but never past c = 6
    ("x", "ghi", "x", 5.0, 2.0),     # B2 hit: p -= max(1, |B1| / |B2|) = 3
    ("x", "g", "xy", 0.5, 0.0),      # B2 hit: p -= 1, never below 0
])
def test_arc_target_moves_as_the_paper_says(ghost: str, b1: str, b2: str, before: float, after: float) -> None:
    p = arc_state("ab", "cd", b1, b2, before, 6)
    p.insert(k(ghost))
    assert p.p == after and k(ghost) in p.t2 and k(ghost) not in p.b1 and k(ghost) not in p.b2


def test_arc_evicts_from_t1_over_its_target_else_from_t2() -> None:
    assert next(iter(arc_state("ab", "cd", "", "", 1.0, 4).candidates())) == k("a")    # |T1| = 2 > p = 1
    assert next(iter(arc_state("ab", "cd", "", "", 2.0, 4).candidates())) == k("c")    # |T1| = p: T2's oldest
    p = arc_state("ab", "cd", "", "", 2.0, 4)
    p.evicted(k("c"))
    assert list(p.b2) == [k("c")]


def test_arc_ghost_lists_stay_bounded() -> None:
    p = Keyed(ArcPolicy())
    run(p, 8, range(1000))           # a pure scan: every key once
    assert len(p) == 8
    assert len(p.t1) + len(p.b1) <= 8 and len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 16


def test_arc_made_smaller_bounds_its_target_and_ghosts_by_the_new_size() -> None:
    """A miniature copy whose sampling rate fell (EvictionPolicy.resized): ARC's c, its target
    and its ghost lists follow the new size, not the most entries it ever held."""
    p = arc_state("abcd", "efgh", "ijkl", "mnop", 6.0, 8)
    p.resized(4)
    assert p.c == 4 and p.p == 4.0
    assert len(p.t1) + len(p.b1) <= 4 or not p.b1
    assert len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 8 or not p.b2


def hot_then_scan(hot: int, scan: int, rounds: int) -> list[str]:
    """A hot set used again and again, each round followed by a scan of one-off keys."""
    out = []
    for r in range(rounds):
        out += [f"hot{i}" for i in range(hot)] * 2
        out += [f"scan{r}-{i}" for i in range(scan)]
    return out


def hit_rate(policy: KeyedPolicy, capacity: int, trace: list[str]) -> float:
    hits = run(policy, capacity, trace)
    return sum(hits) / len(hits)


def test_scan_resistance_arc_and_s3fifo_keep_the_hot_set_lru_does_not() -> None:
    trace = hot_then_scan(hot=20, scan=60, rounds=20)
    lru, arc, s3 = (hit_rate(p, 40, trace) for p in (Keyed(LruPolicy()), Keyed(ArcPolicy()), Keyed(S3FifoPolicy())))
    # LRU: each scan flushes the hot set, which then only hits on its second pass in a round
    assert lru == pytest.approx(20 / 100, abs=0.02)
    assert arc > lru + 0.15 and s3 > lru + 0.15, (lru, arc, s3)


def test_s3fifo_one_hit_in_the_small_queue_promotes_to_main() -> None:
    p = Keyed(S3FifoPolicy())
    for n in range(10):
        p.insert(k(n))
    p.touch(k(0))
    assert list(p.small)[:1] == [k(0)]
    victim = next(iter(p.candidates()))        # 0 was hit in S: promoted to M, 1 offered instead
    assert victim == k(1) and k(0) in p.main and p.main[k(0)] == 0
    p.evicted(victim)
    assert k(1) in p.ghost
    p.insert(k(1))                             # back while the ghost remembers it: straight to M
    assert k(1) in p.main and k(1) not in p.ghost


def test_s3fifo_main_gives_second_chances_by_frequency() -> None:
    p = Keyed(S3FifoPolicy())
    for name in "abc":
        p.ghost[k(name)] = None
        p.insert(k(name))                      # all three straight into M
    p.touch(k("a"))
    p.touch(k("a"))
    assert p.main[k("a")] == 2
    assert next(iter(p.candidates())) == k("b")    # a pays one hit to stay: 2 -> 1
    assert p.main[k("a")] == 1


def test_s3fifo_ghost_is_bounded_by_main() -> None:
    p = Keyed(S3FifoPolicy())
    run(p, 10, range(500))
    assert len(p.ghost) <= max(1, len(p.main))


# -- state across a restart ---------------------------------------------------------------------


class Cache:
    """A tier of ``capacity`` keys driven as the RAM tier drives its policy, whose policy can be
    swapped for a restored copy mid-trace."""

    def __init__(self, policy: KeyedPolicy, capacity: int) -> None:
        self.policy, self.capacity, self.resident = policy, capacity, set[bytes]()

    def access(self, key: bytes) -> bool:
        if key in self.resident:
            self.policy.touch(key)
            return True
        if len(self.resident) >= self.capacity:
            victim = next(iter(self.policy.candidates()))
            self.policy.evicted(victim)
            self.resident.discard(victim)
        self.policy.insert(key)
        self.resident.add(key)
        return False


def zipf_keys(n: int, seed: int) -> list[bytes]:
    import random
    rng = random.Random(seed)
    return [k(int(rng.paretovariate(1.1)) % 400) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_a_restored_policy_decides_exactly_as_the_original(name: str) -> None:
    """A restart with the tier's keys still resident (the SSD tier): the restored policy makes
    the same decisions as the one that never stopped, hit for hit. (slru with a fixed ratio:
    its tuner's miniature copies are not saved, they learn again; see the test after.)"""
    trace = zipf_keys(6000, seed=3)
    fixed = PolicySettings(slru_ratio=4.0)
    original = Cache(Keyed(make_eviction_policy(name, fixed)), 60)
    for key in trace[:3000]:
        original.access(key)
    raw = original.policy.snapshot().encode()
    restored = Cache(Keyed(make_eviction_policy(name, fixed)), 60)
    restored.policy.restore(PolicySnapshot.decode(raw), original.resident.__contains__)
    restored.resident = set(original.resident)
    assert set(restored.policy) == original.resident and len(restored.policy) == 60
    assert [restored.access(key) for key in trace[3000:]] == [original.access(key) for key in trace[3000:]]


def test_arc_restored_with_nothing_resident_keeps_its_target_and_ghosts() -> None:
    """A restart of the RAM tier (empty again): T1 and T2 become ghosts B1 and B2, p stays, and
    a block that was in T2 comes back into T2 (frequency remembered)."""
    p = Keyed(ArcPolicy())
    run(p, 4, "abcddbbe")
    t2, target = list(p.t2), p.p
    fresh = Keyed(ArcPolicy())
    fresh.restore(PolicySnapshot.decode(p.snapshot().encode()), lambda key: False)
    assert len(fresh) == 0 and fresh.p == target and fresh.c == p.c
    assert set(t2) <= set(fresh.b2)
    fresh.insert(t2[0])
    assert t2[0] in fresh.t2


def test_s3fifo_restored_with_nothing_resident_sends_proven_blocks_to_main() -> None:
    p = Keyed(S3FifoPolicy())
    p.ghost[k("hot")] = None
    p.insert(k("hot"))                   # in M
    fresh = Keyed(S3FifoPolicy())
    fresh.restore(PolicySnapshot.decode(p.snapshot().encode()), lambda key: False)
    assert len(fresh) == 0 and k("hot") in fresh.ghost
    fresh.insert(k("hot"))
    assert k("hot") in fresh.main


def test_lru_and_clock_restored_with_nothing_resident_start_cold() -> None:
    for name in ("lru", "clock"):
        p = Keyed(make_eviction_policy(name))
        p.insert(k(1))
        fresh = Keyed(make_eviction_policy(name))
        fresh.restore(p.snapshot(), lambda key: False)
        assert len(fresh) == 0 and list(fresh) == []


def test_a_damaged_snapshot_is_refused_with_a_clear_error() -> None:
    raw = Keyed(LruPolicy()).snapshot().encode()
    p = Keyed(LruPolicy())
    for n in range(5):
        p.insert(k(n))
    good = p.snapshot().encode()
    for bad in (b"", b"garbage", raw[:-1] + b"x" if len(raw) > 12 else b"x", good[:-3], good + b"\0"):
        with pytest.raises(SnapshotError):
            PolicySnapshot.decode(bad)
