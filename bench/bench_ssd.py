"""kvcached SSD-tier benchmark: every figure next to a baseline measured in the same run.

    python bench/bench_ssd.py [--json PATH] [--quick] [--dir DIR] [--reconcile-files N] [--threads N]

Everything runs in a fresh temporary directory under ``--dir`` (default ``var/bench-ssd/`` in
the repository: the same disk as the repository, ignored by git), removed afterwards. These
machines are shared and noisy (see /work/shared/BASELINES.md): compare ratios, not absolute
numbers. The filesystem is named in the output; on ext4 without a journal (as on these
machines) creating a file is expensive while inodes of its block group were deleted in the
last minutes, which a one-file-per-block tier pays and fio does not.

1. Throughput of :meth:`SsdTier.write_many` and :meth:`SsdTier.read_many` (kvcached.tiers.ssd)
   for 64 KiB and 1 MiB blocks: durability "batch" (commit wait ``--commit-ms``, default 10 as
   kv.ssd_commit_ms), ``direct_io="auto"`` (O_DIRECT where the filesystem allows it; the output
   says if it does not), ``--threads`` I/O threads (default 16), batches as big as one
   write-back round of the store (256 x 64 KiB, 64 x 1 MiB: kvcached.store.ssd_mover DEMOTE_BATCH_*),
   ``--inflight`` batches at once (default 1: the daemon's write-back issues one round at a
   time). Payloads come from a page-aligned anonymous mmap cut into slots, like the RAM arena
   (``SsdWrite.payload`` is a memoryview of a slot); reads go into page-aligned slots of another
   mmap. Every read must come back verified (read_into returns None) and one in ``CHECK_EVERY``
   is also compared byte for byte with its source (memcmp, on the clock). Keys are real index
   keys of random digests, so blocks spread over the 4096 leaf directories, which are created
   before timing (a long-lived tier has them all). Each pass writes fresh blocks; files stay
   until the figure ends. GB/s counts payload bytes (kvcached also writes a 4 KiB header page
   per block). 256 MiB of 64 KiB blocks and 1.5 GiB of 1 MiB blocks per pass.

   Baseline: fio on the same directory, ``--direct=1 --ioengine=libaio --iodepth=<threads>``
   (``psync`` with ``--numjobs=<threads>`` where libaio is missing), same block size, a
   sequential write then read of one file of the same total size; ``bw_bytes`` from
   ``--output-format=json``. Targets, durability "batch" and reads: >= 0.7x fio for 1 MiB
   blocks, >= 0.5x for 64 KiB. kvcached's batch writes include what fio's do not: a group
   commit (fsync of every file, rename, fsync of each directory touched).

   Second baseline, no target: "bare files", the same files (names, leaves, header page, tmp +
   rename, group fsync, O_DIRECT) written and read by a plain thread pool without asyncio,
   header encoding or BLAKE3: the gap to it is what kvcached's own code costs, the gap from it
   to fio what one file per block costs on this filesystem.

   kvcached, fio and bare files run in interleaved rounds (``--rounds``, default 3; the order
   reverses every round); each side's median round is shown, and the ratio is the median over
   rounds of the two sides' ratio within a round. Extra rows, one run each, no target:
   "batch" against fio ``--fsync=<batch>`` (one fsync per batch), durability "always" against
   fio ``--fsync=1`` (each block made durable alone), "none" against plain fio, and "batch"
   with 4 batches in flight.

2. Boot reconcile of ``--reconcile-files`` block files (default 100,000, 4 KiB payloads): the
   files are written through SsdTier (durability "none", to be quick) with a BlockIndex record
   each (tiers = SSD, written with ``BlockIndex.write``), then a fresh SsdTier is opened (as
   after a restart) and :func:`kvcached.store.ssd_reconcile.reconcile_ssd` is timed, open included.
   Baseline: a bare scan of the same tree in one thread (os.scandir of every leaf; open, fstat,
   pread of the 4 KiB header page, close of every file), the least file work any reconcile must
   do. The header pages are dropped from the page cache (posix_fadvise DONTNEED, untimed) before
   each timed pass; with ``--drop-caches`` (root) the whole page, dentry and inode cache is
   dropped instead, closer to a reboot but it slows every process on the machine for a while.
   Then stale temporary files, orphan block files, records whose file is gone and torn
   (truncated) files are mixed in and the reconcile runs again; every count of its report is
   checked (exit status 1 if one is wrong). This figure runs first: creating 100k files goes
   faster before figure 1 deletes its own.

--quick: one round of 32 MiB / 128 MiB per case, no 4-in-flight pass, 5k files to reconcile: a
smoke test (< 30 s on a quiet machine). Progress goes to stderr, the table to stdout; --json
PATH writes the figures with details.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import mmap
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence, TypeVar

import blake3

from kvcached.index import BlockIndex, BlockRecord, Tier, queue_entry
from kvcached.store.ssd_reconcile import ReconcileReport, reconcile_ssd
from kvcached.tiers.ssd import Durability, SsdTier, SsdWrite
from kvcached.tiers.ssd_format import PAGE, TMP_MARK, BlockHeader, block_dir, block_name, leaf_dirs, padded
from kvcached_agent.address import index_key

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "var" / "bench-ssd"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = (64 * KiB, 1 * MiB)
BATCH = {64 * KiB: 256, 1 * MiB: 64}          # blocks per write_many: one write-back round (store.DEMOTE_BATCH_*)
TARGET = {64 * KiB: 0.5, 1 * MiB: 0.7}        # kvcached / fio, durability "batch" and reads
SOURCE_BYTES = 256 * MiB                      # the source arena; blocks cycle over its slots
CHECK_EVERY = 8                               # one read in this many is compared with its source
RECONCILE_PAYLOAD = 4 * KiB
MODEL = "bench/ssd"
STALE_TOKEN = "stale000"                      # not hex: never a live boot token

T = TypeVar("T")
_T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[bench-ssd {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def count_name(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else f"{n:,}"


@dataclass(frozen=True)
class Settings:
    rounds: int
    total: dict[int, int]       # bytes written (and read) per case, per block size
    reconcile_files: int
    stale_tmp: int              # mixed into the second reconcile ...
    orphans: int
    missing: int                # records whose file is deleted
    torn: int                   # files truncated to their header page
    extras: bool                # also the 4-batches-in-flight pass


FULL = Settings(rounds=3, total={64 * KiB: 256 * MiB, 1 * MiB: 1536 * MiB}, reconcile_files=100_000,
                stale_tmp=300, orphans=300, missing=100, torn=100, extras=True)
QUICK = Settings(rounds=1, total={64 * KiB: 32 * MiB, 1 * MiB: 128 * MiB}, reconcile_files=5_000,
                 stale_tmp=50, orphans=50, missing=20, torn=20, extras=False)


@dataclass
class Row:
    """One printed figure: kvcached against its baseline."""

    figure: int
    case: str
    unit: str
    kvcached: float
    baseline_name: str
    baseline: float
    higher_is_better: bool
    target: str = ""
    passed: bool | None = None
    verdict_text: str = ""      # overrides PASS/BELOW (e.g. a count check)
    details: dict[str, Any] = field(default_factory=dict)
    paired_ratio: float | None = None

    @property
    def ratio(self) -> float:
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.kvcached / self.baseline if self.baseline else float("nan")

    @property
    def verdict(self) -> str:
        if self.verdict_text:
            return self.verdict_text
        return "-" if self.passed is None else ("PASS" if self.passed else "BELOW")


# =============================================================================================
# memory: page-aligned arenas, compared with memcmp


_libc = ctypes.CDLL(None, use_errno=True)
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcmp.restype = ctypes.c_int


class Arena:
    """An anonymous mmap (page aligned, as the RAM tier's arena) cut into equal slots."""

    def __init__(self, slot_bytes: int, slots: int, *, random_fill: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.mm = mmap.mmap(-1, slot_bytes * slots)
        if random_fill:
            chunk = 16 * MiB
            for off in range(0, len(self.mm), chunk):
                n = min(chunk, len(self.mm) - off)
                self.mm[off:off + n] = os.urandom(n)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)

    def slot(self, i: int, nbytes: int | None = None) -> memoryview:
        """A view of slot ``i`` (the caller releases it)."""
        off = i * self.slot_bytes
        return memoryview(self.mm)[off:off + (self.slot_bytes if nbytes is None else nbytes)]

    def same(self, i: int, other: "Arena", j: int, nbytes: int) -> bool:
        """Bytes ``[0, nbytes)`` of slot ``i`` equal those of ``other``'s slot ``j``."""
        return _libc.memcmp(self.address + i * self.slot_bytes, other.address + j * other.slot_bytes, nbytes) == 0

    def close(self) -> None:
        del self._anchor
        self.mm.close()


@dataclass
class Blocks:
    """Blocks of one size: index keys, headers, and the source slot of each payload."""

    size: int
    keys: list[bytes]
    headers: list[BlockHeader]
    slots: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def items(self) -> list[tuple[bytes, BlockHeader]]:
        return list(zip(self.keys, self.headers))


def make_blocks(size: int, count: int, source: Arena, sums: list[bytes], start_slot: int = 0) -> Blocks:
    """``count`` blocks with random digests (so random keys and leaf directories) whose
    payloads cycle over the source arena's slots; ``sums`` are the slots' BLAKE3 checksums."""
    now = time.time()
    keys, headers, slots = [], [], []
    for i in range(count):
        digest = os.urandom(32)
        layer = i % 32
        slot = (start_slot + i) % source.slots
        keys.append(index_key(digest, layer))
        headers.append(BlockHeader(digest, layer, size, sums[slot], now))
        slots.append(slot)
    return Blocks(size, keys, headers, slots)


def slot_sums(source: Arena, nbytes: int) -> list[bytes]:
    out = []
    for i in range(source.slots):
        view = source.slot(i, nbytes)
        out.append(blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest())
        view.release()
    return out


# =============================================================================================
# kvcached side


def open_tier(directory: Path, durability: Durability, threads: int, commit_s: float) -> SsdTier:
    """An opened SsdTier that tracks no fresh paths (as after the boot reconcile)."""
    ssd = SsdTier(str(directory), 1 << 50, durability=durability, commit_s=commit_s, direct_io="auto", threads=threads)
    ssd.open()
    ssd.reconciled(0, 0, 0)
    return ssd


async def kv_write(ssd: SsdTier, blocks: Blocks, source: Arena, batch: int, inflight: int) -> float:
    """Publish every block through write_many, ``inflight`` batches at once; seconds."""
    batches = iter([range(i, min(i + batch, len(blocks))) for i in range(0, len(blocks), batch)])

    async def worker() -> None:
        for idx in batches:
            writes = [SsdWrite(blocks.keys[i], blocks.headers[i], source.slot(blocks.slots[i], blocks.size)) for i in idx]
            try:
                errors = await ssd.write_many(writes)
            finally:
                for w in writes:
                    w.payload.release()
            failed = [e for e in errors if e is not None]
            if failed:
                raise RuntimeError(f"write_many: {len(failed)} of {len(writes)} blocks failed, first: {failed[0]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return time.perf_counter() - t0


async def kv_read(ssd: SsdTier, blocks: Blocks, source: Arena, dest: Arena, batch: int, inflight: int) -> tuple[float, int]:
    """Read every block into ``dest`` through read_many (as a promotion does), ``inflight`` batches at once (each
    worker owns ``batch`` slots of ``dest``); one block in CHECK_EVERY is compared with its
    source. Returns (seconds, blocks compared)."""
    batches = iter([range(i, min(i + batch, len(blocks))) for i in range(0, len(blocks), batch)])
    compared = 0

    async def worker(w: int) -> None:
        nonlocal compared
        base = w * batch
        for idx in batches:
            views = [dest.slot(base + j) for j in range(len(idx))]
            try:
                problems = await ssd.read_many([(blocks.keys[i], blocks.headers[i], v) for i, v in zip(idx, views)])
            finally:
                for v in views:
                    v.release()
            bad = [(i, p) for i, p in zip(idx, problems) if p is not None]
            if bad:
                raise RuntimeError(f"read_into: {len(bad)} of {len(idx)} blocks not served, first: {bad[0][1]}")
            for j, i in enumerate(idx):
                if i % CHECK_EVERY == 0:
                    if not dest.same(base + j, source, blocks.slots[i], blocks.size):
                        raise RuntimeError(f"block {i}: bytes read differ from the bytes written (read_into said OK)")
                    compared += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return time.perf_counter() - t0, compared


def drop_file_cache(paths: Sequence[str]) -> None:
    """Drop the page cache of these files (clean pages; untimed helper)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# =============================================================================================
# fio side


@dataclass
class Fio:
    """fio runs on one directory: sequential write then read of one file per job."""

    exe: str
    engine: str     # "libaio" or "psync"
    depth: int      # libaio: --iodepth; psync: --numjobs
    direct: bool

    @classmethod
    def find(cls, depth: int, direct: bool) -> "Fio | None":
        exe = shutil.which("fio")
        if exe is None:
            return None
        engines = subprocess.run([exe, "--enghelp"], capture_output=True, text=True).stdout
        engine = "libaio" if "libaio" in engines.split() else "psync"
        return cls(exe, engine, depth, direct)

    def describe(self, fsync: int = 0) -> str:
        how = f"libaio QD{self.depth}" if self.engine == "libaio" else f"psync x{self.depth} jobs"
        return f"fio {how}" + (f" fsync={fsync}" if fsync else "") + ("" if self.direct else " (buffered)")

    def argv(self, directory: Path, rw: str, bs: int, total: int, fsync: int, out: Path) -> list[str]:
        args = [self.exe, "--name=kvbench", f"--rw={rw}", f"--bs={bs}", f"--direct={int(self.direct)}",
                f"--ioengine={self.engine}", "--output-format=json", f"--output={out}"]
        if self.engine == "libaio":
            args += [f"--filename={directory / 'fio.0.dat'}", f"--size={total}", f"--iodepth={self.depth}"]
        else:
            args += [f"--directory={directory}", "--filename_format=fio.$jobnum.dat", f"--numjobs={self.depth}",
                     f"--size={total // self.depth}", "--group_reporting"]
        if not self.direct:     # no O_DIRECT here: start each job from an empty cache, write to the disk
            args += ["--invalidate=1"] + (["--end_fsync=1"] if rw == "write" else [])
        if fsync:
            args.append(f"--fsync={fsync}")
        return args

    def run(self, directory: Path, rw: str, bs: int, total: int, fsync: int = 0) -> dict[str, Any]:
        """One fio job; its bandwidth (bytes/s) and runtime from fio's JSON."""
        out = directory / f"fio-{rw}.json"
        argv = self.argv(directory, rw, bs, total, fsync, out)
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-2000:]}")
        text = out.read_text()
        doc = json.loads(text[text.index("{"):])     # fio may put warnings before the JSON
        out.unlink()
        job = doc["jobs"][0]
        if job.get("error"):
            raise RuntimeError(f"fio job error {job['error']}: {' '.join(argv)}")
        side = job[rw]
        return {"gbps": side["bw_bytes"] / 1e9, "bw_bytes": side["bw_bytes"], "io_bytes": side["io_bytes"],
                "runtime_ms": side["runtime"], "argv": " ".join(argv[1:])}

    def clean(self, directory: Path) -> None:
        for f in directory.glob("fio.*.dat"):
            f.unlink()


