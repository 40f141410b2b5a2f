"""The engine's prefill rate for load plans (kvcached_agent.prefill): given, or fitted from its
own steps, never counting an idle engine's wait as work."""

from __future__ import annotations

import pytest

from kvcached_agent.prefill import PrefillRate, StepClock


def test_a_given_rate_is_used_as_is_and_a_negative_one_refused() -> None:
    assert PrefillRate(20000).seconds_per_token() == pytest.approx(1 / 20000)
    assert PrefillRate(20000).tokens_per_s() == pytest.approx(20000)
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=">= 0"):
            PrefillRate(bad)


def test_the_rate_is_unknown_until_enough_prefill_steps_are_measured() -> None:
    rate = PrefillRate(prefill_tokens=16)
    for _ in range(20):
        rate.step(4, 0.01)                               # decode steps only: nothing about prefill
    assert rate.seconds_per_token() is None
    for _ in range(PrefillRate.MIN_STEPS - 1):
        rate.step(512, 0.01 + 512 * 1e-4)
    assert rate.seconds_per_token() is None
    rate.step(512, 0.01 + 512 * 1e-4)
    assert rate.seconds_per_token() is not None


def test_the_fit_takes_the_slope_so_a_steps_overhead_is_not_charged_to_its_tokens() -> None:
    rate = PrefillRate(prefill_tokens=16)
    for tokens in (1, 2048, 3, 1024, 1, 4096, 2, 512, 1, 2048):   # 20 ms a step, 10k tokens/s
        rate.step(tokens, 0.02 + tokens / 10_000)
    assert rate.tokens_per_s() == pytest.approx(10_000)


def test_steps_of_one_size_fall_back_to_their_mean_which_overstates_recomputing() -> None:
    rate = PrefillRate(prefill_tokens=16)
    for _ in range(8):
        rate.step(1000, 0.02 + 1000 / 10_000)
    per_token = rate.seconds_per_token()
    assert per_token is not None and per_token == pytest.approx(0.12 / 1000) and per_token > 1 / 10_000


def test_the_window_follows_the_engine_when_it_slows() -> None:
    rate = PrefillRate(prefill_tokens=16)
    for tokens in (1, 1024, 2, 4096) * 16:
        rate.step(tokens, 0.01 + tokens / 10_000)
    for tokens in (1, 1024, 2, 4096) * 16:               # a busier GPU: a quarter of the rate
        rate.step(tokens, 0.01 + tokens / 2_500)
    assert rate.tokens_per_s() == pytest.approx(2_500)


def test_the_step_clock_counts_a_step_only_when_the_engine_ran_on_without_a_pause() -> None:
    rate = PrefillRate(prefill_tokens=16)
    clock = StepClock(rate)
    clock.scheduled(0.0, 2048, frozenset({"a"}), frozenset())
    clock.scheduled(0.3, 1, frozenset({"a"}), frozenset({"a"}))        # a's prefill took 0.3 s
    clock.scheduled(0.32, 0, frozenset(), frozenset())                 # nothing scheduled: a finished
    clock.scheduled(60.0, 2048, frozenset({"b"}), frozenset())          # idle a minute: not a step
    clock.scheduled(60.3, 1, frozenset({"b"}), frozenset({"b"}))
    clock.scheduled(90.0, 4096, frozenset({"c"}), frozenset())          # b finished, c new: not counted
    assert rate.steps() == [(2048, pytest.approx(0.3)), (2048, pytest.approx(0.3))]
