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
  BLAKE3 checksum.

Either way the daemon serves meanwhile. :meth:`RamAdoption.run` goes through the blocks in the
background, a batch at a time (hashing in a worker thread), oldest last-seen first, so the
eviction policy meets them in about the order they were used. A request that names a block
not settled yet settles it first, on the spot (:meth:`RamAdoption.settle`, called by the
store's entry points): the blocks engines want most are served again at once, and a Put of such
a block finds it present instead of busy. The index's RAM bits are made true by the caller: the boot reconcile keeps
RAM only for the placed keys (:attr:`RamAdoption.placed_keys`), and every block aborted here is
written as lost at restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Iterable

from kvcached.index import BlockIndex, GoneReason, Tier
from kvcached.index.format import CHECKSUM_AT, F64, LAST_SEEN_AT, NBYTES_AT, RECORD, SCHEMA_VERSION, TIERS_AT, U64, record_tenant
from kvcached.tiers.ram import RamBlock, RamTier
from kvcached.tiers.slot_directory import SlotEntry
from kvcached_agent.integrity import CHECKSUM_BYTES, payload_checksum

__all__ = ["AdoptionReport", "RamAdoption"]

log = logging.getLogger("kvcached.adoption")

BATCH_BYTES = 64 << 20      # hashed per worker-thread hand-off: the loop gets control back between batches
SETTLE_BYTES = 64 << 20     # hashed on the spot for one request at most; blocks past it stay unsettled for now
PROGRESS_S = 5.0
_RAM, _SSD = int(Tier.RAM), int(Tier.SSD)


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
    other_tenants: int = 0  # blocks in an arena not of the tenant their record names (or of one no longer configured): dropped
    trusted: bool = False
    elapsed_s: float = 0.0
    settled_on_demand: int = 0   # settled because a request named them before the background pass did
    done: bool = False

    def summary(self) -> dict[str, int | float | bool]:
        return {"listed": self.listed, "adopted": self.adopted, "adopted_bytes": self.adopted_bytes,
                "mismatched": self.mismatched, "unrecorded": self.unrecorded, "conflicting": self.conflicting,
                "other_tenants": self.other_tenants, "on_demand": self.settled_on_demand, "trusted": self.trusted,
                "elapsed_s": round(self.elapsed_s, 3),
                "done": self.done}


class RamAdoption:
    """Places ``entries`` in ``ram`` at construction; :meth:`run` checks and commits them, and
    :meth:`settle` does so on the spot for the blocks a request names."""

    def __init__(self, ram: RamTier, entries: Iterable[SlotEntry], *, trusted: bool) -> None:
        self.ram = ram
        self.report = AdoptionReport(trusted=trusted)
        self.pending: dict[bytes, RamBlock] = {}     # placed, not settled yet
        self._t0 = time.monotonic()
        self._unplaced: list[bytes] = []             # in an arena not taken up: their records lose RAM
        for entry in entries:
            self.report.listed += 1
            if entry.owner not in ram.arenas or (entry.owner and ram.shares is None):
                self.report.other_tenants += 1
                self._unplaced.append(entry.key)
                continue
            try:
                block = ram.place(entry.key, entry.slot, entry.cls, entry.length, entry.owner)
            except ValueError:
                self.report.conflicting += 1
                continue
            self.pending[block.key] = block
        self.report.placed = len(self.pending)

    @property
    def placed_keys(self) -> set[bytes]:
        return set(self.pending)

    def settle(self, keys: Iterable[bytes], index: BlockIndex, clock: Callable[[], float],
               budget: int | None = SETTLE_BYTES) -> None:
        """Settle those of ``keys`` still pending, now, in order, until ``budget`` bytes were
        hashed (None: all of them): a request is about to name them."""
        pending = self.pending
        todo = [pending.pop(key) for key in keys if key in pending]
        if not todo:
            return
        if budget is not None and not self.report.trusted:
            size, n = 0, 0
            while n < len(todo) and (n == 0 or size + todo[n].length <= budget):
                size += todo[n].length
                n += 1
            for block in todo[n:]:          # left for later, as they were
                pending[block.key] = block
            todo = todo[:n]
        self.report.settled_on_demand += len(todo)
        sums = [None] * len(todo) if self.report.trusted else _checksums([self.ram.view(b) for b in todo])
        lost = self._decide(todo, index.raw_many([b.key for b in todo]), sums)
        if lost:
            index.write(index.without_tier(lost, Tier.RAM, GoneReason.LOST_AT_RESTART, clock()))

    def _decide(self, blocks: list[RamBlock], records: list[bytes | None],
                sums: list[bytes] | list[None]) -> list[bytes]:
        """Commit or drop each of ``blocks`` by its raw record (and checksum); the keys dropped.
        Raw: three fields read in place (kvcached.index.format), not a record decoded, per block."""
        report, ram = self.report, self.ram
        lost = []
        for block, raw, checksum in zip(blocks, records, sums):
            tiers = _tiers_of(raw, block.length)
            if not tiers & _RAM:
                report.unrecorded += 1
                ram.abort(block)
                lost.append(block.key)
            elif record_tenant(raw) != ram.tenant_of(block.key):     # type: ignore[arg-type]
                # its bytes lie in another tenant's arena than its record names (or in the
                # default tenant's, where tenants are no longer counted): never served
                report.other_tenants += 1
                ram.abort(block)
                lost.append(block.key)
            elif checksum is None or checksum == raw[CHECKSUM_AT:CHECKSUM_AT + CHECKSUM_BYTES]:  # type: ignore[index]
                ram.commit(block, clean=bool(tiers & _SSD))
                report.adopted += 1
                report.adopted_bytes += block.length
            else:
                report.mismatched += 1
                ram.abort(block)
                lost.append(block.key)
        return lost

    async def run(self, index: BlockIndex, executor: Executor | None, clock: Callable[[], float],
                  stopping: Callable[[], bool] = lambda: False) -> AdoptionReport:
        """Check (unless trusted) and commit every placed block not settled on demand meanwhile;
        drop the rest, and write their records as lost at restart. Returns :attr:`report`."""
        loop = asyncio.get_running_loop()
        report, pending = self.report, self.pending
        keys = list(pending)
        raws = await loop.run_in_executor(executor, index.raw_many, keys)     # for the order only
        ages = [_last_seen(raw) for raw in raws]
        order = [keys[i] for i in sorted(range(len(keys)), key=ages.__getitem__)]
        del raws, ages
        lost: list[bytes] = [key for key in self._unplaced if key not in pending]
        next_progress = time.monotonic() + PROGRESS_S
        i = 0
        while i < len(order) and not stopping():
            batch: list[RamBlock] = []
            size = 0
            while i < len(order) and (not batch or size < BATCH_BYTES):
                block = pending.get(order[i])
                i += 1
                if block is not None:
                    batch.append(block)
                    size += block.length
            if not batch:
                continue
            if report.trusted:
                sums: list[bytes] | list[None] = [None] * len(batch)
            else:       # the slots are WRITING: nothing changes their bytes while they are hashed
                sums = await loop.run_in_executor(executor, _checksums, [self.ram.view(b) for b in batch])
            # Settled on demand meanwhile: not again. The records as they are now, and the
            # commits, with no await in between (a record may have changed during the hashing).
            keep = [j for j, b in enumerate(batch) if pending.get(b.key) is b]
            batch, sums = [batch[j] for j in keep], [sums[j] for j in keep]   # type: ignore[assignment]
            for block in batch:
                del pending[block.key]
            lost += self._decide(batch, index.raw_many([b.key for b in batch]), sums)
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + PROGRESS_S
                log.info("checking the RAM tier left by the previous process",
                         extra={"fields": {"checked": i, "of": len(order), "adopted": report.adopted}})
        for block in list(pending.values()) if stopping() else []:
            self.ram.abort(block)
            lost.append(block.key)
        pending.clear()
        if lost:
            index.write(index.without_tier(lost, Tier.RAM, GoneReason.LOST_AT_RESTART, clock()))
        report.elapsed_s = time.monotonic() - self._t0
        report.done = True
        return report


def _readable(raw: bytes | None) -> bool:
    return raw is not None and len(raw) >= RECORD.size and raw[0] == SCHEMA_VERSION


def _tiers_of(raw: bytes | None, length: int) -> int:
    """The tiers of a raw record that describes a block of ``length`` bytes (0 otherwise)."""
    if not _readable(raw) or U64.unpack_from(raw, NBYTES_AT)[0] != length:  # type: ignore[arg-type]
        return 0
    return raw[TIERS_AT]  # type: ignore[index]


def _last_seen(raw: bytes | None) -> float:
    return F64.unpack_from(raw, LAST_SEEN_AT)[0] if _readable(raw) else 0.0  # type: ignore[arg-type]


def _checksums(views: list[memoryview]) -> list[bytes]:
    return [payload_checksum(view) for view in views]
