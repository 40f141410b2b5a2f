"""The daemon's KV event streams together: the operator's (events.endpoint, every block) and one
per tenant that has its own (tenants.events, that tenant's blocks alone), fed by one tier feed
on the index (docs/events.md, "Streams per tenant")."""

from __future__ import annotations

import asyncio
from typing import Sequence

from kvcached.events.publisher import EventCounters, EventPublisher
from kvcached.index.presence import TierChange, TierFeed

__all__ = ["EventStreams"]


class _EveryFeed(TierFeed):
    """Hands every change to each stream's own feed (each takes them at its own pace)."""

    def __init__(self, feeds: Sequence[TierFeed]) -> None:
        super().__init__(1)
        self.feeds = list(feeds)

    def add(self, changes: list[TierChange]) -> None:
        for feed in self.feeds:
            feed.add(changes)


class EventStreams:
    """Starts, stops and counts several publishers as one. ``feed``: what the index writes to."""

    def __init__(self, publishers: Sequence[EventPublisher]) -> None:
        if not publishers:
            raise ValueError("no event streams")
        self.publishers = list(publishers)
        self.feed = self.publishers[0].feed if len(self.publishers) == 1 else _EveryFeed(
            [p.feed for p in self.publishers])

    @property
    def counters(self) -> list[EventCounters]:
        return [p.counters for p in self.publishers]

    def start(self, *, ram_lost: bool) -> None:
        """Start every stream; if one cannot bind, those started are closed again (OSError)."""
        started: list[EventPublisher] = []
        try:
            for publisher in self.publishers:
                publisher.start(ram_lost=ram_lost)
                started.append(publisher)
        except BaseException:
            for publisher in started:
                publisher.close_now()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.publishers))
