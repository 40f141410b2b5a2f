"""The policies' own miniature copies (EvictionPolicy.shadow: slru and lru) against the policy
itself run as a copy (ShadowCache over KeyedPolicy): the same hits, hit for hit, and the same
keys held, through capacities that shrink and grow, keys removed, and settings moved, on
streams of hot and cold keys. The live curves and the tuners run these copies on every sampled
use; a copy that decided otherwise than its tier's policy would bend every curve."""

from __future__ import annotations

import random

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.policies.lru import LruPolicy, LruShadow
from kvcached.policies.slru import SlruPolicy, SlruShadow
from kvcached.policies.tuning import RatioTuner, ShadowCache, make_shadow


def stream(seed: int, n: int = 30_000) -> list[bytes]:
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(4000)]
    return [rng.choice(keys[:200]) if rng.random() < 0.4 else rng.choice(keys[:1500]) if rng.random() < 0.5
            else rng.choice(keys) for _ in range(n)]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("make", [lambda: SlruPolicy(1.0), lambda: SlruPolicy(3.0), lambda: SlruPolicy(128.0),
                                  LruPolicy])
def test_a_policys_own_copy_hits_as_the_policy_does(make, seed: int) -> None:
    rng = random.Random(seed)
    fast, slow = make_shadow(make(), 300), ShadowCache(make(), 300)
    assert type(fast) in (SlruShadow, LruShadow)
    for i, key in enumerate(stream(seed)):
        assert fast.access(key) == slow.access(key), i
        if i % 997 == 0:                          # the rate moved: smaller or larger
            fast.capacity = slow.capacity = rng.randrange(20, 600)
        if i % 613 == 0:                          # a key left the sample
            fast.remove(key)
            slow.remove(key)
        if i % 1511 == 0 and isinstance(fast, SlruShadow):
            value = rng.choice((1.0, 2.0, 16.0))
            fast.tuned_to(value)
            slow.tuned_to(value)
        assert fast.size == slow.size <= max(fast.capacity, 1) or fast.size == slow.size
    assert fast.hits == slow.hits > 1000
    assert all((k in fast) == (k in slow) for k in set(stream(seed)))


def test_a_copy_follows_its_tiers_setting() -> None:
    tier = SlruPolicy(7.0)
    copy = make_shadow(SlruPolicy(1.0), 10)
    copy.follow(tier)
    assert isinstance(copy, SlruShadow) and copy.ratio == 7.0
    copy.follow(LruPolicy())                     # not an slru: nothing to follow
    assert copy.ratio == 7.0


def test_tuners_on_own_copies_choose_as_on_the_policy_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """RatioTuner's grid runs on make_shadow: its choices are the ones the generic copies make."""
    import kvcached.policies.tuning as tuning

    def choices() -> list[float]:
        tuner = RatioTuner(lambda r: SlruPolicy(r), presampled=True)
        out = []
        for key in stream(9, 40_000):
            tuner.access(key, 400)
            out.append(tuner.ratio)
        return out

    fast = choices()
    monkeypatch.setattr(tuning, "make_shadow", lambda policy, capacity: ShadowCache(policy, capacity))
    assert fast == choices() and len(set(fast)) > 1


def test_policies_without_a_copy_of_their_own_run_as_themselves() -> None:
    copy = make_shadow(make_keyed_policy("arc").policy, 50)
    assert isinstance(copy, ShadowCache)
