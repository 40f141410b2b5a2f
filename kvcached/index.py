"""The persistent block index: RocksDB (rocksdict, raw mode) at ``kv.index_dir``.

The index is the source of truth for block metadata; tiers hold only bytes. One record per
stored block, keyed by the 32-byte index key (kvcached_agent.address.index_key), in the column
family ``blocks``; the ``meta`` family holds the schema version; ``ssd_age`` is the SSD tier's
eviction queue (see :meth:`BlockIndex.ssd_queue`); ``policy`` holds what the cache policies
learned (kvcached.policy_state), so it survives a restart.

A record whose tier set is empty is a *tombstone*: the bytes are gone (evicted, or lost when
the daemon restarted and they lived only in RAM), the metadata stays for ``kv.gone_ttl`` so a
Get can say why it misses, and a later fetch from a peer can still be checked against the
stored checksum.

Record layout (little-endian, version 1)::

    u8 version | u8 tiers | u8 gone_reason | u8 pad | u32 layer | u64 nbytes |
    f64 created | f64 last_seen | f64 gone_at | 32 B checksum | 32 B digest | model (UTF-8, rest)

Writes go through the WAL without fsync: a daemon crash loses nothing the OS has. Writes that
publish SSD blocks under a durable mode pass ``sync=True`` (one WAL fsync per group commit), so
after a power loss the index never forgets a block file it acknowledged; other writes lost to a
power loss only ever name bytes that lived in RAM, or leave orphan files the boot reconcile removes.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

__all__ = ["BlockIndex", "BlockRecord", "Tier", "GoneReason", "IndexError_", "queue_entry", "queue_time", "raw_ssd_view"]

log = logging.getLogger("kvcached.index")

SCHEMA_VERSION = 1
_RECORD = struct.Struct("<BBBxIQddd32s32s")
_F64 = struct.Struct("<d")
# byte offsets of the fields that change in place (see the layout above)
_TIERS, _REASON, _LAST_SEEN, _GONE_AT, _CHECKSUM = 1, 2, 24, 32, 40
_LAYER, _DIGEST = 4, 72
_FAMILIES = ("blocks", "meta", "ssd_age", "policy")
_AGE = struct.Struct(">Q")      # big-endian microseconds: the queue sorts oldest first


def _is_expired_tombstone(raw: bytes | None, now: float, gone_ttl: float) -> bool:
    return (raw is not None and len(raw) >= _RECORD.size and raw[0] == SCHEMA_VERSION and raw[_TIERS] == 0
            and now - _F64.unpack_from(raw, _GONE_AT)[0] > gone_ttl)


class Tier(enum.IntFlag):
    """Where a block's bytes are (a set: a block can be in several tiers at once)."""

    NONE = 0
    RAM = 1
    SSD = 2


class GoneReason(enum.IntEnum):
    NONE = 0
    EVICTED = 1           # dropped from the last tier that held it
    LOST_AT_RESTART = 2   # lived only in RAM when the daemon stopped
    CORRUPT = 3           # its SSD file failed verification and was quarantined
    FILE_MISSING = 4      # its SSD file was gone (or did not match) at a read or the boot reconcile

    @property
    def text(self) -> str:
        return _REASON_TEXT[self.value]


_REASON_TEXT = {0: "present", 1: "evicted", 2: "lost at restart (it lived only in RAM)",
                3: "its SSD copy was corrupt (quarantined)", 4: "its SSD file was missing or did not match"}


def queue_entry(last_seen: float, key: bytes) -> bytes:
    """The SSD queue entry of ``key`` used last at ``last_seen``."""
    return _AGE.pack(max(0, int(last_seen * 1e6))) + key


def queue_time(entry: bytes) -> float:
    return _AGE.unpack_from(entry)[0] / 1e6


def raw_ssd_view(raw: bytes) -> tuple[Tier, int, float, bytes, bytes, int] | None:
    """(tiers, nbytes, last_seen, checksum, digest, layer) of a raw record, or None if unreadable."""
    if len(raw) < _RECORD.size or raw[0] != SCHEMA_VERSION:
        return None
    _, tiers, _, layer, nbytes, _, last_seen, _, checksum, digest = _RECORD.unpack_from(raw)
    return Tier(tiers), nbytes, last_seen, checksum, digest, layer


