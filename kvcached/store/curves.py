"""The live miss-ratio curves of the store's tiers (kvcached.policies.curves, docs/operations.md):
built over the RAM tier's own policy and the SSD tier's eviction order, fed by the store with
every use of a block (a hit served, a block stored or found stored). Runs on the event loop; a
reader in another thread (the metrics) only reads.

A sampled use costs the curves a few hundred microseconds (one access to every copy of every
tier), now and then milliseconds (a tuner's round), which a request that used the block would
wait for. So the store's requests only queue them (MissRatioCurves ``deferred``), and the event
loop counts them once the request has been answered, a few at a time between the events that
wait (:class:`LiveCurves`). Counted in order, each with its access number, they come out as
if counted at once. A reader on the event loop calls ``drain()`` first (Stats does); the
metrics, read in their own thread, may lag by the uses still queued."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

from kvcached.policies import EVICTION_POLICIES, EvictionPolicy, KeyedPolicy
from kvcached.policies.curves import MissRatioCurves, TierSpec
from kvcached.policies.lru import LruPolicy
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import file_bytes

__all__ = ["DRAIN_SLICE", "LiveCurves", "tier_curves"]

DRAIN_SLICE = 4             # sampled uses counted per turn of the event loop (then the events waiting go first)


def _name(policy: EvictionPolicy) -> str:
    return next((name for name, cls in EVICTION_POLICIES.items() if type(policy) is cls), type(policy).__name__)


def tier_curves(ram: RamTier, ssd: SsdTier | None, ssd_order: KeyedPolicy | None, clock: Callable[[], float],
                sample_keys: int) -> MissRatioCurves:
    """Curves of the RAM tier (its policy; a block takes its slab class's slot) and of the SSD
    tier where there is one (its in-memory order's policy, or LRU for the index's own queue,
    which is LRU with a second chance; a block takes its file), sampling ``sample_keys`` keys;
    what they cost is counted (MissRatioCurves.busy_s, min_busy_s: Stats and the metrics)."""
    slabs = ram.slabs
    tiers = [TierSpec("ram", _name(ram.policy), ram.policy, ram.capacity,
                      lambda n: slabs.classes[min(slabs.class_for(n), len(slabs.classes) - 1)])]
    if ssd is not None:
        order = ssd_order.policy if ssd_order is not None else LruPolicy()
        tiers.append(TierSpec("ssd", _name(order) if ssd_order is not None else "lru", order, ssd.capacity,
                              file_bytes))
    return LiveCurves(tiers, clock, sample_keys=sample_keys, timer=time.thread_time, process_timer=time.process_time)


class LiveCurves(MissRatioCurves):
    """Curves whose sampled uses are counted on the event loop after the request that made them
    (see the module): :meth:`uses` queues them and asks the loop to :meth:`drain` them,
    DRAIN_SLICE per turn. Without a running loop (a tool, a test) they are counted at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, deferred=True, **kwargs)
        self._draining: asyncio.AbstractEventLoop | None = None   # the loop asked to drain, until the queue is empty

    def uses(self, keys: Sequence[bytes], nbytes: Callable[[int], int]) -> None:
        super().uses(keys, nbytes)
        if not self.pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.drain()
            return
        if self._draining is not loop:        # not asked yet, or asked of a loop that has since ended
            self._draining = loop
            loop.call_soon(self._drain_slice)

    def _drain_slice(self) -> None:
        if self.drain(DRAIN_SLICE):
            asyncio.get_running_loop().call_soon(self._drain_slice)
        else:
            self._draining = None
