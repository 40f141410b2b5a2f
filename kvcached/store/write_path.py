"""The write path: Puts (bytes sent to the daemon) and agents' direct writes into arena slots.

- :meth:`WritePath.put` checks a whole batch before storing any of it, skips blocks RAM or SSD
  already hold (engines save the same prefixes again and again), checksums the new ones, offers
  them to the admission policy and writes the admitted ones into RAM. Under ``write_through``
  they are on SSD before it returns; under ``write_back`` the demoter publishes them soon after
  and a Put waits while too much of the RAM tier is dirty; ``write_through_selective`` holds a
  new block in RAM until its N-th hit (:meth:`on_hit`, called by the read path). What the write
  policy does with a new block is kvcached.store.write_policy's, for both halves.
- A block another tenant stores under an address a writer names is neither replaced nor
  revealed: the writer is told its block was declined, as admission might (counted in
  ``other_tenant``).
- Agents (kvcached.api.agent_session) :meth:`reserve` slots, write them, and
  :meth:`commit_written` makes the written blocks visible at once; a background thread checksums
  them and their records are written after (a read, delete or publish of such a block waits,
  kvcached.store.inflight). Under write_through the commit itself waits, then publishes.

Runs on the event loop; checksums of Put payloads are computed on it (blocking: large batches
use the integrity module's threads), agents' off it on the store's hashing thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Sequence

from kvcached.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from kvcached.index import BlockRecord, Tier
from kvcached.index.format import encode_record
from kvcached.policies.admission import AdmissionPolicy, AlwaysAdmit
from kvcached.store.inflight import release_view
from kvcached.store.parts import Room, StoreParts, tiers_for_writer
from kvcached.store.results import CommitOutcome, PutItem, PutResult, SlotRefusal
from kvcached.store.ssd_mover import SsdMover
from kvcached.store.write_policy import DIRTY_WAIT_S, AppliedWritePolicy
from kvcached.tiers.ram import WRITING, RamBlock, RamFull
from kvcached.tiers.ssd import SsdTier
from kvcached_agent.address import DIGEST_BYTES, BlockAddress
from kvcached_agent.integrity import Hasher

__all__ = ["DIRTY_WAIT_S", "MAX_MODEL_BYTES", "WritePath"]

log = logging.getLogger("kvcached.store")

MAX_MODEL_BYTES = 256        # a model label is a name, not a payload
RAM = int(Tier.RAM)          # a plain int: enum conversions cost a record each on the hot path


class WritePath(Room):
    """Puts and agents' slot writes (see the module). ``ssd`` and ``mover`` are None without
    an SSD tier; ``policy`` applies kv.write_policy to the new blocks of both."""

    def __init__(self, parts: StoreParts, ssd: SsdTier | None, mover: SsdMover | None,
                 admission: AdmissionPolicy) -> None:
        super().__init__(parts)
        self.ssd = ssd
        self.mover = mover
        self.admission = admission
        self.policy = AppliedWritePolicy(parts, ssd, mover)
        #: Checksums of saved blocks, on ``settings.hash_threads`` threads (kv.hash_threads); an
        #: agent's batch is handed to them from one more thread (``_hand_off``), so the event
        #: loop never waits.
        self.hasher = Hasher(parts.settings.hash_threads)
        self._hand_off = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-hash")

    def close(self) -> None:
        self._hand_off.shutdown(wait=True)
        self.hasher.close()

    # -- put ----------------------------------------------------------------------------------

    async def put(self, items: Sequence[PutItem]) -> PutResult:
        """Store a batch. Every item is checked before any is stored, so a bad item stores
        nothing. Blocks already present (in RAM or on SSD) count as ``present``; new blocks the
        admission policy does not take yet count as ``declined``. If the RAM tier fills with
        blocks in use, the blocks stored so far stay and ResourceExhausted says how many. Under
        write_through the new blocks are on SSD before this returns; a block that cannot be
        published is dropped again and the error says so, one the SSD write budget refuses is
        dropped and counted as declined."""
        through = self.mover is not None and self.settings.writes.synchronous
        result, new, full, theirs = self._put_ram(items, hold=through)
        own = {b.key for b, _ in new}
        if through:
            # Blocks of this batch already in RAM but not on SSD yet (another Put of the same
            # block is publishing it, or it was put under write-back) are made durable too.
            new += await self.policy.dirty_blocks(list({i.address.key for i in items} - own - theirs))
        if through and new:
            failed, refused = await self.policy.write_through(new, own)
            result.stored -= len(refused)
            result.declined += len(refused)
            if failed:
                result.stored -= len(failed)
                raise self.policy.publish_error(failed, result, len(items))
        elif new and self.mover is not None:
            self.mover.demote_wanted.set()
            await self.policy.throttle_dirty()
        if full is not None:
            raise ResourceExhausted(f"stored {result.stored} of {len(items)} blocks: {full}")
        return result

    def _put_ram(self, items: Sequence[PutItem], hold: bool) -> tuple[PutResult, list[tuple[RamBlock, BlockRecord]],
                                                                      RamFull | None, set[bytes]]:
        """The RAM part of a Put: returns what it stored, the new blocks (pinned if ``hold``,
        so none can be evicted before it is published), the RamFull that stopped it early, and
        the keys of another tenant's blocks (declined, counted). A Put's items are one caller's:
        the first one's tenant is all of theirs."""
        for i, item in enumerate(items):
            self._check_put(i, item)
        tenant = items[0].tenant if items else ""
        keys = [item.address.key for item in items]
        index = self.index if self.ssd is not None else None      # without SSD a stored block is in RAM
        tiers = tiers_for_writer(self.ram, index, keys, tenant)
        theirs = {key for key, t in zip(keys, tiers) if t is None}
        foreign = sum(t is None for t in tiers)          # items (a key twice in a batch counts twice)
        self.counters.other_tenant += foreign
        todo: list[tuple[int, PutItem]] = []
        for i, (item, t) in enumerate(zip(items, tiers)):
            key = item.address.key
            if t is None:
                continue
            if key in self.ram or t & Tier.SSD:
                self.ledger.touched(key)    # a re-put is a use
            else:
                todo.append((i, item))
        for i, item in todo:
            if self.ram.busy_reason(item.address.key) == "being written":
                raise FailedPrecondition(f"block {i} ({item.address}) is being written by an agent right now "
                                         "(reserved, not committed yet); nothing was stored: retry shortly")
        if hold and todo:
            self.policy.check_room(todo)
        checksums = self.hasher.checksums([item.payload for _, item in todo])
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
        result = PutResult(present=len(items) - offered - foreign, declined=offered - len(todo) + foreign)
        new: list[tuple[RamBlock, BlockRecord]] = []
        full: RamFull | None = None
        # Records of this batch are staged in the ledger and go to the index in one write at
        # the end, with the tombstones of whatever the batch evicted.
        try:
            for (_, item), checksum in zip(todo, checksums):
                key = item.address.key
                if key in self.ram:      # the same block twice in this batch
                    result.present += 1
                    continue
                try:
                    block = self.ram.reserve(key, len(item.payload), item.tenant)
                except RamFull as exc:
                    full = exc
                    break
                except ValueError:   # pragma: no cover - checked above, same thread
                    raise FailedPrecondition(f"block {item.address} is being written by another writer") from None
                self.ram.write(block, item.payload)
                self.commit_new(block)
                if hold:
                    self.ram.hold(block)
                record = BlockRecord(item.address.digest, item.address.layer, item.model, len(item.payload),
                                     checksum, now, now, Tier.RAM, tenant=item.tenant)
                self.ledger.stage(key, record)
                new.append((block, record))
                self.ledger.reserved(key)
                result.stored += 1
                self.counters.puts += 1
                self.counters.put_bytes += len(item.payload)
                self.tally.put(item.tenant, len(item.payload))
        except BaseException:
            for block, _ in new if hold else ():
                self.ram.unpin(block)
            raise
        finally:
            try:
                self.ledger.commit()
            except Unavailable:
                for block, _ in new if hold else ():
                    if block.refs > 0:
                        self.ram.unpin(block)
                    if self.ram.busy_reason(block.key) is None:
                        self.ram.delete(block.key)
                raise
        # a block of this batch may have been evicted by a later one of the same batch (not if held)
        return result, [(b, r) for b, r in new if self.ram.committed(b)], full, theirs

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

    def commit_new(self, block: RamBlock) -> None:
        """Commit a block new to this daemon, as the write policy has it
        (:meth:`AppliedWritePolicy.commit_new`; peer pulls commit theirs here too)."""
        self.policy.commit_new(block)

    def on_hit(self, block: RamBlock) -> None:
        """A read used ``block`` (:meth:`AppliedWritePolicy.on_hit`)."""
        self.policy.on_hit(block)

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

    # -- agents: blocks written straight into arena slots ---------------------------------------

    def reserve(self, entries: Sequence[tuple[BlockAddress, int]], tenant: str = "") -> list[RamBlock | SlotRefusal]:
        """Slots for blocks an agent is about to write, entry by entry: a RamBlock (WRITING, its
        bytes counted as held) or why not: ``present`` (RAM or SSD has it: nothing to write),
        ``busy`` (another writer has it reserved), ``full`` (no room, or agents and readers
        already hold half the RAM tier), ``invalid`` (a size outside 1..max_block_bytes),
        ``declined`` (the admission policy does not take it yet, or another tenant's block is
        stored there: nothing to write)."""
        keys = [a.key for a, _ in entries]
        on_ssd = tiers_for_writer(self.ram, self.index if self.ssd is not None else None, keys, tenant)
        inflight = self.inflight
        out: list[RamBlock | SlotRefusal] = []
        mine: set[bytes] = set()
        try:
            for (address, length), tiers in zip(entries, on_ssd):
                key = address.key
                if not 0 < length <= self.ram.max_block_bytes:
                    out.append(SlotRefusal.INVALID)
                elif key in mine:
                    out.append(SlotRefusal.PRESENT)        # the same block twice in one batch: written once
                elif tiers is None:
                    self.counters.other_tenant += 1
                    out.append(SlotRefusal.DECLINED)
                elif key in self.ram or tiers & Tier.SSD:
                    self.ledger.touched(key)     # a re-save is a use
                    out.append(SlotRefusal.PRESENT)
                elif inflight.held_bytes + length > inflight.max_held_bytes:
                    out.append(SlotRefusal.FULL)
                elif not self.admission.admit(key):
                    self.counters.declined += 1
                    out.append(SlotRefusal.DECLINED)
                else:
                    try:
                        block = self.ram.reserve(key, length, tenant)
                    except ValueError:           # reserved by another writer right now
                        out.append(SlotRefusal.BUSY)
                        continue
                    except RamFull:
                        out.append(SlotRefusal.FULL)
                        continue
                    self.ledger.reserved(key)
                    inflight.held_bytes += length
                    mine.add(key)
                    out.append(block)
        finally:
            try:
                self.ledger.commit()      # tombstones of what the reservations evicted
            except BaseException:
                for slot in out:
                    if isinstance(slot, RamBlock):
                        self.abort_reserved(slot)
                raise
        return out

    async def throttle_writes(self) -> None:
        """Back-pressure for agents' writes: an Allocate waits while committed blocks still
        waiting for their checksum hold a quarter of the RAM tier (they cannot be evicted yet),
        and under write_back while the tier is too dirty (AppliedWritePolicy.throttle_dirty), as a Put does.
        A writer faster than the checksums or the disk slows to their pace instead of being
        refused for lack of room."""
        hashing = self.inflight.hashing
        while self.inflight.hashing_bytes > self.ram.capacity // 4 and hashing:
            await asyncio.wait(set(hashing.values()), return_when=asyncio.FIRST_COMPLETED)
        if self.mover is not None and not self.settings.writes.synchronous:
            await self.policy.throttle_dirty()

    def abort_reserved(self, block: RamBlock) -> None:
        """Give back a reserved slot that was not committed (the agent gave up or went away)."""
        if block.refs == WRITING and self.ram.holds(block):
            self.ram.abort(block)
        self.inflight.held_bytes -= block.length

    async def commit_written(self, written: Sequence[tuple[BlockAddress, RamBlock]],
                             model: str, tenant: str = "") -> list[CommitOutcome | None]:
        """The agent wrote these reserved blocks: each becomes visible (and evictable) now, and
        is recorded in the index once a background thread has checksummed it. Under
        write_through this waits for the records and the SSD publish; a block that cannot be
        published is dropped (``failed``). Per entry: None, ``failed`` or ``unknown`` (not a
        reserved block any more); under write_through also ``declined`` (the SSD write budget
        refused it; not kept)."""
        out: list[CommitOutcome | None] = []
        batch: list[tuple[BlockAddress, RamBlock]] = []
        through = self.mover is not None and self.settings.writes.synchronous
        for address, block in written:
            if block.refs != WRITING or not self.ram.holds(block):
                out.append(CommitOutcome.UNKNOWN)
                continue
            self.inflight.held_bytes -= block.length
            self.commit_new(block)
            self.ram.hold(block)          # held until recorded: never evicted unrecorded
            if through:
                self.ram.hold(block)      # and, under write_through, until published
            batch.append((address, block))
            out.append(None)
        if not batch:
            return out
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for _, block in batch:
            self.inflight.hashing[block.key] = done
            self.inflight.hashing_bytes += block.length
        task = self.inflight.spawn(self._record_written(batch, model, tenant, done))
        if self.mover is None:
            return out
        if not through:
            self.mover.demote_wanted.set()
            return out
        refused: list[RamBlock] = []
        try:
            await asyncio.shield(task)
            new = await self.policy.dirty_blocks([b.key for _, b in batch])
            if new:
                _, refused = await self.policy.write_through(new, {b.key for _, b in batch})
        finally:
            durable = [self.ram.holds(b) and b.clean for _, b in batch]
            for (_, block), ok in zip(batch, durable):
                if self.ram.holds(block):
                    self.ram.unpin(block)
                    if not ok and block.refs == 0:      # not on SSD: not kept (write_through)
                        self.ram.delete(block.key)
                        self.ledger.delete_records([block.key])
        declined = {b.key for b in refused}
        outcomes = iter(None if ok else CommitOutcome.DECLINED if block.key in declined else CommitOutcome.FAILED
                        for (_, block), ok in zip(batch, durable))
        return [r if r is not None else next(outcomes) for r in out]

    async def _record_written(self, batch: list[tuple[BlockAddress, RamBlock]], model: str, tenant: str,
                              done: asyncio.Future[None]) -> None:
        """Checksum agent-written blocks off the event loop, then record them in one index write.
        Blocks that could not be checksummed are dropped (never served unrecorded)."""
        views = [self.ram.view(b) for _, b in batch]
        checksums: list[bytes] | None = None
        try:
            checksums = await asyncio.get_running_loop().run_in_executor(self._hand_off, self.hasher.checksums, views)
        except Exception:
            log.exception("checksumming agent blocks failed; they are dropped")
        finally:
            for view in views:
                release_view(view)
            self._finish_written(batch, model, tenant, checksums, done)

    def _finish_written(self, batch: list[tuple[BlockAddress, RamBlock]], model: str, tenant: str,
                        checksums: list[bytes] | None, done: asyncio.Future[None]) -> None:
        now = self.clock()
        hashing = self.inflight.hashing
        stored = stored_bytes = 0
        for i, (address, block) in enumerate(batch):
            if hashing.get(block.key) is done:
                del hashing[block.key]
            self.inflight.hashing_bytes -= block.length
            if not self.ram.holds(block):
                continue
            self.ram.unpin(block)
            if checksums is not None:
                self.ledger.stage(block.key, encode_record(address.digest, address.layer, model, block.length,
                                                           checksums[i], now, now, RAM, self.ledger.route_of(address),
                                                           tenant))
                self.counters.puts += 1
                self.counters.put_bytes += block.length
                stored, stored_bytes = stored + 1, stored_bytes + block.length
            elif block.refs == 0:
                self.ram.delete(block.key)
        self.tally.put(tenant, stored_bytes, stored)
        try:
            self.ledger.commit()
        except Unavailable:
            pass             # logged; the blocks left RAM again
        done.set_result(None)
