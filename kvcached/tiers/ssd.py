"""SSD tier: block files on local disk, published crash-safely, read back verified.

This module owns the files and nothing else: the index (which blocks are on SSD, their
checksums) belongs to the store, which calls :meth:`SsdTier.write_many` and
:meth:`SsdTier.read_into` and records the outcome. File format: :mod:`kvcached.tiers.ssd_format`.

Publishing a block (docs/ssd-format.md has the guarantees per mode; the mechanics are
:class:`kvcached.tiers.ssd_publish.BlockPublisher`'s):

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

Room (:class:`SsdSpace`, counted by :class:`kvcached.tiers.ssd_usage.SsdUsage`): a block whose
file the tier can never hold (bigger than kv.ssd_gib or than the filesystem) is refused before
anything is written or evicted, and so is one that would not fit even if every file of the tier
were evicted (something else fills the disk). A block that meets a full disk while being written
is written once more after the caller's forced eviction (``make_room``), and only its final
outcome counts.

Reads and writes use O_DIRECT with page-aligned buffers where the filesystem supports it (a
plain block's payload goes straight between the file and its arena slot; a coded or sealed one,
kvcached.codecs, through a per-thread scratch area, a sealed raw one opened in place in its
slot), buffered I/O otherwise. All I/O runs
on a thread pool, so many blocks are in flight at once; the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import errno
import logging
import os
import secrets
import time
from typing import Awaitable, Callable, Iterator, Literal

import blake3

from kvcached.codecs import StoredForm, UnpackError
from kvcached.host.fsmodes import make_dirs
from kvcached.tiers.ssd_errors import SsdFull, SsdTooLarge, SsdWriteError
from kvcached.tiers.ssd_format import HEADER_BYTES, SUFFIX, TMP_MARK, BlockHeader, HeaderError, block_dir, block_name, file_bytes, padded
from kvcached.tiers.ssd_io import fsync_dir, preadv_all, probe_direct, subdirs, unlink_all_sized, unlink_sized
from kvcached.tiers.ssd_publish import BlockPublisher, Durability, PageBuffers, SsdWrite
from kvcached.tiers.ssd_usage import SsdCounters, SsdSpace, SsdUsage, TenantUse

__all__ = ["SsdTier", "SsdWrite", "SsdWriteError", "SsdFull", "SsdTooLarge", "SsdSpace", "Durability", "DirectIo",
           "IO_ERROR", "ReadFault", "ReadProblem", "SsdRead", "SsdVictim"]

log = logging.getLogger("kvcached.ssd")

#: A block file to remove: (index key, its header, its tenant's tag).
SsdVictim = tuple[bytes, BlockHeader, str]
#: A block to read: (index key, its header as the index knows it, its arena slot[, its tenant's tag]).
SsdRead = tuple[bytes, BlockHeader, memoryview] | tuple[bytes, BlockHeader, memoryview, str]

DirectIo = Literal["auto", "on", "off"]
QUARANTINE_KEEP = 100            # newest quarantined files kept for inspection
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


class SsdTier:
    """The SSD tier's block files (see the module): publishes them (:meth:`write_many`), reads
    them back verified (:meth:`read_many`), removes them, and walks them for the boot reconcile.
    ``counters`` and the counts of what it holds (``blocks``, ``payload_bytes``, ``used_bytes``)
    are read by the store's metrics."""

    def __init__(self, directory: str, capacity: int, *, durability: Durability = "batch", commit_s: float = 0.01,
                 direct_io: DirectIo = "auto", threads: int = 8, form: StoredForm | None = None) -> None:
        self.directory = os.path.abspath(directory)
        self.blocks_dir = os.path.join(self.directory, "blocks")
        self.quarantine_dir = os.path.join(self.directory, "quarantine")
        self.capacity = capacity
        self.durability = durability
        self.commit_s = commit_s
        self.direct_io_setting = direct_io
        self.boot_token = secrets.token_hex(4)
        self.counters = SsdCounters()
        self.usage = SsdUsage(self.directory, capacity)
        self.threads = threads
        self._removing: dict[str, asyncio.Future[None]] = {}   # names being unlinked or quarantined
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvcached-ssd")
        self._buffers = PageBuffers()
        self.form = form if form is not None else StoredForm()      # what blocks become on disk (kvcached.codecs)
        self._publisher = BlockPublisher(self.blocks_dir, self.boot_token, self.usage, self.counters, self._pool,
                                         self._buffers, self.form, durability=durability, commit_s=commit_s,
                                         threads=threads)

    # -- what it holds (SsdUsage's counts) --------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """File bytes of the published blocks this tier knows of."""
        return self.usage.used_bytes

    @property
    def payload_bytes(self) -> int:
        """Their payload bytes."""
        return self.usage.payload_bytes

    @property
    def blocks(self) -> int:
        return self.usage.blocks

    @property
    def fresh(self) -> set[str] | None:
        """Paths published or removed since boot, while the boot reconcile runs (None after)."""
        return self.usage.fresh

    @property
    def direct(self) -> bool:
        """Whether block files are read and written with O_DIRECT (decided by :meth:`open`)."""
        return self._publisher.direct

    # -- set-up -------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the top of the tree (leaf directories come with their first block) and decide
        on O_DIRECT. Raises OSError (unusable directory) or ValueError (``direct_io = "on"``
        where the filesystem refuses it)."""
        make_dirs(self.blocks_dir)              # 0700 whatever the umask (kvcached.host.fsmodes)
        make_dirs(self.quarantine_dir)
        fsync_dir(self.directory)
        if self.direct_io_setting == "off":
            self._publisher.direct = False
        else:
            problem = probe_direct(os.path.join(self.directory, f".direct-probe{TMP_MARK}{self.boot_token}"))
            if problem and self.direct_io_setting == "on":
                raise ValueError(f"kv.ssd_direct_io is \"on\" but {self.directory} refuses O_DIRECT: {problem}")
            self._publisher.direct = problem is None
            if problem:
                log.info("O_DIRECT unavailable; using buffered I/O", extra={"fields": {"dir": self.directory, "why": problem}})

    async def close(self) -> None:
        """Finish the commits in progress (their blocks stay unpublished if the group has not
        started) and stop the threads."""
        await self._publisher.close()
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
        """:meth:`SsdUsage.space`: the room for block files now (raises OSError)."""
        return self.usage.space()

    def refusals(self, sizes: list[int]) -> list[SsdWriteError | None]:
        """:meth:`SsdUsage.refusals`: which blocks of these payload sizes must not be written."""
        return self.usage.refusals(sizes)

    def free_bytes(self) -> int:
        """Bytes free on the tier's filesystem for the daemon now (0 if it cannot be examined)."""
        return self.usage.free_bytes()

    async def _write_all(self, writes: list[SsdWrite]) -> list[SsdWriteError | None]:
        """Write and publish ``writes`` (:meth:`BlockPublisher.publish`) once no removal of the
        same names is pending; per block, None or its error."""
        if not writes:
            return []
        paths = [self.path_of(w.key, w.header.digest, w.header.layer) for w in writes]
        for path in paths:  # before any file appears: the boot reconcile must not take it for an orphan
            self.usage.touched(path)
        # A removal of the same name still queued on a thread would unlink the new file.
        while pending := {id(f): f for p in paths if (f := self._removing.get(p)) is not None}:
            await asyncio.wait(pending.values())
        return await self._publisher.publish(list(zip(writes, paths)))

    # -- reading ------------------------------------------------------------------------------

    async def read_into(self, key: bytes, header: BlockHeader, dest: memoryview, tenant: str = "") -> ReadProblem | None:
        """Read the block described by ``header`` (what the index says it is; ``tenant``'s, whose
        key opens it if sealed) into ``dest`` (its arena slot, at least :func:`padded` bytes) and
        verify it. None when the bytes in ``dest[:length]`` are the block; else the
        :class:`ReadProblem`. A coded or sealed file is unpacked by what its own header says."""
        return (await self.read_many([(key, header, dest, tenant)]))[0]

    async def read_many(self, reads: list[SsdRead]) -> list[ReadProblem | None]:
        """:meth:`read_into` for a batch, split into one job per I/O thread."""
        loop = asyncio.get_running_loop()
        jobs = [(self.path_of(r[0], r[1].digest, r[1].layer), r[1], r[2], r[3] if len(r) > 3 else "") for r in reads]
        per_job = -(-len(jobs) // self.threads) if jobs else 1
        chunks = await asyncio.gather(*(loop.run_in_executor(self._pool, self._read_chunk, jobs[i:i + per_job])
                                        for i in range(0, len(jobs), per_job)))
        problems = [p for chunk in chunks for p in chunk]
        for (_, header, _, _), problem in zip(jobs, problems):
            if problem is None:
                self.counters.reads += 1
                self.counters.read_bytes += header.length
            elif problem.fault is ReadFault.MISSING:
                self.counters.missing += 1
            elif problem.fault is ReadFault.DAMAGED:
                self.counters.corrupt += 1
        return problems

    def _read_chunk(self, jobs: list[tuple[str, BlockHeader, memoryview, str]]) -> list[ReadProblem | None]:
        return [self._read_verify(path, header, dest, tenant) for path, header, dest, tenant in jobs]

    def _read_verify(self, path: str, want: BlockHeader, dest: memoryview, tenant: str) -> ReadProblem | None:
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
            # A plain file (the payload as it is) is read in one call, straight into its slot; a
            # coded or sealed one has its stored form's first pages there too, and the rest after.
            started = time.perf_counter()
            got = preadv_all(fd, [head, body], min(actual, file_bytes(n)))
            self.form.read(got, time.perf_counter() - started)      # what coding would save a part of (kv.ssd_codec auto)
            try:
                found = BlockHeader.decode(head)
                problem = found.disagreement(want.digest, want.layer, n, want.checksum)
            except HeaderError as exc:
                problem = str(exc)
            if problem is not None:
                return ReadProblem(ReadFault.DAMAGED, problem)
            if actual != found.file_size:
                return ReadProblem(ReadFault.DAMAGED, f"file is {actual} bytes, expected {found.file_size} (truncated or torn)")
            if got != min(actual, file_bytes(n)):
                return ReadProblem(ReadFault.DAMAGED, f"short read: {got} of {min(actual, file_bytes(n))} bytes")
            if not found.plain:
                problem = self._unpack(fd, found, body, got - HEADER_BYTES, tenant)
                if problem is not None:
                    return ReadProblem(ReadFault.DAMAGED, problem)
            if blake3.blake3(body[:n]).digest() != want.checksum:
                return ReadProblem(ReadFault.DAMAGED, "payload does not match its BLAKE3 checksum")
            return None
        except OSError as exc:
            return ReadProblem(ReadFault.IO_ERROR, f"{IO_ERROR}: read failed: {exc.strerror or exc}")
        except Exception as exc:        # not the file's fault that we know of (memory, say): a miss, the file kept
            log.exception("SSD read failed", extra={"fields": {"file": path}})
            return ReadProblem(ReadFault.IO_ERROR, f"{IO_ERROR}: read failed: {exc!r}")
        finally:
            os.close(fd)
            body.release()

    def _unpack(self, fd: int, found: BlockHeader, body: memoryview, have: int, tenant: str) -> str | None:
        """Thread: the stored form of a coded or sealed block, whose first ``have`` bytes are in
        ``body``, unpacked into ``body[:length]``; None, or why it cannot be (the file is damaged
        or not this tenant's). A sealed form read whole is opened where it lies (its plain text
        goes to a scratch area first); any other is gathered into the thread's scratch area (the
        rest read from the file), since a codec cannot decode in place."""
        stored = found.stored_length
        have = min(have, stored)
        if found.nonce and have == stored:
            source = body[:stored]
        else:
            scratch = self._buffers.scratch(padded(stored))
            scratch[:have] = body[:have]
            if have < stored:
                rest = padded(stored) - have
                view = memoryview(scratch)[have:have + rest]
                started = time.perf_counter()
                try:
                    got = preadv_all(fd, [view], rest, HEADER_BYTES + have)
                finally:
                    view.release()
                self.form.read(got, time.perf_counter() - started)
                if got != rest:
                    return f"short read of the stored form: {have + got} of {padded(stored)} bytes"
            source = memoryview(scratch)[:stored]
        out = body[:found.length]
        try:
            self.form.unpack(found.codec, found.nonce, found.tag, source, out, tenant, found.identity(), self._buffers.plain)
        except UnpackError as exc:
            return f"stored form does not unpack: {exc}"
        finally:
            source.release()
            out.release()
        return None

    # -- removal ------------------------------------------------------------------------------

    async def remove_many(self, items: list[SsdVictim]) -> int:
        """Unlink the files of these blocks (accounting them out, each under its tenant, by the
        size its file had); returns how many existed."""
        paths = [(self.path_of(k, h.digest, h.layer), h.length, tenant) for k, h, tenant in items]
        with self._removing_paths([p for p, _, _ in paths]):
            sizes = await asyncio.get_running_loop().run_in_executor(self._pool, unlink_all_sized, [p for p, _, _ in paths])
        for (path, length, tenant), size in zip(paths, sizes):
            self.usage.touched(path)
            if size >= 0:
                self.usage.removed(length, tenant, size)
                self.counters.removed += 1
        return sum(size >= 0 for size in sizes)

    def remove_now(self, key: bytes, header: BlockHeader, tenant: str = "") -> bool:
        """Unlink one block's file, ``tenant``'s, on the calling thread (Delete: one unlink is
        cheap)."""
        path = self.path_of(key, header.digest, header.layer)
        self.usage.touched(path)
        size = unlink_sized(path)
        if size >= 0:
            self.usage.removed(header.length, tenant, size)
            self.counters.removed += 1
        return size >= 0

    def held_by_tenant(self, tenant: str) -> tuple[int, int]:
        """(blocks, payload bytes) of ``tenant``'s on the tier (a tenant tag)."""
        use = self.usage.tenants.get(tenant)
        return (use.blocks, use.payload_bytes) if use is not None else (0, 0)

    async def quarantine(self, key: bytes, header: BlockHeader, why: str, tenant: str = "") -> None:
        """Move a bad block file aside (for an operator to inspect), keeping the newest few."""
        path = self.path_of(key, header.digest, header.layer)
        self.usage.touched(path)
        log.error("corrupt SSD block quarantined", extra={"fields": {"key": key.hex(), "file": path, "problem": why}})
        with self._removing_paths([path]):
            size = await asyncio.get_running_loop().run_in_executor(self._pool, self._quarantine_file, path)
        if size >= 0:
            self.usage.removed(header.length, tenant, size)

    def _quarantine_file(self, path: str) -> int:
        """Thread: move the file aside; the size it had (-1: there was none)."""
        target = os.path.join(self.quarantine_dir, f"{os.path.basename(path)}.{os.getpid()}-{time.time_ns()}")
        try:
            size = os.stat(path).st_size
            os.rename(path, target)
        except FileNotFoundError:
            return -1
        except OSError:
            return unlink_sized(path)
        try:
            names = sorted(os.scandir(self.quarantine_dir), key=lambda e: e.stat().st_mtime_ns)
            for entry in names[:max(0, len(names) - QUARANTINE_KEEP)]:
                unlink_sized(entry.path)
        except OSError:
            pass
        return size

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

    def is_fresh(self, path: str) -> bool:
        """Published or removed by this run while the boot reconcile runs (it must not judge it)."""
        return self.usage.is_fresh(path)

    def reconciled(self, blocks: int, payload_bytes: int, file_bytes_: int,
                   tenants: dict[str, TenantUse] | None = None) -> None:
        """The boot reconcile is done: its count replaces the tier's (:meth:`SsdUsage.reconciled`)."""
        self.usage.reconciled(blocks, payload_bytes, file_bytes_, tenants)

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
