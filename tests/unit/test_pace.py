"""kvcached.host.pace.TokenBucket with the clock passed in: the rate, the burst of one second's
worth, and what a charge past it owes."""

from __future__ import annotations

import pytest

from kvcached.host.pace import TokenBucket


def test_takes_up_to_a_seconds_worth_then_refills_at_its_rate() -> None:
    bucket = TokenBucket(10.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(11)] == [True] * 10 + [False]
    assert not bucket.has(1.0, 0.05) and bucket.has(1.0, 0.1)
    assert bucket.take(100.0, 10.0) and not bucket.take(100.0), "a long pause refills one second's worth, no more"


def test_a_charge_past_the_bucket_owes_the_time_that_keeps_the_rate() -> None:
    bucket = TokenBucket(16.0, now=0.0)
    assert bucket.charge(16.0, 0.0) == 0.0
    assert bucket.charge(8.0, 0.0) == pytest.approx(0.5)
    assert bucket.charge(8.0, 0.5) == pytest.approx(0.5), "half a second refilled 8; 8 more owe another half"
    assert not bucket.has(1.0, 0.9) and bucket.has(1.0, 1.1)
