"""Moving blocks between RAM and SSD: promotion (SSD -> RAM) and publishing (RAM -> SSD).

- :meth:`SsdMover.promote` reads SSD blocks into fresh arena slots, verifies them and commits
  the good ones; a damaged file is quarantined and the block becomes a miss, never served.
- :meth:`SsdMover.publish` writes blocks to SSD (claimed in ``InFlight.publishing`` so a Delete
  or a second write-through of them waits), then records them: clean in RAM, the SSD tier in
  their records, queued for SSD eviction. A write that meets a full disk gets one forced
  eviction (kvcached.store.ssd_evictor) and one more try.
- :meth:`SsdMover.demote` is one write-back round (the daemon's demoter calls it when
  ``demote_wanted`` is set): the oldest dirty blocks, up to a batch.
- The SSD write budget (kvcached.policies.admission.SsdWriteBudget) decides whether a publish
  may write at all; its per-minute ledger is persisted in the index's policy family before any
  byte is written.

Reads and writes run in background tasks no caller can cancel (their index step must follow
their file step); everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import islice

from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier, queue_entry
from kvcached.policies.admission import SsdWriteBudget
from kvcached.store.inflight import pin_arrived, release_view
from kvcached.store.parts import Room, StoreParts
from kvcached.store.ssd_evictor import SsdEvictor, header_of
from kvcached.tiers.ram import WRITING, RamBlock, RamFull
from kvcached.tiers.ssd import IO_ERROR, ReadFault, ReadProblem, SsdTier, SsdTooLarge, SsdWrite, SsdWriteError
from kvcached.tiers.ssd_format import file_bytes
from kvcached_agent.address import BlockAddress

__all__ = ["BUDGET_PREFIX", "DEMOTE_BATCH_BLOCKS", "DEMOTE_BATCH_BYTES", "SsdMover", "load_budget"]

log = logging.getLogger("kvcached.store")

DEMOTE_BATCH_BYTES = 64 << 20   # one write-back round publishes at most this much ...
DEMOTE_BATCH_BLOCKS = 256       # ... or this many blocks
BUDGET_PREFIX = b"budget/"       # policy-family keys of the SSD write budget's ledger (+ be64 minute)

Published = list[tuple[RamBlock, BlockRecord, SsdWriteError]]


def load_budget(index: BlockIndex, budget: SsdWriteBudget, now: float) -> None:
    """Take up the SSD write budget's ledger from the index (at boot) and drop the minutes
    that are more than a day old."""
    items = index.policy_items(BUDGET_PREFIX)
    entries = [(int.from_bytes(k[len(BUDGET_PREFIX):], "big"), int.from_bytes(v, "little")) for k, v in items]
    budget.load(entries, now)
    kept = {m for m, _ in budget.minutes()}
    stale = [(k, None) for k, (m, _) in zip((k for k, _ in items), entries) if m not in kept]
    if stale:
        index.write(policy=stale)


class SsdMover(Room):
    """Promotion, publishing and write-back between the RAM and SSD tiers (see the module).
    ``demote_wanted`` is set when dirty blocks wait; ``round_done`` is set (and replaced) after
    every publishing round; ``ssd_failing`` says the last round published nothing."""

    def __init__(self, parts: StoreParts, ssd: SsdTier, evictor: SsdEvictor, budget: SsdWriteBudget) -> None:
        super().__init__(parts)
        self.ssd = ssd
        self.evictor = evictor
        self.budget = budget
        self.demote_wanted = asyncio.Event()
        self.round_done = asyncio.Event()
        self.ssd_failing = False

    # -- SSD -> RAM ----------------------------------------------------------------------------

    async def promote(self, addresses: list[BlockAddress], deadline: float | None = None) -> list[RamBlock]:
        """Read SSD blocks into RAM, verified; returns them pinned. A block another request is
        fetching is waited for, not read twice. A block that cannot get a slot stays a miss."""
        loop = asyncio.get_running_loop()
        fetching = self.inflight.fetching
        records = self.index.get_many([a.key for a in addresses])
        mine: list[tuple[BlockRecord, RamBlock, asyncio.Future[RamBlock | None]]] = []
        waits: list[asyncio.Future[RamBlock | None]] = []
        try:
            for address, record in zip(addresses, records):
                key = address.key
                if record is None or not record.tiers & Tier.SSD or key in self.ram:
                    continue
                if key in fetching:
                    waits.append(fetching[key])
                    continue
                try:
                    block = self.ram.reserve(key, record.nbytes, record.tenant)
                except (RamFull, ValueError):   # no room now, or an agent is writing it: a miss
                    continue
                future: asyncio.Future[RamBlock | None] = loop.create_future()
                fetching[key] = future
                mine.append((record, block, future))
                waits.append(future)
        finally:
            if mine:
                self.inflight.spawn(self._read_and_commit(mine))
            self.ledger.commit()      # tombstones of what the reservations evicted
        return await pin_arrived(self.ram, waits, deadline)

    async def _read_and_commit(self, mine: list[tuple[BlockRecord, RamBlock, asyncio.Future[RamBlock | None]]]) -> None:
        """Read reserved blocks from SSD, commit the good ones, drop the bad ones, resolve every
        future whatever happens."""
        bad: list[tuple[BlockRecord, RamBlock, ReadProblem]] = []
        try:
            views = [self.ram.slot_view(b) for _, b, _ in mine]
            try:
                started = time.perf_counter()
                problems: list[ReadProblem | None] = await self.ssd.read_many(
                    [(b.key, header_of(r), v, r.tenant) for (r, b, _), v in zip(mine, views)])
                self.delivery.took("ssd", sum(r.nbytes for (r, _, _), p in zip(mine, problems) if p is None),
                                   time.perf_counter() - started)
            except Exception as exc:     # the reads themselves failed (not a bad file): every one is a miss
                log.exception("SSD reads failed")
                problems = [ReadProblem(ReadFault.IO_ERROR, f"{IO_ERROR}: {exc}")] * len(mine)
            finally:
                for view in views:
                    release_view(view)
            good: list[RamBlock] = []
            for (record, block, future), problem in zip(mine, problems):
                if problem is None:
                    self.ram.commit(block, clean=True)
                    good.append(block)
                else:
                    self.ram.abort(block)
                    if problem.fault is not ReadFault.IO_ERROR:    # an I/O error says nothing about the file
                        bad.append((record, block, problem))
            puts = self.index.with_tier([b.key for b in good], Tier.RAM)
            known = {key for key, _ in puts}
            for block in good:
                if block.key not in known and self.ram.busy_reason(block.key) is None:   # deleted meanwhile
                    self.ram.delete(block.key)
            for record, block, problem in bad:
                reason = GoneReason.FILE_MISSING if problem.fault is ReadFault.MISSING else GoneReason.CORRUPT
                puts += self.ledger.without_ssd([block.key], reason, self.clock())
            self.index.write(puts)
            self.evictor.forget([block.key for _, block, _ in bad])
            self.counters.promotions += len(known)
            for record, block, problem in bad:    # moved aside before anyone is told it is a miss
                if problem.fault is ReadFault.DAMAGED:
                    self.counters.ssd_corrupt += 1
                    await self.ssd.quarantine(block.key, header_of(record), problem, record.tenant)
        finally:
            for record, block, future in mine:
                self.inflight.fetching.pop(block.key, None)
                if block.refs == WRITING and self.ram.holds(block):   # reserved, never committed
                    self.ram.abort(block)
                if not future.done():
                    future.set_result(block if self.ram.committed(block) else None)

    # -- RAM -> SSD ----------------------------------------------------------------------------

    def publish(self, blocks: list[tuple[RamBlock, BlockRecord]]) -> asyncio.Task[Published]:
        """Start publishing blocks on SSD: claimed now (pinned, and known as being published,
        so a Delete or another write-through Put of them waits), written and recorded by a task
        that no caller can cancel (its index step must follow its file step). The task returns
        the blocks that failed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for block, _ in blocks:
            self.ram.hold(block)
            self.inflight.publishing[block.key] = done
        return self.inflight.spawn(self._publish_claimed(blocks, done))

    async def _publish_claimed(self, blocks: list[tuple[RamBlock, BlockRecord]],
                               done: asyncio.Future[None]) -> Published:
        """Write claimed blocks to SSD, then record them: marked clean, the SSD tier in their
        records, queued for SSD eviction. Blocks that meet a full disk get one bounded forced
        eviction and one more try. Blocks that still fail stay dirty and are returned."""
        publishing = self.inflight.publishing
        writes = [SsdWrite(b.key, header_of(r), self.ram.slot_view(b), r.tenant) for b, r in blocks]
        try:
            errors = await self.ssd.write_many(writes, make_room=self.evictor.make_room)
        finally:
            for w in writes:       # no view of the arena outlives the write (tracebacks keep frames)
                release_view(w.payload)
            for block, _ in blocks:
                self.ram.unpin(block)
                if publishing.get(block.key) is done:
                    del publishing[block.key]
            done.set_result(None)
        published = [(b, r) for (b, r), e in zip(blocks, errors) if e is None]
        failed = [(b, r, e) for (b, r), e in zip(blocks, errors) if e is not None]
        self.ssd_failing = bool(failed) and not published
        self.round_done.set()
        self.round_done = asyncio.Event()
        puts = self.index.with_tier([b.key for b, _ in published], Tier.SSD)
        known = {key for key, _ in puts}
        queue = [queue_entry(r.last_seen, b.key) for b, r in published if b.key in known]
        self.evictor.published([b.key for b, _ in published if b.key in known])    # in publish order: oldest first
        dropped: list[tuple[BlockRecord, RamBlock]] = [(r, b) for b, r in published if b.key not in known]
        self.index.write(puts, queue=queue, sync=self.ssd.durability != "none")
        for block, _ in published:
            if block.key in known:
                self.ram.mark_clean(block)
        for record, block in dropped:    # deleted while it was written: its file goes too
            self.ssd.remove_now(block.key, header_of(record), record.tenant)
        self.counters.demotions += len(known)
        self.evictor.over_capacity()
        return failed

    def within_budget(self, blocks: list[tuple[RamBlock, BlockRecord]]) -> tuple[
            list[tuple[RamBlock, BlockRecord]], list[tuple[RamBlock, BlockRecord]]]:
        """Split blocks about to be published into those the SSD write budget takes (counted
        now, and the ledger's minute persisted before any byte is written) and those it
        refuses."""
        budget = self.budget
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

    async def demote(self) -> int:
        """One write-back round: publish the oldest dirty blocks (up to a batch); returns how
        many left the dirty list (published, or refused by the SSD write budget: those are kept
        in RAM only), 0 when none could. ``counters.demotions`` counts the published ones.
        Blocks being written or in flight are skipped."""
        if not self.ram.dirty:
            return 0
        picks: list[RamBlock] = []
        nbytes = 0
        synchronous = self.settings.writes.synchronous
        publishing, hashing = self.inflight.publishing, self.inflight.hashing
        for key in islice(self.ram.dirty, 4 * DEMOTE_BATCH_BLOCKS + len(hashing)):
            block = self.ram.get(key)
            if block is None or key in publishing or key in hashing:
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
                self.ledger.drop_unindexed(block)
        batch = [(b, r) for b, r in zip(picks, records) if r is not None and r.present]
        batch, refused = self.within_budget(batch)
        for block, _ in refused:       # the day's SSD writes are spent: kept in RAM only
            self.ram.mark_clean(block)
        if not batch:
            return len(refused)
        failed = await asyncio.shield(self.publish(batch))
        never = [b for b, _, e in failed if isinstance(e, SsdTooLarge)]
        for block in never:            # no SSD write can ever take it: kept in RAM only, not tried again
            if self.ram.holds(block):
                self.ram.mark_clean(block)
        if failed:
            log.warning("write-back failed; blocks stay in RAM only",
                        extra={"fields": {"blocks": len(failed), "never_fit": len(never), "error": str(failed[0][2])}})
        return len(batch) - len(failed) + len(never) + len(refused)

    async def write_back_all(self) -> int:
        """Write every block only RAM holds to SSD (Drain): the dirty ones, and clean ones whose
        SSD copy was evicted. Returns how many were published; stops when a round publishes
        nothing (the SSD failing, or only busy blocks left)."""
        keys = self.ram.clean_keys()
        for key, record in zip(keys, self.index.get_many(keys)):
            block = self.ram.get(key)
            if block is not None and record is not None and record.present and not record.tiers & Tier.SSD:
                self.ram.mark_dirty(block)
        before = self.counters.demotions
        while self.ram.dirty and await self.demote():
            pass
        return self.counters.demotions - before