# =============================================================================================
# bare files: the tier's on-disk protocol in the fewest Python calls (a second baseline)


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BareFiles:
    """The same files as SsdTier (same names and leaf directories, a 4 KiB header page, then
    the payload, O_DIRECT, ``<name>.tmp`` renamed into place), written and read with plain
    threads and no asyncio, no header encoding and no checksum. Writes: per batch, write every
    file (in parallel), fsync and close each (in parallel), rename each, fsync each directory
    touched (in parallel): kvcached's group commit without its wait. Reads: open, fstat, one
    preadv into the header page and the destination slot, close; no BLAKE3 check. The gap to
    this is what kvcached's own code costs."""

    def __init__(self, directory: Path, threads: int, direct: bool) -> None:
        self.blocks_dir = directory / "blocks"
        for leaf in leaf_dirs():
            (self.blocks_dir / leaf).mkdir(parents=True, exist_ok=True)
        self.direct = os.O_DIRECT if direct else 0
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bare-files")
        self.header = mmap.mmap(-1, PAGE)       # written by every thread (read-only use)
        self.local = threading.local()          # per-thread header page for reads

    def path(self, key: bytes, header: BlockHeader) -> str:
        return os.path.join(self.blocks_dir, block_dir(key), block_name(header.digest, header.layer))

    def _write_tmp(self, final: str, payload: memoryview) -> int:
        try:
            fd = os.open(final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | self.direct, 0o600)
            os.pwritev(fd, [self.header, payload], 0)
        finally:
            payload.release()
        return fd

    def _read(self, path: str, dest: memoryview) -> int:
        head = getattr(self.local, "head", None)
        if head is None:
            head = self.local.head = mmap.mmap(-1, PAGE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self.direct)
            try:
                os.fstat(fd)
                return os.preadv(fd, [head, dest], 0)
            finally:
                os.close(fd)
        finally:
            dest.release()

    def write(self, blocks: Blocks, source: Arena, batch: int) -> float:
        t0 = time.perf_counter()
        for start in range(0, len(blocks), batch):
            idx = range(start, min(start + batch, len(blocks)))
            finals = [self.path(blocks.keys[i], blocks.headers[i]) for i in idx]
            fds = list(self.pool.map(self._write_tmp, finals, [source.slot(blocks.slots[i], blocks.size) for i in idx]))
            list(self.pool.map(_fsync_close, fds))
            for final in finals:
                os.rename(final + ".tmp", final)
            list(self.pool.map(_fsync_dir, {os.path.dirname(f) for f in finals}))
        return time.perf_counter() - t0

    def read(self, blocks: Blocks, source: Arena, dest: Arena, batch: int) -> float:
        t0 = time.perf_counter()
        want = PAGE + padded(blocks.size)
        for start in range(0, len(blocks), batch):
            idx = range(start, min(start + batch, len(blocks)))
            got = list(self.pool.map(self._read, [self.path(blocks.keys[i], blocks.headers[i]) for i in idx],
                                     [dest.slot(j) for j in range(len(idx))]))
            if any(n != want for n in got):
                raise RuntimeError(f"bare files: short read {min(got)} of {want} bytes")
            for j, i in enumerate(idx):
                if i % CHECK_EVERY == 0 and not dest.same(j, source, blocks.slots[i], blocks.size):
                    raise RuntimeError(f"bare files: block {i} read back differs")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# =============================================================================================
