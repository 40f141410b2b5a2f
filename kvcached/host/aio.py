"""Small asyncio helpers the daemon's rooms share."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

__all__ = ["cancel_and_wait", "run_in_slices", "SliceStats"]

T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, whatever it raised (a stop's way of
    ending background loops: nothing of theirs runs once this returns)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


@dataclass
class SliceStats:
    """What :func:`run_in_slices` spent on the loop: in all, and in its longest slice."""

    busy_s: float = 0.0
    longest_s: float = 0.0
    slices: int = 0

    def add(self, seconds: float) -> None:
        self.busy_s += seconds
        self.longest_s = max(self.longest_s, seconds)
        self.slices += 1


async def run_in_slices(steps: Iterator[T | None], slice_s: float, rest_s: float, stats: SliceStats | None = None,
                        clock: Callable[[], float] = time.monotonic) -> T:
    """Run ``steps`` on the event loop a slice at a time and return their result: steps (each
    yields None, the last one the result) until ``slice_s`` has passed, then a sleep of
    ``rest_s`` in which requests, timers and I/O run, and so on. A slice may overrun by one
    step: steps must be short (a few thousand entries each, under a millisecond)."""
    stats = stats if stats is not None else SliceStats()
    start = clock()
    for item in steps:
        now = clock()
        if item is not None:
            stats.add(now - start)
            return item
        if now - start >= slice_s:
            stats.add(now - start)
            await asyncio.sleep(rest_s)
            start = clock()
    raise ValueError("the steps ended without a result")