class IndexError_(Exception):
    """The index cannot be opened or used (locked by another daemon, corrupt, wrong version)."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    digest: bytes
    layer: int
    model: str
    nbytes: int
    checksum: bytes
    created: float
    last_seen: float
    tiers: Tier = Tier.RAM
    gone_reason: GoneReason = GoneReason.NONE
    gone_at: float = 0.0

    @property
    def present(self) -> bool:
        return self.tiers != Tier.NONE

    def encode(self) -> bytes:
        return _RECORD.pack(SCHEMA_VERSION, int(self.tiers), int(self.gone_reason), self.layer, self.nbytes,
                            self.created, self.last_seen, self.gone_at, self.checksum, self.digest) + self.model.encode()

    @classmethod
    def decode(cls, raw: bytes) -> "BlockRecord":
        if len(raw) < _RECORD.size or raw[0] != SCHEMA_VERSION:
            raise ValueError(f"index record of {len(raw)} bytes, version {raw[:1].hex() or '?'} is not readable")
        (_, tiers, reason, layer, nbytes, created, last_seen, gone_at, checksum, digest) = _RECORD.unpack_from(raw)
        return cls(digest, layer, raw[_RECORD.size:].decode(), nbytes, checksum, created, last_seen,
                   Tier(tiers), GoneReason(reason), gone_at)

    def gone(self, reason: GoneReason, now: float) -> "BlockRecord":
        return replace(self, tiers=Tier.NONE, gone_reason=reason, gone_at=now)


def _present(raw: bytes | None) -> bool:
    return raw is not None and len(raw) >= _RECORD.size and raw[0] == SCHEMA_VERSION and raw[_TIERS] != 0


def _wire_key(raw: bytes) -> bytes:
    """The block's address as the peer protocol writes it: digest, then u32 layer."""
    return raw[_DIGEST:_DIGEST + 32] + raw[_LAYER:_LAYER + 4]


