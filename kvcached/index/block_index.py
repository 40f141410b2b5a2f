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

:class:`BlockIndex` reads, patches and writes records; its collaborators hold the rest: the
record format (BlockRecord, Tier, GoneReason, the byte layout, the SSD queue's entries) is
kvcached.index.format's; the RocksDB instance, its opening and its recovery after a failed
write (:class:`~kvcached.index.database.IndexUnwritable`) are kvcached.index.database's; the
changes of presence a write makes are recorded in a kvcached.index.presence feed.

Writes go through the WAL without fsync: a daemon crash loses nothing the OS has. Writes that
publish SSD blocks under a durable mode pass ``sync=True`` (one WAL fsync per group commit), so
after a power loss the index never forgets a block file it acknowledged; other writes lost to a
power loss only ever name bytes that lived in RAM, or leave orphan files the boot reconcile removes.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Callable, Iterable, Iterator, cast

from rocksdict import Rdict, WriteBatch

from kvcached.index.database import IndexDatabase, IndexUnwritable
from kvcached.index.format import (
    AGE,
    F64,
    FOREIGN,
    GONE_AT_AT,
    LAST_SEEN_AT,
    REASON_AT,
    RECORD,
    SCHEMA_VERSION,
    TIERS_AT,
    BlockRecord,
    GoneReason,
    Tier,
    checksum_for,
    is_expired_tombstone,
    is_present,
    record_model,
    record_route,
    record_tenant,
    tiers_for,
    tombstone_of,
    wire_key_of,
    with_route,
    writable_tiers_for,
)
from kvcached.index.presence import PresenceFeed, TierFeed
from kvcached.index.record_cache import CACHED_RECORDS, RecordCache

__all__ = ["FOREIGN", "BlockIndex"]


class BlockIndex:
    """Block metadata on disk. One owner (the store, on the event loop) calls it; the methods
    that say so are also safe from a worker thread, and :meth:`write` may be called from one
    (the SSD reconcile, the policy saver) while the owner goes on. Opening the RocksDB
    instance, refusing writes while it cannot be written and recovering from that are its
    :class:`~kvcached.index.database.IndexDatabase`'s; the attributes below say its state."""

    #: Where writes that change a block's presence are recorded (peer announcements); None: nowhere.
    presence: PresenceFeed | None = None
    #: Where writes that change a block's tier set are recorded (KV events); None: nowhere.
    tier_feed: TierFeed | None = None

    def __init__(self, path: str | os.PathLike[str], cached_records: int = CACHED_RECORDS) -> None:
        """Open (creating it if need be) the index at ``path``; raises IndexError_ if it cannot
        be opened: another daemon holds it, it is unreadable, or has another schema version.
        ``cached_records``: how many live records the reads find in memory at most
        (kvcached.index.record_cache; the daemon sizes it by its RAM tier)."""
        self._database = IndexDatabase(path)
        self.path = self._database.path
        #: The records most recently written, as RocksDB holds them: reads of live blocks
        #: (checksums, owners, the records evictions patch) skip RocksDB.
        self.cache = RecordCache(cached_records)
        self._writing = threading.Lock()     # a write and its cache update, one writer at a time

    @property
    def _blocks(self) -> Rdict:
        """The ``blocks`` family of the RocksDB instance serving now (a recovery replaces it)."""
        return self._database.blocks

    # -- writability: the database's state, read here --------------------------------------------

    @property
    def writable(self) -> bool:
        """False from a failed write until :meth:`recover` succeeds: writes are refused, reads go on."""
        return self._database.writable

    @property
    def unwritable_reason(self) -> str:
        """Why the index is not writable, RocksDB's words (the last failed write or attempt)."""
        return self._database.unwritable_reason

    @property
    def unwritable_since(self) -> float:
        """time.time() of the failure that made the index unwritable."""
        return self._database.unwritable_since

    @property
    def recoveries(self) -> int:
        """Times the index became writable again without a restart."""
        return self._database.recoveries

    @property
    def write_failures(self) -> int:
        """Writes that failed, or were refused while the index was unwritable."""
        return self._database.write_failures

    def recover(self, now: float) -> bool:
        """Make an unwritable index writable again if it can be; True when it is writable. Call
        from the index's owner about every second while :attr:`writable` is False; ``now`` is a
        monotonic clock; it never waits on RocksDB (steps: :meth:`IndexDatabase.recover`)."""
        return self._database.recover(now)

    def free_bytes(self) -> int:
        """Bytes free to the daemon on the index's filesystem."""
        return self._database.free_bytes()

    # -- point operations ---------------------------------------------------------------------

    def get(self, key: bytes) -> BlockRecord | None:
        raw = self.raw(key)
        return None if raw is None else BlockRecord.decode(raw)

    def raw(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key``'s record (None if absent); read-only, thread-safe."""
        raw = self.cache.get(key)
        return raw if raw is not None else self._blocks.get(key)

    def raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The raw records of ``keys`` (None where absent): from the record cache, the others in
        one multi-get; for hot loops that read a few fields (kvcached.index.format.raw_ssd_view)
        instead of decoding records."""
        found, missing = self.cache.many(keys)
        if not missing:
            return found
        if len(missing) == len(keys):
            return self._read_many(keys)
        for i, raw in zip(missing, self._read_many([keys[i] for i in missing])):
            found[i] = raw
        return found

    def _read_many(self, keys: list[bytes]) -> list[bytes | None]:
        """One RocksDB multi-get. rocksdict's stubs type a multi-get key list as a list of its
        key union, which a list[bytes] is not."""
        return cast("list[bytes | None]", self._blocks[cast(Any, keys)])

    def get_many(self, keys: list[bytes]) -> list[BlockRecord | None]:
        return [None if raw is None else BlockRecord.decode(raw) for raw in self.raw_many(keys)]

    def checksums(self, keys: list[bytes], tenant: str | None = None) -> list[bytes | None]:
        """The payload checksums of ``keys`` (None where absent), read straight from the stored
        bytes: the Get path needs nothing else from the record. With ``tenant`` (a Tenant.tag),
        a block of another tenant gives :data:`FOREIGN`: a read serves a block to its own
        tenant alone, whatever address it was asked by (docs/security.md)."""
        tag = None if tenant is None else tenant.encode()
        return [checksum_for(raw, tag) for raw in self.raw_many(keys)]

    def owners(self, keys: list[bytes]) -> list[tuple[str, str] | None]:
        """(model, tenant) of each of ``keys`` (None where absent), read straight from the stored
        bytes: serving a peer's pull needs nothing else from the record (the checksum came with
        the pin)."""
        return [(record_model(raw), record_tenant(raw)) if raw is not None and len(raw) >= RECORD.size
                and raw[0] == SCHEMA_VERSION else None for raw in self.raw_many(keys)]

    def tiers_of(self, keys: list[bytes], tenant: str | None = None) -> list[Tier]:
        """The tier set of each of ``keys`` (NONE where absent, or another tenant's than
        ``tenant``, a Tenant.tag, where given), from the raw bytes."""
        tag = None if tenant is None else tenant.encode()
        return [tiers_for(raw, tag) for raw in self.raw_many(keys)]

    def writable_tiers(self, keys: list[bytes], tenant: str) -> list[Tier | None]:
        """For a writer acting as ``tenant``: format.writable_tiers_for of each of ``keys``."""
        tag = tenant.encode()
        return [writable_tiers_for(raw, tag) for raw in self.raw_many(keys)]

    def write(self, puts: Iterable[tuple[bytes, BlockRecord | bytes]] = (), deletes: Iterable[bytes] = (), *,
              queue: Iterable[bytes] = (), unqueue: Iterable[bytes] = (), sync: bool = False,
              watch: bool = True, policy: Iterable[tuple[bytes, bytes | None]] = (),
              known: dict[bytes, bytes] | None = None) -> None:
        """Apply puts (records, or encoded records from the ``with_*`` methods), deletes, SSD
        queue entries (from :func:`queue_entry`) and ``policy`` family entries (None deletes)
        atomically, in one WriteBatch; ``sync`` waits
        for the WAL to reach the disk. With a :attr:`presence` feed, blocks that become present or
        stop being present are recorded in it once the write is done; ``watch=False`` says the
        write changes no block's presence (last-seen times). ``known``: records some of the puts
        replace, as the caller read them just before (the ``read`` of :meth:`without_tier`), so
        the feeds need not read them again."""
        db = self._database
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(db.blocks_handle)
        n = 0
        watching = (self.presence is not None or self.tier_feed is not None) and watch
        written_keys: list[bytes] = []
        written: list[bytes] = []
        deleted: list[bytes] = []
        for key, record in puts:
            raw = record if isinstance(record, bytes) else record.encode()
            batch.put(key, raw)
            written_keys.append(key)
            written.append(raw)
            n += 1
        for key in deletes:
            batch.delete(key)
            deleted.append(key)
            n += 1
        for entry in queue:
            batch.put(entry, b"", column_family=db.ssd_age_handle)
            n += 1
        for entry in unqueue:
            batch.delete(entry, column_family=db.ssd_age_handle)
            n += 1
        for key, value in policy:
            if value is None:
                batch.delete(key, column_family=db.policy_handle)
            else:
                batch.put(key, value, column_family=db.policy_handle)
            n += 1
        if not n:
            return
        before = self._before(written_keys + deleted, known) if watching and (written or deleted) else []
        try:
            with self._writing:
                db.commit(batch, sync)
                self.cache.written(zip(written_keys, written), deleted)
        except IndexUnwritable:
            del batch             # see IndexDatabase.commit: this frame lives on in the traceback
            raise
        if before:
            if self.presence is not None:
                self.presence.record_write(written, before)
            if self.tier_feed is not None:
                self.tier_feed.record_write(written, before)

    def _before(self, keys: list[bytes], known: dict[bytes, bytes] | None) -> list[bytes | None]:
        """The records ``keys`` hold now, for the feeds: read, but for those ``known``."""
        if not known:
            return self.raw_many(keys)
        unknown = [key for key in keys if key not in known]
        read = dict(zip(unknown, self.raw_many(unknown))) if unknown else {}
        return [known[key] if key in known else read[key] for key in keys]

    # -- the engine keys of blocks (routes), for KV events -------------------------------------------

    def set_routes(self, routes: Iterable[tuple[bytes, bytes]]) -> None:
        """Give each stored block of (index key, encoded route keys) those keys, in its record
        (kvcached.index.format: what the KV events of that block carry so routers can match it to
        the engine's own blocks). Absent blocks, and blocks that carry those keys already, are
        left as they are."""
        pairs = list(routes)
        if not pairs:
            return
        puts = []
        for (key, blob), raw in zip(pairs, self.raw_many([k for k, _ in pairs])):
            if raw is None or len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION or record_route(raw) == blob:
                continue
            puts.append((key, with_route(raw, blob)))
        if puts:
            self.write(puts)

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

    def without_tier(self, keys: list[bytes], tier: Tier, reason: GoneReason, now: float,
                     read: dict[bytes, bytes] | None = None) -> list[tuple[bytes, bytes]]:
        """Encoded records of ``keys`` with ``tier`` cleared, for :meth:`write`. A record left in
        no tier becomes a tombstone (``reason``, gone at ``now``). Absent records, and records
        not in ``tier``, are left out. ``read`` gets the records as they were (for :meth:`write`'s
        ``known``)."""
        out = []
        mask, keep, why = int(tier), ~int(tier) & 0xFF, int(reason)   # plain ints: enum ops are slow
        for key, raw in zip(keys, self.raw_many(keys)):
            if raw is None or len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION or not raw[TIERS_AT] & mask:
                continue
            if read is not None:
                read[key] = raw
            out.append((key, tombstone_of(raw, why, now, keep)))
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

    def ssd_queue(self, limit: int, after: bytes | None = None) -> list[tuple[bytes, bytes, bytes | None]]:
        """Up to ``limit`` oldest queue entries (those past ``after``, an entry, where given):
        (entry, key, the key's raw record or None)."""
        entries = list(itertools.islice(self._queue_entries(after), limit))
        keys = [e[AGE.size:] for e in entries]
        return list(zip(entries, keys, self.raw_many(keys) if keys else []))

    def ssd_queue_keys(self) -> Iterator[bytes]:
        """Every key of the SSD queue, oldest entry first (a key may repeat, and a stale one
        may no longer be on SSD); read-only, safe from a worker thread."""
        return (entry[AGE.size:] for entry in self._queue_entries())

    def _queue_entries(self, after: bytes | None = None) -> Iterator[bytes]:
        it = self._database.ssd_age.iter()
        it.seek(after + b"\0") if after is not None else it.seek_to_first()   # the first entry past ``after``
        while it.valid():
            yield it.key()
            it.next()

    def policy_get(self, key: bytes) -> bytes | None:
        return self._database.policy.get(key)

    def policy_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Entries of the ``policy`` family whose key starts with ``prefix``, in key order."""
        out: list[tuple[bytes, bytes]] = []
        it = self._database.policy.iter()
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

    def raw_records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, raw record) in key order (kvcached.index.boot reads them all at a start)."""
        it = self._blocks.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key(), it.value()
            it.next()

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
        self.cache.clear()
        self._database.close()
