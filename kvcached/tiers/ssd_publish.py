"""Publishing SSD block files: the write half of :class:`kvcached.tiers.ssd.SsdTier`.

:class:`BlockPublisher` writes each block's temporary file ``<name>.tmp-<boot>-<n>`` on the
tier's I/O threads and publishes it under the durability mode (docs/ssd-format.md has the
guarantees per mode):

- ``always``: each block alone: write, fsync, rename, fsync the directory, on its thread.
- ``batch``: group commit. Each file is written and fsynced by an I/O thread, many at once (the
  disk serves concurrent fsyncs in parallel); the group, which closes when no other write is in
  flight, when it is big, or at most ``commit_s`` after its first file, is then renamed and
  each directory it touched fsynced once. Directory fsyncs, paid per block in ``always``, are
  paid per group.
- ``none``: write, rename; the kernel writes back when it likes.

A block whose write, fsync or rename fails is discarded (its temporary file removed) and
reported failed; an fsync is never retried (after a failed fsync the page cache may already
have dropped the dirty pages, so a second fsync can succeed without the data being on disk).
A published block is counted in the tier's :class:`~kvcached.tiers.ssd_usage.SsdUsage` and
:class:`~kvcached.tiers.ssd_usage.SsdCounters` when it is published, whether or not its caller
is still waiting. Room checks, retries after a full disk and the names' bookkeeping for the boot
reconcile are the tier's (:meth:`SsdTier.write_many`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from kvcached.codecs import Packed, StoredForm
from kvcached.host.fsmodes import make_dirs
from kvcached.tiers.ssd_errors import SsdFull, SsdWriteError, write_error
from kvcached.tiers.ssd_format import HEADER_BYTES, PAGE, TMP_MARK, BlockHeader, file_bytes, padded
from kvcached.tiers.ssd_io import fsync_dir, pwritev_all, rename_all, unlink_quietly
from kvcached.tiers.ssd_usage import SsdCounters, SsdUsage

__all__ = ["GROUP_MAX_BYTES", "GROUP_MAX_FILES", "BlockPublisher", "Durability", "PageBuffers", "SsdWrite"]

log = logging.getLogger("kvcached.ssd")

Durability = Literal["always", "batch", "none"]
GROUP_MAX_FILES = 256            # a batch group commits at this many files without waiting
GROUP_MAX_BYTES = 256 << 20      # ... or this many bytes
CODED, SEALED = 1, 2             # how a written file holds its block (counted once it is published)


@dataclass(slots=True)
class SsdWrite:
    """One block to publish, ``tenant``'s (a tenant tag: what the tier counts it under).
    ``payload`` must stay valid (pinned) until the write completes."""

    key: bytes
    header: BlockHeader
    payload: memoryview
    tenant: str = ""


@dataclass(slots=True)
class _Written:
    """A temporary file written and fsynced, waiting for its group commit (rename, dir fsync)."""

    write: SsdWrite
    tmp: str
    final: str
    size: int                 # the file's bytes (a coded block's are its own)
    form: int                 # CODED | SEALED: how the file holds the block
    future: asyncio.Future[None] = field(repr=False)


class PageBuffers(threading.local):
    """Per-thread page-aligned buffers (anonymous mmaps are page aligned, as O_DIRECT needs):
    a header page, a bounce page for a payload's last partial page, and a scratch area for
    stored forms (coded or sealed blocks), grown to the largest asked for."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_BYTES)
        self.tail = mmap.mmap(-1, PAGE)
        self._scratch = mmap.mmap(-1, PAGE)
        self._plain = mmap.mmap(-1, PAGE)

    def scratch(self, nbytes: int) -> mmap.mmap:
        """This thread's scratch area for stored forms, at least ``nbytes`` long (its contents
        are not kept; no view of it may outlive the call that asked)."""
        if len(self._scratch) < nbytes:
            self._scratch.close()
            self._scratch = mmap.mmap(-1, padded(nbytes))
        return self._scratch

    def plain(self, nbytes: int) -> mmap.mmap:
        """A second such area, for a sealed form's plain text while the stored form is read."""
        if len(self._plain) < nbytes:
            self._plain.close()
            self._plain = mmap.mmap(-1, padded(nbytes))
        return self._plain