class BlockIndex:
    """Block metadata on disk. Not thread-safe: one owner (the store) calls it."""

    #: Told (gained wire keys, dropped wire keys) after writes that change presence (peer announcements).
    watcher: Callable[[list[bytes], list[bytes]], None] | None = None

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise IndexError_(f"cannot create index directory {self.path}: {exc.strerror or exc}") from None
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        try:
            self._db = Rdict(self.path, opts, column_families={n: Options(raw_mode=True) for n in _FAMILIES})
        except Exception as exc:  # rocksdict raises plain Exception
            text = str(exc)
            if "lock" in text.lower():
                raise IndexError_(f"index {self.path} is in use by another process (is another kvcached running?): {text}") from None
            raise IndexError_(f"cannot open index {self.path}: {text}") from None
        self._blocks = self._db.get_column_family("blocks")
        self._blocks_handle = self._db.get_column_family_handle("blocks")
        meta = self._db.get_column_family("meta")
        version = meta.get(b"schema_version")
        if version is None:
            meta[b"schema_version"] = struct.pack("<I", SCHEMA_VERSION)
        elif struct.unpack("<I", version)[0] != SCHEMA_VERSION:
            raise IndexError_(f"index {self.path} has schema version {struct.unpack('<I', version)[0]}, "
                              f"this kvcached reads {SCHEMA_VERSION}")
        del meta
        self._write_opts = WriteOptions()
        self._sync_opts = WriteOptions()
        self._sync_opts.sync = True
        self._age = self._db.get_column_family("ssd_age")
        self._age_handle = self._db.get_column_family_handle("ssd_age")
        self._policy = self._db.get_column_family("policy")
        self._policy_handle = self._db.get_column_family_handle("policy")

    # -- point operations ---------------------------------------------------------------------

    def get(self, key: bytes) -> BlockRecord | None:
        raw = self._blocks.get(key)
        return None if raw is None else BlockRecord.decode(raw)

    def raw(self, key: bytes) -> bytes | None:
        """The stored bytes of ``key``'s record (None if absent); read-only, thread-safe."""
        return self._blocks.get(key)

    def get_many(self, keys: list[bytes]) -> list[BlockRecord | None]:
        return [None if raw is None else BlockRecord.decode(raw) for raw in self._blocks[keys]]

    def checksums(self, keys: list[bytes]) -> list[bytes | None]:
        """The payload checksums of ``keys`` (None where absent), read straight from the stored
        bytes: the Get path needs nothing else from the record."""
        return [None if raw is None or len(raw) < _RECORD.size else raw[_CHECKSUM:_CHECKSUM + 32]
                for raw in self._blocks[keys]]

    def tiers_of(self, keys: list[bytes]) -> list[Tier]:
        """The tier set of each of ``keys`` (NONE where absent), from the raw bytes."""
        return [Tier(raw[_TIERS]) if raw is not None and len(raw) >= _RECORD.size else Tier.NONE
                for raw in self._blocks[keys]]

    def write(self, puts: Iterable[tuple[bytes, BlockRecord | bytes]] = (), deletes: Iterable[bytes] = (), *,
              queue: Iterable[bytes] = (), unqueue: Iterable[bytes] = (), sync: bool = False,
              watch: bool = True, policy: Iterable[tuple[bytes, bytes | None]] = ()) -> None:
        """Apply puts (records, or encoded records from the ``with_*`` methods), deletes, SSD
        queue entries (from :func:`queue_entry`) and ``policy`` family entries (None deletes)
        atomically, in one WriteBatch; ``sync`` waits
        for the WAL to reach the disk. With a :attr:`watcher`, blocks that become present or
        stop being present are reported to it once the write is done; ``watch=False`` says the
        write changes no block's presence (last-seen times)."""
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._blocks_handle)
        n = 0
        watching = self.watcher is not None and watch
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
        before = self._blocks[[k for k, _ in encoded] + deleted] if watching and (encoded or deleted) else []
        self._db.write(batch, self._sync_opts if sync else self._write_opts)
        if before:
            self._report(encoded, deleted, before)

    def _report(self, encoded: list[tuple[bytes, bytes]], deleted: list[bytes], before: list[bytes | None]) -> None:
        gained: list[bytes] = []
        dropped: list[bytes] = []
        for (_, raw), old in zip(encoded, before):
            was, now = _present(old), _present(raw)
            if now and not was:
                gained.append(_wire_key(raw))
            elif was and not now:
                dropped.append(_wire_key(raw))
        for old in before[len(encoded):]:
            if _present(old):
                dropped.append(_wire_key(old))      # type: ignore[arg-type]
        if gained or dropped:
            try:
                self.watcher(gained, dropped)       # type: ignore[misc]
            except Exception:
                log.exception("index watcher failed")

    def present_wire_keys(self) -> list[bytes]:
        """The wire keys (digest | u32 layer) of every present block, read-only (safe from a
        worker thread): what a peer snapshot lists."""
        out = []
        it = self._blocks.iter()
        it.seek_to_first()
        while it.valid():
            raw = it.value()
            if _present(raw):
                out.append(_wire_key(raw))
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
        for key, raw in zip(keys, self._blocks[keys]):
            if raw is None or len(raw) < _RECORD.size or raw[0] != SCHEMA_VERSION or not raw[_TIERS] & mask:
                continue
            patched = bytearray(raw)
            patched[_TIERS] &= keep
            if not patched[_TIERS]:
                patched[_REASON] = why
                _F64.pack_into(patched, _GONE_AT, now)
            out.append((key, bytes(patched)))
        return out

    def with_tier(self, keys: list[bytes], tier: Tier) -> list[tuple[bytes, bytes]]:
        """Encoded records of ``keys`` with ``tier`` added (a tombstone comes back to life).
        Absent records are left out: a block the index no longer knows stays unknown."""
        out = []
        mask = int(tier)
        for key, raw in zip(keys, self._blocks[keys]):
            if raw is None or len(raw) < _RECORD.size or raw[0] != SCHEMA_VERSION:
                continue
            patched = bytearray(raw)
            patched[_TIERS] |= mask
            patched[_REASON] = 0
            _F64.pack_into(patched, _GONE_AT, 0.0)
            out.append((key, bytes(patched)))
        return out

    def with_last_seen(self, keys: list[bytes], now: float) -> list[tuple[bytes, bytes]]:
        """Encoded records of the present blocks among ``keys`` with last-seen set to ``now``."""
        out = []
        for key, raw in zip(keys, self._blocks[keys]):
            if raw is None or len(raw) < _RECORD.size or raw[0] != SCHEMA_VERSION or not raw[_TIERS]:
                continue
            patched = bytearray(raw)
            _F64.pack_into(patched, _LAST_SEEN, now)
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
        keys = [e[_AGE.size:] for e in entries]
        return list(zip(entries, keys, self._blocks[keys] if keys else []))

    def ssd_queue_keys(self) -> Iterator[bytes]:
        """Every key of the SSD queue, oldest entry first (a key may repeat, and a stale one
        may no longer be on SSD); read-only, safe from a worker thread."""
        it = self._age.iter()
        it.seek_to_first()
        while it.valid():
            yield it.key()[_AGE.size:]
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
            if len(raw) >= _RECORD.size and raw[0] == SCHEMA_VERSION and raw[_TIERS] & Tier.SSD:
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
                          progress: Callable[[int], None] | None = None, batch: int = 10_000) -> dict[str, int]:
        """Make the index true after a (re)start; returns counts.

        RAM held only bytes, and they are gone now: records whose only tier was RAM become
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
                if record.tiers & Tier.RAM:
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
            if _is_expired_tombstone(raw, now, gone_ttl):
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
        doomed = [key for key, raw in zip(keys, self._blocks[keys]) if _is_expired_tombstone(raw, now, gone_ttl)]
        self.write(deletes=doomed)
        return len(doomed)

    def close(self) -> None:
        """Flush and close; the object is unusable afterwards."""
        del self._blocks, self._blocks_handle, self._age, self._age_handle, self._policy, self._policy_handle
        try:
            self._db.flush()
        finally:
            self._db.close()
