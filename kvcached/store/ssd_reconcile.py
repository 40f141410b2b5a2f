"""Boot reconcile of the SSD tier: make the index and the block files agree again.

After a crash the directory can hold temporary files of interrupted writes, files whose index
record never got written (or was dropped), files that do not match their record (torn, or
overwritten by a block whose name collides); the index can name files that are gone. The
reconcile walks both, in a worker thread, while the daemon already serves:

1. every file: temporary files of earlier runs are removed; a block file must have a valid
   header whose block has an index record on SSD, that names this very path, with the same
   length and checksum, and the file the right size; a good file is counted (the tier's size)
   and re-queued for SSD eviction, any other is removed;
2. every index record on SSD: its file must still exist (one ``stat``); else the record loses
   the SSD tier.

Reads need not wait: every SSD read verifies the header and the payload checksum anyway, so a
block not yet checked is either served verified or is a miss. Files this run publishes are
left alone (:attr:`SsdTier.fresh`). Payloads are not hashed here (a full read of the tier would
take minutes); each is verified when it is read. While the index cannot be written (its disk is
full), the walk waits for it to recover (the daemon's loop recovers it) instead of failing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from kvcached.index import BlockIndex, IndexUnwritable, Tier, queue_entry, raw_ssd_view, record_tenant
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import HeaderError
from kvcached.tiers.ssd_usage import TenantUse
from kvcached_agent.address import index_key

__all__ = ["ReconcileReport", "reconcile_ssd"]

log = logging.getLogger("kvcached.ssd")

PROGRESS_EVERY = 20_000
QUEUE_BATCH = 10_000
UNWRITABLE_WAIT_S = 0.5    # how often a walk waiting for the index to recover looks again


@dataclass(slots=True)
class ReconcileReport:
    records: int = 0          # index records on SSD looked at
    adopted: int = 0          # ... whose file is good
    adopted_bytes: int = 0    # their payload bytes
    adopted_file_bytes: int = 0   # ... and file bytes
    on_ssd: int = 0               # records on SSD whose file exists, this run's included: the tier's
    on_ssd_bytes: int = 0         # size when the walk ends (removals of earlier files while the
    on_ssd_file_bytes: int = 0    # reconcile ran make any count kept along the way wrong)
    by_tenant: dict[str, TenantUse] = field(default_factory=dict)   # the same by tenant tag
    files: int = 0            # files looked at
    stale_tmp: int = 0        # temporary files of earlier runs removed
    orphans: int = 0          # block files no record claims, removed
    bad_files: int = 0        # unreadable headers, wrong size, disagreeing with the record: removed
    elapsed_s: float = 0.0
    lost: list[bytes] = field(default_factory=list)   # keys whose record must lose the SSD tier

    def summary(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("records", "adopted", "adopted_bytes", "files", "stale_tmp",
                                                "orphans", "bad_files", "elapsed_s")} | {"lost": len(self.lost)}


def reconcile_ssd(index: BlockIndex, ssd: SsdTier, stop: Callable[[], bool] = lambda: False,
                  status: Callable[[str, int], None] | None = None) -> ReconcileReport:
    """Run the reconcile (in a worker thread). Files are removed here; the records to change
    are returned in ``lost`` for the index's owner to apply (it re-checks each one).

    One header read per file: the files are walked first (each good file is counted and
    re-queued, each bad one removed); then the records are walked with a ``stat`` each, to find
    the ones whose file is gone (never there, or removed by the first pass). ``status(phase,
    seen)`` is told the progress (systemd's STATUS line) as the log is."""
    report = ReconcileReport()
    t0 = time.monotonic()

    def progress(phase: str, seen: int) -> None:
        if seen % PROGRESS_EVERY == 0:
            log.info("reconciling SSD tier", extra={"fields": {"phase": phase, "seen": seen,
                                                               "elapsed_s": round(time.monotonic() - t0, 1)}})
            if status is not None:
                status(phase, seen)

    queue: list[bytes] = []
    for entry in ssd.walk():
        report.files += 1
        progress("files", report.files)
        if report.files % 10_000 == 0 and stop():
            return report
        name = entry.name
        if ssd.is_stale_tmp(name):
            report.stale_tmp += 1
            _remove(ssd, entry.path)
            continue
        if not ssd.is_block_name(name) or ssd.is_fresh(entry.path):
            continue
        try:
            header, size = ssd.read_header(entry.path)
        except FileNotFoundError:
            continue
        except (OSError, HeaderError) as exc:
            report.bad_files += 1
            log.warning("unreadable SSD block file removed", extra={"fields": {"file": entry.path, "problem": str(exc)}})
            _remove(ssd, entry.path)
            continue
        key = index_key(header.digest, header.layer)
        raw = index.raw(key)
        view = raw_ssd_view(raw) if raw is not None else None
        problem: str | None
        if view is None or not view[0] & Tier.SSD:
            problem = "no index record claims it"
        elif ssd.path_of(key, header.digest, header.layer) != entry.path:
            problem = "it lies under another block's name"
        elif size != header.file_size:
            problem = f"file is {size} bytes, expected {header.file_size}"
        else:
            problem = header.disagreement(view[4], view[5], view[1], view[3])
        if problem is None:
            report.adopted += 1
            report.adopted_bytes += view[1]           # type: ignore[index]
            report.adopted_file_bytes += size
            queue.append(queue_entry(view[2], key))   # type: ignore[index]
            if len(queue) >= QUEUE_BATCH:
                if not _write_queue(index, queue, stop):
                    return report
                queue = []
        elif problem == "no index record claims it":
            report.orphans += 1
            _remove(ssd, entry.path)
        else:
            report.bad_files += 1
            log.warning("SSD block file does not match the index; removed",
                        extra={"fields": {"file": entry.path, "problem": problem}})
            _remove(ssd, entry.path)
    if not _write_queue(index, queue, stop):
        return report
    for key, raw in index.ssd_records(stop):
        view = raw_ssd_view(raw)
        if view is None:
            continue
        report.records += 1
        progress("index", report.records)
        path = ssd.path_of(key, view[4], view[5])
        size = _file_size(path)
        if size >= 0:        # a coded block's file is its own size: counted as it is
            report.on_ssd += 1
            report.on_ssd_bytes += view[1]
            report.on_ssd_file_bytes += size
            tenant = record_tenant(raw)
            use = report.by_tenant.get(tenant)
            if use is None:
                use = report.by_tenant[tenant] = TenantUse()
            use.add(1, view[1], size)
        elif not ssd.is_fresh(path):
            report.lost.append(key)
    report.elapsed_s = round(time.monotonic() - t0, 3)
    return report


def _write_queue(index: BlockIndex, queue: list[bytes], stop: Callable[[], bool]) -> bool:
    """Write SSD queue entries; while the index cannot be written, wait for it to recover.
    False if ``stop()`` said to end first."""
    while True:
        try:
            index.write(queue=queue)
            return True
        except IndexUnwritable:
            if stop():
                return False
            time.sleep(UNWRITABLE_WAIT_S)


def _remove(ssd: SsdTier, path: str) -> None:
    if ssd.is_fresh(path):     # published by this run since it was looked at
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:     # a directory under a block's name, no permission: say so, go on
        log.error("cannot remove from the SSD directory", extra={"fields": {"file": path, "error": str(exc)}})


def _file_size(path: str) -> int:
    """The size of ``path`` (-1: there is no such file)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