# figure 1: throughput


@dataclass
class ThroughputCtx:
    directory: Path             # fio's files; kvcached's tree is directory/kv, the bare files' directory/bare
    fio: Fio
    bare: BareFiles
    threads: int
    commit_s: float
    inflight: int
    runner: asyncio.Runner
    sources: dict[int, tuple[Arena, list[bytes]]]
    dests: dict[int, Arena]

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def blocks(self, size: int, total: int) -> Blocks:
        source, sums = self.sources[size]
        return make_blocks(size, max(1, total // size), source, sums, start_slot=random.randrange(source.slots))


def cpu_per_block(before: os.times_result, blocks: int) -> dict[str, float]:
    """This process's user and system CPU microseconds per block since ``before``."""
    now = os.times()
    return {"user_us_per_block": (now.user - before.user) / blocks * 1e6,
            "sys_us_per_block": (now.system - before.system) / blocks * 1e6}


def kv_pass(ctx: ThroughputCtx, size: int, total: int, durability: Durability, *, inflight: int | None = None,
            read: bool = True) -> dict[str, Any]:
    """Write ``total`` bytes of fresh ``size`` blocks through SsdTier, then read them back
    (optional). Files stay until the end of the figure: on this kind of machine's ext4 (no
    journal) a file created soon after others were deleted costs much more kernel time, and
    deleting between passes would make each pass pay for the one before."""
    source, _ = ctx.sources[size]
    blocks = ctx.blocks(size, total)
    flight = ctx.inflight if inflight is None else inflight
    ssd = open_tier(ctx.directory / "kv", durability, ctx.threads, ctx.commit_s)
    try:
        nbytes = len(blocks) * size
        c0 = os.times()
        w_s = ctx.run(kv_write(ssd, blocks, source, BATCH[size], flight))
        out: dict[str, Any] = {"write": {"gbps": nbytes / w_s / 1e9, "seconds": w_s, "blocks": len(blocks),
                                         "group_commits": ssd.counters.group_commits, **cpu_per_block(c0, len(blocks))}}
        if read:
            if not ssd.direct:    # buffered I/O: make the reads come from the disk, not the page cache
                drop_file_cache([ssd.path_of(k, h.digest, h.layer) for k, h in blocks.items()])
            c0 = os.times()
            r_s, compared = ctx.run(kv_read(ssd, blocks, source, ctx.dests[size], BATCH[size], flight))
            out["read"] = {"gbps": nbytes / r_s / 1e9, "seconds": r_s, "blocks": len(blocks), "compared": compared,
                           **cpu_per_block(c0, len(blocks))}
    finally:
        ctx.run(ssd.close())
    return out


def bare_pass(ctx: ThroughputCtx, size: int, total: int) -> dict[str, Any]:
    source, _ = ctx.sources[size]
    blocks = ctx.blocks(size, total)
    nbytes = len(blocks) * size
    c0 = os.times()
    w_s = ctx.bare.write(blocks, source, BATCH[size])
    w_cpu = cpu_per_block(c0, len(blocks))
    if not ctx.bare.direct:
        drop_file_cache([ctx.bare.path(k, h) for k, h in blocks.items()])
    c0 = os.times()
    r_s = ctx.bare.read(blocks, source, ctx.dests[size], BATCH[size])
    return {"write": {"gbps": nbytes / w_s / 1e9, "seconds": w_s, "blocks": len(blocks), **w_cpu},
            "read": {"gbps": nbytes / r_s / 1e9, "seconds": r_s, "blocks": len(blocks), **cpu_per_block(c0, len(blocks))}}


def fio_pass(ctx: ThroughputCtx, size: int, total: int, *, fsync: int = 0, read: bool = True) -> dict[str, Any]:
    try:
        out = {"write": ctx.fio.run(ctx.directory, "write", size, total, fsync)}
        if read:
            out["read"] = ctx.fio.run(ctx.directory, "read", size, total)
        return out
    finally:
        ctx.fio.clean(ctx.directory)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda x: x["gbps"])
    return {**ordered[len(ordered) // 2], "rounds_gbps": [x["gbps"] for x in runs]}


def paired(kv: list[dict[str, Any]], base: list[dict[str, Any]]) -> float:
    """Median over rounds of kvcached / baseline within the same round (the disk's speed drifts)."""
    return statistics.median(k["gbps"] / b["gbps"] for k, b in zip(kv, base))


BARE_NAME = "bare files (threads, no hash)"


def bench_throughput(ctx: ThroughputCtx, s: Settings) -> list[Row]:
    rows: list[Row] = []
    fio = ctx.fio
    for size in SIZES:
        total = s.total[size]
        label = size_name(size)
        runs: dict[str, list[dict[str, Any]]] = {"kvcached": [], "fio": [], "bare": []}
        passes: dict[str, Callable[[], dict[str, Any]]] = {
            "kvcached": lambda: kv_pass(ctx, size, total, "batch"),
            "fio": lambda: fio_pass(ctx, size, total),
            "bare": lambda: bare_pass(ctx, size, total),
        }
        for r in range(s.rounds):
            order = list(passes) if r % 2 == 0 else list(passes)[::-1]
            for name in order:
                progress(f"{label} round {r + 1}/{s.rounds}: {name} write + read of {total >> 20} MiB")
                result = passes[name]()
                runs[name].append(result)
                progress(f"{label} round {r + 1}/{s.rounds}: {name} write {result['write']['gbps']:.3f} GB/s, "
                         f"read {result['read']['gbps']:.3f} GB/s")
        first = len(rows)
        med = {(name, op): median_run([x[op] for x in rs]) for name, rs in runs.items() for op in ("write", "read")}
        for op in ("write", "read"):
            case = f"{op} {label}" + (", batch" if op == "write" else "")
            kv, base = med[("kvcached", op)], med[("fio", op)]
            row = Row(1, case, "GB/s", kv["gbps"], fio.describe(), base["gbps"], True, f">= {TARGET[size]:.1f}x",
                      details={"kvcached": kv, "baseline": base},
                      paired_ratio=paired([x[op] for x in runs["kvcached"]], [x[op] for x in runs["fio"]]))
            row.passed = row.ratio >= TARGET[size]
            rows.append(row)
        for op in ("write", "read"):
            case = f"{op} {label}" + (", batch" if op == "write" else "")
            kv, base = med[("kvcached", op)], med[("bare", op)]
            rows.append(Row(1, case, "GB/s", kv["gbps"], BARE_NAME, base["gbps"], True, details={"kvcached": kv, "baseline": base},
                            paired_ratio=paired([x[op] for x in runs["kvcached"]], [x[op] for x in runs["bare"]])))

        # extra rows: one run each, no target
        progress(f"{label} extra: fio write --fsync={BATCH[size]}")
        fio_sync_b = fio_pass(ctx, size, total, fsync=BATCH[size], read=False)["write"]
        rows.append(Row(1, f"write {label}, batch", "GB/s", med[("kvcached", "write")]["gbps"], fio.describe(BATCH[size]),
                        fio_sync_b["gbps"], True, details={"kvcached": med[("kvcached", "write")], "baseline": fio_sync_b}))
        progress(f"{label} extra: kvcached write, durability always")
        always = kv_pass(ctx, size, total, "always", read=False)["write"]
        progress(f"{label} extra: fio write --fsync=1")
        fio_sync1 = fio_pass(ctx, size, total, fsync=1, read=False)["write"]
        rows.append(Row(1, f"write {label}, always", "GB/s", always["gbps"], fio.describe(1), fio_sync1["gbps"], True,
                        details={"kvcached": always, "baseline": fio_sync1}))
        progress(f"{label} extra: kvcached write, durability none")
        none = kv_pass(ctx, size, total, "none", read=False)["write"]
        rows.append(Row(1, f"write {label}, none", "GB/s", none["gbps"], fio.describe(), med[("fio", "write")]["gbps"], True,
                        details={"kvcached": none, "baseline": med[("fio", "write")]}))
        if s.extras and ctx.inflight < 4:
            progress(f"{label} extra: kvcached write + read, batch, 4 batches in flight")
            deep = kv_pass(ctx, size, total, "batch", inflight=4)
            for op in ("write", "read"):
                case = f"{op} {label}" + (", batch" if op == "write" else "") + ", 4 in flight"
                rows.append(Row(1, case, "GB/s", deep[op]["gbps"], fio.describe(), med[("fio", op)]["gbps"], True,
                                details={"kvcached": deep[op], "baseline": med[("fio", op)]}))
        progress(f"{label}: " + ", ".join(f"{r.case} {r.kvcached:.3f} GB/s ({r.ratio:.2f}x {r.baseline_name})"
                                          for r in rows[first:]))
    return rows


# =============================================================================================
# figure 2: boot reconcile


def block_files(blocks_dir: Path) -> list[str]:
    out = []
    for top in sorted(os.scandir(blocks_dir), key=lambda e: e.name):
        if top.is_dir():
            for leaf in sorted(os.scandir(top.path), key=lambda e: e.name):
                if leaf.is_dir():
                    out += [e.path for e in os.scandir(leaf.path)]
    return out


def bare_scan(blocks_dir: Path) -> tuple[float, int]:
    """The least file work of a reconcile: list every leaf, read every file's header page."""
    t0 = time.perf_counter()
    n = 0
    for top in sorted(os.scandir(blocks_dir), key=lambda e: e.name):
        for leaf in sorted(os.scandir(top.path), key=lambda e: e.name):
            with os.scandir(leaf.path) as it:
                for entry in it:
                    fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.fstat(fd)
                        os.pread(fd, PAGE, 0)
                    finally:
                        os.close(fd)
                    n += 1
    return time.perf_counter() - t0, n


def cold_cache(blocks_dir: Path, drop_caches: bool) -> None:
    """Untimed: make the next pass read headers from the disk."""
    if drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        drop_file_cache(block_files(blocks_dir))


class ReconcileProgress:
    """Passed as reconcile_ssd's ``stop`` (polled every 10k records and files): prints progress."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = self.last = time.perf_counter()

    def __call__(self) -> bool:
        now = time.perf_counter()
        if now - self.last >= 2.0:
            self.last = now
            progress(f"{self.label}: running, {now - self.t0:.1f} s")
        return False


async def create_blocks(ssd: SsdTier, index: BlockIndex | None, blocks: Blocks, source: Arena, what: str) -> None:
    """Publish ``blocks`` (durability of ``ssd``) and, with an index, write a record each."""
    batch = 256
    step = max(1, -(-len(blocks) // (10 * batch))) * batch       # progress about every 10 %
    for start in range(0, len(blocks), batch):
        idx = range(start, min(start + batch, len(blocks)))
        writes = [SsdWrite(blocks.keys[i], blocks.headers[i], source.slot(blocks.slots[i], blocks.size)) for i in idx]
        try:
            errors = await ssd.write_many(writes)
        finally:
            for w in writes:
                w.payload.release()
        if any(e is not None for e in errors):
            raise RuntimeError(f"creating {what}: {[e for e in errors if e is not None][0]}")
        if index is not None:
            now = time.time()
            records = [(blocks.keys[i], BlockRecord(blocks.headers[i].digest, blocks.headers[i].layer, MODEL, blocks.size,
                                                    blocks.headers[i].checksum, now, now, tiers=Tier.SSD)) for i in idx]
            index.write(records, queue=[queue_entry(now, k) for k, _ in records])
        done = idx.stop
        if done % step == 0 or done == len(blocks):
            progress(f"creating {what}: {done}/{len(blocks)} files")


def timed_reconcile(index: BlockIndex, directory: Path, threads: int, label: str) -> tuple[float, ReconcileReport]:
    ssd = SsdTier(str(directory), 1 << 50, durability="batch", direct_io="auto", threads=threads)
    try:
        t0 = time.perf_counter()
        ssd.open()
        report = reconcile_ssd(index, ssd, ReconcileProgress(label))
        elapsed = time.perf_counter() - t0
        ssd.reconciled(report.adopted, report.adopted_bytes, report.adopted_file_bytes)
    finally:
        asyncio.run(ssd.close())
    return elapsed, report


def check_counts(report: ReconcileReport, want: dict[str, int]) -> list[str]:
    got = report.summary()
    return [f"{k} {got[k]} (expected {v})" for k, v in want.items() if got[k] != v]


def bench_reconcile(directory: Path, s: Settings, n: int, threads: int, runner: asyncio.Runner, drop_caches: bool,
                    notes: list[str]) -> tuple[list[Row], bool]:
    """Returns the rows and whether every report count was as expected."""
    s = replace(s, missing=min(s.missing, n // 10), torn=min(s.torn, n // 10))    # a small --reconcile-files
    ssd_dir = directory / "reconcile" / "ssd"
    index = BlockIndex(directory / "reconcile" / "index")
    source = Arena(RECONCILE_PAYLOAD, 64, random_fill=True)
    sums = slot_sums(source, RECONCILE_PAYLOAD)
    rows: list[Row] = []
    ok = True
    try:
        blocks = make_blocks(RECONCILE_PAYLOAD, n, source, sums)
        ssd = open_tier(ssd_dir, "none", threads, 0.01)
        t0 = time.perf_counter()
        try:
            runner.run(create_blocks(ssd, index, blocks, source, f"{n} block files + index records"))
        finally:
            runner.run(ssd.close())
        create_s = time.perf_counter() - t0
        progress(f"created {n} block files in {create_s:.1f} s ({n / create_s:.0f} files/s, durability none)")
        blocks_dir = ssd_dir / "blocks"
        cache_how = "drop_caches" if drop_caches else "posix_fadvise(DONTNEED) of every file"

        progress(f"bare scan of {n} files (cold header pages: {cache_how})")
        cold_cache(blocks_dir, drop_caches)
        bare_s, bare_n = bare_scan(blocks_dir)
        progress(f"bare scan: {bare_s:.2f} s, {bare_n / bare_s:.0f} files/s")

        progress(f"reconcile of {n} files (fresh SsdTier, as after a restart)")
        cold_cache(blocks_dir, drop_caches)
        clean_s, clean = timed_reconcile(index, ssd_dir, threads, "reconcile")
        want = {"records": n, "adopted": n, "files": n, "stale_tmp": 0, "orphans": 0, "bad_files": 0, "lost": 0}
        wrong = check_counts(clean, want)
        ok &= not wrong
        progress(f"reconcile: {clean_s:.2f} s, {n / clean_s:.0f} files/s; report {clean.summary()}")
        base = {"seconds": bare_s, "files": bare_n, "files_per_s": bare_n / bare_s}
        rows.append(Row(2, f"reconcile {count_name(n)} files", "s", clean_s, "bare scan (scandir+pread 4K)", bare_s, False,
                        verdict_text="counts OK" if not wrong else "MISMATCH: " + "; ".join(wrong),
                        details={"kvcached": {"seconds": clean_s, "files_per_s": n / clean_s, "report": clean.summary(),
                                              "create_s": create_s}, "baseline": base}))

        # strays: stale temporary files, orphan block files, missing and torn files
        progress(f"mixing in {s.stale_tmp} stale temp files, {s.orphans} orphans, {s.missing} missing files, {s.torn} torn files")
        rng = random.Random(7)
        victims = rng.sample(range(n), s.missing + s.torn)
        strays = make_blocks(RECONCILE_PAYLOAD, s.orphans + s.stale_tmp, source, sums)
        writer = open_tier(ssd_dir, "none", threads, 0.01)
        try:
            paths = [writer.path_of(blocks.keys[i], blocks.headers[i].digest, blocks.headers[i].layer) for i in victims]
            for path in paths[:s.missing]:
                os.unlink(path)
            for path in paths[s.missing:]:
                os.truncate(path, PAGE)
            orphans = Blocks(strays.size, strays.keys[:s.orphans], strays.headers[:s.orphans], strays.slots[:s.orphans])
            runner.run(create_blocks(writer, None, orphans, source, f"{s.orphans} orphans"))
            for k, h in list(zip(strays.keys, strays.headers))[s.orphans:]:
                tmp = writer.path_of(k, h.digest, h.layer) + TMP_MARK + STALE_TOKEN
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(os.urandom(2 * PAGE))
        finally:
            runner.run(writer.close())
        files = n - s.missing + s.orphans + s.stale_tmp     # torn files are walked (and removed)
        cold_cache(blocks_dir, drop_caches)
        progress(f"reconcile of {files} files with strays")
        quiet = logging.getLogger("kvcached.ssd")     # one warning per torn file otherwise; the counts are checked
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            mixed_s, mixed = timed_reconcile(index, ssd_dir, threads, "reconcile with strays")
        finally:
            quiet.setLevel(level)
        want = {"records": n, "adopted": n - s.missing - s.torn, "files": files, "stale_tmp": s.stale_tmp,
                "orphans": s.orphans, "bad_files": s.torn, "lost": s.missing + s.torn}
        wrong = check_counts(mixed, want)
        left = len(block_files(blocks_dir))
        if left != n - s.missing - s.torn:
            wrong.append(f"{left} files left (expected {n - s.missing - s.torn})")
        ok &= not wrong
        progress(f"reconcile with strays: {mixed_s:.2f} s; report {mixed.summary()}")
        rows.append(Row(2, f"reconcile {count_name(n)} + strays", "s", mixed_s, "bare scan (scandir+pread 4K)", bare_s, False,
                        verdict_text="counts OK" if not wrong else "MISMATCH: " + "; ".join(wrong),
                        details={"kvcached": {"seconds": mixed_s, "files_per_s": files / mixed_s, "report": mixed.summary(),
                                              "expected": want}, "baseline": base}))
        notes.append(f"reconcile: {n / clean_s:,.0f} files/s ({clean_s:.1f} s for {n:,}); bare scan {bare_n / bare_s:,.0f} "
                     f"files/s; with strays {files / mixed_s:,.0f} files/s; {n:,} files created through SsdTier "
                     f"(durability none) in {create_s:.1f} s. Header pages cold before each pass ({cache_how}); "
                     + ("dentries and inodes cold too." if drop_caches else
                        "dentries and inodes stay cached (--drop-caches makes them cold, as after a reboot)."))
    finally:
        index.close()
        source.close()
    return rows, ok


# =============================================================================================
# output


TITLES = {
    1: "1. SsdTier.write_many / read_into vs fio, same directory; GB/s of payload, higher is better",
    2: "2. Boot reconcile (reconcile_ssd, fresh SsdTier) vs a bare scan of the same files; seconds, lower is better",
}


def fmt(value: float, unit: str) -> str:
    if unit == "GB/s":
        return f"{value:.3f} GB/s"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.0f} {unit}"


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    for fig in sorted({r.figure for r in rows}):
        print()
        print(TITLES[fig])
        w = [38, 12, 30, 12, 8, 9, 10]
        print("  " + "".join(h.ljust(x) for h, x in zip(["case", "kvcached", "baseline", "", "ratio", "target", "verdict"], w)).rstrip())
        for r in (r for r in rows if r.figure == fig):
            cells = [r.case, fmt(r.kvcached, r.unit), r.baseline_name, fmt(r.baseline, r.unit), f"{r.ratio:.2f}x",
                     r.target or "-", r.verdict]
            print("  " + "".join(c.ljust(x) for c, x in zip(cells, w)).rstrip())
    print()
    print("ratio = kvcached / baseline. Targeted rows: each side's median round; ratio = median over rounds of the")
    print("ratio within a round. Rows without a target ran once.")


# =============================================================================================
# main


def disk_needed(s: Settings, n_files: int, figures: set[str]) -> int:
    """Peak bytes on disk: figure 1 keeps its files until it ends (kvcached: its rounds and
    three extra passes; bare files: its rounds; fio: one file at a time)."""
    fig1 = sum((2 * s.rounds + 3) * total // size * (PAGE + padded(size)) for size, total in s.total.items())
    fig1 += max(s.total.values())
    fig2 = (n_files + s.orphans + s.stale_tmp) * (PAGE + padded(RECONCILE_PAYLOAD))
    return max(fig1 if "1" in figures else 0, fig2 + (64 * MiB if "2" in figures else 0))


def describe_fs(path: Path) -> str:
    """The filesystem holding ``path``: type and device, and for ext4 whether it has a journal."""
    best: tuple[int, str, str] = (-1, "?", "?")
    target = str(path.resolve())
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4]
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > best[0]:
                    fstype, source = right.split()[:2]
                    best = (len(mount), fstype, source)
    except OSError:
        return "an unknown filesystem"
    _, fstype, source = best
    text = f"{fstype} on {source}"
    if fstype == "ext4":
        try:
            task = Path(f"/sys/fs/ext4/{os.path.basename(source)}/journal_task").read_text().strip()
            text += " (no journal)" if task == "<none>" else " (journaled)"
        except OSError:
            pass
    return text


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def new_runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)     # as the daemon runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached SSD-tier benchmark (figures with same-run fio baselines)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (< 30 s): small sizes, one round, 5k files to reconcile")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"where to make the temporary directory (default {DEFAULT_DIR.relative_to(ROOT)}); removed afterwards")
    parser.add_argument("--reconcile-files", type=int, help="block files for the reconcile figure (default 100000, --quick 5000)")
    parser.add_argument("--threads", type=int, default=16, help="SsdTier I/O threads; also fio's iodepth (default 16)")
    parser.add_argument("--inflight", type=int, default=1, help="write_many / read batches in flight at once (default 1)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per targeted case (default 3, --quick 1)")
    parser.add_argument("--commit-ms", type=float, default=10.0, help="group commit wait, as kv.ssd_commit_ms (default 10)")
    parser.add_argument("--figures", default="12", help="which figures to run (default 12)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="before each reconcile pass, drop the whole page/dentry/inode cache (root; slows the machine)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)

    s = QUICK if args.quick else FULL
    if args.rounds:
        s = replace(s, rounds=args.rounds)
    n_files = args.reconcile_files or s.reconcile_files
    figures = set(args.figures)
    signal.signal(signal.SIGTERM, _interrupt)
    notes: list[str] = []
    rows: list[Row] = []
    counts_ok = True
    started = time.time()

    args.dir.mkdir(parents=True, exist_ok=True)
    need = disk_needed(s, n_files, figures)
    free = shutil.disk_usage(args.dir).free
    if need * 1.2 > free:
        print(f"not enough free space in {args.dir}: about {need >> 20} MiB needed, {free >> 20} MiB free", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="run-", dir=args.dir))
    probe = SsdTier(str(tmp / "probe"), 1 << 30, direct_io="auto", threads=1)
    probe.open()
    direct = probe.direct
    asyncio.run(probe.close())
    shutil.rmtree(tmp / "probe")
    if not direct:
        notes.append(f"O_DIRECT is NOT available in {tmp}: kvcached used buffered I/O; before each read pass the page "
                     "cache of every file was dropped (posix_fadvise DONTNEED) and fio ran with --direct=0 --invalidate=1 "
                     "(writes with --end_fsync=1). Reads may still be partly served from memory.")
    fio = Fio.find(args.threads, direct)
    if "1" in figures and fio is None:
        notes.append("figure 1 skipped: fio is not installed (make system-deps)")
        figures.discard("1")
    if fio is not None and fio.engine != "libaio":
        notes.append(f"fio has no libaio engine here: baseline is psync with {args.threads} jobs")

    fs = describe_fs(tmp)
    if "no journal" in fs:
        notes.append(f"{args.dir} is on {fs}: fsyncs are not folded into journal commits, and creating a file costs "
                     "much kernel time when inodes of its block group were deleted in the last 60-300 s (ext4 skips "
                     "them one by one, ialloc.c recently_deleted): one file per block pays it, fio's one file does not")
    progress(f"directory {tmp} on {fs} (O_DIRECT {'yes' if direct else 'NO'}), {args.threads} I/O threads, "
             f"{args.inflight} batch(es) in flight, {s.rounds} round(s)")
    sources: dict[int, tuple[Arena, list[bytes]]] = {}
    dests: dict[int, Arena] = {}
    try:
        with new_runner() as runner:
            if "2" in figures:     # first: its 100k file creations run faster before figure 1 deletes its files
                fig2, counts_ok = bench_reconcile(tmp, s, n_files, args.threads, runner, args.drop_caches, notes)
                rows += fig2
            if "1" in figures:
                assert fio is not None
                progress("filling the source arenas with random bytes")
                for size in SIZES:
                    src = Arena(size, max(1, min(SOURCE_BYTES, s.total[size]) // size), random_fill=True)
                    sources[size] = (src, slot_sums(src, size))
                    dests[size] = Arena(padded(size), BATCH[size] * max(4, args.inflight))
                for leaf in leaf_dirs():      # a long-lived tier has all its leaf directories
                    (tmp / "kv" / "blocks" / leaf).mkdir(parents=True, exist_ok=True)
                bare = BareFiles(tmp / "bare", args.threads, direct)
                try:
                    ctx = ThroughputCtx(tmp, fio, bare, args.threads, args.commit_ms / 1000, args.inflight, runner,
                                        sources, dests)
                    rows += bench_throughput(ctx, s)
                finally:
                    bare.close()
                    progress("removing figure 1's files")
                    shutil.rmtree(tmp / "kv", ignore_errors=True)
                    shutil.rmtree(tmp / "bare", ignore_errors=True)
    finally:
        for src, _ in sources.values():
            src.close()
        for dst in dests.values():
            dst.close()
        if args.keep:
            progress(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    header = (f"kvcached SSD-tier benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\n"
              f"directory {args.dir} on {fs} (O_DIRECT {'yes' if direct else 'NO'}); {args.threads} I/O threads, "
              f"{args.inflight} batch(es) in flight, batches of {BATCH[64 * KiB]} x 64 KiB / {BATCH[MiB]} x 1 MiB, "
              f"commit wait {args.commit_ms:g} ms; {s.rounds} round(s) of "
              + " / ".join(f"{s.total[z] >> 20} MiB" for z in SIZES) + " per 64 KiB / 1 MiB case")
    rows.sort(key=lambda r: r.figure)
    print_table(rows, header)
    if "1" in figures:
        notes.append(f"reads: every read_into verified (BLAKE3) and 1 in {CHECK_EVERY} compared byte for byte with its "
                     "source; leaf directories created before timing; kvcached writes a 4 KiB header page per block "
                     "on top of the payload counted in GB/s (6% more bytes at 64 KiB)")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                        "directory": str(args.dir), "direct_io": direct, "threads": args.threads, "inflight": args.inflight,
                        "commit_ms": args.commit_ms, "fio": asdict(fio) if fio else None,
                        "settings": {**asdict(s), "reconcile_files": n_files}},
               "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "notes": notes}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0 if counts_ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); temp dir removed")
        sys.exit(130)
