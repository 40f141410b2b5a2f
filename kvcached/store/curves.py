"""The live miss-ratio curves of the store's tiers (kvcached.policies.curves, docs/operations.md):
built over the RAM tier's own policy and the SSD tier's eviction order, fed by the store with
every use of a block (a hit served, a block stored or found stored). Runs on the event loop; a
reader in another thread (the metrics) only reads."""

from __future__ import annotations

import time
from typing import Callable

from kvcached.policies import EVICTION_POLICIES, EvictionPolicy, KeyedPolicy
from kvcached.policies.curves import MissRatioCurves, TierSpec
from kvcached.policies.lru import LruPolicy
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import file_bytes

__all__ = ["tier_curves"]


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
    return MissRatioCurves(tiers, clock, sample_keys=sample_keys, timer=time.thread_time,
                           process_timer=time.process_time)
