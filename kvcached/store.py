"""The store: one place that puts, finds, fetches and deletes blocks across tiers and the index.

APIs (gRPC now; the agent socket and peers later) call the store and translate its errors
(kvcached.errors). Everything here runs on the event loop thread; the clock is passed in so
tests move time by hand. Methods that wait for the SSD tier are coroutines; between their
awaits each runs in synchronous steps, and per-request state (``_pending``/``_evicted``) never
lives across an await.

With an SSD tier (kvcached.tiers.ssd) the store also moves blocks between tiers:

- ``write_through``: a Put returns once its new blocks are published on SSD (per the durability
  mode); ``write_back``: a Put returns once they are in RAM and the demoter (:meth:`demote`,
  driven by the daemon) publishes them soon after, oldest first; ``write_through_selective``:
  a new block is held in RAM until its N-th hit, then written back (kvcached.policies.write).
- Admission (kvcached.policies.admission) decides whether an offered new block is stored at
  all; the SSD write budget whether a publish may write (refused blocks stay in RAM only).
- A Get of a block only on SSD reads it into a fresh arena slot, verifies it, and serves it
  (promotion); a damaged file is quarantined and the block is a miss, never served.
- :meth:`evict_ssd` drops SSD blocks past ``ssd_ttl`` (from the index's SSD queue) or over
  capacity: least recently used first from that queue, or in the order of an in-memory
  eviction policy (``ssd_order``, [kv] ssd_policy).
- A write that meets a full disk gets one forced eviction (:meth:`_make_room`, in the same
  order) and one more try; the eviction frees what the writes need and at most
  ``FULL_DISK_EVICT_FACTOR`` times that. A block the SSD tier can never hold, or could not hold
  even emptied, is refused before anything is evicted (kvcached.tiers.ssd.SsdSpace).

Agents (kvcached.api.agent_server) write blocks straight into arena slots: :meth:`reserve`
hands out slots, :meth:`commit_written` makes the written blocks visible at once and records
them once a background thread has checksummed them (a Get, a pin, a Delete or a write-back of
such a block waits for its record; under write_through the commit itself waits, then publishes).
:attr:`gpu` is the view of what each agent holds on its GPU.

Lookup follows SGLang's batch_exists: count from the first digest and stop at the first miss,
per tier and across all tiers (a block in RAM and on SSD counts for both).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Protocol, Sequence

from kvcached.gpu_view import GpuView
from kvcached.errors import (DataLoss, FailedPrecondition, InvalidArgument, KvError, NotFound, ResourceExhausted,
                             Unavailable)
from kvcached.index import BlockIndex, BlockRecord, GoneReason, IndexUnwritable, Tier, queue_entry, queue_time, raw_ssd_view
from kvcached.policies import EvictionPolicy
from kvcached.policies.admission import AdmissionPolicy, AlwaysAdmit, SsdWriteBudget
from kvcached.policies.prefetch import PrefetchPolicy, WaitComplete
from kvcached.policies.write import WritePolicy, make_write_policy
from kvcached.reads import ReadStats, outcome
from kvcached.ssd_reconcile import ReconcileReport
from kvcached.tiers.ram import WRITING, BlockBusy, RamBlock, RamFull, RamTier
from kvcached.tiers.ssd import IO_ERROR, SsdFull, SsdTier, SsdTooLarge, SsdWrite, SsdWriteError
from kvcached.tiers.ssd_format import BlockHeader, file_bytes
from kvcached_agent.address import DIGEST_BYTES, BlockAddress, index_key
from kvcached_agent.integrity import payload_checksums

__all__ = ["Store", "PutItem", "Fetched", "Pinned", "Miss", "LookupResult"]

log = logging.getLogger("kvcached.store")

MAX_MODEL_BYTES = 256        # a model label is a name, not a payload
DEMOTE_BATCH_BYTES = 64 << 20   # one write-back round publishes at most this much ...
DEMOTE_BATCH_BLOCKS = 256       # ... or this many blocks
EVICT_BATCH = 256               # SSD queue entries looked at per step
FULL_DISK_EVICT_FACTOR = 2      # a forced eviction drops at most this many times what its writes need
DIRTY_WAIT_S = 10.0             # longest a write-back Put waits for the demoter (see _throttle_dirty)

BUDGET_PREFIX = b"budget/"       # policy-family keys of the SSD write budget's ledger (+ be64 minute)

# Engines look up the same prompt prefixes over and over (that is why they cache): the index keys
# of recent lookups are kept per layer, a dict hit instead of ~0.9 us of BLAKE3; a layer's cache is
# started afresh once it holds this many (about 6 MB), and at most a few layers are kept.
LOOKUP_KEYS = 1 << 15
LOOKUP_LAYERS = 4


class PeerTierLike(Protocol):
    """What the store asks of the peer tier (kvcached.peers.tier.PeerTier)."""

    def usable_mask(self) -> int: ...
    def holds(self, address: BlockAddress, usable: int) -> bool: ...
    def held(self, digests: Sequence[bytes], layer: int) -> list[bool]: ...
    async def fetch(self, addresses: Sequence[BlockAddress], reserve: Callable[[BlockAddress, int], Any],
                    abort: Callable[[Any], None]) -> list[tuple[BlockAddress, Any, Any]]: ...


@dataclass(frozen=True, slots=True)
class PutItem:
    address: BlockAddress
    payload: bytes | memoryview
    model: str = ""
    checksum: bytes = b""      # empty: the daemon computes it; else it must match


@dataclass(frozen=True, slots=True)
class Fetched:
    address: BlockAddress
    payload: bytes
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Pinned:
    """A block held for a reader: its bytes stay put until :meth:`Store.unpin`."""

    address: BlockAddress
    block: RamBlock
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Miss:
    address: BlockAddress
    reason: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest-prefix hit counts: per tier, and ``longest`` where each block is in some tier."""

    longest: int
    ram: int
    ssd: int = 0
    gpu: int = 0
    peer: int = 0


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    lookups: int = 0
    deletes: int = 0
    promotions: int = 0
    demotions: int = 0
    ssd_evictions_ttl: int = 0
    ssd_evictions_capacity: int = 0
    ssd_evictions_admin: int = 0
    ssd_full_disk_evictions: int = 0   # SSD blocks a forced eviction dropped (also in ssd_evictions_capacity / _ttl)
    ssd_corrupt: int = 0
    declined: int = 0              # new blocks the admission policy did not take
    ssd_budget_declined: int = 0   # publishes the SSD write budget refused (kept in RAM only)
    held_written: int = 0          # write_through_selective: held blocks that earned their SSD write


@dataclass(slots=True)
class _Reached:
    """How far one read had to go: blocks promoted from SSD and pulled from peers for it, and
    whether the peer tier was in play."""

    peers: bool
    promoted: int = 0
    pulled: int = 0


@dataclass(slots=True)
class PutResult:
    stored: int = 0
    present: int = 0
    declined: int = 0      # not stored: the admission policy (or the SSD write budget) declined them


