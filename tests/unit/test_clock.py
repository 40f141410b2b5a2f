"""kvcached.policies.clock: CLOCK (second chance), and the policy registry."""

from __future__ import annotations

import itertools

import pytest

from kvcached.policies import EVICTION_POLICIES, KeyedPolicy, make_eviction_policy
from kvcached.policies.clock import ClockPolicy
from tests.unit.conftest import Keyed


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def first(policy: KeyedPolicy, n: int) -> list[bytes]:
    return list(itertools.islice(policy.candidates(), n))


def make(*names: str) -> Keyed:
    p = Keyed(ClockPolicy())
    for k in keys(*names):
        p.insert(k)
    return p


def test_registry() -> None:
    assert EVICTION_POLICIES["clock"] is ClockPolicy
    assert isinstance(make_eviction_policy("clock"), ClockPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'lru9'; known: arc, clock, lru, s3fifo"):
        make_eviction_policy("lru9")


def test_insert_and_len() -> None:
    p = make("a", "b", "c")
    assert len(p) == 3
    p.insert(b"b")                      # re-insert: still one entry, now the newest
    assert len(p) == 3
    assert first(p, 3) == keys("a", "c", "b")


def test_candidates_oldest_first() -> None:
    assert first(make("a", "b", "c"), 3) == keys("a", "b", "c")


def test_touched_key_is_skipped_once() -> None:
    p = make("a", "b", "c")
    p.touch(b"a")
    assert first(p, 4) == keys("b", "c", "a", "b")


def test_second_chance_is_spent() -> None:
    p = make("a", "b")
    p.touch(b"a")
    assert first(p, 1) == keys("b")     # sweeps past a, clearing its bit
    assert first(p, 2) == keys("a", "b"), "a lost its bit in the previous sweep"


def test_touch_again_after_the_bit_was_cleared() -> None:
    p = make("a", "b")
    p.touch(b"a")
    first(p, 1)
    p.touch(b"a")
    assert first(p, 1) == keys("b")


def test_touch_of_unknown_key_is_ignored() -> None:
    p = make("a")
    p.touch(b"zz")
    assert len(p) == 1 and first(p, 1) == keys("a")


def test_remove() -> None:
    p = make("a", "b", "c")
    p.remove(b"b")
    assert len(p) == 2
    assert list(p.candidates()) == keys("a", "c", "a", "c")
    p.remove(b"unknown")                # ignored
    p.remove(b"b")                      # twice: ignored
    assert len(p) == 2


def test_remove_while_iterating_as_the_tier_does() -> None:
    p = make("a", "b", "c")
    it = p.candidates()
    assert next(it) == b"a"
    p.remove(b"a")                      # the tier evicts what it was offered
    assert next(it) == b"b"
    assert len(p) == 2


def test_iteration_is_bounded() -> None:
    p = make(*"abcde")
    for k in keys(*"abcde"):
        p.touch(k)
    assert list(p.candidates()) == keys(*"abcde"), "all referenced: one pass clears, the next offers"
    q = make(*"abcde")
    assert len(list(q.candidates())) == 10, "at most two passes"


def test_skipped_candidates_stay_and_keep_order() -> None:
    """The tier skipping a busy key leaves it resident; the next sweep offers it again."""
    p = make("a", "b", "c")
    assert first(p, 2) == keys("a", "b")    # a skipped (busy), b skipped too
    assert len(p) == 3
    assert first(p, 3) == keys("c", "a", "b")


def test_empty() -> None:
    p = Keyed(ClockPolicy())
    assert list(p.candidates()) == [] and len(p) == 0


def test_candidates_end_when_the_ring_empties() -> None:
    p = make("a", "b")
    out = []
    for k in p.candidates():
        out.append(k)
        p.remove(k)
    assert out == keys("a", "b") and len(p) == 0
