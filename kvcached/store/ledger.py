"""The store's side of the index: what a request changed, written once at its end.

A request (a Put, an agent's reserve or commit, a promotion, a pull) stages the records of its
new blocks here, and takes here what the RAM tier evicted meanwhile (its outbox,
``RamTier.take_evicted``: every method of the ledger takes it first, so evictions are noted in
the order they happened relative to the stages); :meth:`RecordLedger.commit` then writes both to
the index in one write. The
ledger is synchronous and holds no lock: it relies on the event loop running one request's
synchronous steps at a time, so every path that stages a record or reserves RAM (which may evict)
calls :meth:`commit` before its next await. A staged record that would otherwise wait for
another request's commit would be written with that request's, which is still correct, but the
contract is that each path commits its own.

Every change that takes the SSD tier out of a record, or deletes a record, goes through
:meth:`without_ssd` and :meth:`delete_records`: they count ``ssd_losses``, which voids Lookup's
memory of which RAM blocks have an SSD copy (kvcached.store.read_path).

Blocks used since the last flush (``touched``) get their last-seen time written in batches by
:meth:`flush_last_seen`, off the hot path (the daemon's maintenance loop).
"""

from __future__ import annotations

import logging
from typing import Callable

from kvcached.errors import Unavailable
from kvcached.index import BlockIndex, BlockRecord, GoneReason, IndexUnwritable, Tier
from kvcached.index.format import is_present, tombstone_of
from kvcached.policies import KeyedPolicy
from kvcached.store.routes import RouteKeys
from kvcached.tiers.ram import RamBlock, RamTier
from kvcached_agent.address import BlockAddress

__all__ = ["RecordLedger"]

log = logging.getLogger("kvcached.store")


class RecordLedger:
    """Index changes of the request in progress, and last-seen times due (see the module)."""

    def __init__(self, ram: RamTier, index: BlockIndex, clock: Callable[[], float],
                 routes: RouteKeys | None = None) -> None:
        self.ram = ram
        self.index = index
        self.clock = clock
        self.routes = routes                           # engine keys held for blocks being recorded
        self._pending: dict[bytes, BlockRecord | bytes] = {}   # records (or their bytes) of the request in progress
        self._evicted: set[bytes] = set()              # evicted during it, index not yet told
        self._touched: set[bytes] = set()              # used since the last flush_last_seen
        self.ssd_losses = 0                            # SSD copies lost or records deleted, ever

    def _take_evictions(self) -> None:
        for blocks in self.ram.take_evicted():
            self._ram_evicted(blocks)

    def stage(self, key: bytes, record: BlockRecord | bytes) -> None:
        """``record`` (or its bytes: kvcached.index.format.encode_record) goes to the index
        with this request's commit."""
        self._take_evictions()
        self._pending[key] = record

    def route_of(self, address: BlockAddress) -> bytes:
        """The engine's keys an agent offered for the block it is saving at ``address``, for
        the record being made (b"": none; kvcached.store.routes). Taken: asked once per record."""
        return self.routes.take(address) if self.routes is not None else b""

    def reserved(self, key: bytes) -> None:
        """A slot for ``key`` was just reserved: an eviction of an older copy earlier in this
        request leaves no tombstone (the new block has the key now)."""
        self._take_evictions()
        self._evicted.discard(key)

    def touched(self, key: bytes) -> None:
        """``key`` was used: its last-seen time is due."""
        self._take_evictions()
        self._touched.add(key)

    def _ram_evicted(self, blocks: list[RamBlock]) -> None:
        """The RAM tier dropped ``blocks`` (inside a request): noted here, told to the index
        once per request by :meth:`commit`, not once per victim."""
        now = self.clock()
        for block in blocks:
            key = block.key
            self._touched.discard(key)
            record = self._pending.get(key)
            if isinstance(record, bytes):   # stored earlier in this very batch
                self._pending[key] = tombstone_of(record, GoneReason.EVICTED, now)
            elif record is not None:
                self._pending[key] = record.gone(GoneReason.EVICTED, now)
            else:
                self._evicted.add(key)

    def commit(self) -> None:
        """One index write for the request: its new records and its evictions' tombstones.

        If the index cannot be written, the request's new blocks leave RAM again (what the
        index does not know must not be served) and Unavailable says so."""
        self._take_evictions()
        new_keys = [key for key, record in self._pending.items()
                    if (is_present(record) if isinstance(record, bytes) else record.present)]
        puts: list[tuple[bytes, BlockRecord | bytes]] = list(self._pending.items())
        evicted, self._evicted = list(self._evicted), set()
        self._pending.clear()
        known: dict[bytes, bytes] = {}
        try:
            if evicted:
                puts += self.index.without_tier(evicted, Tier.RAM, GoneReason.EVICTED, self.clock(), known)
            self.index.write(puts, known=known)
        except Exception as exc:
            for key in new_keys:
                if self.ram.busy_reason(key) is None:
                    self.ram.delete(key)
            # An unwritable index said so once in the log; each refused put is the caller's news.
            (log.debug if isinstance(exc, IndexUnwritable) else log.error)(
                "index write failed", extra={"fields": {"blocks": len(new_keys), "error": str(exc)}})
            raise Unavailable(f"the index cannot be written ({exc}); none of the {len(new_keys)} new blocks "
                              "of this request were kept") from exc

    def without_ssd(self, keys: list[bytes], reason: GoneReason, now: float) -> list[tuple[bytes, bytes]]:
        """Index puts that take the SSD tier out of ``keys``' records, to be written with no
        await in between (a Lookup in between would remember the old records)."""
        self.ssd_losses += 1
        return self.index.without_tier(keys, Tier.SSD, reason, now)

    def delete_records(self, keys: list[bytes]) -> None:
        """Delete the index records of ``keys`` (a key deleted may come back as a new block that
        is not on SSD, so Lookup's memory of SSD copies is voided too)."""
        self.ssd_losses += 1
        self.index.write(deletes=keys)

    def flush_last_seen(self, order: KeyedPolicy | None) -> int:
        """Write the last-seen time of blocks used since the previous flush (batched, off the
        hot path), telling the SSD eviction ``order`` too; returns how many records were
        updated."""
        self._take_evictions()
        if not self._touched:
            return 0
        keys, self._touched = list(self._touched), set()
        if order is not None:
            for key in keys:             # unknown keys (not on SSD) are ignored
                order.touch(key)
        puts = self.index.with_last_seen(keys, self.clock())
        self.index.write(puts, watch=False)
        return len(puts)

    def drop_unindexed(self, block: RamBlock) -> str:
        """A resident block without an index record (its write failed): never served, dropped.
        Returns why, in words (a reader's miss reason)."""
        if self.ram.busy_reason(block.key) is None:
            self.ram.delete(block.key)
        log.error("resident block without index record dropped", extra={"fields": {"key": block.key.hex()}})
        return "its index record is missing; the bytes were dropped"
