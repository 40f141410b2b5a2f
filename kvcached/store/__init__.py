"""The store: one place that puts, finds, fetches and deletes blocks across tiers and the index.

APIs (gRPC, the agent socket, peers) call :class:`Store` and translate its errors
(kvcached.errors). The store is a thin facade over rooms, one per concern, each with its own
contract:

- ``results``: the records it takes and hands back; ``parts``: what SIGHUP may change, and the
  parts every room shares;
- ``ledger``: the index writes of the request in progress, tombstones, last-seen times;
- ``inflight``: blocks being fetched, published or checksummed, and the background tasks;
- ``write_path``: Puts and agents' reserve/commit, admission, write policies;
- ``read_path``: Get and pin, and making blocks resident (promotion, peer pulls);
- ``lookups``: Lookup, Present, load plans: what the tiers hold, without serving bytes;
- ``ssd_mover``: promotion from SSD, publishing and write-back, the SSD write budget;
- ``ssd_evictor``: TTL, capacity and forced evictions, the SSD order, the boot reconcile;
- ``admin``: Delete, dropping RAM copies, listing; ``stats``: the Stats table;
- ``peer_pulls``: pulls from peers (serving a peer's pull is kvcached.peers.store_link's).

Everything runs on the event loop thread, except :meth:`Store.stats`, which the Prometheus
scrape thread reads too (plain ints, no lock). The clock is passed in so tests move time by
hand. Methods that wait (for the SSD tier, a peer, an agent's checksums) are coroutines; the
synchronous ones block the loop only on RocksDB (point reads, and index writes, fsynced per
``kv.ssd_durability`` after an SSD publish) and on checksumming a Put's payloads.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Mapping, Sequence

from kvcached.index import BlockIndex, BlockRecord, IndexUnwritable
from kvcached.policies import KeyedPolicy
from kvcached.policies.admission import AdmissionPolicy, AlwaysAdmit, SsdWriteBudget
from kvcached.policies.load_cost import LoadPlan
from kvcached.policies.prefetch import PrefetchPolicy
from kvcached.policies.write import WritePolicy, make_write_policy
from kvcached.store import admin
from kvcached.store.adoption import SETTLE_BYTES, AdoptionReport, RamAdoption
from kvcached.store.curves import OwnHits, tier_curves
from kvcached.store.gpu_view import GpuView
from kvcached.store.inflight import InFlight
from kvcached.store.ledger import RecordLedger
from kvcached.store.lookups import ChainPlan, Lookups
from kvcached.store.parts import StoreParts, StoreSettings
from kvcached.store.peer_pulls import PeerPulls, PeerTierLike
from kvcached.store.read_path import ReadPath
from kvcached.store.reads import DeliveryRates, ReadStats
from kvcached.store.results import (
    CommitOutcome,
    Counters,
    Fetched,
    LookupResult,
    Miss,
    Pinned,
    Presence,
    PutItem,
    PutResult,
    SlotRefusal,
    TenantTally,
)
from kvcached.store.routes import RouteKeys
from kvcached.store.ssd_evictor import SsdEvictor
from kvcached.store.ssd_mover import SsdMover, load_budget
from kvcached.store.ssd_reconcile import ReconcileReport
from kvcached.store.stats import stats_table
from kvcached.store.write_path import WritePath
from kvcached.tiers.ram import RamBlock, RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_shares import SsdShares
from kvcached_agent.address import BlockAddress, index_key

__all__ = ["CommitOutcome", "Fetched", "LookupResult", "Miss", "Pinned", "Presence", "PutItem", "PutResult", "SlotRefusal", "Store"]


class Store:
    """Blocks across the RAM tier, the SSD tier (optional), peers (optional) and the index.

    Built complete by its constructor, from what [kv] says. Two things change after it:
    what SIGHUP may change (``ssd_ttl``, ``gone_ttl``, ``prefetch``, ``mirror_pulls``, the
    write policy and SSD budget: their setters), and ``peers``, a late binding: the peer tier
    is built over the store (it serves peers' pulls from it), so the daemon binds it here once
    the peer tier is up. Until then, and without [quic], reads reach RAM and SSD only.

    ``rebuild_ssd_order``: the SSD order given starts empty and is rebuilt from the index
    after the boot reconcile (the keeper does it); until :meth:`adopt_ssd_order` the index's
    own queue orders SSD eviction. ``adoption``: the previous process's RAM tier being taken
    up. ``timed_tiers``: the tiers whose read latencies are timed (none: reads are counted, not timed).
    ``ssd_shares``: SSD file bytes each tenant keeps (tag -> bytes; kvcached.tiers.ssd_shares).
    ``curve_keys``: the live miss-ratio curves sample that many keys (0: none; store.curves)."""

    def __init__(self, ram: RamTier, index: BlockIndex, *, ssd: SsdTier | None = None,
                 write_policy: WritePolicy | str = "write_back", ssd_ttl: float = 7 * 86400.0, gone_ttl: float = 3600.0,
                 max_gpu_blocks: int = 1_000_000, clock: Callable[[], float] = time.time,
                 admission: AdmissionPolicy | None = None, ssd_budget: SsdWriteBudget | None = None,
                 ssd_order: KeyedPolicy | None = None, rebuild_ssd_order: bool = False,
                 adoption: RamAdoption | None = None, mirror_pulls: bool = True,
                 prefetch: PrefetchPolicy | None = None, timed_tiers: Sequence[str] = (),
                 count_tenants: bool = False, ssd_shares: Mapping[str, int] | None = None,
                 curve_keys: int = 0, hash_threads: int = 2, route_keys_bytes: int = 64 << 20) -> None:
        self.ram = ram
        self.index = index
        self.ssd = ssd
        self.clock = clock
        self.admission = admission or AlwaysAdmit()
        budget = ssd_budget or SsdWriteBudget(0)
        self.counters = Counters()
        self.tally = TenantTally(count_tenants)      # puts and reads by tenant, where several are configured
        self.reads = ReadStats()
        if timed_tiers:
            self.reads.time_reads(timed_tiers)
        self.gpu = GpuView(max_gpu_blocks)
        #: The previous process's RAM tier, being taken up (kvcached.store.adoption), if any: the
        #: entry points below settle the blocks they name first (:meth:`_settle`).
        self.adoption = adoption
        self.settings = StoreSettings(
            writes=make_write_policy(write_policy) if isinstance(write_policy, str) else write_policy,
            dirty_limit=ram.capacity // 2, ssd_ttl=ssd_ttl, gone_ttl=gone_ttl, mirror_pulls=mirror_pulls, hash_threads=hash_threads)
        if prefetch is not None:
            self.settings.prefetch = prefetch
        ram.prefer_clean = ssd is not None
        self.routes = RouteKeys(max_bytes=route_keys_bytes)   # the engine's keys of blocks being saved (KV events)
        self.ledger = RecordLedger(ram, index, clock, self.routes)
        # Readers and agents may hold at most half the RAM tier, so a stalled one can never
        # hold all of it: puts keep finding room in the other half.
        self.inflight = InFlight(max_held_bytes=ram.capacity // 2)
        self._budget = budget
        self.delivery = DeliveryRates()      # what SSD reads and peer pulls deliver lately (load cost rule)
        parts = StoreParts(ram, index, self.ledger, self.inflight, self.counters, self.settings, clock, self.tally, self.delivery)
        self.evictor: SsdEvictor | None = None
        self.mover: SsdMover | None = None
        if ssd is not None:
            self.evictor = SsdEvictor(parts, ssd, ssd_order, order_ready=not rebuild_ssd_order,
                                      shares=SsdShares(ssd_shares, ssd.usage) if ssd_shares else None)
            self.mover = SsdMover(parts, ssd, self.evictor, budget)
        self.writer = WritePath(parts, ssd, self.mover, self.admission)
        self.pulls = PeerPulls(parts, self.writer, self.mover)
        self.reader = ReadPath(parts, self.writer, self.mover, self.pulls, self.reads)
        self.lookups = Lookups(parts, self.mover, self.pulls, self.gpu, self.reads)
        self.own_hits = OwnHits(self.reads, ssd is not None)
        self.curves = tier_curves(ram, ssd, ssd_order, time.monotonic, curve_keys, self.own_hits) if curve_keys else None

    # -- what SIGHUP changes, the peer tier's late binding, views ----------------------------------

    @property
    def write_policy(self) -> str:
        """The write policy's config name ([kv] write_policy)."""
        return self.settings.writes.name

    @write_policy.setter
    def write_policy(self, name: str) -> None:
        self.settings.writes = make_write_policy(name)

    @property
    def ssd_budget(self) -> SsdWriteBudget:
        """The SSD write budget ([kv] ssd_write_budget_gib)."""
        return self._budget

    @ssd_budget.setter
    def ssd_budget(self, budget: SsdWriteBudget) -> None:
        self._budget = budget
        if self.mover is not None:
            self.mover.budget = budget

    @property
    def ssd_ttl(self) -> float:
        return self.settings.ssd_ttl

    @ssd_ttl.setter
    def ssd_ttl(self, value: float) -> None:
        self.settings.ssd_ttl = value

    @property
    def gone_ttl(self) -> float:
        return self.settings.gone_ttl

    @gone_ttl.setter
    def gone_ttl(self, value: float) -> None:
        self.settings.gone_ttl = value

    @property
    def prefetch(self) -> PrefetchPolicy:
        return self.settings.prefetch

    @prefetch.setter
    def prefetch(self, policy: PrefetchPolicy) -> None:
        self.settings.prefetch = policy

    @property
    def mirror_pulls(self) -> bool:
        return self.settings.mirror_pulls

    @mirror_pulls.setter
    def mirror_pulls(self, value: bool) -> None:
        self.settings.mirror_pulls = value

    @property
    def peers(self) -> PeerTierLike | None:
        """The peer tier (kvcached.peers.tier.PeerTier), set by the daemon when [quic] is on."""
        return self.pulls.peers

    @peers.setter
    def peers(self, tier: PeerTierLike | None) -> None:
        self.pulls.peers = tier

    @property
    def ssd_order(self) -> KeyedPolicy | None:
        """The SSD tier's eviction order ([kv] ssd_policy); None: the index's LRU queue."""
        return self.evictor.order if self.evictor is not None else None

    @property
    def ssd_order_ready(self) -> bool:
        """False while a rebuilt SSD order is awaited (boot): until then the index queue decides."""
        return self.evictor.order_ready if self.evictor is not None else True

    @property
    def ssd_reconciled(self) -> bool:
        """Whether the boot reconcile has counted the SSD tier (capacity eviction waits for it)."""
        return self.evictor.reconciled if self.evictor is not None else True

    @ssd_reconciled.setter
    def ssd_reconciled(self, done: bool) -> None:
        if self.evictor is not None:
            self.evictor.reconciled = done

    @property
    def demote_wanted(self) -> "asyncio.Event":
        """Set when dirty blocks wait for write-back (the daemon's demoter waits on it)."""
        return self._mover().demote_wanted

    @property
    def evict_wanted(self) -> "asyncio.Event":
        """Set when the SSD tier is over capacity (the daemon's evictor waits on it)."""
        return self._evictor().wanted

    @property
    def pinned_bytes(self) -> int:
        """Bytes readers pin and agents hold reserved (Stats' held_bytes)."""
        return self.inflight.held_bytes

    @property
    def max_pinned_bytes(self) -> int:
        return self.inflight.max_held_bytes

    @property
    def max_block_bytes(self) -> int:
        return self.ram.max_block_bytes

    def _mover(self) -> SsdMover:
        assert self.mover is not None, "no SSD tier"
        return self.mover

    def _evictor(self) -> SsdEvictor:
        assert self.evictor is not None, "no SSD tier"
        return self.evictor

    @property
    def ram_adoption(self) -> AdoptionReport | None:
        return self.adoption.report if self.adoption is not None else None

    def _settle(self, keys: Iterable[bytes], budget: int | None = SETTLE_BYTES) -> None:
        """Blocks of the previous process's RAM tier among ``keys`` not checked yet: settled now
        (served again, or dropped), before the request that names them goes on."""
        if self.adoption is not None and self.adoption.pending:
            self.adoption.settle(keys, self.index, self.clock, budget)

    def _settle_chain(self, digests: Sequence[bytes], layer: int) -> None:
        self._settle(index_key(d, layer) for d in digests)

    # -- writes ----------------------------------------------------------------------------------

    async def put(self, items: Sequence[PutItem]) -> PutResult:
        self._settle(keys := [item.address.key for item in items], None)
        self._used(keys, lambda i: len(items[i].payload), saved=True)
        return await self.writer.put(items)

    def reserve(self, entries: Sequence[tuple[BlockAddress, int]], tenant: str = "") -> list[RamBlock | SlotRefusal]:
        """Slots for an agent's blocks (kvcached.store.write_path), as ``tenant``'s (Tenant.tag)."""
        self._settle(keys := [address.key for address, _ in entries], None)
        self._used(keys, lambda i: entries[i][1], saved=True)   # saved, or found saved: a use
        results = self.writer.reserve(entries, tenant)
        if self.routes:
            self.routes.reserved([a for (a, _), r in zip(entries, results) if not isinstance(r, SlotRefusal)])
            found = self.routes.found([a for (a, _), r in zip(entries, results) if r is SlotRefusal.PRESENT])
            try:
                self.index.set_routes(found)
            except IndexUnwritable:      # the keys are an extra: the reservations stand, the blocks keep digest names
                pass
        return results

    async def throttle_writes(self) -> None:
        await self.writer.throttle_writes()

    def abort_reserved(self, block: RamBlock, address: BlockAddress) -> None:
        """Give back the slot reserved for ``address``'s block (and any engine keys held for it)."""
        self.writer.abort_reserved(block)
        self.routes.abandoned([address])

    async def commit_written(self, written: Sequence[tuple[BlockAddress, RamBlock]],
                             model: str, tenant: str = "") -> list[CommitOutcome | None]:
        """Record agent-written blocks (kvcached.store.write_path) as ``tenant``'s ("": the default's)."""
        outcomes = await self.writer.commit_written(written, model, tenant)
        self.routes.abandoned(a for (a, _), outcome in zip(written, outcomes) if outcome is not None)
        return outcomes

    def offset_of(self, block: RamBlock) -> int:
        """Byte offset of the block's slot in the shared arena."""
        return self.ram.slabs.offset(block.slot)

    # -- reads -----------------------------------------------------------------------------------

    async def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  tenant: str | None = "") -> tuple[list[Fetched], list[Miss]]:
        self._settle(a.key for a in addresses)
        found, misses = await self.reader.get(addresses, allow_partial=allow_partial, tenant=tenant)
        self._used([f.address.key for f in found], lambda i: len(found[i].payload))
        return found, misses

    async def pin(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  peers: bool = True, tenant: str | None = "") -> list[Pinned | Miss]:
        self._settle(a.key for a in addresses)
        results = await self.reader.pin(addresses, allow_partial=allow_partial, peers=peers, tenant=tenant)
        self._used(*_pinned_uses(results))
        return results

    def _used(self, keys: Sequence[bytes], nbytes: Callable[[int], int], saved: bool = False) -> None:
        """Blocks used: the curves count them (and, of blocks to be saved, those RAM holds already)."""
        if self.curves is not None:
            if saved:
                self.own_hits.written(sum(map(self.ram.__contains__, keys)))
            self.curves.uses(keys, nbytes)

    def read(self, pinned: Pinned, start: int, length: int) -> bytes:
        return self.reader.read(pinned, start, length)

    def unpin(self, pinned: Pinned) -> None:
        self.reader.unpin(pinned)

    def unpin_many(self, pins: Sequence[Pinned]) -> None:
        self.reader.unpin_many(pins)

    def lookup(self, digests: Sequence[bytes], layer: int, agent: int | None = None,
               tenant: str | None = "") -> LookupResult:
        self._settle_chain(digests, layer)
        return self.lookups.lookup(digests, layer, agent, tenant)

    def plan(self, digests: Sequence[bytes], layer: int, recompute_s: float, block_bytes: int,
             agent: int | None = None, tenant: str | None = "") -> tuple[LoadPlan, int]:
        """Which held blocks are worth loading (ReadPath.plan), counted as a lookup."""
        self._settle_chain(digests, layer)
        return self.lookups.plan(digests, layer, recompute_s, block_bytes, agent, tenant)

    def plan_scan(self, seen: Presence, recompute_s: float, block_bytes: int) -> ChainPlan:
        """The load plan of a chain whose presence was asked already, made a part at a time
        (Lookups.plan_scan)."""
        return self.lookups.plan_scan(seen, recompute_s, block_bytes)

    def present(self, digests: Sequence[bytes], layer: int, agent: int | None = None,
                tenant: str | None = "") -> Presence:
        """Which tiers hold each block, each on its own (ReadPath.present)."""
        self._settle_chain(digests, layer)
        return self.lookups.present(digests, layer, agent, tenant)

    @property
    def wants_routes(self) -> bool:
        """Whether agents should send the engine's keys of the blocks they save (for KV events)."""
        return self.index.tier_feed is not None

    def keep_routes(self, entries: Sequence[tuple[bytes, int, bytes]], owner: int = 0) -> None:
        """The engine's keys (encoded, checked by the caller) of blocks (digest, layer) about to be
        saved, for their KV events, kept once reserved (store.routes) and bounded per ``owner``
        (the agent session that sent them); none without events."""
        if self.index.tier_feed is not None:
            self.routes.offer(entries, owner)

    def drop_routes(self, owner: int) -> None:
        """The agent session ``owner`` ended: the keys it offered and no save reserved go."""
        self.routes.release(owner)

    async def locate(self, digests: Sequence[bytes], layer: int) -> None:
        """Before a Lookup, in a cluster: ask where remote blocks are (ReadPath.locate)."""
        await self.lookups.locate(digests, layer)

    @property
    def asks_homes(self) -> bool:
        """Whether a Lookup should be preceded by :meth:`locate` (a cluster)."""
        return self.pulls.peers is not None and self.pulls.peers.asks_homes

    def stored_bytes(self, addresses: Sequence[BlockAddress], tenant: str | None = "") -> int:
        self._settle(a.key for a in addresses)
        return self.reader.stored_bytes(addresses, tenant)

    def present_wire_keys(self) -> list[bytes]:
        """Every block held, as the peer protocol's 36-byte wire keys (an index scan: off the loop)."""
        return self.index.present_wire_keys()

    def owners(self, keys: list[bytes]) -> list[tuple[str, str] | None]:
        """(model, tenant tag) of each block of ``keys`` (None: not indexed)."""
        return self.index.owners(keys)

    def view(self, block: RamBlock) -> memoryview:
        """A view of a pinned block's bytes in the arena (released with release_view)."""
        return self.ram.view(block)

    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int:
        self._settle_chain(digests, layer)
        return self.lookups.local_prefix(digests, layer)

    # -- the SSD tier ------------------------------------------------------------------------------

    async def demote(self) -> int:
        return await self.mover.demote() if self.mover is not None else 0

    async def write_back_all(self) -> int:
        return await self.mover.write_back_all() if self.mover is not None else 0

    def load_budget(self) -> None:
        """Take up the SSD write budget's ledger from the index (at boot)."""
        load_budget(self.index, self._budget, self.clock())

    async def evict_ssd(self, need_bytes: int = 0) -> int:
        return await self.evictor.evict(need_bytes) if self.evictor is not None else 0

    def adopt_ssd_order(self, built: KeyedPolicy) -> None:
        self._evictor().adopt_order(built)

    def finish_ssd_reconcile(self, report: ReconcileReport) -> None:
        self._evictor().finish_reconcile(report)

    async def drop_from_ssd(self, keys: Sequence[bytes]) -> tuple[int, int, int]:
        return await self.evictor.drop(keys) if self.evictor is not None else (0, 0, len(keys))

    # -- operator actions, upkeep ----------------------------------------------------------------

    async def delete(self, addresses: Sequence[BlockAddress], *, skip_busy: bool = False,
                     tenant: str | None = None) -> tuple[int, int]:
        self._settle((a.key for a in addresses), None)
        return await admin.delete(self.ram, self.index, self.ssd, self.evictor, self.ledger, self.inflight,
                                  self.counters, addresses, skip_busy=skip_busy, tenant=tenant)

    def drop_from_ram(self, keys: Sequence[bytes]) -> tuple[int, int, int]:
        self._settle(keys, None)
        return admin.drop_from_ram(self.ram, self.index, self.ssd is not None, self.ledger, self.inflight, keys)

    def list_blocks(self, *, model: str = "", tier: str = "", page_token: bytes = b"",
                    page_size: int = 100, max_scan: int = 10_000,
                    tenant: str | None = None) -> tuple[list[BlockRecord], bytes]:
        return admin.list_blocks(self.index, model=model, tier=tier, page_token=page_token, page_size=page_size,
                                 max_scan=max_scan, tenant=tenant)

    def flush_last_seen(self) -> int:
        return self.ledger.flush_last_seen(self.ssd_order)

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for background promotions, publishes and checksums to end."""
        await self.inflight.drain(timeout)

    def close(self) -> None:
        """Stop the checksum thread (after :meth:`drain`)."""
        self.writer.close()

    def stats(self) -> dict[str, int]:
        """Every count the store keeps, by name (kvcached.store.stats)."""
        return stats_table(self.ram, self.index, self.counters, self.gpu, self.inflight, self.writer.hasher.threads,
                           self.ssd, self.ssd_reconciled, self.ssd_budget, self.clock)


def _pinned_uses(results: Sequence[Pinned | Miss]) -> tuple[list[bytes], Callable[[int], int]]:
    """The keys of the blocks pinned among ``results``, and each one's length (Store._used)."""
    blocks = [r.block for r in results if isinstance(r, Pinned)]
    return [b.key for b in blocks], lambda i: blocks[i].length
