"""The live miss-ratio curves of the store's tiers (kvcached.policies.curves, docs/operations.md):
built over the RAM tier's own policy and the SSD tier's eviction order, fed by the store with
every use of a block (a hit served, a block stored or found stored). Runs on the event loop; a
reader in another thread (the metrics) only reads.

A sampled use costs the curves some tens of microseconds (one access to every copy of every
tier), now and then a millisecond (a tuner's round), which a request that used the block would
wait for. So the store's requests only queue them (MissRatioCurves ``deferred``), and the event
loop counts them once the request has been answered (:class:`LiveCurves`): once DRAIN_AFTER
are queued (or DRAIN_WAIT_S after the first), DRAIN_SLICE at a time between the events that
wait. Counted in batches, the copies' dicts are still in the CPU's caches from one use to the
next: a daemon serving a trace spent 50 us a sampled use counting them four at a time as they
came, 26 us in batches of 64 (the curves' budget buys twice the sample). Counted in order, each
with its access number, they come out as if counted at once. A reader on the event loop calls
``drain()`` first (Stats does); the metrics, read in their own thread, may lag by the uses
still queued."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from kvcached.policies import EVICTION_POLICIES, EvictionPolicy, KeyedPolicy
from kvcached.policies.curves import MissRatioCurves, TierSpec
from kvcached.policies.lru import LruPolicy
from kvcached.store.reads import ReadStats
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import file_bytes

__all__ = ["DRAIN_AFTER", "DRAIN_SLICE", "DRAIN_WAIT_S", "LiveCurves", "OwnHits", "tier_curves"]

DRAIN_AFTER = 64            # sampled uses queued before the event loop is asked to count them
DRAIN_WAIT_S = 0.5          # ... or this long after the first was queued
DRAIN_SLICE = 8             # sampled uses counted per turn of the event loop (then the events waiting go first)


def _name(policy: EvictionPolicy) -> str:
    return next((name for name, cls in EVICTION_POLICIES.items() if type(policy) is cls), type(policy).__name__)


def tier_curves(ram: RamTier, ssd: SsdTier | None, ssd_order: KeyedPolicy | None, clock: Callable[[], float],
                sample_keys: int, own_hits: Callable[[], tuple[int, ...]] | None = None) -> MissRatioCurves:
    """Curves of the RAM tier (its policy; a block takes its slab class's slot) and of the SSD
    tier where there is one (its in-memory order's policy, or LRU for the index's own queue,
    which is LRU with a second chance; a block takes its file), sampling ``sample_keys`` keys;
    what they cost is counted (MissRatioCurves.busy_s, min_busy_s: Stats and the metrics) and
    bounded (their budget). ``own_hits``: the store's count of the uses RAM held, and RAM or SSD
    (:class:`OwnHits`)."""
    slabs = ram.slabs
    tiers = [TierSpec("ram", _name(ram.policy), ram.policy, ram.capacity,
                      lambda n: slabs.classes[min(slabs.class_for(n), len(slabs.classes) - 1)])]
    if ssd is not None:
        order = ssd_order.policy if ssd_order is not None else LruPolicy()
        tiers.append(TierSpec("ssd", _name(order) if ssd_order is not None else "lru", order, ssd.capacity,
                              file_bytes))
    return LiveCurves(tiers, clock, sample_keys=sample_keys, timer=time.thread_time, process_timer=time.process_time,
                      own_hits=own_hits)


class OwnHits:
    """The store's own count of the uses the curves count that its tiers held: reads served from
    RAM (ReadStats), and from SSD, and saves of blocks RAM held already (:meth:`written`). The
    curves correct their estimates by it at 1x (kvcached.policies.curve_window)."""

    def __init__(self, reads: ReadStats, ssd: bool) -> None:
        self.reads = reads
        self.ssd = ssd
        self.present = 0                # saves of blocks RAM held

    def written(self, held: int) -> None:
        self.present += held

    def __call__(self) -> tuple[int, ...]:
        hits = self.reads.hits
        ram = hits["ram"] + self.present
        return (ram, ram + hits["ssd"]) if self.ssd else (ram,)


class LiveCurves(MissRatioCurves):
    """Curves whose sampled uses are counted on the event loop after the request that made them
    (see the module): :meth:`uses` queues them and asks the loop to :meth:`drain` them,
    DRAIN_SLICE per turn, once DRAIN_AFTER wait or DRAIN_WAIT_S after the first. Without a
    running loop (a tool, a test) they are counted at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, deferred=True, **kwargs)
        self._draining: asyncio.AbstractEventLoop | None = None   # the loop asked to drain, until the queue is empty
        self._waiting: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None   # a drain asked for later

    def uses(self, keys: Sequence[bytes], nbytes: Callable[[int], int]) -> None:
        super().uses(keys, nbytes)
        if not self.pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.drain()
            return
        if self._draining is loop:
            return
        if self.pending >= DRAIN_AFTER or self._draining is not None:   # enough, or asked of a loop since ended
            if self._waiting is not None:
                self._waiting[1].cancel()
                self._waiting = None
            self._draining = loop
            loop.call_soon(self._drain_slice)
        elif self._waiting is None or self._waiting[0] is not loop:
            self._waiting = (loop, loop.call_later(DRAIN_WAIT_S, self._drain_slice))

    def _drain_slice(self) -> None:
        self._waiting = None
        loop = asyncio.get_running_loop()
        self._draining = loop
        if self.drain(DRAIN_SLICE):
            loop.call_soon(self._drain_slice)
        else:
            self._draining = None
