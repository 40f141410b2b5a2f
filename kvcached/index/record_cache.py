"""The records of live blocks, held in memory as the index last wrote them.

Every request that reads a resident block (a Load's checksums and owner), and every eviction
(its tombstone is the block's record patched), reads that block's record; on a node serving
several engines that was a RocksDB point read per block on the event loop. The index writes
every record it stores here too, so those reads are dictionary lookups.

Contract (:class:`RecordCache`, no I/O, no threads of its own):

- *Write-through, never ahead of the database*: :meth:`written` is called after a write is in
  RocksDB, with what it wrote; an entry is always the bytes RocksDB holds for its key, or the
  key is absent here. The index calls it under its writers' lock, so two writers (the event
  loop, a worker thread) cannot leave an older record cached over a newer one.
- Only *live* records are kept (some tier holds the block): a tombstone or a delete drops the
  key. The records kept are those written most recently, at most ``capacity`` of them: the
  oldest are dropped first. Reads never add an entry (a read racing a writer could otherwise
  cache what the writer just replaced).
- A miss is not an answer: the caller reads RocksDB for it.
"""

from __future__ import annotations

from typing import Iterable

from kvcached.index.format import is_present

__all__ = ["CACHED_RECORDS", "CACHED_BLOCK_BYTES", "RecordCache", "cached_records"]

CACHED_RECORDS = 1 << 16         # records kept at least (about 20 MiB at the most)
CACHED_BLOCK_BYTES = 16 << 10    # one record kept per this many bytes of the RAM tier


def cached_records(ram_bytes: int) -> int:
    """How many records a daemon with a RAM tier of ``ram_bytes`` keeps: one for every block
    its RAM tier holds at blocks of 16 KiB or more (a record in memory costs some 300 bytes,
    under 2% of such a block), and at least :data:`CACHED_RECORDS`."""
    return max(CACHED_RECORDS, ram_bytes // CACHED_BLOCK_BYTES)


class RecordCache:
    """At most ``capacity`` live raw records by index key (0: none kept)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must not be negative")
        self.capacity = capacity
        self._records: dict[bytes, bytes] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def get(self, key: bytes) -> bytes | None:
        """The record of ``key`` as last written, or None (not known here: read RocksDB)."""
        return self._records.get(key)

    def many(self, keys: list[bytes]) -> tuple[list[bytes | None], list[int]]:
        """The records of ``keys`` known here (None elsewhere), and the positions of the others,
        which the caller reads from RocksDB."""
        get = self._records.get
        found = [get(key) for key in keys]
        missing = [i for i, raw in enumerate(found) if raw is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        return found, missing

    def written(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = ()) -> None:
        """What a write just put in RocksDB: live records are kept (replacing and refreshing
        older ones), tombstones and deleted keys dropped."""
        if not self.capacity:
            return
        records = self._records
        for key, raw in puts:
            records.pop(key, None)       # re-inserted at the young end
            if is_present(raw):
                records[key] = raw
        for key in deletes:
            records.pop(key, None)
        over = len(records) - self.capacity
        if over > 0:
            for key in [k for k, _ in zip(records, range(over))]:
                del records[key]

    def clear(self) -> None:
        self._records.clear()
