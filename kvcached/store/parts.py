"""What the store's rooms share: the settings SIGHUP may change, and the parts every room holds.

:class:`StoreSettings` is shared by reference, so a change is seen by every room at once.
:class:`StoreParts` bundles the RAM tier, the index, the ledger, the in-flight tables, the
counters, the settings and the clock; a :class:`Room` takes them as attributes of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvcached.index import BlockIndex, Tier
from kvcached.policies.prefetch import PrefetchPolicy, WaitComplete
from kvcached.policies.write import WritePolicy
from kvcached.store.inflight import InFlight
from kvcached.store.ledger import RecordLedger
from kvcached.store.reads import DeliveryRates
from kvcached.store.results import Counters, TenantTally
from kvcached.tiers.ram import RamTier

__all__ = ["Room", "StoreParts", "StoreSettings", "tiers_for_writer"]


@dataclass(slots=True)
class StoreSettings:
    writes: WritePolicy                 # [kv] write_policy
    dirty_limit: int                    # write-back: a Put waits for the demoter above this many dirty bytes
    ssd_ttl: float = 7 * 86400.0        # [kv] ssd_ttl: SSD blocks unused this long are dropped
    gone_ttl: float = 3600.0            # [kv] gone_ttl: how long a tombstone says why a block went
    mirror_pulls: bool = True           # [kv] mirror_pulls: a pulled block is stored here too
    prefetch: PrefetchPolicy = field(default_factory=WaitComplete)   # [kv] prefetch_policy
    hash_threads: int = 2               # [kv] hash_threads, resolved: threads checksumming saved blocks


@dataclass(frozen=True, slots=True)
class StoreParts:
    ram: RamTier
    index: BlockIndex
    ledger: RecordLedger
    inflight: InFlight
    counters: Counters
    settings: StoreSettings
    clock: Callable[[], float]
    tally: TenantTally = field(default_factory=TenantTally)
    delivery: DeliveryRates = field(default_factory=DeliveryRates)   # what SSD reads and pulls deliver lately


class Room:
    """A room of the store: the shared parts as its own attributes."""

    def __init__(self, parts: StoreParts) -> None:
        self.ram = parts.ram
        self.index = parts.index
        self.ledger = parts.ledger
        self.inflight = parts.inflight
        self.counters = parts.counters
        self.settings = parts.settings
        self.clock = parts.clock
        self.tally = parts.tally
        self.delivery = parts.delivery


def tiers_for_writer(ram: RamTier, index: BlockIndex | None, keys: list[bytes], tenant: str) -> list[Tier | None]:
    """For a writer (a Put, an agent's save, a Delete) acting as ``tenant`` (a Tenant.tag): None
    where another tenant's block is stored under a key, which the writer may neither replace nor
    be told of (in RAM, its owner there, recorded or not yet; else its index record); else the
    key's tier set as the index has it (NONE: absent, a tombstone, or committed in RAM, which
    the caller asks RAM about). Only keys RAM does not hold committed are read from ``index``
    (one batched read); without one (no SSD tier: a stored block is in RAM) none are."""
    owners = [ram.tenant_of(k) for k in keys]
    ask = [k for k in keys if k not in ram] if index is not None else []
    read = dict(zip(ask, index.writable_tiers(ask, tenant))) if index is not None and ask else {}
    return [None if owner not in (None, tenant) else read.get(k, Tier.NONE) for k, owner in zip(keys, owners)]
