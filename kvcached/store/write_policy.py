"""``kv.write_policy`` applied to new blocks: when a block stored in RAM goes to the SSD tier.

- ``write_through``: a Put (or an agent's commit) publishes its new blocks before it returns
  (:meth:`AppliedWritePolicy.write_through`); a block the tier can never take fails the Put
  before anything is stored (:meth:`~AppliedWritePolicy.check_room`).
- ``write_back``: the demoter publishes new blocks soon after; a writer waits while more than
  half the RAM tier is dirty (:meth:`~AppliedWritePolicy.throttle_dirty`).
- ``write_through_selective``: a new block is held in RAM, clean, until its N-th hit
  (:meth:`~AppliedWritePolicy.commit_new`, :meth:`~AppliedWritePolicy.on_hit`).

Both halves of kvcached.store.write_path (Puts and agents' slot writes) use one instance, so the
policy is applied the same way whichever way a block came in. Runs on the event loop.
"""

from __future__ import annotations

import asyncio

from kvcached.errors import KvError, ResourceExhausted, Unavailable
from kvcached.index import BlockRecord
from kvcached.store.parts import Room, StoreParts
from kvcached.store.results import PutItem, PutResult
from kvcached.store.ssd_mover import SsdMover
from kvcached.tiers.ram import RamBlock
from kvcached.tiers.ssd import SsdFull, SsdTier, SsdTooLarge, SsdWriteError

__all__ = ["DIRTY_WAIT_S", "AppliedWritePolicy", "Failed"]

DIRTY_WAIT_S = 10.0          # longest a write-back Put waits for the demoter (see throttle_dirty)

Failed = list[tuple[RamBlock, BlockRecord, SsdWriteError]]


class AppliedWritePolicy(Room):
    """What the write policy does with a new block once it is in RAM (see the module). ``ssd``
    and ``mover`` are None without an SSD tier (then nothing here waits or publishes)."""

    def __init__(self, parts: StoreParts, ssd: SsdTier | None, mover: SsdMover | None) -> None:
        super().__init__(parts)
        self.ssd = ssd
        self.mover = mover

    # -- write_through_selective -----------------------------------------------------------------

    def commit_new(self, block: RamBlock) -> None:
        """Commit a block new to this daemon. Under write_through_selective it is held in RAM
        (clean: nothing wants it on SSD yet) until its hits earn it a write, see :meth:`on_hit`."""
        held = self.ssd is not None and self.settings.writes.hits_before_ssd > 0
        self.ram.commit(block, clean=held)
        if held:
            block.hits_to_ssd = self.settings.writes.hits_before_ssd

    def on_hit(self, block: RamBlock) -> None:
        """A read used ``block``: its last-seen time is due, and a block held back by
        write_through_selective is one hit closer to its SSD write."""
        self.ledger.touched(block.key)
        if block.hits_to_ssd > 0:
            block.hits_to_ssd -= 1
            if block.hits_to_ssd == 0:
                self.ram.mark_dirty(block)
                self.counters.held_written += 1
                if self.mover is not None:
                    self.mover.demote_wanted.set()

    # -- write_back ---------------------------------------------------------------------------

    async def throttle_dirty(self) -> None:
        """Write-back backpressure: while more than half the RAM tier is dirty (not yet on SSD),
        a Put waits for the demoter, so a writer faster than the disk slows to the disk's pace
        instead of pushing unwritten blocks out of RAM. A failing SSD, or a wait past
        ``DIRTY_WAIT_S``, lets the Put go: dirty blocks may then be dropped, and are counted."""
        mover = self.mover
        assert mover is not None
        deadline = self.clock() + DIRTY_WAIT_S
        while self.ram.dirty_bytes > self.settings.dirty_limit and not mover.ssd_failing and self.clock() < deadline:
            mover.demote_wanted.set()
            try:
                await asyncio.wait_for(mover.round_done.wait(), DIRTY_WAIT_S)
            except TimeoutError:
                return

    # -- write_through ------------------------------------------------------------------------

    def check_room(self, todo: list[tuple[int, PutItem]]) -> None:
        """Write-through: a new block the SSD tier cannot take, however much it evicts
        (kvcached.tiers.ssd.SsdSpace.refusal), fails the Put with ResourceExhausted before
        anything is stored or evicted."""
        assert self.ssd is not None
        for (i, item), refusal in zip(todo, self.ssd.refusals([len(item.payload) for _, item in todo])):
            if refusal is not None:
                raise ResourceExhausted(f"block {i} ({item.address}): {refusal.strerror}; nothing was stored "
                                        "(kv.write_policy = write_through keeps only blocks published on SSD)")

    async def dirty_blocks(self, keys: list[bytes]) -> list[tuple[RamBlock, BlockRecord]]:
        """The blocks of ``keys`` in RAM that are still dirty once any publish of them in
        progress is over; returned pinned, with their records."""
        await self.inflight.published(keys)
        dirty = [b for k in keys if (b := self.ram.get(k)) is not None and not b.clean]
        out = []
        for block, record in zip(dirty, self.index.get_many([b.key for b in dirty])):
            if record is not None and record.present:
                self.ram.hold(block)
                out.append((block, record))
        return out

    async def write_through(self, new: list[tuple[RamBlock, BlockRecord]], own: set[bytes]) -> tuple[
            Failed, list[RamBlock]]:
        """Publish pinned blocks on SSD and unpin them; those that fail, and those of ``own``
        (this request's new blocks) that the SSD write budget refuses, are not kept (a
        write-through store acknowledges only what is on SSD). A refused block stored earlier
        stays in RAM only, as write-back keeps it. Returns (failed, refused)."""
        assert self.mover is not None
        failed: Failed = []
        refused: list[tuple[RamBlock, BlockRecord]] = []
        try:
            allowed, refused = self.mover.within_budget(new)
            if allowed:
                failed = await asyncio.shield(self.mover.publish(allowed))
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
            self.ledger.delete_records([b.key for b in gone])
        return failed, [b for b, _ in refused]

    @staticmethod
    def publish_error(failed: Failed, result: PutResult, n: int) -> KvError:
        """The error a write-through Put of ``n`` blocks answers when ``failed`` were not
        published: ResourceExhausted for lack of room, Unavailable otherwise."""
        first = failed[0][2]
        text = (f"stored {result.stored} of {n} blocks; {len(failed)} could not be written to the SSD tier "
                f"(kv.write_policy = write_through) and were not kept: {first.strerror or first}")
        if isinstance(first, (SsdFull, SsdTooLarge)):      # no room: the messages name the directory and sizes
            return ResourceExhausted(text)
        return Unavailable(text)
