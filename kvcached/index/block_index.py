"""The persistent block index: RocksDB (rocksdict, raw mode) at ``kv.index_dir``.

The index is the source of truth for block metadata; tiers hold only bytes. One record per
stored block, keyed by the 32-byte index key (kvcached_agent.address.index_key), in the column
family ``blocks``; the ``meta`` family holds the schema version; ``ssd_age`` is the SSD tier's
eviction queue (see :meth:`BlockIndex.ssd_queue`); ``policy`` holds what the cache policies
learned (kvcached.index.policy_state), so it survives a restart.

A record whose tier set is empty is a *tombstone*: the bytes are gone (evicted, or lost when
the daemon restarted and they lived only in RAM), the metadata stays for ``kv.gone_ttl`` so a
Get can say why it misses, and a later fetch from a peer can still be checked against the
stored checksum.

The record format (BlockRecord, Tier, GoneReason, the byte layout, the SSD queue's entries) is
kvcached.index.format's.

Writes go through the WAL without fsync: a daemon crash loses nothing the OS has. Writes that
publish SSD blocks under a durable mode pass ``sync=True`` (one WAL fsync per group commit), so
after a power loss the index never forgets a block file it acknowledged; other writes lost to a
power loss only ever name bytes that lived in RAM, or leave orphan files the boot reconcile removes.

A write that fails (its disk is full; RocksDB then refuses every later write until it is told to
resume, which rocksdict cannot do) makes the index *unwritable*: writes are refused at once with
:class:`IndexUnwritable` (the API's UNAVAILABLE), reads go on, and :meth:`BlockIndex.recover`,
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
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, cast

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from kvcached.errors import Unavailable
from kvcached.host.fsmodes import make_dirs
from kvcached.index.format import (
    AGE,
    CHECKSUM_AT,
    F64,
    GONE_AT_AT,
    LAST_SEEN_AT,
    REASON_AT,
    RECORD,
    SCHEMA_VERSION,
    TIERS_AT,
    BlockRecord,
    GoneReason,
    Tier,
    is_expired_tombstone,
    is_present,
    queue_entry,
    queue_time,
    raw_ssd_view,
    wire_key_of,
)

__all__ = ["BlockIndex", "PresenceFeed", "BlockRecord", "Tier", "GoneReason", "IndexError_", "IndexUnwritable", "queue_entry",
           "queue_time", "raw_ssd_view"]

log = logging.getLogger("kvcached.index")

_FAMILIES = ("blocks", "meta", "ssd_age", "policy")
_SENTINEL = b"write_check"      # in ``meta``: what a recovery writes and reads back
KEEP_LOG_FILES = 16             # RocksDB's LOG.old files kept (each open, recoveries' included, starts one)
RECOVERY_HEADROOM = 1 << 20     # free bytes wanted beyond the WAL's size before a reopen is tried
# Memory and disk the index may hold beyond its table files. The blocks family takes nearly all
# writes; the small families would never fill a memtable of their own, and a WAL is kept until
# every family with data in it has flushed: without a cap on the WALs they grow (RocksDB's
# default cap is 4x all the write buffers, about 2 GiB here) and so does a restart's replay.
MEMTABLE_BYTES = 32 << 20       # every family's memtables together; past it the largest is flushed
MAX_WAL_BYTES = 64 << 20        # past it the families holding the oldest WAL are flushed, the WAL deleted
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 16.0   # wait after a failed recovery attempt, doubling


class IndexError_(Exception):
    """The index cannot be opened or used (locked by another daemon, corrupt, wrong version)."""


class IndexUnwritable(IndexError_, Unavailable):
    """A write was refused: the index cannot be written now (a full disk, an I/O error). Nothing
    of that write was applied; reads go on; :meth:`BlockIndex.recover` brings writes back."""


class PresenceFeed:
    """Blocks that became present or stopped being present, in the order the index's writes
    made them so, as (wire key, present) pairs for one reader to take in batches (the peer
    tier's announcer). The index records into it from whatever thread wrote; a deque's append
    and popleft are atomic, so neither side takes a lock and the index calls nothing above it.
    An index records changes only while it has a feed (:attr:`BlockIndex.presence`): a daemon
    without peers keeps none."""

    def __init__(self) -> None:
        self._changes: deque[tuple[bytes, bool]] = deque()

    def record(self, gained: list[bytes], dropped: list[bytes]) -> None:
        self._changes.extend((key, True) for key in gained)
        self._changes.extend((key, False) for key in dropped)

    def take(self) -> list[tuple[bytes, bool]]:
        """The changes recorded so far, oldest first; they are gone from the feed."""
        changes = self._changes
        return [changes.popleft() for _ in range(len(changes))]

    def __len__(self) -> int:
        return len(self._changes)


class BlockIndex:
    """Block metadata on disk. One owner (the store, on the event loop) calls it; the methods
    that say so are also safe from a worker thread, and :meth:`write` may be called from one
    (the SSD reconcile, the policy saver) while the owner goes on."""

    #: Where writes that change a block's presence are recorded (peer announcements); None: nowhere.
    presence: PresenceFeed | None = None

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
        families = {name: Options(raw_mode=True) for name in _FAMILIES}
        if read_only:
            return Rdict(self.path, Options(raw_mode=True), column_families=families,
                         access_type=AccessType.read_only())
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_keep_log_file_num(KEEP_LOG_FILES)
        opts.set_db_write_buffer_size(MEMTABLE_BYTES)
        opts.set_max_total_wal_size(MAX_WAL_BYTES)
        return Rdict(self.path, opts, column_families=families)

    def _bind(self, db: Rdict, *, read_only: bool) -> Rdict | None:
        """Serve from ``db`` from now on; returns the instance it replaces (None at first), whose
        family objects this index no longer holds, ready to be closed."""
        old: Rdict | None = getattr(self, "_db", None)
        self._db = db
        self._read_only = read_only
        self._blocks = db.get_column_family("blocks")
        self._blocks_handle = db.get_column_family_handle("blocks")
        self._meta = db.get_column_family("meta")
        self._meta_handle = db.get_column_family_handle("meta")
        self._age = db.get_column_family("ssd_age")
        self._age_handle = db.get_column_family_handle("ssd_age")
        self._policy = db.get_column_family("policy")
        self._policy_handle = db.get_column_family_handle("policy")
        return old

    # -- point operations ---------------------------------------------------------------------

    def get(self, key: bytes) -> BlockRecord | None:
        raw = self._blocks.get(key)
        return None if raw is None else BlockRecord.decode(raw)

    def raw(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key``'s record (None if absent); read-only, thread-safe."""
        return self._blocks.get(key)

    def raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The raw records of ``keys`` in one multi-get (None where absent): for hot loops that
        read a few fields (kvcached.index.format.raw_ssd_view) instead of decoding records. rocksdict's stubs
        type a multi-get key list as a list of its key union, which a list[bytes] is not."""
        return cast("list[bytes | None]", self._blocks[cast(Any, keys)])

    def get_many(self, keys: list[bytes]) -> list[BlockRecord | None]:
        return [None if raw is None else BlockRecord.decode(raw) for raw in self.raw_many(keys)]

    def checksums(self, keys: list[bytes]) -> list[bytes | None]:
        """The payload checksums of ``keys`` (None where absent), read straight from the stored
        bytes: the Get path needs nothing else from the record."""
        return [None if raw is None or len(raw) < RECORD.size else raw[CHECKSUM_AT:CHECKSUM_AT + 32]
                for raw in self.raw_many(keys)]

    def models(self, keys: list[bytes]) -> list[str | None]:
        """The model names of ``keys`` (None where absent), read straight from the stored bytes:
        serving a peer's pull needs nothing else from the record (the checksum came with the pin)."""
        return [raw[RECORD.size:].decode() if raw is not None and len(raw) >= RECORD.size
                and raw[0] == SCHEMA_VERSION else None for raw in self.raw_many(keys)]

    def tiers_of(self, keys: list[bytes]) -> list[Tier]:
        """The tier set of each of ``keys`` (NONE where absent), from the raw bytes."""
        return [Tier(raw[TIERS_AT]) if raw is not None and len(raw) >= RECORD.size else Tier.NONE
                for raw in self.raw_many(keys)]

    def write(self, puts: Iterable[tuple[bytes, BlockRecord | bytes]] = (), deletes: Iterable[bytes] = (), *,
              queue: Iterable[bytes] = (), unqueue: Iterable[bytes] = (), sync: bool = False,
              watch: bool = True, policy: Iterable[tuple[bytes, bytes | None]] = ()) -> None:
        """Apply puts (records, or encoded records from the ``with_*`` methods), deletes, SSD
        queue entries (from :func:`queue_entry`) and ``policy`` family entries (None deletes)
        atomically, in one WriteBatch; ``sync`` waits
        for the WAL to reach the disk. With a :attr:`presence` feed, blocks that become present or
        stop being present are recorded in it once the write is done; ``watch=False`` says the
        write changes no block's presence (last-seen times)."""
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._blocks_handle)
        n = 0
        watching = self.presence is not None and watch
        encoded: list[tuple[bytes, bytes]] = []
        deleted: list[bytes] = []
        for key, record in puts:
            raw = record if isinstance(record, bytes) else record.encode()
            batch.put(key, raw)
            if watching:
                encoded.append((key, raw))
            n += 1
        for key in deletes:
            batch.delete(key)
            if watching:
                deleted.append(key)
            n += 1
        for entry in queue:
            batch.put(entry, b"", column_family=self._age_handle)
            n += 1
        for entry in unqueue:
            batch.delete(entry, column_family=self._age_handle)
            n += 1
        for key, value in policy:
            if value is None:
                batch.delete(key, column_family=self._policy_handle)
            else:
                batch.put(key, value, column_family=self._policy_handle)
            n += 1
        if not n:
            return
        before = self.raw_many([k for k, _ in encoded] + deleted) if watching and (encoded or deleted) else []
        try:
            self._commit(batch, sync)
        except IndexUnwritable:
            del batch             # see _commit: this frame lives on in the traceback
            raise
        if before:
            self._report(encoded, deleted, before)

    def _commit(self, batch: WriteBatch, sync: bool) -> None:
        """Write ``batch``, or raise IndexUnwritable (nothing of it applied). The first failure
        makes the index unwritable: RocksDB refuses every write after a failed one anyway, until
        it is reopened (:meth:`recover`).

        A refused batch is dropped from the frames the exception passes through: it holds a
        column family handle, which keeps the RocksDB instance, and its lock, alive for as
        long as the traceback lives, and callers keep those (gRPC keeps an aborted call's state,
        exception chain included, for a while), so the reopen could not take the lock."""
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
        objects, iterators, handles, batches bound to them: see _commit); until then the
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

    def _report(self, encoded: list[tuple[bytes, bytes]], deleted: list[bytes], before: list[bytes | None]) -> None:
        gained: list[bytes] = []
        dropped: list[bytes] = []
        for (_, raw), old in zip(encoded, before):
            was, now = is_present(old), is_present(raw)
            if now and not was:
                gained.append(wire_key_of(raw))
            elif was and not now:
                dropped.append(wire_key_of(raw))
        for old in before[len(encoded):]:
            if is_present(old):
                dropped.append(wire_key_of(old))      # type: ignore[arg-type]
        if (gained or dropped) and self.presence is not None:
            self.presence.record(gained, dropped)

    def present_wire_keys(self) -> list[bytes]:
        """The wire keys (digest | u32 layer) of every present block, read-only (safe from a
        worker thread): what a peer snapshot lists."""
        out = []
        it = self._blocks.iter()
        it.seek_to_first()
        while it.valid():
            raw = it.value()
            if is_present(raw):
                out.append(wire_key_of(raw))
            it.next()
        del it
        return out

    # -- in-place changes: patch the stored bytes, no decode (hot: evictions, touches) ----------

    def without_tier(self, keys: list[bytes], tier: Tier, reason: GoneReason, now: float) -> list[tuple[bytes, bytes]]:
        """Encoded records of ``keys`` with ``tier`` cleared, for :meth:`write`. A record left in
        no tier becomes a tombstone (``reason``, gone at ``now``). Absent records, and records
        not in ``tier``, are left out."""
        out = []
        mask, keep, why = int(tier), ~int(tier) & 0xFF, int(reason)   # plain ints: enum ops are slow
        for key, raw in zip(keys, self.raw_many(keys)):
            if raw is None or len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION or not raw[TIERS_AT] & mask:
                continue
            patched = bytearray(raw)
            patched[TIERS_AT] &= keep
            if not patched[TIERS_AT]:
                patched[REASON_AT] = why
                F64.pack_into(patched, GONE_AT_AT, now)
            out.append((key, bytes(patched)))
        return out

    def with_tier(self, keys: list[bytes], tier: Tier) -> list[tuple[bytes, bytes]]:
        """Encoded records of ``keys`` with ``tier`` added (a tombstone comes back to life).
        Absent records are left out: a block the index no longer knows stays unknown."""
        out = []
        mask = int(tier)
        for key, raw in zip(keys, self.raw_many(keys)):
            if raw is None or len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION:
                continue
            patched = bytearray(raw)
            patched[TIERS_AT] |= mask
            patched[REASON_AT] = 0
            F64.pack_into(patched, GONE_AT_AT, 0.0)
            out.append((key, bytes(patched)))
        return out

    def with_last_seen(self, keys: list[bytes], now: float) -> list[tuple[bytes, bytes]]:
        """Encoded records of the present blocks among ``keys`` with last-seen set to ``now``."""
        out = []
        for key, raw in zip(keys, self.raw_many(keys)):
            if raw is None or len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION or not raw[TIERS_AT]:
                continue
            patched = bytearray(raw)
            F64.pack_into(patched, LAST_SEEN_AT, now)
            out.append((key, bytes(patched)))
        return out

    # -- the SSD queue ----------------------------------------------------------------------------
    #
    # ``ssd_age`` holds one empty-valued entry ``be64(last_seen µs) | key`` per block on SSD,
    # written when the block's file is published. Touches do not move entries (the hot path
    # never writes here); the evictor reads from the oldest end and re-queues an entry at the
    # record's real last-seen time if the block was used since (second chance), so the queue
    # converges to LRU order. Entries whose record no longer has the SSD tier are stale and are
    # dropped when met.

    def ssd_queue(self, limit: int) -> list[tuple[bytes, bytes, bytes | None]]:
        """Up to ``limit`` oldest queue entries: (entry, key, the key's raw record or None)."""
        entries: list[bytes] = []
        it = self._age.iter()
        it.seek_to_first()
        while it.valid() and len(entries) < limit:
            entries.append(it.key())
            it.next()
        del it
        keys = [e[AGE.size:] for e in entries]
        return list(zip(entries, keys, self.raw_many(keys) if keys else []))

    def ssd_queue_keys(self) -> Iterator[bytes]:
        """Every key of the SSD queue, oldest entry first (a key may repeat, and a stale one
        may no longer be on SSD); read-only, safe from a worker thread."""
        it = self._age.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key()[AGE.size:]
            it.next()
        del it

    def policy_get(self, key: bytes) -> bytes | None:
        return self._policy.get(key)

    def policy_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Entries of the ``policy`` family whose key starts with ``prefix``, in key order."""
        out: list[tuple[bytes, bytes]] = []
        it = self._policy.iter()
        it.seek(prefix)
        while it.valid() and it.key().startswith(prefix):
            out.append((it.key(), it.value()))
            it.next()
        del it
        return out

    def ssd_records(self, stop: Callable[[], bool] = lambda: False) -> Iterator[tuple[bytes, bytes]]:
        """(key, raw record) of every record with the SSD tier, in key order, read-only (safe from
        a worker thread); ``stop()`` is polled to end early."""
        it = self._blocks.iter()
        it.seek_to_first()
        n = 0
        while it.valid():
            raw = it.value()
            if len(raw) >= RECORD.size and raw[0] == SCHEMA_VERSION and raw[TIERS_AT] & Tier.SSD:
                yield it.key(), raw
            n += 1
            if n % 10_000 == 0 and stop():
                break
            it.next()
        del it

    # -- scans --------------------------------------------------------------------------------

    def scan(self, start_after: bytes | None = None) -> Iterator[tuple[bytes, BlockRecord]]:
        """Every record in key order, optionally starting after ``start_after``."""
        it = self._blocks.iter()
        if start_after is None:
            it.seek_to_first()
        else:
            it.seek(start_after)
            if it.valid() and it.key() == start_after:
                it.next()
        while it.valid():
            yield it.key(), BlockRecord.decode(it.value())
            it.next()

    def count_estimate(self) -> int:
        return self._blocks.property_int_value("rocksdb.estimate-num-keys") or 0

    def reconcile_at_boot(self, now: float, gone_ttl: float,
                          progress: Callable[[int], None] | None = None, batch: int = 10_000,
                          ram_kept: set[bytes] | frozenset[bytes] = frozenset()) -> dict[str, int]:
        """Make the index true after a (re)start; returns counts.

        RAM held only bytes, and they are gone now, except for the blocks of ``ram_kept``: the
        ones a predecessor's arena still holds, being taken up (kvcached.store.adoption, which
        writes those it drops). Other records lose RAM; those whose only tier was RAM become
        tombstones (reason: lost at restart). Tombstones older than ``gone_ttl`` are deleted.
        Unreadable records are deleted. ``progress(seen)`` is called every ``batch`` records.
        """
        counts = {"seen": 0, "kept": 0, "lost_at_restart": 0, "pruned": 0, "unreadable": 0}
        puts: list[tuple[bytes, BlockRecord]] = []
        deletes: list[bytes] = []
        it = self._blocks.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            counts["seen"] += 1
            try:
                record = BlockRecord.decode(it.value())
            except (ValueError, UnicodeDecodeError):
                deletes.append(key)
                counts["unreadable"] += 1
            else:
                if record.tiers & Tier.RAM and key not in ram_kept:
                    rest = record.tiers & ~Tier.RAM
                    if rest:
                        puts.append((key, replace(record, tiers=rest)))
                        counts["kept"] += 1
                    else:
                        puts.append((key, record.gone(GoneReason.LOST_AT_RESTART, now)))
                        counts["lost_at_restart"] += 1
                elif not record.present and now - record.gone_at > gone_ttl:
                    deletes.append(key)
                    counts["pruned"] += 1
                else:
                    counts["kept"] += 1
            if len(puts) + len(deletes) >= batch:
                self.write(puts, deletes)
                puts, deletes = [], []
            if progress is not None and counts["seen"] % batch == 0:
                progress(counts["seen"])
            it.next()
        del it
        self.write(puts, deletes)
        return counts

    def expired_tombstones(self, now: float, gone_ttl: float, stop: Callable[[], bool] = lambda: False) -> list[bytes]:
        """Keys of tombstones older than ``gone_ttl``, read from the raw records (no decode).
        Read-only: safe from a worker thread; ``stop()`` is polled to end the scan early."""
        out: list[bytes] = []
        it = self._blocks.iter()
        it.seek_to_first()
        n = 0
        while it.valid():
            raw = it.value()
            if is_expired_tombstone(raw, now, gone_ttl):
                out.append(it.key())
            n += 1
            if n % 10_000 == 0 and stop():
                break
            it.next()
        del it
        return out

    def delete_expired(self, keys: list[bytes], now: float, gone_ttl: float) -> int:
        """Delete those of ``keys`` that are still expired tombstones (a block may have come
        back since they were found); returns how many. Call from the index's owner."""
        doomed = [key for key, raw in zip(keys, self.raw_many(keys)) if is_expired_tombstone(raw, now, gone_ttl)]
        self.write(deletes=doomed)
        return len(doomed)

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
            del (self._db, self._blocks, self._blocks_handle, self._meta, self._meta_handle, self._age,
                 self._age_handle, self._policy, self._policy_handle)
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