class Store:
    def __init__(self, ram: RamTier, index: BlockIndex, *, ssd: SsdTier | None = None,
                 write_policy: WritePolicy | str = "write_back", ssd_ttl: float = 7 * 86400.0, gone_ttl: float = 3600.0,
                 max_gpu_blocks: int = 1_000_000, clock: Callable[[], float] = time.time,
                 admission: AdmissionPolicy | None = None, ssd_budget: SsdWriteBudget | None = None,
                 ssd_order: EvictionPolicy | None = None) -> None:
        self.ram = ram
        self.index = index
        self.ssd = ssd
        self.writes = make_write_policy(write_policy) if isinstance(write_policy, str) else write_policy
        self.admission = admission or AlwaysAdmit()
        self.ssd_budget = ssd_budget or SsdWriteBudget(0)
        # The SSD tier's eviction order ([kv] ssd_policy): None is "lru", the index's own queue
        # (no memory per block); a policy here orders the SSD blocks in memory.
        self.ssd_order = ssd_order
        # False while a rebuilt order is awaited (boot): until then the index queue decides
        self.ssd_order_ready = True
        self.ssd_ttl = ssd_ttl
        self.gone_ttl = gone_ttl
        self.clock = clock
        self.counters = Counters()
        self.reads = ReadStats()
        self.ssd_reconciled = ssd is None    # capacity eviction waits for the boot reconcile's count
        self.demote_wanted = asyncio.Event()  # set when dirty blocks wait (the daemon's demoter waits on it)
        self.evict_wanted = asyncio.Event()   # set when the SSD tier is over capacity
        self._promoting: dict[bytes, asyncio.Future[RamBlock | None]] = {}
        self._demoting: dict[bytes, asyncio.Future[None]] = {}   # being published: done when it is
        self._background: set[asyncio.Task[object]] = set()      # promotions and publishes no caller may cancel
        self._hashing: dict[bytes, asyncio.Future[None]] = {}    # committed by an agent, record not written yet
        self._hashing_bytes = 0
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-hash")
        self.gpu = GpuView(max_gpu_blocks)
        self._lookup_keys: dict[int, dict[bytes, bytes]] = {}
        # Lookup's memory of SSD copies of blocks in RAM (see _ssd_prefix_in_ram): key -> the
        # value of _ssd_losses when the index said the block is on SSD. Every SSD copy lost or
        # record deleted (_without_ssd, _delete_records) adds one, voiding every entry at once.
        self._ssd_seen: dict[bytes, int] = {}
        self._ssd_losses = 0
        self.dirty_limit = ram.capacity // 2
        self._round_done = asyncio.Event()    # set (and replaced) after every publishing round
        self._ssd_failing = False             # the last round published nothing: do not throttle on it
        ram.prefer_clean = ssd is not None
        self._touched: set[bytes] = set()
        # State of the one request in progress. Store methods never await, so requests on the
        # event loop cannot interleave; a method that comes to await must carry this state in
        # a per-request object instead.
        self._pending: dict[bytes, BlockRecord] = {}   # records of the request in progress
        self._evicted: set[bytes] = set()              # evicted during it, index not yet told
        # Readers (streams, later agents) may pin at most this much, so a stalled reader can
        # never hold the whole tier: puts keep finding room in the other half.
        self.max_pinned_bytes = ram.capacity // 2
        self.pinned_bytes = 0
        ram.on_evict = self._on_ram_evict
        # The peer tier (kvcached.peers.tier.PeerTier), set by the daemon when [quic] is on.
        self.peers: PeerTierLike | None = None
        self.mirror_pulls = True
        self.prefetch: PrefetchPolicy = WaitComplete()     # [kv] prefetch_policy, set by the daemon
        self._transient: dict[bytes, bytes] = {}   # pulled, not mirrored: key -> checksum, dropped once read

    @property
    def write_policy(self) -> str:
        """The write policy's config name ([kv] write_policy)."""
        return self.writes.name

    @write_policy.setter
    def write_policy(self, name: str) -> None:
        self.writes = make_write_policy(name)

    # -- put ----------------------------------------------------------------------------------

    async def put(self, items: Sequence[PutItem]) -> PutResult:
        """Store a batch. Every item is checked before any is stored, so a bad item stores
        nothing. Blocks already present (in RAM or on SSD) count as ``present``; new blocks the
        admission policy does not take yet count as ``declined``. If the RAM tier fills with
        blocks in use, the blocks stored so far stay and ResourceExhausted says how many. Under
        write_through the new blocks are on SSD before this returns; a block that cannot be
        published is dropped again and the error says so, one the SSD write budget refuses is
        dropped and counted as declined."""
        through = self.ssd is not None and self.writes.synchronous
        result, new, full = self._put_ram(items, hold=through)
        own = {b.key for b, _ in new}
        if through:
            # Blocks of this batch already in RAM but not on SSD yet (another Put of the same
            # block is publishing it, or it was put under write-back) are made durable too.
            new += await self._dirty_present(items, {b.key for b, _ in new})
        if through and new:
            failed, refused = await self._write_through(new, own)
            result.stored -= len(refused)
            result.declined += len(refused)
            if failed:
                result.stored -= len(failed)
                raise self._publish_error(failed, result, len(items))
        elif new and self.ssd is not None:
            self.demote_wanted.set()
            await self._throttle_dirty()
        if full is not None:
            raise ResourceExhausted(f"stored {result.stored} of {len(items)} blocks: {full}")
        return result

    async def _write_through(self, new: list[tuple[RamBlock, BlockRecord]], own: set[bytes]) -> tuple[
            list[tuple[RamBlock, BlockRecord, SsdWriteError]], list[RamBlock]]:
        """Publish pinned blocks on SSD and unpin them; those that fail, and those of ``own``
        (this request's new blocks) that the SSD write budget refuses, are not kept (a
        write-through store acknowledges only what is on SSD). A refused block stored earlier
        stays in RAM only, as write-back keeps it. Returns (failed, refused)."""
        failed: list[tuple[RamBlock, BlockRecord, SsdWriteError]] = []
        refused: list[tuple[RamBlock, BlockRecord]] = []
        try:
            allowed, refused = self._within_budget(new)
            if allowed:
                failed = await asyncio.shield(self._publish(allowed))
        finally:
            for block, _ in new:
                self.ram.unpin(block)
        for block, _ in refused:
            if block.key not in own and self.ram.holds(block):
                self.ram.mark_clean(block)
        refused = [(b, r) for b, r in refused if b.key in own]
        gone = [b for b, _, _ in failed] + [b for b, _ in refused]
        for block in gone:
            if self.ram.busy_reason(block.key) is None:
                self.ram.delete(block.key)
        if gone:
            self._delete_records([b.key for b in gone])
        return failed, [b for b, _ in refused]

    def _within_budget(self, blocks: list[tuple[RamBlock, BlockRecord]]) -> tuple[
            list[tuple[RamBlock, BlockRecord]], list[tuple[RamBlock, BlockRecord]]]:
        """Split blocks about to be published into those the SSD write budget takes (counted
        now, and the ledger's minute persisted before any byte is written) and those it
        refuses."""
        budget = self.ssd_budget
        if budget.unlimited or not blocks:
            return blocks, []
        now = self.clock()
        allowed: list[tuple[RamBlock, BlockRecord]] = []
        refused: list[tuple[RamBlock, BlockRecord]] = []
        for block, record in blocks:
            (allowed if budget.take(file_bytes(block.length), now) else refused).append((block, record))
        if allowed:
            minute, nbytes = budget.current_minute()
            self.index.write(policy=[(BUDGET_PREFIX + minute.to_bytes(8, "big"), nbytes.to_bytes(8, "little"))])
        self.counters.ssd_budget_declined += len(refused)
        return allowed, refused

    def load_budget(self) -> None:
        """Take up the SSD write budget's ledger from the index (at boot) and drop the minutes
        that are more than a day old."""
        now = self.clock()
        items = self.index.policy_items(BUDGET_PREFIX)
        entries = [(int.from_bytes(k[len(BUDGET_PREFIX):], "big"), int.from_bytes(v, "little")) for k, v in items]
        self.ssd_budget.load(entries, now)
        kept = {m for m, _ in self.ssd_budget.minutes()}
        stale = [(k, None) for k, (m, _) in zip((k for k, _ in items), entries) if m not in kept]
        if stale:
            self.index.write(policy=stale)

    async def _dirty_present(self, items: Sequence[PutItem], mine: set[bytes]) -> list[tuple[RamBlock, BlockRecord]]:
        """Write-through: blocks of ``items`` that were already in RAM but are not on SSD."""
        return await self._dirty_keys(list({i.address.key for i in items} - mine))

    async def _dirty_keys(self, keys: list[bytes]) -> list[tuple[RamBlock, BlockRecord]]:
        """The blocks of ``keys`` in RAM that are still dirty once any publish of them in
        progress is over; returned pinned, with their records."""
        while waits := {id(f): f for k in keys if (f := self._demoting.get(k)) is not None}:
            await asyncio.wait(waits.values())
        dirty = [b for k in keys if (b := self.ram.get(k)) is not None and not b.clean]
        out = []
        for block, record in zip(dirty, self.index.get_many([b.key for b in dirty])):
            if record is not None and record.present:
                self.ram.pin(block)
                out.append((block, record))
        return out

    async def _throttle_dirty(self) -> None:
        """Write-back backpressure: while more than half the RAM tier is dirty (not yet on SSD),
        a Put waits for the demoter, so a writer faster than the disk slows to the disk's pace
        instead of pushing unwritten blocks out of RAM. A failing SSD, or a wait past
        ``DIRTY_WAIT_S``, lets the Put go: dirty blocks may then be dropped, and are counted."""
        deadline = self.clock() + DIRTY_WAIT_S
        while self.ram.dirty_bytes > self.dirty_limit and not self._ssd_failing and self.clock() < deadline:
            self.demote_wanted.set()
            try:
                await asyncio.wait_for(self._round_done.wait(), DIRTY_WAIT_S)
            except TimeoutError:
                return

    def _put_ram(self, items: Sequence[PutItem], hold: bool) -> tuple[PutResult, list[tuple[RamBlock, BlockRecord]],
                                                                      RamFull | None]:
        """The RAM part of a Put: returns what it stored, the new blocks (pinned if ``hold``,
        so none can be evicted before it is published), and the RamFull that stopped it early."""
        for i, item in enumerate(items):
            self._check_put(i, item)
        # Engines save the same prefixes again and again: blocks already here are neither
        # hashed nor copied.
        todo: list[tuple[int, PutItem]] = []
        for i, item in enumerate(items):
            if item.address.key in self.ram:
                self._touched.add(item.address.key)    # a re-put is a use
            else:
                todo.append((i, item))
        if self.ssd is not None and todo:
            on_ssd = self.index.tiers_of([item.address.key for _, item in todo])
            for (_, item), tiers in zip(todo, on_ssd):
                if tiers & Tier.SSD:
                    self._touched.add(item.address.key)
            todo = [t for t, tiers in zip(todo, on_ssd) if not tiers & Tier.SSD]
        for i, item in todo:
            if self.ram.busy_reason(item.address.key) == "being written":
                raise FailedPrecondition(f"block {i} ({item.address}) is being written by an agent right now "
                                         "(reserved, not committed yet); nothing was stored: retry shortly")
        if hold and todo:
            self._check_ssd_room(todo)
        checksums = payload_checksums([item.payload for _, item in todo])
        for (i, item), checksum in zip(todo, checksums):
            if item.checksum and item.checksum != checksum:
                raise DataLoss(f"block {i} ({item.address}): payload does not match its BLAKE3 checksum "
                               "(damaged on the way?); nothing was stored")
        offered = len(todo)       # only a batch that passed every check is offered to admission
        keep = self._admitted(todo)
        if not all(keep):
            todo = [t for t, k in zip(todo, keep) if k]
            checksums = [c for c, k in zip(checksums, keep) if k]
        now = self.clock()
        result = PutResult(present=len(items) - offered, declined=offered - len(todo))
        new: list[tuple[RamBlock, BlockRecord]] = []
        full: RamFull | None = None
        # Records of this batch wait in _pending and go to the index in one write at the end,
        # with the tombstones of whatever the batch evicted (see _on_ram_evict).
        pending = self._pending
        try:
            for (_, item), checksum in zip(todo, checksums):
                key = item.address.key
                if key in self.ram:      # the same block twice in this batch
                    result.present += 1
                    continue
                try:
                    block = self.ram.reserve(key, len(item.payload))
                except RamFull as exc:
                    full = exc
                    break
                except ValueError:   # pragma: no cover - checked above, same thread
                    raise FailedPrecondition(f"block {item.address} is being written by another writer") from None
                self.ram.write(block, item.payload)
                self._commit_new(block)
                if hold:
                    self.ram.pin(block)
                record = BlockRecord(item.address.digest, item.address.layer, item.model, len(item.payload),
                                     checksum, now, now, Tier.RAM)
                pending[key] = record
                new.append((block, record))
                self._evicted.discard(key)
                result.stored += 1
                self.counters.puts += 1
                self.counters.put_bytes += len(item.payload)
        except BaseException:
            for block, _ in new if hold else ():
                self.ram.unpin(block)
            raise
        finally:
            try:
                self._write_index()
            except Unavailable:
                for block, _ in new if hold else ():
                    if block.refs > 0:
                        self.ram.unpin(block)
                    if self.ram.busy_reason(block.key) is None:
                        self.ram.delete(block.key)
                raise
        # a block of this batch may have been evicted by a later one of the same batch (not if held)
        return result, [(b, r) for b, r in new if self.ram.get(b.key) is b], full

    def _check_ssd_room(self, todo: list[tuple[int, PutItem]]) -> None:
        """Write-through: a new block the SSD tier cannot take, however much it evicts
        (kvcached.tiers.ssd.SsdSpace.refusal), fails the Put with ResourceExhausted before
        anything is stored or evicted."""
        assert self.ssd is not None
        for (i, item), refusal in zip(todo, self.ssd.refusals([len(item.payload) for _, item in todo])):
            if refusal is not None:
                raise ResourceExhausted(f"block {i} ({item.address}): {refusal.strerror}; nothing was stored "
                                        "(kv.write_policy = write_through keeps only blocks published on SSD)")

    def _admitted(self, todo: list[tuple[int, PutItem]]) -> list[bool]:
        """Per new block of a Put, whether the admission policy takes it; one offer per block
        per batch."""
        if isinstance(self.admission, AlwaysAdmit):
            return [True] * len(todo)
        verdict: dict[bytes, bool] = {}
        for _, item in todo:
            key = item.address.key
            if key not in verdict:
                verdict[key] = self.admission.admit(key)
        keep = [verdict[item.address.key] for _, item in todo]
        self.counters.declined += keep.count(False)
        return keep

    def _commit_new(self, block: RamBlock) -> None:
        """Commit a block new to this daemon. Under write_through_selective it is held in RAM
        (clean: nothing wants it on SSD yet) until its hits earn it a write, see :meth:`_hit`."""
        held = self.ssd is not None and self.writes.hits_before_ssd > 0
        self.ram.commit(block, clean=held)
        if held:
            block.hits_to_ssd = self.writes.hits_before_ssd

    def _hit(self, block: RamBlock) -> None:
        """A read used ``block``: its last-seen time is due, and a block held back by
        write_through_selective is one hit closer to its SSD write."""
        self._touched.add(block.key)
        if block.hits_to_ssd > 0:
            block.hits_to_ssd -= 1
            if block.hits_to_ssd == 0:
                self.ram.mark_dirty(block)
                self.counters.held_written += 1
                self.demote_wanted.set()

    def _publish_error(self, failed: list[tuple[RamBlock, BlockRecord, SsdWriteError]], result: PutResult,
                       n: int) -> KvError:
        first = failed[0][2]
        text = (f"stored {result.stored} of {n} blocks; {len(failed)} could not be written to the SSD tier "
                f"(kv.write_policy = write_through) and were not kept: {first.strerror or first}")
        if isinstance(first, (SsdFull, SsdTooLarge)):      # no room: the messages name the directory and sizes
            return ResourceExhausted(text)
        return Unavailable(text)

    def _check_put(self, i: int, item: PutItem) -> None:
        n = len(item.payload)
        if n == 0:
            raise InvalidArgument(f"block {i} ({item.address}): empty payload")
        if len(item.model.encode()) > MAX_MODEL_BYTES:
            raise InvalidArgument(f"block {i} ({item.address}): model label is over {MAX_MODEL_BYTES} bytes")
        if n > self.ram.max_block_bytes:
            raise InvalidArgument(f"block {i} ({item.address}): payload of {n} bytes is over the "
                                  f"limit of {self.ram.max_block_bytes} bytes (kv.max_block_mib)")
        if item.checksum and len(item.checksum) != DIGEST_BYTES:
            raise InvalidArgument(f"block {i} ({item.address}): checksum must be {DIGEST_BYTES} bytes "
                                  f"(BLAKE3-256), got {len(item.checksum)}")

    # -- get ----------------------------------------------------------------------------------

    async def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False) -> tuple[list[Fetched], list[Miss]]:
        """Fetch a batch (blocks only on SSD are promoted to RAM first). Without
        ``allow_partial`` any miss raises NotFound naming it."""
        started = time.perf_counter()
        await self._recorded(addresses)
        held, reached = await self._make_resident(addresses)
        try:
            return self._get_resident(addresses, allow_partial, reached, started)
        finally:
            for block in held:
                self._unpin_block(block)

    def _get_resident(self, addresses: Sequence[BlockAddress], allow_partial: bool, reached: "_Reached",
                      started: float) -> tuple[list[Fetched], list[Miss]]:
        found: list[Fetched] = []
        misses: list[Miss] = []
        blocks: list[tuple[BlockAddress, RamBlock]] = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is None:
                misses.append(Miss(address, self.miss_reason(address)))
            else:
                blocks.append((address, block))
        checksums = self._checksums([b.key for _, b in blocks])
        for (address, block), checksum in zip(blocks, checksums):
            if checksum is None:
                misses.append(Miss(address, self._drop_unindexed(block)))
                continue
            found.append(Fetched(address, self.ram.read(block), checksum))
            self._hit(block)
        self.counters.hits += len(found)
        self.counters.misses += len(misses)
        self.counters.hit_bytes += sum(len(f.payload) for f in found)
        self._count_read(len(addresses), len(found), reached, started)
        if misses and not allow_partial:
            first = misses[0]
            more = f" (and {len(misses) - 1} more of {len(addresses)})" if len(misses) > 1 else ""
            raise NotFound(f"block {first.address}: {first.reason}{more}")
        return found, misses

    async def pin(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  peers: bool = True) -> list["Pinned | Miss"]:
        """Pin a batch for a reader that copies out of the arena itself (streams, agents), in
        request order: while pinned a block can be neither evicted nor deleted, so the batch is
        a snapshot however long the copy takes. Blocks only on SSD are promoted first. Without
        ``allow_partial`` a miss pins nothing and raises NotFound. Release every Pinned with
        :meth:`unpin`. ``peers=False`` leaves the peer tier out (serving a peer's pull)."""
        started = time.perf_counter()
        await self._recorded(addresses)
        held, reached = await self._make_resident(addresses, peers)
        try:
            return self._pin_resident(addresses, allow_partial, reached, started)
        finally:
            for block in held:
                self._unpin_block(block)

    def _pin_resident(self, addresses: Sequence[BlockAddress], allow_partial: bool, reached: "_Reached",
                      started: float) -> list["Pinned | Miss"]:
        resident = [(address, self.ram.get(address.key)) for address in addresses]
        checksums = self._checksums([b.key for _, b in resident if b is not None])
        found = iter(checksums)
        entries: list[tuple[BlockAddress, RamBlock | None, bytes | None]] = [
            (address, block, next(found) if block is not None else None) for address, block in resident]
        missing = [a for a, b, c in entries if b is None or c is None]
        if missing and not allow_partial:
            self.counters.misses += len(missing)
            self._count_read(len(addresses), len(addresses) - len(missing), reached, started)
            more = f" (and {len(missing) - 1} more of {len(addresses)})" if len(missing) > 1 else ""
            raise NotFound(f"block {missing[0]}: {self.miss_reason(missing[0])}{more}")
        wanted = sum(b.length for _, b, c in entries if b is not None and c is not None)
        if self.pinned_bytes + wanted > self.max_pinned_bytes:
            raise ResourceExhausted(
                f"readers would pin {self.pinned_bytes + wanted} bytes, over half the RAM tier "
                f"({self.max_pinned_bytes} bytes; {self.pinned_bytes} pinned now): fetch fewer blocks per stream")
        out: list[Pinned | Miss] = []
        for address, block, checksum in entries:
            if block is None or checksum is None:
                reason = self.miss_reason(address) if block is None else self._drop_unindexed(block)
                out.append(Miss(address, reason))
                self.counters.misses += 1
                continue
            self.ram.pin(block)
            self.pinned_bytes += block.length
            self._hit(block)
            self.counters.hits += 1
            self.counters.hit_bytes += block.length
            out.append(Pinned(address, block, checksum))
        self._count_read(len(addresses), len(addresses) - len(missing), reached, started)
        return out

    def _count_read(self, asked: int, found: int, reached: "_Reached", started: float) -> None:
        tier = self.reads.blocks(asked, found, reached.promoted, reached.pulled, ssd=self.ssd is not None,
                                 peers=reached.peers)
        self.reads.took(tier, outcome(asked, found), started)

    def read(self, pinned: "Pinned", start: int, length: int) -> bytes:
        """A copy of up to ``length`` bytes of a pinned block from ``start``."""
        return self.ram.read_range(pinned.block, start, length)

    def unpin(self, pinned: "Pinned") -> None:
        self._unpin_block(pinned.block)
        self.pinned_bytes -= pinned.block.length

    def _unpin_block(self, block: RamBlock) -> None:
        self.ram.unpin(block)
        if self._transient and block.refs == 0 and self._transient.pop(block.key, None) is not None:
            if self.ram.get(block.key) is block:      # read once, not mirrored: gone again
                self.ram.delete(block.key)

    def _checksums(self, keys: list[bytes]) -> list[bytes | None]:
        """Checksums of resident blocks: from the index, or for pulled blocks that are not
        mirrored (never indexed), from the pull."""
        checksums = self.index.checksums(keys)
        if self._transient:
            checksums = [c if c is not None else self._transient.get(k) for k, c in zip(keys, checksums)]
        return checksums

    # -- agents: blocks written straight into arena slots ---------------------------------------

    def reserve(self, entries: Sequence[tuple[BlockAddress, int]]) -> list[RamBlock | str]:
        """Slots for blocks an agent is about to write, entry by entry: a RamBlock (WRITING, its
        bytes counted as held) or why not: ``present`` (RAM or SSD has it: nothing to write),
        ``busy`` (another writer has it reserved), ``full`` (no room, or agents and readers
        already hold half the RAM tier), ``invalid`` (a size outside 1..max_block_bytes),
        ``declined`` (the admission policy does not take it yet: nothing to write)."""
        keys = [a.key for a, _ in entries]
        on_ssd = self.index.tiers_of(keys) if self.ssd is not None else [Tier.NONE] * len(keys)
        out: list[RamBlock | str] = []
        mine: set[bytes] = set()
        try:
            for (address, length), tiers in zip(entries, on_ssd):
                key = address.key
                if not 0 < length <= self.ram.max_block_bytes:
                    out.append("invalid")
                elif key in mine:
                    out.append("present")        # the same block twice in one batch: written once
                elif key in self.ram or tiers & Tier.SSD:
                    self._touched.add(key)       # a re-save is a use
                    out.append("present")
                elif self.pinned_bytes + length > self.max_pinned_bytes:
                    out.append("full")
                elif not self.admission.admit(key):
                    self.counters.declined += 1
                    out.append("declined")
                else:
                    try:
                        block = self.ram.reserve(key, length)
                    except ValueError:           # reserved by another writer right now
                        out.append("busy")
                        continue
                    except RamFull:
                        out.append("full")
                        continue
                    self._evicted.discard(key)
                    self.pinned_bytes += length
                    mine.add(key)
                    out.append(block)
        finally:
            try:
                self._write_index()      # tombstones of what the reservations evicted
            except BaseException:
                for block in out:
                    if isinstance(block, RamBlock):
                        self.abort_reserved(block)
                raise
        return out

    async def throttle_writes(self) -> None:
        """Back-pressure for agents' writes: an Allocate waits while committed blocks still
        waiting for their checksum hold a quarter of the RAM tier (they cannot be evicted yet),
        and under write_back while the tier is too dirty (see _throttle_dirty), as a Put does.
        A writer faster than the checksums or the disk slows to their pace instead of being
        refused for lack of room."""
        while self._hashing_bytes > self.ram.capacity // 4 and self._hashing:
            await asyncio.wait({id(f): f for f in self._hashing.values()}.values(), return_when=asyncio.FIRST_COMPLETED)
        if self.ssd is not None and not self.writes.synchronous:
            await self._throttle_dirty()

    def abort_reserved(self, block: RamBlock) -> None:
        """Give back a reserved slot that was not committed (the agent gave up or went away)."""
        if block.refs == WRITING and self.ram.holds(block):
            self.ram.abort(block)
        self.pinned_bytes -= block.length

    async def commit_written(self, written: Sequence[tuple[BlockAddress, RamBlock]], model: str) -> list[str | None]:
        """The agent wrote these reserved blocks: each becomes visible (and evictable) now, and
        is recorded in the index once a background thread has checksummed it. Under
        write_through this waits for the records and the SSD publish; a block that cannot be
        published is dropped (``failed``). Per entry: None, ``failed`` or ``unknown`` (not a
        reserved block any more); under write_through also ``declined`` (the SSD write budget
        refused it; not kept)."""
        out: list[str | None] = []
        batch: list[tuple[BlockAddress, RamBlock]] = []
        through = self.ssd is not None and self.writes.synchronous
        for address, block in written:
            if block.refs != WRITING or not self.ram.holds(block):
                out.append("unknown")
                continue
            self.pinned_bytes -= block.length
            self._commit_new(block)
            self.ram.pin(block)          # held until recorded: never evicted unrecorded
            if through:
                self.ram.pin(block)      # and, under write_through, until published
            batch.append((address, block))
            out.append(None)
        if not batch:
            return out
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for _, block in batch:
            self._hashing[block.key] = done
            self._hashing_bytes += block.length
        task = asyncio.ensure_future(self._record_written(batch, model, done))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if self.ssd is None:
            return out
        if not through:
            self.demote_wanted.set()
            return out
        refused: list[RamBlock] = []
        try:
            await asyncio.shield(task)
            new = await self._dirty_keys([b.key for _, b in batch])
            if new:
                _, refused = await self._write_through(new, {b.key for _, b in batch})
        finally:
            durable = [self.ram.get(b.key) is b and b.clean for _, b in batch]
            for (_, block), ok in zip(batch, durable):
                if self.ram.holds(block):
                    self.ram.unpin(block)
                    if not ok and block.refs == 0:      # not on SSD: not kept (write_through)
                        self.ram.delete(block.key)
                        self._delete_records([block.key])
        declined = {b.key for b in refused}
        it = iter(zip(batch, durable))

        def status(entry: tuple[tuple[BlockAddress, RamBlock], bool]) -> str | None:
            (_, block), ok = entry
            return None if ok else "declined" if block.key in declined else "failed"
        return [r if r is not None else status(next(it)) for r in out]

    async def _record_written(self, batch: list[tuple[BlockAddress, RamBlock]], model: str,
                              done: asyncio.Future[None]) -> None:
        """Checksum agent-written blocks off the event loop, then record them in one index write.
        Blocks that could not be checksummed are dropped (never served unrecorded)."""
        views = [self.ram.view(b) for _, b in batch]
        checksums: list[bytes] | None = None
        try:
            checksums = await asyncio.get_running_loop().run_in_executor(self._hasher, payload_checksums, views)
        except Exception:
            log.exception("checksumming agent blocks failed; they are dropped")
        finally:
            for view in views:
                _release(view)
            self._finish_written(batch, model, checksums, done)

    def _finish_written(self, batch: list[tuple[BlockAddress, RamBlock]], model: str, checksums: list[bytes] | None,
                        done: asyncio.Future[None]) -> None:
        now = self.clock()
        for i, (address, block) in enumerate(batch):
            if self._hashing.get(block.key) is done:
                del self._hashing[block.key]
            self._hashing_bytes -= block.length
            if not self.ram.holds(block):
                continue
            self.ram.unpin(block)
            if checksums is not None:
                self._pending[block.key] = BlockRecord(address.digest, address.layer, model, block.length,
                                                       checksums[i], now, now, Tier.RAM)
                self.counters.puts += 1
                self.counters.put_bytes += block.length
            elif block.refs == 0:
                self.ram.delete(block.key)
        try:
            self._write_index()
        except Unavailable:
            pass             # logged; the blocks left RAM again
        done.set_result(None)

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for background promotions, publishes and checksums: on a
        clean stop they finish before the tiers close."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)

    async def _recorded(self, addresses: Sequence[BlockAddress]) -> None:
        """Wait until agent-written blocks among ``addresses`` have their index records."""
        if self._hashing:
            waits = {id(f): f for a in addresses if (f := self._hashing.get(a.key)) is not None}
            if waits:
                await asyncio.wait(waits.values())

    def offset_of(self, block: RamBlock) -> int:
        """Byte offset of the block's slot in the shared arena."""
        return self.ram.slabs.offset(block.slot)

    def _drop_unindexed(self, block: RamBlock) -> str:
        """A resident block without an index record (its write failed): never served, dropped."""
        if self.ram.busy_reason(block.key) is None:
            self.ram.delete(block.key)
        log.error("resident block without index record dropped", extra={"fields": {"key": block.key.hex()}})
        return "its index record is missing; the bytes were dropped"

    @property
    def max_block_bytes(self) -> int:
        return self.ram.max_block_bytes

    def stored_bytes(self, addresses: Sequence[BlockAddress]) -> int:
        """Payload bytes of those of ``addresses`` that a Get would serve, from RAM or SSD
        (sizing an answer before fetching it)."""
        total = 0
        absent = []
        for a in addresses:
            block = self.ram.get(a.key)
            if block is not None:
                total += block.length
            else:
                absent.append(a.key)
        if self.ssd is not None and absent:
            total += sum(r.nbytes for r in self.index.get_many(absent) if r is not None and r.tiers & Tier.SSD)
        return total

    def miss_reason(self, address: BlockAddress) -> str:
        """Why ``address`` is not here, in words."""
        record = self.index.get(address.key)
        if record is None:
            return "unknown block"
        if not record.present:
            return f"{record.gone_reason.text}; its metadata is kept until {self.gone_ttl:.0f} s after it went"
        return "not resident in any tier this daemon has"

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes], layer: int, agent: int | None = None) -> LookupResult:
        """Longest prefixes of a chain, each counted from the first digest: per tier what that
        tier holds (a block in RAM and on SSD counts for both), ``longest`` where each block is
        in some tier. ``agent`` (an agent session) asks for itself: ``gpu`` is what that agent
        holds, and it counts towards ``longest`` (the agent can use its own GPU blocks). Without
        it ``gpu`` is the longest prefix any one agent holds, and ``longest`` counts what a Get
        can return (RAM, SSD, peers)."""
        started = time.perf_counter()
        self.counters.lookups += 1
        if digests and set(map(len, digests)) != {DIGEST_BYTES}:
            i, digest = next((i, d) for i, d in enumerate(digests) if len(d) != DIGEST_BYTES)
            raise InvalidArgument(f"digests[{i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes (BLAKE3-256)")
        gpu = self.gpu.prefix(agent, digests) if agent is not None else self.gpu.longest(digests) if self.gpu else 0
        cache = self._lookup_keys.get(layer)
        if cache is None or len(cache) > LOOKUP_KEYS:
            if len(self._lookup_keys) >= LOOKUP_LAYERS:
                self._lookup_keys.clear()
            cache = self._lookup_keys[layer] = {}
        keys = [cache.get(d) or cache.setdefault(d, index_key(d, layer)) for d in digests]
        ram = self.ram.resident_prefix(keys)
        if ram == len(keys) or (self.ssd is None and agent is None and self.peers is None):
            ssd = self._ssd_prefix_in_ram(keys) if self.ssd is not None and ram else 0
            peer = _prefix(self.peers.held(digests, layer)) if self.peers is not None and ram else 0
            self.reads.took("gpu" if agent is not None and gpu >= len(keys) else "ram", outcome(len(keys), ram), started)
            return LookupResult(longest=ram, ram=ram, ssd=ssd, gpu=gpu, peer=peer)
        # Only the keys after the RAM prefix can extend ``longest``; SSD and peers are counted
        # from the start. ``longest`` counts a block a usable peer holds: a Get pulls it.
        on_ssd = [bool(t & Tier.SSD) for t in self.index.tiers_of(keys)] if self.ssd is not None else [False] * len(keys)
        ssd = _prefix(on_ssd)
        on_peer = self.peers.held(digests, layer) if self.peers is not None else [False] * len(keys)
        peer = _prefix(on_peer)
        on_gpu = self.gpu.held(agent, digests) if agent is not None else None
        longest = ram
        while longest < len(keys) and (on_ssd[longest] or keys[longest] in self.ram or on_peer[longest]
                                       or (on_gpu is not None and digests[longest] in on_gpu)):
            longest += 1
        tier = ("gpu" if agent is not None and gpu >= max(longest, 1) else "peer" if self.peers is not None
                else "ssd" if self.ssd is not None else "ram")
        self.reads.took(tier, outcome(len(keys), longest), started)
        return LookupResult(longest=longest, ram=ram, ssd=ssd, gpu=gpu, peer=peer)

    def _ssd_prefix_in_ram(self, keys: list[bytes]) -> int:
        """How many of ``keys``, all resident in RAM, from the first, also have an SSD copy
        (Lookup's hot path: a RAM hit must not pay an index read per block).

        The index says, once: that a block is on SSD stays in ``_ssd_seen`` until an SSD copy
        is lost or a record deleted anywhere (only :meth:`_without_ssd` and
        :meth:`_delete_records` take the SSD tier from a record), so a block remembered is on SSD
        whatever happens to its RAM copy. Of the others, a dirty block (not written back yet) or
        one write_through_selective holds back has no SSD copy; a clean one may or may not (its
        SSD copy evicted, or refused by the SSD write budget: kept in RAM only). Only clean
        blocks before the first dirty or held one, and not remembered, are read (one batched
        read)."""
        get = self.ram.get
        seen, losses = self._ssd_seen, self._ssd_losses
        end = len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            if seen.get(key) == losses:
                continue
            block = get(key)
            if block is None or not block.clean or block.hits_to_ssd:
                end = i
                break
            ask.append(i)
        if ask:
            if len(seen) > LOOKUP_KEYS:
                seen.clear()
            for i, tier in zip(ask, self.index.tiers_of([keys[i] for i in ask])):
                if tier not in _ON_SSD:
                    return i
                seen[keys[i]] = losses
        return end

    def _without_ssd(self, keys: list[bytes], reason: GoneReason, now: float) -> list[tuple[bytes, bytes]]:
        """Index puts that take the SSD tier out of ``keys``' records, to be written with no
        await in between (a Lookup in between would remember the old records). Every such
        change goes through here, so Lookup's memory of SSD copies (``_ssd_seen``) is voided."""
        self._ssd_losses += 1
        return self.index.without_tier(keys, Tier.SSD, reason, now)

    def _delete_records(self, keys: list[bytes]) -> None:
        """Delete the index records of ``keys``. Voids Lookup's memory of SSD copies: a key
        deleted may come back as a new block that is not on SSD."""
        self._ssd_losses += 1
        self.index.write(deletes=keys)

    # -- delete -------------------------------------------------------------------------------

    async def delete(self, addresses: Sequence[BlockAddress], *, skip_busy: bool = False) -> tuple[int, int]:
        """Remove blocks from every tier and the index; returns (deleted, not_found). Waits for
        the daemon's own SSD writes and reads of them to finish; a block that a client is
        reading or writing raises FailedPrecondition and nothing is deleted, or with
        ``skip_busy`` is left alone (counted in neither number)."""
        addresses = list(dict.fromkeys(addresses))   # the same block twice counts once
        keys = [a.key for a in addresses]
        while waits := {id(f): f for k in keys
                        if (f := self._demoting.get(k) or self._promoting.get(k) or self._hashing.get(k)) is not None}:
            await asyncio.wait(waits.values())
        busy_keys = {key: busy for key in keys if (busy := self.ram.busy_reason(key)) is not None}
        if busy_keys and not skip_busy:
            address = next(a for a in addresses if a.key in busy_keys)
            raise FailedPrecondition(f"block {address} is in use ({busy_keys[address.key]}); nothing was deleted")
        keys = [k for k in keys if k not in busy_keys]
        records = self.index.get_many(keys)
        deleted = 0
        for key, record in zip(keys, records):
            try:
                in_ram = self.ram.delete(key)
            except BlockBusy as exc:  # pragma: no cover - checked above, same thread
                raise FailedPrecondition(str(exc)) from None
            if in_ram or (record is not None and record.present):
                deleted += 1
        self._delete_records([k for k, r in zip(keys, records) if r is not None])
        if self.ssd is not None:    # the index first: a crash in between leaves an orphan file, never a dangling record
            for key, record in zip(keys, records):
                if record is not None and record.tiers & Tier.SSD:
                    self.ssd.remove_now(key, _header(record))
            self._forget_on_ssd(keys)
        self.counters.deletes += deleted
        return deleted, len(keys) - deleted

    # -- an operator's evictions (Admin Evict, Drain) ----------------------------------------

    def drop_from_ram(self, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Drop the RAM copies of these blocks; returns (dropped, busy, absent). With an SSD
        tier only copies already on SSD go (the index keeps the SSD copy); without one, any idle
        block goes and becomes a tombstone, as an eviction would. Blocks being read, written or
        written back, and dirty ones, count as busy."""
        victims: list[RamBlock] = []
        busy = absent = 0
        keys = list(dict.fromkeys(keys))
        on_ssd = ([r is not None and bool(r.tiers & Tier.SSD) for r in self.index.get_many(keys)]
                  if self.ssd is not None else [True] * len(keys))
        for key, kept in zip(keys, on_ssd):
            block = self.ram.get(key)
            if block is None:
                absent += 1
            elif block.refs != 0 or key in self._demoting or key in self._hashing or not kept:
                busy += 1
            else:
                victims.append(block)
        if victims:
            self.ram.drop(victims)
            self._write_index()
        return len(victims), busy, absent

    async def write_back_all(self) -> int:
        """Write every block only RAM holds to SSD (Drain): the dirty ones, and clean ones whose
        SSD copy was evicted. Returns how many were published; stops when a round publishes
        nothing (the SSD failing, or only busy blocks left)."""
        if self.ssd is None:
            return 0
        keys = [b.key for b in self.ram.blocks() if b.clean]
        for key, record in zip(keys, self.index.get_many(keys)):
            block = self.ram.get(key)
            if block is not None and record is not None and record.present and not record.tiers & Tier.SSD:
                self.ram.mark_dirty(block)
        before = self.counters.demotions
        while self.ram.dirty and await self.demote():
            pass
        return self.counters.demotions - before

    async def drop_from_ssd(self, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Remove the SSD copies of these blocks; returns (dropped, busy, absent). A copy in RAM
        stays (RAM only from now on); blocks being promoted or written back count as busy."""
        if self.ssd is None:
            return 0, 0, len(keys)
        keys = list(dict.fromkeys(keys))
        records = self.index.get_many(keys)
        victims: list[tuple[bytes, BlockHeader]] = []
        busy = absent = 0
        for key, record in zip(keys, records):
            if record is None or not record.tiers & Tier.SSD:
                absent += 1
            elif key in self._promoting or key in self._demoting:
                busy += 1
            else:
                victims.append((key, _header(record)))
        if victims:
            dropped = [k for k, _ in victims]
            self.index.write(self._without_ssd(dropped, GoneReason.EVICTED, self.clock()))
            self._forget_on_ssd(dropped)
            # The index first: a crash leaves an orphan file, never a dangling record. A copy in
            # RAM stays clean, as after evict_ssd, so write-back does not undo the eviction.
            await self.ssd.remove_many(victims)
            self.counters.ssd_evictions_admin += len(victims)
        return len(victims), busy, absent

    # -- listing and stats --------------------------------------------------------------------

    def list_blocks(self, *, model: str = "", tier: str = "", page_token: bytes = b"",
                    page_size: int = 100, max_scan: int = 10_000) -> tuple[list[BlockRecord], bytes]:
        """A page of index records in key order, filtered by model and tier
        (``ram``, ``ssd``, ``gone`` or empty for all). The token continues the listing;
        an empty token means the end."""
        if page_token and len(page_token) != DIGEST_BYTES:
            raise InvalidArgument("page_token is not one this daemon returned")
        want = {"": None, "ram": Tier.RAM, "ssd": Tier.SSD, "gone": Tier.NONE}
        if tier not in want:
            raise InvalidArgument(f"tier must be one of ram, ssd, gone or empty; got {tier!r}")
        page_size = max(1, min(page_size or 100, 1000))
        out: list[BlockRecord] = []
        last = b""
        scanned = 0
        for key, record in self.index.scan(page_token or None):
            last = key
            scanned += 1
            if (not model or record.model == model) and _tier_matches(record, want[tier]):
                out.append(record)
                if len(out) == page_size:
                    break
            if scanned >= max_scan:
                break
        else:
            return out, b""
        return out, last

    def stats(self) -> dict[str, int]:
        c = self.counters
        out = {
            "ram_blocks": len(self.ram),
            "ram_bytes": self.ram.used_bytes,
            "ram_reserved_bytes": self.ram.slabs.reserved_bytes,
            "ram_capacity_bytes": self.ram.capacity,
            "ram_evictions": self.ram.evictions,
            "ram_dropped": self.ram.dropped,
            "index_entries": self.index.count_estimate(),
            "puts": c.puts, "put_bytes": c.put_bytes, "hits": c.hits, "misses": c.misses,
            "hit_bytes": c.hit_bytes, "lookups": c.lookups, "deletes": c.deletes,
            "ram_dirty_bytes": self.ram.dirty_bytes, "ram_dirty_evictions": self.ram.dirty_evictions,
            "promotions": c.promotions, "demotions": c.demotions,
            "agents": len(self.gpu), "held_bytes": self.pinned_bytes,
            "gpu_blocks": sum(len(a.blocks) for a in self.gpu.agents()),
            "admission_declined": c.declined,
        }
        if self.ssd is not None:
            sc = self.ssd.counters
            out |= {
                "ssd_blocks": self.ssd.blocks, "ssd_bytes": self.ssd.payload_bytes, "ssd_file_bytes": self.ssd.used_bytes, "ssd_capacity_bytes": self.ssd.capacity,
                "ssd_evictions_ttl": c.ssd_evictions_ttl, "ssd_evictions_capacity": c.ssd_evictions_capacity,
                "ssd_evictions_admin": c.ssd_evictions_admin, "ssd_full_disk_evictions": c.ssd_full_disk_evictions,
                "ssd_corrupt": c.ssd_corrupt, "ssd_reads": sc.reads, "ssd_read_bytes": sc.read_bytes,
                "ssd_writes": sc.writes, "ssd_write_bytes": sc.write_bytes,
                "ssd_file_bytes_written": sc.file_bytes_written, "ssd_write_errors": sc.write_errors,
                "ssd_no_space": sc.no_space, "ssd_missing": sc.missing, "ssd_group_commits": sc.group_commits,
                "ssd_reconciled": int(self.ssd_reconciled),
                "ssd_budget_declined": c.ssd_budget_declined, "held_written": c.held_written,
            }
            if not self.ssd_budget.unlimited:
                out["ssd_budget_remaining_bytes"] = self.ssd_budget.remaining(self.clock())
        return out

    # -- SSD tier: promotion, publishing, eviction -------------------------------------------

    async def _make_resident(self, addresses: Sequence[BlockAddress],
                             peers: bool = True) -> tuple[list[RamBlock], "_Reached"]:
        """Promote the blocks of ``addresses`` that are only on SSD, then pull from peers those
        that no local tier holds. While it waits, the blocks already resident are pinned (so the
        batch's own promotions cannot evict them); returns every block it pinned, for the caller
        to unpin, and how many came from SSD and from peers (read accounting).

        How long it waits for those reads is the prefetch policy's call ([kv] prefetch_policy);
        the reads go on to the end either way. A peer's pull (``peers`` False) always waits:
        the peer has its own deadline."""
        reached = _Reached(peers=peers and self.peers is not None)
        absent = [a for a in addresses if a.key not in self.ram]
        if not absent:
            return [], reached
        tiers = self.index.tiers_of([a.key for a in absent]) if self.ssd is not None else [Tier.NONE] * len(absent)
        wanted = list({a.key: a for a, t in zip(absent, tiers) if t & Tier.SSD}.values())
        remote: list[BlockAddress] = []
        if peers and self.peers is not None:
            usable = self.peers.usable_mask()
            remote = list({a.key: a for a, t in zip(absent, tiers)
                           if not t & Tier.SSD and (a.key in self._promoting or self.peers.holds(a, usable))}.values())
        if not wanted and not remote:
            return [], reached
        wait_s = self.prefetch.wait_s() if peers else None
        deadline = asyncio.get_running_loop().time() + wait_s if wait_s is not None else None
        held = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is not None:
                self.ram.pin(block)
                held.append(block)
        try:
            if wanted:
                promoted = await self._promote(wanted, deadline)
                reached.promoted = len(promoted)
                held += promoted
            if remote:
                pulled = await self._pull(remote, deadline)
                reached.pulled = len(pulled)
                held += pulled
        except BaseException:
            for block in held:
                self._unpin_block(block)
            raise
        return held, reached

    async def _promote(self, addresses: list[BlockAddress], deadline: float | None = None) -> list[RamBlock]:
        """Read SSD blocks into RAM, verified; returns them pinned. A block another request is
        promoting is waited for, not read twice. A block that cannot get a slot stays a miss.

        The reads run in a task of their own that no caller can cancel: a client that gives up
        (or its deadline) must not leave a slot reserved or a future that others wait on
        unresolved."""
        assert self.ssd is not None
        loop = asyncio.get_running_loop()
        records = self.index.get_many([a.key for a in addresses])
        mine: list[tuple[BlockRecord, RamBlock, asyncio.Future[RamBlock | None]]] = []
        waits: list[asyncio.Future[RamBlock | None]] = []
        try:
            for address, record in zip(addresses, records):
                key = address.key
                if record is None or not record.tiers & Tier.SSD or key in self.ram:
                    continue
                if key in self._promoting:
                    waits.append(self._promoting[key])
                    continue
                try:
                    block = self.ram.reserve(key, record.nbytes)
                except (RamFull, ValueError):   # no room now, or an agent is writing it: a miss
                    continue
                future: asyncio.Future[RamBlock | None] = loop.create_future()
                self._promoting[key] = future
                mine.append((record, block, future))
                waits.append(future)
        finally:
            if mine:
                self._in_background(self._read_and_commit(mine))
            self._write_index()      # tombstones of what the reservations evicted
        return await self._pin_when_resident(waits, deadline)

    def _in_background(self, work: Any) -> None:
        """Run ``work`` in a task no caller can cancel (drain waits for it on a clean stop)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _pin_when_resident(self, waits: list[asyncio.Future[RamBlock | None]],
                                 deadline: float | None = None) -> list[RamBlock]:
        """Wait for promotions or pulls (never cancelling them), until ``deadline`` (event-loop
        time; None: until all are done); pin the blocks that arrived."""
        if not waits:
            return []
        if deadline is None:
            blocks = await asyncio.shield(asyncio.gather(*waits))
        else:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining > 0:
                await asyncio.wait(waits, timeout=remaining)      # on a timeout the reads go on
            blocks = [w.result() for w in waits if w.done() and not w.cancelled() and w.exception() is None]
        held: list[RamBlock] = []
        for block in blocks:
            if block is not None and self.ram.get(block.key) is block:
                self.ram.pin(block)
                held.append(block)
        return held

    async def _pull(self, addresses: list[BlockAddress], deadline: float | None = None) -> list[RamBlock]:
        """Pull blocks from peers into RAM (flow 5); returns them pinned. A block another
        request is pulling or promoting is waited for, not pulled twice. As _promote, the work
        runs in a task no caller can cancel; the peer tier bounds it by its pull deadline."""
        assert self.peers is not None
        loop = asyncio.get_running_loop()
        mine: list[BlockAddress] = []
        waits: list[asyncio.Future[RamBlock | None]] = []
        futures: dict[bytes, asyncio.Future[RamBlock | None]] = {}
        for address in addresses:
            if address.key in self._promoting:
                waits.append(self._promoting[address.key])
            elif address.key not in self.ram:
                futures[address.key] = self._promoting[address.key] = loop.create_future()
                waits.append(futures[address.key])
                mine.append(address)
        if mine:
            self._in_background(self._pull_and_commit(mine, futures))
        return await self._pin_when_resident(waits, deadline)

    def _reserve_pulled(self, address: BlockAddress, length: int) -> tuple[tuple[RamBlock, memoryview], memoryview] | None:
        if not 0 < length <= self.ram.max_block_bytes:
            return None
        try:
            block = self.ram.reserve(address.key, length)
        except (RamFull, ValueError):     # no room now, or someone is writing it: a miss
            return None
        self._evicted.discard(address.key)
        view = self.ram.slot_view(block)
        return (block, view), view      # the handle the peer tier gives back, and where the payload goes

    def _abort_pulled(self, handle: tuple[RamBlock, memoryview]) -> None:
        block, view = handle
        _release(view)
        if block.refs == WRITING and self.ram.holds(block):
            self.ram.abort(block)

    async def _pull_and_commit(self, mine: list[BlockAddress], futures: dict[bytes, asyncio.Future[RamBlock | None]]) -> None:
        """Fetch, then commit what arrived verified: recorded and (write-back) headed for SSD
        when mirror_pulls is on, else held only until read. Every future is resolved."""
        assert self.peers is not None
        got: list[tuple[BlockAddress, Any, Any]] = []
        try:
            got = await self.peers.fetch(mine, self._reserve_pulled, self._abort_pulled)
            now = self.clock()
            for address, (block, view), head in got:
                _release(view)
                if self.mirror_pulls:
                    if self.ssd is None:
                        self.ram.commit(block, clean=True)
                    else:
                        self._commit_new(block)
                    self._pending[block.key] = BlockRecord(address.digest, address.layer, head.model, block.length,
                                                           head.checksum, now, now, Tier.RAM)
                else:
                    self.ram.commit(block, clean=True)
                    self._transient[block.key] = head.checksum
            try:
                self._write_index()
            except Unavailable:
                pass                      # logged; the blocks left RAM again
            if self.mirror_pulls and self.ssd is not None and got:
                self.demote_wanted.set()
        except Exception:
            log.exception("pulling from peers failed")
            for _, handle, _ in got:
                self._abort_pulled(handle)
        finally:
            for address in mine:
                future = futures[address.key]
                if self._promoting.get(address.key) is future:
                    del self._promoting[address.key]
                if not future.done():
                    block = self.ram.get(address.key)
                    future.set_result(block if block is not None and block.refs != WRITING else None)

    async def serve_pull(self, rows: Sequence[tuple[bytes, int]], max_payload: int, counters: Any) -> list[Any]:
        """A peer's Pull: per row a (Block head, payload view, release) or a Miss, in order.
        Only local tiers are asked (a pull never starts another pull). The blocks stay pinned
        until their release is called."""
        from kvcached.peers import protocol as p     # late: the store does not need the peer tier otherwise

        addresses = []
        out: list[Any] = []
        for digest, layer in rows:
            try:
                addresses.append(BlockAddress(digest, layer))
            except ValueError:
                addresses.append(None)
        valid = [a for a in addresses if a is not None]
        results = iter(await self.pin(valid, allow_partial=True, peers=False)) if valid else iter(())
        pinned = []
        for (digest, layer), address in zip(rows, addresses):
            result = next(results) if address is not None else None
            if isinstance(result, Pinned):
                pinned.append(result)
            out.append(result if result is not None else p.Miss(digest, layer, p.MissReason.NOT_FOUND))
        records = {r.digest + r.layer.to_bytes(4, "little"): r
                   for r in self.index.get_many([x.block.key for x in pinned]) if r is not None}
        answers: list[Any] = []
        for (digest, layer), result in zip(rows, out):
            if not isinstance(result, Pinned):
                reason = p.MissReason.NOT_FOUND
                if isinstance(result, Miss) and "corrupt" in result.reason:
                    reason = p.MissReason.DAMAGED
                answers.append(result if isinstance(result, p.Miss) else p.Miss(digest, layer, reason))
                continue
            record = records.get(digest + layer.to_bytes(4, "little"))
            if result.block.length > max_payload or record is None:
                self.unpin(result)
                answers.append(p.Miss(digest, layer, p.MissReason.TOO_LARGE if record else p.MissReason.NOT_FOUND))
                continue
            view = self.ram.view(result.block)
            counters.served += 1
            counters.served_bytes += result.block.length
            answers.append((p.Block(digest, layer, record.model, result.block.length, result.checksum), view,
                            _releaser(self, result, view)))
        return answers

    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int:
        """How long a prefix of the chain RAM and SSD hold (a peer's Exists)."""
        keys = [index_key(d, layer) for d in digests]
        ram = self.ram.resident_prefix(keys)
        if ram == len(keys) or self.ssd is None:
            return ram
        tiers = self.index.tiers_of(keys[ram:])
        n = ram
        for key, tier in zip(keys[ram:], tiers):
            if not (tier & Tier.SSD or key in self.ram):
                break
            n += 1
        return n

    async def _read_and_commit(self, mine: list[tuple[BlockRecord, RamBlock, asyncio.Future[RamBlock | None]]]) -> None:
        """Read reserved blocks from SSD, commit the good ones, drop the bad ones, resolve every
        future whatever happens."""
        assert self.ssd is not None
        bad: list[tuple[BlockRecord, RamBlock, str]] = []
        try:
            views = [self.ram.slot_view(b) for _, b, _ in mine]
            try:
                problems: list[str | None] = await self.ssd.read_many(
                    [(b.key, _header(r), v) for (r, b, _), v in zip(mine, views)])
            except Exception as exc:     # the reads themselves failed (not a bad file): every one is a miss
                log.exception("SSD reads failed")
                problems = [f"{IO_ERROR}: {exc}"] * len(mine)
            finally:
                for view in views:
                    _release(view)
            good: list[RamBlock] = []
            for (record, block, future), problem in zip(mine, problems):
                if problem is None:
                    self.ram.commit(block, clean=True)
                    good.append(block)
                else:
                    self.ram.abort(block)
                    if not problem.startswith(IO_ERROR):    # an I/O error says nothing about the file
                        bad.append((record, block, problem))
            puts = self.index.with_tier([b.key for b in good], Tier.RAM)
            known = {key for key, _ in puts}
            for block in good:
                if block.key not in known and self.ram.busy_reason(block.key) is None:   # deleted meanwhile
                    self.ram.delete(block.key)
            for record, block, problem in bad:
                reason = GoneReason.FILE_MISSING if problem == "missing" else GoneReason.CORRUPT
                puts += self._without_ssd([block.key], reason, self.clock())
            self.index.write(puts)
            self._forget_on_ssd([block.key for _, block, _ in bad])
            self.counters.promotions += len(known)
            for record, block, problem in bad:    # moved aside before anyone is told it is a miss
                if problem != "missing":
                    self.counters.ssd_corrupt += 1
                    await self.ssd.quarantine(block.key, _header(record), problem)
        finally:
            for record, block, future in mine:
                self._promoting.pop(block.key, None)
                if block.refs == WRITING and self.ram.holds(block):   # reserved, never committed
                    self.ram.abort(block)
                if not future.done():
                    future.set_result(block if self.ram.get(block.key) is block else None)

    def _publish(self, blocks: list[tuple[RamBlock, BlockRecord]]) -> asyncio.Task[list[tuple[RamBlock, BlockRecord, SsdWriteError]]]:
        """Start publishing blocks on SSD: claimed now (pinned, and known as being published,
        so a Delete or another write-through Put of them waits), written and recorded by a task
        that no caller can cancel (its index step must follow its file step). The task returns
        the blocks that failed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for block, _ in blocks:
            self.ram.pin(block)
            self._demoting[block.key] = done
        task = asyncio.ensure_future(self._publish_claimed(blocks, done))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _publish_claimed(self, blocks: list[tuple[RamBlock, BlockRecord]],
                               done: asyncio.Future[None]) -> list[tuple[RamBlock, BlockRecord, SsdWriteError]]:
        """Write claimed blocks to SSD, then record them: marked clean, the SSD tier in their
        records, queued for SSD eviction. Blocks that meet a full disk get one bounded forced
        eviction (:meth:`_make_room`) and one more try. Blocks that still fail stay dirty and are
        returned."""
        assert self.ssd is not None
        writes = [SsdWrite(b.key, _header(r), self.ram.slot_view(b)) for b, r in blocks]
        try:
            errors = await self.ssd.write_many(writes, make_room=self._make_room)
        finally:
            for w in writes:       # no view of the arena outlives the write (tracebacks keep frames)
                _release(w.payload)
            for block, _ in blocks:
                self.ram.unpin(block)
                if self._demoting.get(block.key) is done:
                    del self._demoting[block.key]
            done.set_result(None)
        published = [(b, r) for (b, r), e in zip(blocks, errors) if e is None]
        failed = [(b, r, e) for (b, r), e in zip(blocks, errors) if e is not None]
        self._ssd_failing = bool(failed) and not published
        self._round_done.set()
        self._round_done = asyncio.Event()
        puts = self.index.with_tier([b.key for b, _ in published], Tier.SSD)
        known = {key for key, _ in puts}
        queue = [queue_entry(r.last_seen, b.key) for b, r in published if b.key in known]
        if self.ssd_order is not None:
            for block, _ in published:          # in publish order: oldest first
                if block.key in known and block.key not in self.ssd_order:
                    self.ssd_order.insert(block.key)
        dropped: list[tuple[BlockRecord, RamBlock]] = [(r, b) for b, r in published if b.key not in known]
        self.index.write(puts, queue=queue, sync=self.ssd.durability != "none")
        for block, _ in published:
            if block.key in known:
                self.ram.mark_clean(block)
        for record, block in dropped:    # deleted while it was written: its file goes too
            self.ssd.remove_now(block.key, _header(record))
        self.counters.demotions += len(known)
        if self.ssd.used_bytes > self.ssd.capacity:
            self.evict_wanted.set()
        return failed

    async def demote(self) -> int:
        """One write-back round: publish the oldest dirty blocks (up to a batch); returns how
        many left the dirty list (published, or refused by the SSD write budget: those are kept
        in RAM only), 0 when none could. ``counters.demotions`` counts the published ones.
        Blocks being written or in flight are skipped."""
        if self.ssd is None or not self.ram.dirty:
            return 0
        picks: list[RamBlock] = []
        nbytes = 0
        synchronous = self.writes.synchronous
        for key in islice(self.ram.dirty, 4 * DEMOTE_BATCH_BLOCKS + len(self._hashing)):
            block = self.ram.get(key)
            if block is None or key in self._demoting or key in self._hashing:
                continue
            if synchronous and block.refs > 0:      # a write-through Put or commit publishes it itself
                continue
            picks.append(block)
            nbytes += block.length
            if len(picks) >= DEMOTE_BATCH_BLOCKS or nbytes >= DEMOTE_BATCH_BYTES:
                break
        records = self.index.get_many([b.key for b in picks])
        for block, record in zip(picks, records):
            if record is None or not record.present:
                self._drop_unindexed(block)
        batch = [(b, r) for b, r in zip(picks, records) if r is not None and r.present]
        batch, refused = self._within_budget(batch)
        for block, _ in refused:       # the day's SSD writes are spent: kept in RAM only
            self.ram.mark_clean(block)
        if not batch:
            return len(refused)
        failed = await asyncio.shield(self._publish(batch))
        never = [b for b, _, e in failed if isinstance(e, SsdTooLarge)]
        for block in never:            # no SSD write can ever take it: kept in RAM only, not tried again
            if self.ram.holds(block):
                self.ram.mark_clean(block)
        if failed:
            log.warning("write-back failed; blocks stay in RAM only",
                        extra={"fields": {"blocks": len(failed), "never_fit": len(never), "error": str(failed[0][2])}})
        return len(batch) - len(failed) + len(never) + len(refused)

    async def evict_ssd(self, need_bytes: int = 0) -> int:
        """Drop SSD blocks unused for ``ssd_ttl``, then (once the boot reconcile has counted the
        tier) more while the tier is over capacity, and at least ``need_bytes`` more when asked
        (a full disk): least recently used first, or in ``ssd_order``'s order. Returns how many
        were dropped. Blocks in RAM stay there (RAM-only now, not written back again); others
        become tombstones."""
        if self.ssd is None:
            return 0
        over = max(0, self.ssd.used_bytes - self.ssd.capacity) if self.ssd_reconciled else 0
        dropped, freed = await self._evict_in_order(over, need_bytes)
        if dropped:
            log.info("SSD blocks evicted", extra={"fields": {"blocks": dropped, "bytes": freed,
                                                             "used_bytes": self.ssd.used_bytes}})
        return dropped

    async def _evict_in_order(self, over: int, need_bytes: int) -> tuple[int, int]:
        """Drop SSD blocks past ``ssd_ttl``, and more, least recently used first or in
        ``ssd_order``'s order, until max(``over``, ``need_bytes``) file bytes are freed (the
        last block may pass it). Returns (blocks, bytes)."""
        if self.ssd_order is None or not self.ssd_order_ready:
            return await self._evict_ssd_queue(over, need_bytes)
        dropped, freed = await self._evict_ssd_queue(0, 0)         # the TTL only
        more = await self._evict_ssd_ordered(max(over - freed, need_bytes - freed))
        return dropped + more[0], freed + more[1]

    async def _make_room(self, need: int) -> None:
        """Forced eviction for blocks that met a full disk and need ``need`` file bytes: drop SSD
        blocks in eviction order until the filesystem has ``need`` bytes free, reading its free
        space before each step (something else may be filling the disk too), and never more
        than ``FULL_DISK_EVICT_FACTOR * need`` bytes (the last block may pass it): a request
        that cannot get room must not empty the tier. Never raises (an eviction that fails is
        logged; the writes are then tried again as things stand)."""
        assert self.ssd is not None
        limit = FULL_DISK_EVICT_FACTOR * need
        dropped = freed = 0
        free = self.ssd.free_bytes()
        try:
            while free < need and freed < limit:
                blocks, nbytes = await self._evict_in_order(0, min(need - free, limit - freed))
                if not blocks:
                    break
                dropped, freed = dropped + blocks, freed + nbytes
                free = self.ssd.free_bytes()
        except Exception:
            log.exception("forced SSD eviction failed")
        self.counters.ssd_full_disk_evictions += dropped
        fields = {"need_bytes": need, "evicted_blocks": dropped, "evicted_bytes": freed, "limit_bytes": limit,
                  "free_bytes": free, "tier_bytes": self.ssd.used_bytes}
        if free < need:
            log.warning("SSD filesystem full: a forced eviction could not make room", extra={"fields": fields})
        else:
            log.info("SSD filesystem full: blocks evicted to make room", extra={"fields": fields})

    def _forget_on_ssd(self, keys: Sequence[bytes]) -> None:
        """These blocks left the SSD tier other than by its eviction: the SSD policy forgets
        them (no ghost: the policy did not choose it)."""
        if self.ssd_order is not None:
            for key in keys:
                self.ssd_order.remove(key)

    def adopt_ssd_order(self, built: EvictionPolicy) -> None:
        """Take the SSD policy rebuilt after the boot reconcile (policy_state.build_ssd_order);
        blocks published since boot, which the interim policy holds, are added to it."""
        interim = self.ssd_order
        if interim is not None:
            for key in list(interim):
                if key not in built:
                    built.insert(key)
        self.ssd_order = built
        self.ssd_order_ready = True

    async def _evict_ssd_ordered(self, want: int) -> tuple[int, int]:
        """Capacity eviction in ``ssd_order``'s order until ``want`` file bytes are freed;
        returns (blocks, bytes). Keys the policy still holds but the index says are not on SSD
        any more (deleted, dropped by an operator, lost) are forgotten as they are met."""
        assert self.ssd is not None and self.ssd_order is not None
        order = self.ssd_order
        dropped = freed = 0
        while freed < want:
            victims: list[tuple[bytes, BlockHeader]] = []
            stale: list[bytes] = []
            looked = 0
            for key in order.candidates():
                looked += 1
                if looked > 4 * EVICT_BATCH:          # bounded work per step, even among stale keys
                    break
                if key in self._promoting:            # being read right now: not this round
                    continue
                raw = self.index.raw(key)
                view = raw_ssd_view(raw) if raw is not None else None
                if view is None or not view[0] & Tier.SSD:
                    stale.append(key)
                    continue
                _, nbytes, _, checksum, digest, layer = view
                victims.append((key, BlockHeader(digest, layer, nbytes, checksum, 0.0)))
                freed += file_bytes(nbytes)
                if freed >= want or len(victims) >= EVICT_BATCH:
                    break
            for key in stale:
                order.remove(key)
            for key, _ in victims:
                order.evicted(key)
            keys = [k for k, _ in victims]
            self.index.write(self._without_ssd(keys, GoneReason.EVICTED, self.clock()))
            await self.ssd.remove_many(victims)
            dropped += len(victims)
            self.counters.ssd_evictions_capacity += len(victims)
            if not victims and not stale:
                break
            await asyncio.sleep(0)                     # let requests in between steps
        return dropped, freed

    async def _evict_ssd_queue(self, over: int, need_bytes: int) -> tuple[int, int]:
        """Walk the index's SSD queue, oldest first: drop blocks past the TTL, and (LRU, with a
        second chance for blocks used since they were queued) more until ``over`` and
        ``need_bytes`` are freed. Returns (blocks, bytes)."""
        assert self.ssd is not None
        ssd = self.ssd
        now = self.clock()
        ttl_before = now - self.ssd_ttl
        freed = dropped = 0
        while True:
            victims: list[tuple[bytes, BlockHeader]] = []
            queue: list[bytes] = []
            unqueue: list[bytes] = []
            expired_keys: list[bytes] = []
            done = False
            entries = self.index.ssd_queue(EVICT_BATCH)
            for entry, key, raw in entries:
                view = raw_ssd_view(raw) if raw is not None else None
                if view is None or not view[0] & Tier.SSD:
                    unqueue.append(entry)            # stale: the block left SSD already
                    continue
                tiers, nbytes, last_seen, checksum, digest, layer = view
                if key in self._promoting:          # being read right now: not this round
                    continue
                queued_at = queue_time(entry)
                wanted = freed < over or freed < need_bytes
                if last_seen < ttl_before or (wanted and last_seen <= queued_at + 1e-6):
                    unqueue.append(entry)
                    victims.append((key, BlockHeader(digest, layer, nbytes, checksum, 0.0)))
                    if last_seen < ttl_before:
                        expired_keys.append(key)
                    freed += file_bytes(nbytes)
                elif wanted or queued_at < ttl_before:   # used since it was queued: second chance
                    again = queue_entry(last_seen, key)
                    if again != entry:
                        unqueue.append(entry)
                        queue.append(again)
                else:
                    done = True
                    break
            if not entries:
                done = True
            keys = [k for k, _ in victims]
            puts = self._without_ssd(keys, GoneReason.EVICTED, now)
            self.index.write(puts, queue=queue, unqueue=unqueue)
            # A copy still in RAM stays there and stays "clean": the policy chose to drop its SSD
            # copy, so it is not written back again (that would undo the eviction every round).
            await ssd.remove_many(victims)
            dropped += len(victims)
            self.counters.ssd_evictions_ttl += len(expired_keys)
            self.counters.ssd_evictions_capacity += len(victims) - len(expired_keys)
            if self.ssd_order is not None:
                for key in keys:
                    self.ssd_order.remove(key)
            if done or not (victims or queue or unqueue):
                break
        return dropped, freed

    def finish_ssd_reconcile(self, report: ReconcileReport) -> None:
        """Apply the boot reconcile's findings: records whose file was missing or bad lose the
        SSD tier (unless this run published the block again meanwhile); the tier's size counts
        the good files; capacity eviction may start."""
        assert self.ssd is not None
        keys = report.lost
        for i in range(0, len(keys), EVICT_BATCH * 40):
            chunk = keys[i:i + EVICT_BATCH * 40]
            records = self.index.get_many(chunk)
            still = [k for k, r in zip(chunk, records) if r is not None and r.tiers & Tier.SSD
                     and not self.ssd.is_fresh(self.ssd.path_of(k, r.digest, r.layer))]
            self.index.write(self._without_ssd(still, GoneReason.FILE_MISSING, self.clock()))
            self._forget_on_ssd(still)
            for key in still:
                block = self.ram.get(key)
                if block is not None:
                    self.ram.mark_dirty(block)
        self.ssd.reconciled(report.on_ssd, report.on_ssd_bytes, report.on_ssd_file_bytes)
        self.ssd_reconciled = True
        if self.ssd.used_bytes > self.ssd.capacity:
            self.evict_wanted.set()

    # -- maintenance --------------------------------------------------------------------------

    def _on_ram_evict(self, blocks: list[RamBlock]) -> None:
        """The RAM tier dropped ``blocks`` (inside a request): note it; _write_index tells the
        index once per request, not once per victim."""
        now = self.clock()
        for block in blocks:
            key = block.key
            self._touched.discard(key)
            record = self._pending.get(key)
            if record is not None:          # stored earlier in this very batch
                self._pending[key] = record.gone(GoneReason.EVICTED, now)
            else:
                self._evicted.add(key)

    def _write_index(self) -> None:
        """One index write for the request: its new records and its evictions' tombstones.

        If the index cannot be written, the request's new blocks leave RAM again (what the
        index does not know must not be served) and Unavailable says so."""
        puts: list[tuple[bytes, BlockRecord | bytes]] = list(self._pending.items())
        new_keys = [key for key, record in puts if record.present]
        evicted, self._evicted = list(self._evicted), set()
        self._pending.clear()
        try:
            if evicted:
                puts += self.index.without_tier(evicted, Tier.RAM, GoneReason.EVICTED, self.clock())
            self.index.write(puts)
        except Exception as exc:
            for key in new_keys:
                if self.ram.busy_reason(key) is None:
                    self.ram.delete(key)
            # An unwritable index said so once in the log; each refused put is the caller's news.
            (log.debug if isinstance(exc, IndexUnwritable) else log.error)(
                "index write failed", extra={"fields": {"blocks": len(new_keys), "error": str(exc)}})
            raise Unavailable(f"the index cannot be written ({exc}); none of the {len(new_keys)} new blocks "
                              "of this request were kept") from exc

    def flush_last_seen(self) -> int:
        """Write the last-seen time of blocks used since the previous flush (batched, off the
        hot path); returns how many records were updated."""
        if not self._touched:
            return 0
        keys, self._touched = list(self._touched), set()
        if self.ssd_order is not None:
            for key in keys:             # unknown keys (not on SSD) are ignored
                self.ssd_order.touch(key)
        puts = self.index.with_last_seen(keys, self.clock())
        self.index.write(puts, watch=False)
        return len(puts)


# Every tier set that includes SSD: Lookup tests membership (~20 ns), not ``tier & Tier.SSD``
# (an enum flag operation, ~0.4 us: a quarter of a RAM-hit lookup of 64 blocks).
_ON_SSD = frozenset({Tier.SSD, Tier.RAM | Tier.SSD})


def _prefix(held: Sequence[bool]) -> int:
    """How many of ``held``, from the first, are true."""
    return next((i for i, here in enumerate(held) if not here), len(held))


def _tier_matches(record: BlockRecord, tier: Tier | None) -> bool:
    if tier is None:
        return True
    if tier == Tier.NONE:
        return not record.present
    return bool(record.tiers & tier)


def _header(record: BlockRecord) -> BlockHeader:
    """The SSD file header that describes ``record``'s block."""
    return BlockHeader(record.digest, record.layer, record.nbytes, record.checksum, record.created)


def _releaser(store: Store, pinned: Pinned, view: memoryview) -> Callable[[], None]:
    def release() -> None:
        _release(view)
        store.unpin(pinned)
    return release


def _release(view: memoryview) -> None:
    """Release an arena view now; if an I/O thread still holds a slice of it (a request was
    cancelled mid-I/O), the garbage collector releases it once the thread is done."""
    try:
        view.release()
    except BufferError:
        pass
