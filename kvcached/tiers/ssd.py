"""SSD tier: block files on local disk, published crash-safely, read back verified.

This module owns the files and nothing else: the index (which blocks are on SSD, their
checksums) belongs to the store, which calls :meth:`SsdTier.write_many` and
:meth:`SsdTier.read_into` and records the outcome. File format: :mod:`kvcached.tiers.ssd_format`.

Publishing a block (docs/ssd-format.md has the guarantees per mode):

- ``always``: each block alone: write ``<name>.tmp-<boot>-<n>``, fsync it, rename, fsync the dir.
- ``batch``: group commit. Each file is written and fsynced by an I/O thread, many at once (the
  disk serves concurrent fsyncs in parallel); the group, which closes when no other write is in
  flight, when it is big, or at most ``commit_s`` after its first file, is then renamed and
  each directory it touched fsynced once, and the store makes one synced index write for it.
  Directory fsyncs and index syncs, paid per block in ``always``, are paid per group.
- ``none``: write, rename; the kernel writes back when it likes.

A block whose write, fsync or rename fails is discarded (its temporary file removed) and
reported failed; an fsync is never retried (after a failed fsync the page cache may already
have dropped the dirty pages, so a second fsync can succeed without the data being on disk).

Room (:class:`SsdSpace`): a block whose file the tier can never hold (bigger than kv.ssd_gib or
than the filesystem) is refused before anything is written or evicted, and so is one that would
not fit even if every file of the tier were evicted (something else fills the disk). A block that
meets a full disk while being written is written once more after the caller's forced eviction
(``make_room``), and only its final outcome counts.

Reads and writes use O_DIRECT with page-aligned buffers where the filesystem supports it (the
payload goes straight between the file and its arena slot), buffered I/O otherwise. All I/O runs
on a thread pool, so many blocks are in flight at once; the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Literal

import blake3

from kvcached.host.fsmodes import make_dirs
from kvcached.tiers.ssd_format import (
    HEADER_BYTES,
    PAGE,
    SUFFIX,
    TMP_MARK,
    BlockHeader,
    HeaderError,
    block_dir,
    block_name,
    file_bytes,
    padded,
)
from kvcached.tiers.ssd_io import fsync_dir, preadv_all, probe_direct, pwritev_all, rename_all, subdirs, unlink_all, unlink_quietly

__all__ = ["SsdTier", "SsdWrite", "SsdWriteError", "SsdFull", "SsdTooLarge", "SsdSpace", "Durability", "DirectIo",
           "IO_ERROR", "ReadFault", "ReadProblem"]

log = logging.getLogger("kvcached.ssd")

Durability = Literal["always", "batch", "none"]
DirectIo = Literal["auto", "on", "off"]
GROUP_MAX_FILES = 256            # a batch group commits at this many files without waiting
GROUP_MAX_BYTES = 256 << 20      # ... or this many bytes
QUARANTINE_KEEP = 100            # newest quarantined files kept for inspection
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
IO_ERROR = "I/O error"     # a read problem that says nothing about the file (a miss, no quarantine)


class ReadFault(enum.Enum):
    """What kind of problem kept a block from being served from its file."""

    MISSING = "missing"      # no file (counted missing; the record loses the SSD tier)
    IO_ERROR = "io_error"    # the read itself failed: nothing is known about the file (a miss, no quarantine)
    DAMAGED = "damaged"      # the file is there and wrong (counted corrupt, quarantined)


class ReadProblem(str):
    """Why a block was not served from its file: the text for people (the string itself) and
    ``fault`` for code that acts on it."""

    fault: ReadFault

    def __new__(cls, fault: ReadFault, text: str) -> "ReadProblem":
        problem = super().__new__(cls, text)
        problem.fault = fault
        return problem


MISSING = ReadProblem(ReadFault.MISSING, "missing")


class SsdWriteError(OSError):
    """A block could not be published; nothing of it is left on disk."""


class SsdFull(SsdWriteError):
    """The filesystem (or quota) has no room for the block: it met a full disk while being
    written, or was refused before because even an empty tier would not make room."""


class SsdTooLarge(SsdWriteError):
    """Refused before anything was written or evicted: the block's file is bigger than the tier
    can ever hold (kv.ssd_gib, or the filesystem's size). Trying again cannot help."""


@dataclass(slots=True)
class SsdWrite:
    """One block to publish. ``payload`` must stay valid (pinned) until the write completes."""

    key: bytes
    header: BlockHeader
    payload: memoryview


@dataclass(frozen=True, slots=True)
class SsdSpace:
    """The room for block files at one moment (:meth:`SsdTier.space`): what a block's file must
    fit in before anything is evicted for it. Sizes in bytes."""

    directory: str
    capacity: int       # kv.ssd_gib: the tier never holds more
    filesystem: int     # the filesystem's size
    free: int           # free on it now, for the daemon (statvfs f_bavail)
    tier: int           # the tier's own files, published or being written (what evicting them all frees)

    def refusal(self, nbytes: int) -> SsdWriteError | None:
        """Why a block of ``nbytes`` payload bytes must not be written, nothing evicted for it:
        SsdTooLarge when its file is bigger than the tier could ever be, SsdFull when it is
        bigger than the free space plus every file of the tier (something else fills the disk).
        None when it fits, or an eviction could make room for it. The message names the sizes."""
        size = file_bytes(nbytes)
        if size > self.capacity or size > self.filesystem:
            return SsdTooLarge(errno.EFBIG, f"a block of {nbytes} bytes needs a {size}-byte file, more than the SSD "
                               f"tier can ever hold (kv.ssd_gib is {self.capacity} bytes, the filesystem of "
                               f"{self.directory} {self.filesystem} bytes); nothing was evicted for it")
        if size > self.free + self.tier:
            return SsdFull(errno.ENOSPC, f"the filesystem of {self.directory} is full: a {size}-byte SSD block file "
                           f"does not fit in its {self.free} free bytes even with all {self.tier} bytes of the SSD "
                           "tier's files evicted (something else fills the disk); nothing was evicted for it")
        return None


@dataclass(slots=True)
class SsdCounters:
    writes: int = 0
    write_bytes: int = 0
    file_bytes_written: int = 0       # block files published, headers and padding included (drive wear)
    write_errors: int = 0             # blocks not published in the end (see write_many)
    no_space: int = 0                 # blocks that met a full disk or were refused for lack of room
    reads: int = 0
    read_bytes: int = 0
    corrupt: int = 0
    missing: int = 0
    removed: int = 0
    group_commits: int = 0


@dataclass(slots=True)
class _Written:
    """A temporary file written and fsynced, waiting for its group commit (rename, dir fsync)."""

    write: SsdWrite
    tmp: str
    final: str
    future: asyncio.Future[None] = field(repr=False)


class _Buffers(threading.local):
    """Per-thread page-aligned buffers (anonymous mmaps are page aligned, as O_DIRECT needs)."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.tail = mmap.mmap(-1, PAGE)


class SsdTier:
    def __init__(self, directory: str, capacity: int, *, durability: Durability = "batch", commit_s: float = 0.01,
                 direct_io: DirectIo = "auto", threads: int = 8) -> None:
        self.directory = os.path.abspath(directory)
        self.blocks_dir = os.path.join(self.directory, "blocks")
        self.quarantine_dir = os.path.join(self.directory, "quarantine")
        self.capacity = capacity
        self.durability = durability
        self.commit_s = commit_s
        self.direct_io_setting = direct_io
        self.direct = False
        self.boot_token = secrets.token_hex(4)
        self.used_bytes = 0          # file bytes of published blocks this tier knows of
        self.payload_bytes = 0       # their payload bytes
        self.blocks = 0
        self.counters = SsdCounters()
        # Paths published or removed since boot, while the boot reconcile runs (it leaves them alone).
        self.fresh: set[str] | None = set()
        self.threads = threads
        self._writing = 0            # blocks whose files are being written now (group commit timing)
        # File bytes of the blocks a write_many call is writing, until it returns (a block it has
        # published already counts in used_bytes too meanwhile: room is overestimated, never under).
        self._unsettled_bytes = 0
        self._tmp_serial = itertools.count()
        self._removing: dict[str, asyncio.Future[None]] = {}   # names being unlinked or quarantined
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvcached-ssd")
        self._buffers = _Buffers()
        self._group: list[_Written] = []
        self._group_bytes = 0
        self._group_timer: asyncio.TimerHandle | None = None
        self._commits: set[asyncio.Task[None]] = set()

    # -- set-up -------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the top of the tree (leaf directories come with their first block) and decide
        on O_DIRECT. Raises OSError (unusable directory) or ValueError (``direct_io = "on"``
        where the filesystem refuses it)."""
        make_dirs(self.blocks_dir)              # 0700 whatever the umask (kvcached.host.fsmodes)
        make_dirs(self.quarantine_dir)
        fsync_dir(self.directory)
        if self.direct_io_setting == "off":
            self.direct = False
        else:
            problem = probe_direct(os.path.join(self.directory, f".direct-probe{TMP_MARK}{self.boot_token}"))
            if problem and self.direct_io_setting == "on":
                raise ValueError(f"kv.ssd_direct_io is \"on\" but {self.directory} refuses O_DIRECT: {problem}")
            self.direct = problem is None
            if problem:
                log.info("O_DIRECT unavailable; using buffered I/O", extra={"fields": {"dir": self.directory, "why": problem}})

    async def close(self) -> None:
        """Finish the commits in progress (their blocks stay unpublished if the group has not
        started) and stop the threads."""
        if self._group_timer is not None:
            self._group_timer.cancel()
            self._group_timer = None
        if self._group:
            self._start_commit()
        if self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)
        self._pool.shutdown(wait=True)

    # -- names --------------------------------------------------------------------------------

    def path_of(self, key: bytes, digest: bytes, layer: int) -> str:
        return os.path.join(self.blocks_dir, block_dir(key), block_name(digest, layer))

    # -- writing ------------------------------------------------------------------------------

    async def write_many(self, writes: list[SsdWrite],
                         make_room: Callable[[int], Awaitable[object]] | None = None) -> list[SsdWriteError | None]:
        """Publish ``writes`` under the durability mode; per block, None when published or the
        error that discarded it. A block :meth:`SsdSpace.refusal` refuses is not written at all
        (SsdTooLarge, SsdFull). Blocks that meet a full disk (SsdFull) are, given ``make_room``,
        written once more after ``await make_room(n)``, n the file bytes they need (the caller
        evicts; it must not raise). The counters count each block's final outcome:
        ``write_errors`` the blocks not published, ``no_space`` those that met a full disk or
        were refused for lack of room, published in the end or not."""
        results = self.refusals([w.header.length for w in writes])
        self.counters.no_space += sum(isinstance(r, SsdFull) for r in results)
        todo = [i for i, r in enumerate(results) if r is None]
        for i, r in zip(todo, await self._write_all([writes[i] for i in todo])):
            results[i] = r
        met = [i for i in todo if isinstance(results[i], SsdFull)]     # met a full disk while written
        self.counters.no_space += len(met)
        if met and make_room is not None:
            await make_room(sum(file_bytes(writes[i].header.length) for i in met))
            for i, r in zip(met, await self._write_all([writes[i] for i in met])):
                if isinstance(r, SsdFull):
                    r = SsdFull(r.errno, f"the filesystem of {self.directory} is full ({os.strerror(r.errno or errno.ENOSPC)}) "
                                "even after evicting SSD blocks to make room", r.filename)
                results[i] = r
        self.counters.write_errors += sum(r is not None for r in results)
        return results

    def space(self) -> SsdSpace:
        """The room for block files now (one statvfs; raises OSError if the directory cannot be
        examined). Until the boot reconcile has counted the tier, all that is used on the
        filesystem is taken for the tier's (its files of earlier runs are not counted yet), so
        nothing is refused for room that an eviction could still make."""
        st = os.statvfs(self.directory)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        tier = self.used_bytes + self._unsettled_bytes if self.fresh is None else size - free
        return SsdSpace(self.directory, self.capacity, size, free, tier)

    def refusals(self, sizes: list[int]) -> list[SsdWriteError | None]:
        """:meth:`SsdSpace.refusal` for blocks of these payload sizes, against one look at the
        filesystem. If it cannot be examined, nothing is refused here (the writes will say)."""
        try:
            space = self.space()
        except OSError:
            return [None] * len(sizes)
        return [space.refusal(n) for n in sizes]

    def free_bytes(self) -> int:
        """Bytes free on the tier's filesystem for the daemon now (0 if it cannot be examined)."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    async def _write_all(self, writes: list[SsdWrite]) -> list[SsdWriteError | None]:
        """Write and publish ``writes``, split into one job per I/O thread (a job per block
        costs more in hand-offs than a small block's write); per block, None or its error."""
        if not writes:
            return []
        loop = asyncio.get_running_loop()
        paths = [self.path_of(w.key, w.header.digest, w.header.layer) for w in writes]
        for path in paths:  # before any file appears: the boot reconcile must not take it for an orphan
            self._touched_path(path)
        # A removal of the same name still queued on a thread would unlink the new file.
        while pending := {id(f): f for p in paths if (f := self._removing.get(p)) is not None}:
            await asyncio.wait(pending.values())
        per_job = -(-len(writes) // self.threads)
        chunks = [writes[i:i + per_job] for i in range(0, len(writes), per_job)]
        unsettled = sum(file_bytes(w.header.length) for w in writes)
        self._unsettled_bytes += unsettled
        self._writing += len(writes)       # each chunk takes its own off when its files are written
        try:
            results = await asyncio.gather(*(self._write_chunk(loop, chunk) for chunk in chunks))
        finally:
            self._unsettled_bytes -= unsettled
        return [r for chunk in results for r in chunk]

    async def _write_chunk(self, loop: asyncio.AbstractEventLoop, chunk: list[SsdWrite]) -> list[SsdWriteError | None]:
        try:
            written = await loop.run_in_executor(self._pool, self._write_files, chunk)
        finally:
            self._writing -= len(chunk)
        out: list[SsdWriteError | None] = []
        waits: list[tuple[int, asyncio.Future[None]]] = []
        for w, res in zip(chunk, written):
            if isinstance(res, BaseException):
                out.append(self._failed(w, res))
                continue
            out.append(None)
            if self.durability == "batch":
                fut: asyncio.Future[None] = loop.create_future()
                self._enqueue(_Written(w, res[0], res[1], fut))
                waits.append((len(out) - 1, fut))
            else:
                self._published(w)
        for i, fut in waits:
            try:
                await fut
            except SsdWriteError as exc:
                out[i] = exc
        return out

    def _failed(self, w: SsdWrite, exc: BaseException) -> SsdWriteError:
        """The error that discarded ``w`` (logged unless it is a full disk; write_many counts)."""
        if isinstance(exc, SsdWriteError):
            if not isinstance(exc, SsdFull):
                log.error("SSD write failed", extra={"fields": {"key": w.key.hex(), "error": str(exc)}})
            return exc
        log.error("SSD write failed", extra={"fields": {"key": w.key.hex(), "error": str(exc)}})
        return SsdWriteError(getattr(exc, "errno", None) or errno.EIO, f"SSD write failed: {exc}")

    def _published(self, w: SsdWrite) -> None:
        self._account(w.header.length, +1)
        self.counters.writes += 1
        self.counters.write_bytes += w.header.length
        self.counters.file_bytes_written += file_bytes(w.header.length)

    def _write_files(self, chunk: list[SsdWrite]) -> list[tuple[str, str] | SsdWriteError]:
        """Thread: write each block's temporary file; (tmp, final) or the error, per block."""
        out: list[tuple[str, str] | SsdWriteError] = []
        for w in chunk:
            try:
                out.append(self._write_one(w))
            except SsdWriteError as exc:
                out.append(exc)
        return out

    def _write_one(self, w: SsdWrite) -> tuple[str, str]:
        """Thread: write the temporary file and, unless the mode is ``none``, fsync it. Mode
        ``always`` then renames it and fsyncs the directory; mode ``none`` renames it; mode
        ``batch`` leaves rename and directory fsync to the group commit."""
        final = self.path_of(w.key, w.header.digest, w.header.layer)
        tmp = f"{final}{TMP_MARK}{self.boot_token}-{next(self._tmp_serial)}"   # unique: two writes never share one
        bufs = self._buffers
        bufs.header[:] = w.header.encode()
        n = w.header.length
        whole = n - n % PAGE
        body = w.payload[:whole]
        try:
            parts: list[Any] = [bufs.header, body] if whole else [bufs.header]
            if n > whole:    # the last partial page goes through a zeroed bounce page (no stale arena bytes on disk)
                tail = bufs.tail
                tail[:n - whole] = w.payload[whole:n]
                tail[n - whole:] = bytes(PAGE - (n - whole))
                parts.append(tail)
            self._write_file(final, tmp, parts, n)
        finally:
            body.release()     # no view of the arena may outlive the call (a traceback would keep it)
        return tmp, final

    def _write_file(self, final: str, tmp: str, parts: list[Any], n: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:     # the leaf's first block: make the leaf, durably
                self._make_leaf(os.path.dirname(final))
                fd = os.open(tmp, flags, 0o600)
        except OSError as exc:
            raise _write_error(exc, tmp) from None
        try:
            try:
                pwritev_all(fd, parts, file_bytes(n))
                if self.durability != "none":
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.durability != "batch":
                os.rename(tmp, final)
            if self.durability == "always":
                fsync_dir(os.path.dirname(final))
        except OSError as exc:
            unlink_quietly(tmp)
            if self.durability == "always":
                unlink_quietly(final)
            raise _write_error(exc, tmp) from None

    def _make_leaf(self, leaf: str) -> None:
        """Create a leaf directory durably (at most 4096 times in the tier's life): its parent
        and ``blocks/`` are fsynced every time, since another thread may have created the parent
        and not synced ``blocks/`` yet."""
        make_dirs(leaf)
        fsync_dir(os.path.dirname(leaf))
        fsync_dir(self.blocks_dir)

    def _enqueue(self, item: _Written) -> None:
        """Add a written, fsynced file to the open group. The group commits when no other write
        is in flight (nothing more is coming soon), when it is big, or ``commit_s`` after its
        first file, whichever comes first."""
        self._group.append(item)
        self._group_bytes += item.write.header.length
        if self._writing == 0 or len(self._group) >= GROUP_MAX_FILES or self._group_bytes >= GROUP_MAX_BYTES:
            self._start_commit()
        elif self._group_timer is None:
            self._group_timer = asyncio.get_running_loop().call_later(self.commit_s, self._start_commit)

    def _start_commit(self) -> None:
        if self._group_timer is not None:
            self._group_timer.cancel()
            self._group_timer = None
        group, self._group, self._group_bytes = self._group, [], 0
        if group:
            task = asyncio.get_running_loop().create_task(self._commit(group))
            self._commits.add(task)
            task.add_done_callback(self._commits.discard)

    async def _commit(self, group: list[_Written]) -> None:
        """One group commit: rename every file of the group, then fsync each directory they are
        in once (in parallel). Files were fsynced by their writers, concurrently."""
        loop = asyncio.get_running_loop()
        self.counters.group_commits += 1
        renamed = await loop.run_in_executor(self._pool, rename_all, [(g.tmp, g.final) for g in group])
        dirs: dict[str, list[_Written]] = {}
        for g, r in zip(group, renamed):
            if r is not None:
                self._fail_pending(g, r)
            else:
                dirs.setdefault(os.path.dirname(g.final), []).append(g)
        dir_syncs = await asyncio.gather(*(loop.run_in_executor(self._pool, fsync_dir, d) for d in dirs),
                                         return_exceptions=True)
        for (d, members), synced in zip(dirs.items(), dir_syncs):
            for g in members:
                if synced is None:
                    self._published(g.write)
                    if not g.future.done():
                        g.future.set_result(None)
                else:   # the names may not be durable: discard them, never fsync again
                    unlink_quietly(g.final)
                    self._fail_pending(g, synced)

    def _fail_pending(self, g: _Written, exc: BaseException) -> None:
        unlink_quietly(g.tmp)
        err = self._failed(g.write, exc)
        if not g.future.done():
            g.future.set_exception(err)

    # -- reading ------------------------------------------------------------------------------

    async def read_into(self, key: bytes, header: BlockHeader, dest: memoryview) -> ReadProblem | None:
        """Read the block described by ``header`` (what the index says it is) into ``dest``
        (its arena slot, at least :func:`padded` bytes) and verify it. None when the bytes in
        ``dest[:length]`` are the block; else the :class:`ReadProblem`."""
        return (await self.read_many([(key, header, dest)]))[0]

    async def read_many(self, reads: list[tuple[bytes, BlockHeader, memoryview]]) -> list[ReadProblem | None]:
        """:meth:`read_into` for a batch, split into one job per I/O thread."""
        loop = asyncio.get_running_loop()
        jobs = [(self.path_of(k, h.digest, h.layer), h, d) for k, h, d in reads]
        per_job = -(-len(jobs) // self.threads) if jobs else 1
        chunks = await asyncio.gather(*(loop.run_in_executor(self._pool, self._read_chunk, jobs[i:i + per_job])
                                        for i in range(0, len(jobs), per_job)))
        problems = [p for chunk in chunks for p in chunk]
        for (_, header, _), problem in zip(reads, problems):
            if problem is None:
                self.counters.reads += 1
                self.counters.read_bytes += header.length
            elif problem.fault is ReadFault.MISSING:
                self.counters.missing += 1
            elif problem.fault is ReadFault.DAMAGED:
                self.counters.corrupt += 1
        return problems

    def _read_chunk(self, jobs: list[tuple[str, BlockHeader, memoryview]]) -> list[ReadProblem | None]:
        return [self._read_verify(path, header, dest) for path, header, dest in jobs]

    def _read_verify(self, path: str, want: BlockHeader, dest: memoryview) -> ReadProblem | None:
        n = want.length
        size = padded(n)
        if len(dest) < size:
            raise ValueError(f"destination of {len(dest)} bytes is smaller than {size}")
        head = self._buffers.header
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            return MISSING
        except OSError as exc:
            return ReadProblem(ReadFault.IO_ERROR, f"{IO_ERROR}: cannot open: {exc.strerror or exc}")
        body = dest[:size]
        try:
            actual = os.fstat(fd).st_size
            if actual != file_bytes(n):
                return ReadProblem(ReadFault.DAMAGED, f"file is {actual} bytes, expected {file_bytes(n)} (truncated or torn)")
            got = preadv_all(fd, [head, body], file_bytes(n))
            if got != file_bytes(n):
                return ReadProblem(ReadFault.DAMAGED, f"short read: {got} of {file_bytes(n)} bytes")
            try:
                problem = BlockHeader.decode(head).disagreement(want.digest, want.layer, n, want.checksum)
            except HeaderError as exc:
                problem = str(exc)
            if problem is not None:
                return ReadProblem(ReadFault.DAMAGED, problem)
            if blake3.blake3(body[:n]).digest() != want.checksum:
                return ReadProblem(ReadFault.DAMAGED, "payload does not match its BLAKE3 checksum")
            return None
        except OSError as exc:
            return ReadProblem(ReadFault.IO_ERROR, f"{IO_ERROR}: read failed: {exc.strerror or exc}")
        finally:
            os.close(fd)
            body.release()

    # -- removal ------------------------------------------------------------------------------

    async def remove_many(self, items: list[tuple[bytes, BlockHeader]]) -> int:
        """Unlink the files of these blocks (accounting them out); returns how many existed."""
        paths = [(self.path_of(k, h.digest, h.layer), h.length) for k, h in items]
        with self._removing_paths([p for p, _ in paths]):
            gone = await asyncio.get_running_loop().run_in_executor(self._pool, unlink_all, [p for p, _ in paths])
        for (path, size), existed in zip(paths, gone):
            self._touched_path(path)
            if existed:
                self._account(size, -1)
                self.counters.removed += 1
        return sum(gone)

    def remove_now(self, key: bytes, header: BlockHeader) -> bool:
        """Unlink one block's file on the calling thread (Delete: one unlink is cheap)."""
        path = self.path_of(key, header.digest, header.layer)
        self._touched_path(path)
        existed = unlink_quietly(path)
        if existed:
            self._account(header.length, -1)
            self.counters.removed += 1
        return existed

    async def quarantine(self, key: bytes, header: BlockHeader, why: str) -> None:
        """Move a bad block file aside (for an operator to inspect), keeping the newest few."""
        path = self.path_of(key, header.digest, header.layer)
        self._touched_path(path)
        log.error("corrupt SSD block quarantined", extra={"fields": {"key": key.hex(), "file": path, "problem": why}})
        with self._removing_paths([path]):
            moved = await asyncio.get_running_loop().run_in_executor(self._pool, self._quarantine_file, path)
        if moved:
            self._account(header.length, -1)

    def _quarantine_file(self, path: str) -> bool:
        target = os.path.join(self.quarantine_dir, f"{os.path.basename(path)}.{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return False
        except OSError:
            return unlink_quietly(path)
        try:
            names = sorted(os.scandir(self.quarantine_dir), key=lambda e: e.stat().st_mtime_ns)
            for entry in names[:max(0, len(names) - QUARANTINE_KEEP)]:
                unlink_quietly(entry.path)
        except OSError:
            pass
        return True

    @contextlib.contextmanager
    def _removing_paths(self, paths: list[str]) -> Iterator[None]:
        """Mark ``paths`` as being removed on a thread until the block ends (writes of the same
        names wait for it)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for path in paths:
            self._removing[path] = done
        try:
            yield
        finally:
            for path in paths:
                if self._removing.get(path) is done:
                    del self._removing[path]
            done.set_result(None)

    def _touched_path(self, path: str) -> None:
        if self.fresh is not None:
            self.fresh.add(path)

    def is_fresh(self, path: str) -> bool:
        """Published or removed by this run while the boot reconcile runs (it must not judge it)."""
        fresh = self.fresh
        return fresh is not None and path in fresh

    def reconciled(self, blocks: int, payload_bytes: int, file_bytes_: int) -> None:
        """The boot reconcile is done: its count of the tier (every record on SSD with a file,
        taken at the end of its walk) replaces the one kept so far; stop tracking paths."""
        self.blocks = blocks
        self.payload_bytes = payload_bytes
        self.used_bytes = file_bytes_
        self.fresh = None

    def _account(self, nbytes: int, sign: int) -> None:
        self.used_bytes = max(0, self.used_bytes + sign * file_bytes(nbytes))
        self.payload_bytes = max(0, self.payload_bytes + sign * nbytes)
        self.blocks = max(0, self.blocks + sign)

    # -- walking (boot reconcile) ---------------------------------------------------------------

    def walk(self) -> Iterator[os.DirEntry[str]]:
        """Every entry in the leaf directories (files of all kinds, any name)."""
        for top in subdirs(self.blocks_dir):
            for leaf in subdirs(top):
                try:
                    with os.scandir(leaf) as it:
                        yield from it
                except FileNotFoundError:
                    continue

    def is_stale_tmp(self, name: str) -> bool:
        """A temporary file of an earlier run (this run's own are in flight)."""
        mark = name.rfind(TMP_MARK)
        return mark >= 0 and name[mark + len(TMP_MARK):].split("-")[0] != self.boot_token

    @staticmethod
    def is_block_name(name: str) -> bool:
        return name.endswith(SUFFIX)

    def read_header(self, path: str) -> tuple[BlockHeader, int]:
        """Thread: the header of a file and the file's size (buffered read of one page).
        Raises HeaderError or OSError."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            page = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        return BlockHeader.decode(page), size


# -- helpers (threads) ----------------------------------------------------------------------------


def _write_error(exc: OSError, path: str) -> SsdWriteError:
    if exc.errno in _NOSPACE:
        return SsdFull(exc.errno, f"no space left for SSD block file ({exc.strerror})", path)
    return SsdWriteError(exc.errno or errno.EIO, f"SSD write failed: {exc.strerror or exc}", path)
