"""How late the event loop runs what is due: a tick every few milliseconds, its lateness kept.

Everything the daemon answers goes through one event loop, so one long step on it (a policy
snapshot walked in one go, a scan of a million records, a collection of the garbage collector's
oldest generation) delays every request by as long. :class:`LoopLag` keeps what a watcher saw:
a tick is due every ``period_s``; when it runs ``lag`` seconds late, the lag goes into a
histogram (Prometheus buckets, ``LAG_BUCKETS``) and the longest lag so far is kept. A lag of
``stall_s`` or more is a *stall*: counted, and reported (logged) at most once per
``report_every_s``, with the longest stall since the previous report.

The recorder does no I/O and reads no clock: the times are passed in (:meth:`LoopLag.woke`),
so tests move time by hand. :func:`watch_loop` is the asyncio task that drives it: it sleeps
``period_s`` and tells the recorder when it woke (``time.monotonic``, not the loop's clock:
uvloop's is updated once per loop iteration, in milliseconds). Cost: one wake-up per period,
a few microseconds each.

Only the event loop's thread writes; a scrape (the metrics thread) copies the counts and may
see one tick in the counts but not yet in the sum, which Prometheus tolerates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from kvcached.host.histogram import Histogram

__all__ = ["LoopLag", "Stalls", "watch_loop", "LAG_BUCKETS"]

log = logging.getLogger("kvcached.loop")

#: upper bounds of the histogram's buckets, seconds (+Inf follows): fine around the 50 ms a
#: request may wait at most, coarse beyond
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Stalls:
    """What :meth:`LoopLag.woke` has to report: ``count`` stalls since the last report, the
    longest ``longest_s``."""

    count: int
    longest_s: float


class LoopLag:
    """See the module. ``period_s``: how often a tick is due; ``stall_s``: the lag from which a
    tick is a stall; ``report_every_s``: the least time between two reports of stalls."""

    def __init__(self, period_s: float = 0.005, stall_s: float = 0.1, report_every_s: float = 10.0) -> None:
        self.period_s = period_s
        self.stall_s = stall_s
        self.report_every_s = report_every_s
        self.lags = Histogram(LAG_BUCKETS)
        self.max = 0.0               # the longest lag seen
        self.stalls = 0              # ticks late by stall_s or more
        self.due: float | None = None
        self._unreported = 0         # stalls since the last report, and the longest of them
        self._unreported_max = 0.0
        self._reported_at = float("-inf")

    def start(self, now: float) -> float:
        """The watcher starts at ``now``; returns when the first tick is due."""
        self.due = now + self.period_s
        return self.due

    def woke(self, now: float) -> Stalls | None:
        """The tick due at :attr:`due` ran at ``now``: its lag is recorded and the next tick is
        due ``period_s`` from now. Returns the stalls to report, if one is due."""
        if self.due is None:
            self.start(now)
            return None
        lag = max(0.0, now - self.due)
        self.due = now + self.period_s
        self.lags.observe(lag)
        if lag > self.max:
            self.max = lag
        if lag < self.stall_s:
            return None
        self.stalls += 1
        self._unreported += 1
        self._unreported_max = max(self._unreported_max, lag)
        if now - self._reported_at < self.report_every_s:
            return None
        report = Stalls(self._unreported, self._unreported_max)
        self._unreported, self._unreported_max, self._reported_at = 0, 0.0, now
        return report

    @property
    def ticks(self) -> int:
        return self.lags.total


async def watch_loop(lag: LoopLag, clock: Callable[[], float] = time.monotonic) -> None:
    """Tick every ``lag.period_s`` on the running loop and record how late each tick ran, until
    cancelled; stalls are logged (a warning, at most once per ``lag.report_every_s``)."""
    due = lag.start(clock())
    while True:
        await asyncio.sleep(max(0.0, due - clock()))
        report = lag.woke(clock())
        assert lag.due is not None
        due = lag.due
        if report is not None:
            log.warning("event loop stalled", extra={"fields": {
                "stalls": report.count, "longest_ms": round(report.longest_s * 1000, 1)}})
