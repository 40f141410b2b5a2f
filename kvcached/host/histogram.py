"""A histogram of Prometheus buckets, kept by hand: read latencies and the event loop's lag.

``observe`` is a bisect and two additions, with no lock: prometheus_client's Histogram takes a
lock per observation (bench_metrics.py figure 0: about 1.7 us against 0.3). Only the event loop
thread writes; a scrape copies the counts and may see one observation in the counts but not yet
in the sum, which Prometheus tolerates.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

__all__ = ["Histogram"]


class Histogram:
    """Counts of observations per bucket (upper bounds ``bounds``, then +Inf) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def total(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """(upper bound as Prometheus writes it, observations at or under it) per bucket, +Inf
        last; and the sum."""
        counts, total = list(self.counts), self.sum
        out, running = [], 0
        for bound, n in zip([*map(repr, self.bounds), "+Inf"], counts):
            running += n
            out.append((bound, running))
        return out, total