class BlockPublisher:
    """Writes and publishes block files on ``pool`` (see the module). ``direct`` (O_DIRECT) is
    decided by :meth:`SsdTier.open` before the first write."""

    def __init__(self, blocks_dir: str, boot_token: str, usage: SsdUsage, counters: SsdCounters,
                 pool: concurrent.futures.ThreadPoolExecutor, buffers: PageBuffers, form: StoredForm, *,
                 durability: Durability, commit_s: float, threads: int) -> None:
        self.blocks_dir = blocks_dir
        self.boot_token = boot_token
        self.usage = usage
        self.counters = counters
        self.durability = durability
        self.commit_s = commit_s
        self.threads = threads
        self.direct = False
        self.form = form
        self._pool = pool
        self._buffers = buffers
        self._writing = 0            # blocks whose files are being written now (group commit timing)
        self._tmp_serial = itertools.count()
        self._group: list[_Written] = []
        self._group_bytes = 0
        self._group_timer: asyncio.TimerHandle | None = None
        self._commits: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Finish the commits in progress (their blocks stay unpublished if the group has not
        started). The pool is the caller's to stop, after this."""
        if self._group_timer is not None:
            self._group_timer.cancel()
            self._group_timer = None
        if self._group:
            self._start_commit()
        if self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)

    async def publish(self, writes: list[tuple[SsdWrite, str]]) -> list[SsdWriteError | None]:
        """Write and publish each block at its final path, split into one job per I/O thread (a
        job per block costs more in hand-offs than a small block's write); per block, None or
        the error that discarded it. The caller counts outcomes in write_errors and no_space."""
        if not writes:
            return []
        loop = asyncio.get_running_loop()
        per_job = -(-len(writes) // self.threads)
        chunks = [writes[i:i + per_job] for i in range(0, len(writes), per_job)]
        with self.usage.unsettled(sum(file_bytes(w.header.length) for w, _ in writes)):
            self._writing += len(writes)       # each chunk takes its own off when its files are written
            results = await asyncio.gather(*(self._write_chunk(loop, chunk) for chunk in chunks))
        return [r for chunk in results for r in chunk]

    async def _write_chunk(self, loop: asyncio.AbstractEventLoop,
                           chunk: list[tuple[SsdWrite, str]]) -> list[SsdWriteError | None]:
        try:
            written = await loop.run_in_executor(self._pool, self._write_files, chunk)
        finally:
            self._writing -= len(chunk)
        out: list[SsdWriteError | None] = []
        waits: list[tuple[int, asyncio.Future[None]]] = []
        for (w, _), res in zip(chunk, written):
            if isinstance(res, BaseException):
                out.append(self._failed(w, res))
                continue
            out.append(None)
            if self.durability == "batch":
                fut: asyncio.Future[None] = loop.create_future()
                self._enqueue(_Written(w, res[0], res[1], res[2], res[3], fut))
                waits.append((len(out) - 1, fut))
            else:
                self._published(w, res[2], res[3])
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

    def _published(self, w: SsdWrite, size: int, form: int) -> None:
        self.usage.added(w.header.length, w.tenant, size)
        self.counters.coded += bool(form & CODED)
        self.counters.sealed += bool(form & SEALED)
        self.counters.writes += 1
        self.counters.write_bytes += w.header.length
        self.counters.file_bytes_written += size

    # -- on the I/O threads -------------------------------------------------------------------

    def _write_files(self, chunk: list[tuple[SsdWrite, str]]) -> list[tuple[str, str, int, int] | SsdWriteError]:
        """Thread: write each block's temporary file; (tmp, final, file bytes, form) or the
        error, per block: whatever goes wrong with one block (its coding too) is that block's."""
        out: list[tuple[str, str, int, int] | SsdWriteError] = []
        for w, final in chunk:
            try:
                out.append(self._write_one(w, final))
            except SsdWriteError as exc:
                out.append(exc)
            except Exception as exc:        # not the disk's: a codec's or the seal's failure, say
                log.exception("SSD write failed", extra={"fields": {"key": w.key.hex()}})
                out.append(SsdWriteError(errno.EIO, f"SSD write failed: {exc!r}"))
        return out

    def _write_one(self, w: SsdWrite, final: str) -> tuple[str, str, int, int]:
        """Thread: write the temporary file and, unless the mode is ``none``, fsync it. Mode
        ``always`` then renames it and fsyncs the directory; mode ``none`` renames it; mode
        ``batch`` leaves rename and directory fsync to the group commit. A block the tier's
        :class:`StoredForm` codes or seals is written in that form."""
        tmp = f"{final}{TMP_MARK}{self.boot_token}-{next(self._tmp_serial)}"   # unique: two writes never share one
        packed = None if self.form.plain else self.form.pack(w.payload, w.tenant, w.header.identity(), self._buffers.scratch)
        if packed is not None:
            return self._write_packed(w, final, tmp, packed)
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
            self._write_file(final, tmp, parts, file_bytes(n))
        finally:
            body.release()     # no view of the arena may outlive the call (a traceback would keep it)
        return tmp, final, file_bytes(n), 0

    def _write_packed(self, w: SsdWrite, final: str, tmp: str, packed: Packed) -> tuple[str, str, int, int]:
        """Thread: :meth:`_write_one` of a coded or sealed block, its stored form ``packed`` in
        the thread's page-aligned scratch area, zero-padded to a whole page there."""
        header = BlockHeader(w.header.digest, w.header.layer, w.header.length, w.header.checksum, w.header.created,
                             packed.codec, packed.length, packed.nonce, packed.tag)
        bufs = self._buffers
        bufs.header[:] = header.encode()
        size = padded(packed.length)
        scratch = bufs.scratch(size)
        scratch[packed.length:size] = bytes(size - packed.length)
        body = memoryview(scratch)[:size]
        try:
            self._write_file(final, tmp, [bufs.header, body], header.file_size)
        finally:
            body.release()
        return tmp, final, header.file_size, (CODED if packed.codec else 0) | (SEALED if packed.nonce else 0)

    def _write_file(self, final: str, tmp: str, parts: list[Any], total: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:     # the leaf's first block: make the leaf, durably
                self._make_leaf(os.path.dirname(final))
                fd = os.open(tmp, flags, 0o600)
        except OSError as exc:
            raise write_error(exc, tmp) from None
        try:
            try:
                started = time.perf_counter()
                pwritev_all(fd, parts, total)
                if self.durability != "none":
                    os.fsync(fd)
                self.form.wrote(total, time.perf_counter() - started)    # what coding would save a part of
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
            raise write_error(exc, tmp) from None

    def _make_leaf(self, leaf: str) -> None:
        """Create a leaf directory durably (at most 4096 times in the tier's life): its parent
        and ``blocks/`` are fsynced every time, since another thread may have created the parent
        and not synced ``blocks/`` yet."""
        make_dirs(leaf)
        fsync_dir(os.path.dirname(leaf))
        fsync_dir(self.blocks_dir)

    # -- group commit (batch) -------------------------------------------------------------------

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
                    self._published(g.write, g.size, g.form)
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
