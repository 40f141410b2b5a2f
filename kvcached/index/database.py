"""The RocksDB instance behind the block index: opening it, committing write batches, and
bringing writes back after a failed one, without a restart.

:class:`IndexDatabase` is the only holder of references to the RocksDB instance (rocksdict,
raw mode) and its column families; :class:`~kvcached.index.block_index.BlockIndex` reads and
builds its batches through the families it exposes, which a recovery replaces. Keeping every
reference in one place is what lets a recovery close the failed instance: RocksDB lets its lock
go only once nothing refers to the old instance any more.

A write that fails (its disk is full; RocksDB then refuses every later write until it is told to
resume, which rocksdict cannot do) makes the index *unwritable*: writes are refused at once with
:class:`IndexUnwritable` (the API's UNAVAILABLE), reads go on, and :meth:`IndexDatabase.recover`,
called about every second by the daemon, brings writes back without a restart once the disk has
room (docs/index.md, "When the index cannot be written").
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import struct
import threading
import time

from rocksdict import AccessType, BlockBasedOptions, Options, Rdict, WriteBatch, WriteOptions

from kvcached.errors import Unavailable
from kvcached.host.fsmodes import make_dirs
from kvcached.index.format import SCHEMA_VERSION

__all__ = ["IndexDatabase", "IndexError_", "IndexUnwritable", "KEEP_LOG_FILES", "MAX_WAL_BYTES", "MEMTABLE_BYTES",
           "RECOVERY_HEADROOM", "RETRY_FIRST_S", "RETRY_MAX_S"]

log = logging.getLogger("kvcached.index")

_FAMILIES = ("blocks", "meta", "ssd_age", "policy")
# Families earlier builds kept and this one does not: opened if present (RocksDB opens every
# family or none), then dropped by the writer. "routes" held the engine keys of blocks before
# they moved into the blocks' records (kvcached.index.format).
_RETIRED = ("routes",)
_SENTINEL = b"write_check"      # in ``meta``: what a recovery writes and reads back
KEEP_LOG_FILES = 16             # RocksDB's LOG.old files kept (each open, recoveries' included, starts one)
RECOVERY_HEADROOM = 1 << 20     # free bytes wanted beyond the WAL's size before a reopen is tried
# Memory and disk the index may hold beyond its table files. The blocks family takes nearly all
# writes; the small families would never fill a memtable of their own, and a WAL is kept until
# every family with data in it has flushed: without a cap on the WALs they grow (RocksDB's
# default cap is 4x all the write buffers, about 2 GiB here) and so does a restart's replay.
MEMTABLE_BYTES = 32 << 20       # every family's memtables together; past it the largest is flushed
MAX_WAL_BYTES = 64 << 20        # past it the families holding the oldest WAL are flushed, the WAL deleted
BLOOM_BITS_PER_KEY = 10         # the blocks family's Bloom filter (see _blocks_options)
MEMTABLE_BLOOM_RATIO = 0.02     # of its memtable's size, for the memtable's filter
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 16.0   # wait after a failed recovery attempt, doubling


class IndexError_(Exception):
    """The index cannot be opened or used (locked by another daemon, corrupt, wrong version)."""


class IndexUnwritable(IndexError_, Unavailable):
    """A write was refused: the index cannot be written now (a full disk, an I/O error). Nothing
    of that write was applied; reads go on; :meth:`IndexDatabase.recover` brings writes back."""


class IndexDatabase:
    """The index's RocksDB instance at ``path``, opened as the writer with the schema version
    checked, and its writability. Reads go straight to the families (:attr:`blocks`,
    :attr:`ssd_age`, :attr:`policy`, each with its handle for write batches), which belong to
    the instance serving now: read them through this object each time, never keep one, or a
    recovery could not close the instance it replaces. :meth:`commit` may be called from any
    thread; :meth:`recover` and :meth:`close` from the index's owner."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            make_dirs(self.path)          # 0700 whatever the umask (kvcached.host.fsmodes)
        except OSError as exc:
            raise IndexError_(f"cannot create index directory {self.path}: {exc.strerror or exc}") from None
        #: False from a failed write until :meth:`recover` succeeds: writes are refused, reads go on.
        self.writable = True
        self.unwritable_reason = ""       # why, RocksDB's words (the last failed write or attempt)
        self.unwritable_since = 0.0       # time.time() of the failure
        self.recoveries = 0               # times the index became writable again without a restart
        self.write_failures = 0           # writes that failed or were refused while unwritable
        self._read_only = False           # the open RocksDB is a read-only view (a reopen failed)
        self._retry_at = 0.0              # recover(): no attempt before this (monotonic)
        self._retry_wait = RETRY_FIRST_S
        self._reopening: concurrent.futures.Future[Rdict] | None = None   # recover()'s thread
        self._swap_lock = threading.Lock()   # a write on a thread never meets a DB being swapped
        self._write_opts = WriteOptions()
        self._sync_opts = WriteOptions()
        self._sync_opts.sync = True
        try:
            self._bind(self._open(read_only=False), read_only=False)
        except Exception as exc:  # rocksdict raises plain Exception
            text = str(exc)
            if "lock" in text.lower():
                raise IndexError_(f"index {self.path} is in use by another process (is another kvcached running?): {text}") from None
            raise IndexError_(f"cannot open index {self.path}: {text}") from None
        version = self._meta.get(b"schema_version")
        if version is None:
            self._meta[b"schema_version"] = struct.pack("<I", SCHEMA_VERSION)
        elif struct.unpack("<I", version)[0] != SCHEMA_VERSION:
            found = struct.unpack("<I", version)[0]
            self.close()
            raise IndexError_(f"index {self.path} has schema version {found}, this kvcached reads {SCHEMA_VERSION}")

    def _open(self, *, read_only: bool) -> Rdict:
        """A RocksDB instance on :attr:`path`: the writer (it takes RocksDB's lock and replays the
        WAL into table files), or a read-only view (no lock, nothing written: works on a full disk
        and beside a writer that is still open)."""
        retired = _retired_present(self.path)
        families = {name: Options(raw_mode=True) for name in (*_FAMILIES, *retired)}
        families["blocks"] = _blocks_options()
        if read_only:
            return Rdict(self.path, Options(raw_mode=True), column_families=families,
                         access_type=AccessType.read_only())
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_keep_log_file_num(KEEP_LOG_FILES)
        opts.set_db_write_buffer_size(MEMTABLE_BYTES)
        opts.set_max_total_wal_size(MAX_WAL_BYTES)
        db = Rdict(self.path, opts, column_families=families)
        for name in retired:
            db.drop_column_family(name)
        return db

    def _bind(self, db: Rdict, *, read_only: bool) -> Rdict | None:
        """Serve from ``db`` from now on; returns the instance it replaces (None at first), whose
        family objects this object no longer holds, ready to be closed."""
        old: Rdict | None = getattr(self, "_db", None)
        self._db = db
        self._read_only = read_only
        self.blocks = db.get_column_family("blocks")
        self.blocks_handle = db.get_column_family_handle("blocks")
        self._meta = db.get_column_family("meta")
        self._meta_handle = db.get_column_family_handle("meta")
        self.ssd_age = db.get_column_family("ssd_age")
        self.ssd_age_handle = db.get_column_family_handle("ssd_age")
        self.policy = db.get_column_family("policy")
        self.policy_handle = db.get_column_family_handle("policy")
        return old

    # -- writes -----------------------------------------------------------------------------------

    def commit(self, batch: WriteBatch, sync: bool) -> None:
        """Write ``batch`` (``sync``: wait for the WAL to reach the disk), or raise
        IndexUnwritable (nothing of it applied). The first failure makes the index unwritable:
        RocksDB refuses every write after a failed one anyway, until it is reopened (:meth:`recover`).

        A refused batch is dropped from the frames the exception passes through: it holds a
        column family handle, which keeps the RocksDB instance, and its lock, alive for as
        long as the traceback lives, and callers keep those (gRPC keeps an aborted call's state,
        exception chain included, for a while), so the reopen could not take the lock. A caller
        that holds the batch in a local drops it too before the exception leaves its frame."""
        if self.writable:
            with self._swap_lock:
                if self.writable:         # again, under the lock: another writer may have just failed
                    try:
                        self._db.write(batch, self._sync_opts if sync else self._write_opts)
                        return
                    except Exception as exc:  # rocksdict raises plain Exception
                        self._became_unwritable(str(exc))
        del batch
        self.write_failures += 1
        raise IndexUnwritable(self._refusal())

    def _became_unwritable(self, reason: str) -> None:
        self.unwritable_reason = reason
        if not self.writable:
            return
        self.writable = False
        self.unwritable_since = time.time()
        self._retry_at, self._retry_wait = 0.0, RETRY_FIRST_S
        log.error("the index cannot be written: writes refused, reads go on, until it recovers by itself",
                  extra={"fields": {"path": self.path, "error": reason}})

    def _refusal(self) -> str:
        return (f"{self.unwritable_reason}; the index at {self.path} takes no writes until it recovers by itself "
                f"(tried about every second once its disk has room)")

    # -- recovery from a failed write ------------------------------------------------------------

    def recover(self, now: float) -> bool:
        """Make an unwritable index writable again if it can be; True when it is writable. Call
        from the index's owner about every second while :attr:`writable` is False; ``now`` is a
        monotonic clock. It never waits on RocksDB's slow steps (the event loop calls it):

        1. nothing is tried while the disk has less free space than the WAL's size plus
           :data:`RECOVERY_HEADROOM` (a reopen replays the WAL into new table files), nor within
           ``RETRY_FIRST_S`` (doubling to ``RETRY_MAX_S``) of a failed attempt;
        2. a sentinel record is written and read back: RocksDB may have recovered by itself;
        3. else a read-only view takes over the reads (no lock, nothing written) and a thread
           closes the failed writer (about a second: RocksDB winds down its own recovery) and
           opens it again, replaying its WAL: every write that succeeded is kept;
        4. a later call serves from the new writer once the sentinel reads back.

        If the writer cannot be opened again (the disk filled up again, a worker thread still
        iterates over the old instance), reads go on from the view and a later attempt retries."""
        if self.writable:
            return True
        with self._swap_lock:
            if self._reopening is not None:
                return self._reopened(now) if self._reopening.done() else False
            if now < self._retry_at:
                return False
            free, needed = self.free_bytes(), self._wal_bytes() + RECOVERY_HEADROOM
            if free < needed:
                return False
            if not self._read_only:
                if self._write_check():
                    return self._recovered()
                try:
                    view = self._open(read_only=True)
                except Exception as exc:
                    self.unwritable_reason = f"cannot open a read-only view of the index to reopen it: {exc}"
                    return self._failed(now)       # the failed writer stays: its reads still work
                old = self._bind(view, read_only=True)
            else:
                old = None                         # a reopen failed earlier: the view serves reads
            self._reopening = concurrent.futures.Future()
            threading.Thread(target=self._reopen, args=(old, self._reopening), name="kvcached-index-reopen",
                             daemon=True).start()
            return False

    def _reopen(self, old: Rdict | None, done: "concurrent.futures.Future[Rdict]") -> None:
        """Worker thread: close the failed writer, open a new one; the result goes to ``done``.

        RocksDB lets its lock go only once nothing refers to the old instance (its family
        objects, iterators, handles, batches bound to them: see commit); until then the
        attempt fails and a later one retries."""
        _close_quietly(old)
        del old
        try:
            done.set_result(self._open(read_only=False))
        except Exception as exc:  # rocksdict raises plain Exception
            done.set_exception(exc)

    def _reopened(self, now: float) -> bool:
        assert self._reopening is not None
        done, self._reopening = self._reopening, None
        try:
            writer = done.result()
        except Exception as exc:
            self.unwritable_reason = f"reopening the index failed: {exc}"
            return self._failed(now)
        _close_quietly(self._bind(writer, read_only=False))
        return self._recovered() if self._write_check() else self._failed(now)

    def _recovered(self) -> bool:
        self.writable, self.recoveries = True, self.recoveries + 1
        self._retry_at, self._retry_wait = 0.0, RETRY_FIRST_S
        log.warning("the index is writable again", extra={"fields": {
            "path": self.path, "unwritable_s": round(time.time() - self.unwritable_since, 1),
            "free_bytes": self.free_bytes()}})
        return True

    def _failed(self, now: float) -> bool:
        self._retry_at = now + self._retry_wait
        self._retry_wait = min(self._retry_wait * 2, RETRY_MAX_S)
        log.warning("the index is still not writable; will retry", extra={"fields": {
            "path": self.path, "error": self.unwritable_reason, "reads_from": "read-only view" if self._read_only
            else "the failed writer", "retry_in_s": round(self._retry_at - now, 1)}})
        return False

    def _write_check(self) -> bool:
        """Write a sentinel to ``meta`` (WAL synced) and read it back."""
        value = struct.pack("<d", time.time())
        batch = WriteBatch(raw_mode=True)
        batch.put(_SENTINEL, value, column_family=self._meta_handle)
        try:
            self._db.write(batch, self._sync_opts)
            if self._meta.get(_SENTINEL) == value:
                return True
            self.unwritable_reason = "the index did not read back what it wrote"
        except Exception as exc:
            self.unwritable_reason = str(exc)
        return False

    def free_bytes(self) -> int:
        """Bytes free to the daemon on the index's filesystem."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def _wal_bytes(self) -> int:
        total = 0
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.name.endswith(".log"):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def close(self) -> None:
        """Flush and close; the object is unusable afterwards. An index that cannot be written
        is closed without a flush (its WAL holds every write that succeeded)."""
        with self._swap_lock:
            if self._reopening is not None:           # a recovery's writer, opened or not: let it go
                try:
                    _close_quietly(self._reopening.result())
                except Exception:
                    pass
                self._reopening = None
            db, flush = self._db, self.writable and not self._read_only
            del (self._db, self.blocks, self.blocks_handle, self._meta, self._meta_handle, self.ssd_age,
                 self.ssd_age_handle, self.policy, self.policy_handle)
            try:
                if flush:
                    db.flush()
            finally:
                db.close()


def _close_quietly(db: Rdict | None) -> None:
    """Close an instance the index no longer serves from, without a flush: its WAL holds every
    write that succeeded, and the next writer replays it. Background work is cancelled first
    (Rdict.close flushes, which fails after a write error). Closing a failed writer still takes
    about a second (RocksDB winds down its own error recovery): recover() does it in a thread."""
    if db is None:
        return
    try:
        db.cancel_all_background(False)
        db.close()
    except Exception as exc:
        log.debug("closing the replaced index instance: %s", exc)


def _blocks_options() -> Options:
    """The blocks family's options: a Bloom filter on its table files, because most of its
    reads are of keys it does not hold (a save looks up blocks it is about to store; an index
    write reads the records it replaces, for the feeds). Without one, each such read searches
    every level's table files. 10 bits a key: about 1.2 bytes of memory a block."""
    opts = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
    opts.set_block_based_table_factory(table)
    opts.set_memtable_whole_key_filtering(True)          # the same for the memtables
    opts.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO)
    return opts


def _retired_present(path: str) -> tuple[str, ...]:
    """The retired families (see ``_RETIRED``) the index at ``path`` still has."""
    if not os.path.exists(os.path.join(path, "CURRENT")):
        return ()
    try:
        names = Rdict.list_cf(path, Options(raw_mode=True))
    except Exception:           # unreadable: opening it says why
        return ()
    return tuple(name for name in _RETIRED if name in names)
