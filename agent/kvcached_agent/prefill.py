"""What recomputing a block costs this engine: its prefill rate, measured or given (no I/O).

A load plan (``Agent.plan_loads``, docs/engines.md "Loads that pay") weighs each block held on
SSD or at a peer against recomputing it; the daemon knows what its tiers deliver, the engine
knows what a token of prefill costs it. :class:`PrefillRate` is that second half: a rate given
in the plug-in's settings (``prefill_tokens_per_s``), or fitted from the engine's own recent
steps, ``seconds = overhead + tokens * per_token``. The slope is what counts: a block not
loaded is computed in a step the engine runs anyway, so it adds its tokens and not a step.

Steps are reported as they are scheduled (:meth:`StepClock.scheduled`); a step's length is
the time to the next one, taken only when the engine ran on without a pause in between (a
request of the step is still running in the next), so an idle engine's wait is never counted
as work. Until :data:`PrefillRate.MIN_STEPS` steps with a prefill in them are measured the rate
is unknown, and a plug-in loads every hit (as without a plan).
"""

from __future__ import annotations

from collections import deque

__all__ = ["PrefillRate", "StepClock"]


class PrefillRate:
    """Seconds per token of prefill: ``given`` tokens per second where set (> 0), else fitted
    over the last :data:`WINDOW` steps measured. :meth:`seconds_per_token` is None while unknown."""

    WINDOW = 64
    MIN_STEPS = 4

    def __init__(self, given: float = 0.0, *, prefill_tokens: int = 1) -> None:
        if not 0 <= given < float("inf"):
            raise ValueError(f"prefill_tokens_per_s must be a number >= 0, not {given!r}")
        self.given = given
        self.prefill_tokens = max(1, prefill_tokens)   # a step with fewer tokens is decode only
        self._steps: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)

    def step(self, tokens: int, seconds: float) -> None:
        """One step of the engine: ``tokens`` computed in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, seconds))

    def steps(self) -> list[tuple[int, float]]:
        """The steps measured, oldest first: (tokens, seconds)."""
        return list(self._steps)

    def seconds_per_token(self) -> float | None:
        if self.given > 0:
            return 1.0 / self.given
        steps = list(self._steps)
        prefills = [(t, s) for t, s in steps if t >= self.prefill_tokens]
        if len(prefills) < self.MIN_STEPS:
            return None
        n = len(steps)
        mean_t = sum(t for t, _ in steps) / n
        mean_s = sum(s for _, s in steps) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in steps) / n
        if var_t ** 0.5 > 0.25 * mean_t:
            slope = sum((t - mean_t) * (s - mean_s) for t, s in steps) / n / var_t
            if slope > 0 and mean_s - slope * mean_t >= 0:
                return slope
        # Sizes too alike to tell the overhead from the rate (or a fit that makes no sense):
        # all of the prefill steps' time taken as rate, which overstates recomputing (so a
        # plan errs on loading, as without one).
        return sum(s for _, s in prefills) / sum(t for t, _ in prefills)

    def tokens_per_s(self) -> float | None:
        per_token = self.seconds_per_token()
        return 1.0 / per_token if per_token else None


class StepClock:
    """Turns "a step of ``tokens`` for these requests was scheduled at ``now``" into step
    lengths for a :class:`PrefillRate`: a step lasts until the next is scheduled, counted only
    when some request of it is in the next one too (the engine never paused between them)."""

    def __init__(self, rate: PrefillRate) -> None:
        self.rate = rate
        self._last: tuple[float, int, frozenset[str]] | None = None

    def scheduled(self, now: float, tokens: int, requests: frozenset[str], continuing: frozenset[str]) -> None:
        """A step was scheduled at ``now``: ``tokens`` in all for ``requests``, of which
        ``continuing`` were already running before it."""
        last = self._last
        if last is not None and last[2] & continuing:
            self.rate.step(last[1], now - last[0])
        self._last = (now, tokens, requests) if tokens > 0 else None
