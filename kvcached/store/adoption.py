"""A predecessor's RAM tier, taken up: the blocks its slot directory names, back in their slots.

When a daemon starts with the arena and slot directory of the process before it (systemd's file
descriptor store after a crash or restart, or an upgrade's handover; docs/operations.md), every
committed entry of the directory (kvcached.tiers.slot_directory) is *placed*: its slot is taken
in the RAM tier, in state WRITING, so nothing can write there, evict it or serve it. Then each
placed block is either committed (it serves again, clean when its record says SSD too) or
aborted (its slot is free, its record loses RAM: lost at restart).

- ``trusted`` (a clean handover: the predecessor stopped every write and recorded every
  checksum before it passed the files): each block whose index record says RAM with the same
  length is committed at once.
- Otherwise (a crash): a block is committed only once its slot's bytes hash to its record's
  BLAKE3 checksum. Hashing runs in a worker thread, a batch at a time, while the daemon serves:
  a block not yet checked is simply not there yet (a Get misses it, or finds its SSD copy).

Blocks are committed oldest last-seen first, so the eviction policy meets them in about the
order they were used. The index's RAM bits are made true by the caller: the boot reconcile keeps
RAM only for the placed keys (:attr:`RamAdoption.placed_keys`), and every block aborted here is
written as lost at restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvcached.index import BlockIndex, GoneReason, Tier
from kvcached.tiers.ram import RamBlock, RamTier
from kvcached.tiers.slot_directory import SlotEntry
from kvcached_agent.integrity import payload_checksum

__all__ = ["AdoptionReport", "RamAdoption"]

log = logging.getLogger("kvcached.adoption")

BATCH_BYTES = 64 << 20      # hashed per worker-thread hand-off: the loop gets control back between batches
PROGRESS_S = 5.0


@dataclass
class AdoptionReport:
    """What an adoption did, in blocks (and bytes adopted)."""

    listed: int = 0         # committed entries in the directory
    placed: int = 0         # whose slots could be taken
    adopted: int = 0        # committed again: served
    adopted_bytes: int = 0
    mismatched: int = 0     # bytes did not hash to the record's checksum: dropped
    unrecorded: int = 0     # no record saying RAM with this length (its write never reached the index)
    conflicting: int = 0    # directory entries that overlap (never from a sound directory)
    trusted: bool = False
    elapsed_s: float = 0.0
    done: bool = False
    pending: list[RamBlock] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, int | float | bool]:
        return {"listed": self.listed, "adopted": self.adopted, "adopted_bytes": self.adopted_bytes,
                "mismatched": self.mismatched, "unrecorded": self.unrecorded, "conflicting": self.conflicting,
                "trusted": self.trusted, "elapsed_s": round(self.elapsed_s, 3), "done": self.done}


class RamAdoption:
    """Places ``entries`` in ``ram`` at construction; :meth:`run` checks and commits them."""

    def __init__(self, ram: RamTier, entries: Iterable[SlotEntry], *, trusted: bool) -> None:
        self.ram = ram
        self.report = AdoptionReport(trusted=trusted)
        self._t0 = time.monotonic()
        for entry in entries:
            self.report.listed += 1
            try:
                block = ram.place(entry.key, entry.slot, entry.cls, entry.length)
            except ValueError:
                self.report.conflicting += 1
                continue
            self.report.pending.append(block)
        self.report.placed = len(self.report.pending)

    @property
    def placed_keys(self) -> set[bytes]:
        return {block.key for block in self.report.pending}

    async def run(self, index: BlockIndex, executor: Executor | None, clock: Callable[[], float],
                  stopping: Callable[[], bool] = lambda: False) -> AdoptionReport:
        """Check (unless trusted) and commit every placed block; drop the rest, and write their
        records as lost at restart. Returns the report (also :attr:`report`)."""
        loop = asyncio.get_running_loop()
        report, ram = self.report, self.ram
        pending, report.pending = report.pending, []
        keys = [block.key for block in pending]
        seen = await loop.run_in_executor(executor, index.get_many, keys)     # for the order only
        order = sorted(range(len(pending)), key=lambda i: getattr(seen[i], "last_seen", 0.0))
        lost: list[bytes] = []
        next_progress = time.monotonic() + PROGRESS_S
        i = 0
        while i < len(order):
            batch: list[int] = []
            size = 0
            while i < len(order) and (not batch or size < BATCH_BYTES):
                batch.append(order[i])
                size += pending[order[i]].length
                i += 1
            if report.trusted:
                sums: list[bytes | None] = [None] * len(batch)
            else:       # the slots are WRITING: nothing changes their bytes while they are hashed
                sums = list(await loop.run_in_executor(executor, _checksums, [ram.view(pending[j]) for j in batch]))
            # The records as they are now, and the commits, with no await in between: a record
            # read before the hashing may have changed since (an SSD copy evicted meanwhile).
            fresh = index.get_many([pending[j].key for j in batch])
            for j, record, checksum in zip(batch, fresh, sums):
                block = pending[j]
                if record is None or not record.tiers & Tier.RAM or record.nbytes != block.length:
                    report.unrecorded += 1
                    ram.abort(block)
                    lost.append(block.key)
                elif checksum is None or checksum == record.checksum:
                    ram.commit(block, clean=bool(record.tiers & Tier.SSD))
                    report.adopted += 1
                    report.adopted_bytes += block.length
                else:
                    report.mismatched += 1
                    ram.abort(block)
                    lost.append(block.key)
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + PROGRESS_S
                log.info("checking the RAM tier left by the previous process",
                         extra={"fields": {"checked": i, "of": len(order), "adopted": report.adopted}})
            if stopping():
                for j in order[i:]:
                    ram.abort(pending[j])
                    lost.append(pending[j].key)
                i = len(order)
        if lost:
            index.write(index.without_tier(lost, Tier.RAM, GoneReason.LOST_AT_RESTART, clock()))
        report.elapsed_s = time.monotonic() - self._t0
        report.done = True
        return report


def _checksums(views: list[memoryview]) -> list[bytes]:
    return [payload_checksum(view) for view in views]
