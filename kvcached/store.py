"""The store: one place that puts, finds, fetches and deletes blocks across tiers and the index.

APIs (gRPC now; the agent socket and peers later) call the store and translate its errors
(kvcached.errors). Everything here runs on the event loop thread; the clock is passed in so
tests move time by hand.

Lookup follows SGLang's batch_exists: count from the first digest and stop at the first miss,
per tier and across all tiers. Tiers that this build does not have yet (gpu view, ssd, peer)
answer zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvcached.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier
from kvcached.tiers.ram import BlockBusy, RamBlock, RamFull, RamTier
from kvcached_agent.address import DIGEST_BYTES, BlockAddress, index_key
from kvcached_agent.integrity import payload_checksums

__all__ = ["Store", "PutItem", "Fetched", "Pinned", "Miss", "LookupResult"]

log = logging.getLogger("kvcached.store")

MAX_MODEL_BYTES = 256        # a model label is a name, not a payload


@dataclass(frozen=True, slots=True)
class PutItem:
    address: BlockAddress
    payload: bytes | memoryview
    model: str = ""
    checksum: bytes = b""      # empty: the daemon computes it; else it must match


@dataclass(frozen=True, slots=True)
class Fetched:
    address: BlockAddress
    payload: bytes
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Pinned:
    """A block held for a reader: its bytes stay put until :meth:`Store.unpin`."""

    address: BlockAddress
    block: RamBlock
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Miss:
    address: BlockAddress
    reason: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest-prefix hit counts: per tier, and ``longest`` where each block is in some tier."""

    longest: int
    ram: int
    ssd: int = 0
    gpu: int = 0
    peer: int = 0


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    lookups: int = 0
    deletes: int = 0


@dataclass(slots=True)
class PutResult:
    stored: int = 0
    present: int = 0


class Store:
    def __init__(self, ram: RamTier, index: BlockIndex, *, gone_ttl: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.ram = ram
        self.index = index
        self.gone_ttl = gone_ttl
        self.clock = clock
        self.counters = Counters()
        self._touched: set[bytes] = set()
        # State of the one request in progress. Store methods never await, so requests on the
        # event loop cannot interleave; a method that comes to await must carry this state in
        # a per-request object instead.
        self._pending: dict[bytes, BlockRecord] = {}   # records of the request in progress
        self._evicted: set[bytes] = set()              # evicted during it, index not yet told
        # Readers (streams, later agents) may pin at most this much, so a stalled reader can
        # never hold the whole tier: puts keep finding room in the other half.
        self.max_pinned_bytes = ram.capacity // 2
        self.pinned_bytes = 0
        ram.on_evict = self._on_ram_evict

    # -- put ----------------------------------------------------------------------------------

    def put(self, items: Sequence[PutItem]) -> PutResult:
        """Store a batch. Every item is checked before any is stored, so a bad item stores
        nothing. Blocks already present count as ``present``. If the RAM tier fills with blocks
        in use, the blocks stored so far stay and ResourceExhausted says how many."""
        for i, item in enumerate(items):
            self._check_put(i, item)
        # Engines save the same prefixes again and again: blocks already here are neither
        # hashed nor copied.
        todo: list[tuple[int, PutItem]] = []
        for i, item in enumerate(items):
            if item.address.key in self.ram:
                self._touched.add(item.address.key)    # a re-put is a use
            else:
                todo.append((i, item))
        checksums = payload_checksums([item.payload for _, item in todo])
        for (i, item), checksum in zip(todo, checksums):
            if item.checksum and item.checksum != checksum:
                raise DataLoss(f"block {i} ({item.address}): payload does not match its BLAKE3 checksum "
                               "(damaged on the way?); nothing was stored")
        now = self.clock()
        result = PutResult(present=len(items) - len(todo))
        # Records of this batch wait in _pending and go to the index in one write at the end,
        # with the tombstones of whatever the batch evicted (see _on_ram_evict).
        pending = self._pending
        try:
            for (_, item), checksum in zip(todo, checksums):
                key = item.address.key
                if key in self.ram:      # the same block twice in this batch
                    result.present += 1
                    continue
                try:
                    block = self.ram.reserve(key, len(item.payload))
                except RamFull as exc:
                    raise ResourceExhausted(f"stored {result.stored} of {len(items)} blocks: {exc}") from None
                except ValueError:   # being written by another writer (an agent) right now
                    result.present += 1
                    continue
                self.ram.write(block, item.payload)
                self.ram.commit(block)
                pending[key] = BlockRecord(item.address.digest, item.address.layer, item.model,
                                           len(item.payload), checksum, now, now, Tier.RAM)
                self._evicted.discard(key)
                result.stored += 1
                self.counters.puts += 1
                self.counters.put_bytes += len(item.payload)
        finally:
            self._write_index()
        return result

    def _check_put(self, i: int, item: PutItem) -> None:
        n = len(item.payload)
        if n == 0:
            raise InvalidArgument(f"block {i} ({item.address}): empty payload")
        if len(item.model.encode()) > MAX_MODEL_BYTES:
            raise InvalidArgument(f"block {i} ({item.address}): model label is over {MAX_MODEL_BYTES} bytes")
        if n > self.ram.max_block_bytes:
            raise InvalidArgument(f"block {i} ({item.address}): payload of {n} bytes is over the "
                                  f"limit of {self.ram.max_block_bytes} bytes (kv.max_block_mib)")
        if item.checksum and len(item.checksum) != DIGEST_BYTES:
            raise InvalidArgument(f"block {i} ({item.address}): checksum must be {DIGEST_BYTES} bytes "
                                  f"(BLAKE3-256), got {len(item.checksum)}")

    # -- get ----------------------------------------------------------------------------------

    def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False) -> tuple[list[Fetched], list[Miss]]:
        """Fetch a batch. Without ``allow_partial`` any miss raises NotFound naming it."""
        found: list[Fetched] = []
        misses: list[Miss] = []
        blocks: list[tuple[BlockAddress, RamBlock]] = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is None:
                misses.append(Miss(address, self.miss_reason(address)))
            else:
                blocks.append((address, block))
        checksums = self.index.checksums([b.key for _, b in blocks])
        for (address, block), checksum in zip(blocks, checksums):
            if checksum is None:
                misses.append(Miss(address, self._drop_unindexed(block)))
                continue
            found.append(Fetched(address, self.ram.read(block), checksum))
            self._touched.add(block.key)
        self.counters.hits += len(found)
        self.counters.misses += len(misses)
        self.counters.hit_bytes += sum(len(f.payload) for f in found)
        if misses and not allow_partial:
            first = misses[0]
            more = f" (and {len(misses) - 1} more of {len(addresses)})" if len(misses) > 1 else ""
            raise NotFound(f"block {first.address}: {first.reason}{more}")
        return found, misses

    def pin(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False) -> list["Pinned | Miss"]:
        """Pin a batch for a reader that copies out of the arena itself (streams, agents), in
        request order: while pinned a block can be neither evicted nor deleted, so the batch is
        a snapshot however long the copy takes. Without ``allow_partial`` a miss pins nothing
        and raises NotFound. Release every Pinned with :meth:`unpin`."""
        resident = [(address, self.ram.get(address.key)) for address in addresses]
        checksums = self.index.checksums([b.key for _, b in resident if b is not None])
        found = iter(checksums)
        entries: list[tuple[BlockAddress, RamBlock | None, bytes | None]] = [
            (address, block, next(found) if block is not None else None) for address, block in resident]
        missing = [a for a, b, c in entries if b is None or c is None]
        if missing and not allow_partial:
            self.counters.misses += len(missing)
            more = f" (and {len(missing) - 1} more of {len(addresses)})" if len(missing) > 1 else ""
            raise NotFound(f"block {missing[0]}: {self.miss_reason(missing[0])}{more}")
        wanted = sum(b.length for _, b, c in entries if b is not None and c is not None)
        if self.pinned_bytes + wanted > self.max_pinned_bytes:
            raise ResourceExhausted(
                f"readers would pin {self.pinned_bytes + wanted} bytes, over half the RAM tier "
                f"({self.max_pinned_bytes} bytes; {self.pinned_bytes} pinned now): fetch fewer blocks per stream")
        out: list[Pinned | Miss] = []
        for address, block, checksum in entries:
            if block is None or checksum is None:
                reason = self.miss_reason(address) if block is None else self._drop_unindexed(block)
                out.append(Miss(address, reason))
                self.counters.misses += 1
                continue
            self.ram.pin(block)
            self.pinned_bytes += block.length
            self._touched.add(block.key)
            self.counters.hits += 1
            self.counters.hit_bytes += block.length
            out.append(Pinned(address, block, checksum))
        return out

    def read(self, pinned: "Pinned", start: int, length: int) -> bytes:
        """A copy of up to ``length`` bytes of a pinned block from ``start``."""
        return self.ram.read_range(pinned.block, start, length)

    def unpin(self, pinned: "Pinned") -> None:
        self.ram.unpin(pinned.block)
        self.pinned_bytes -= pinned.block.length

    def _drop_unindexed(self, block: RamBlock) -> str:
        """A resident block without an index record (its write failed): never served, dropped."""
        if self.ram.busy_reason(block.key) is None:
            self.ram.delete(block.key)
        log.error("resident block without index record dropped", extra={"fields": {"key": block.key.hex()}})
        return "its index record is missing; the bytes were dropped"

    @property
    def max_block_bytes(self) -> int:
        return self.ram.max_block_bytes

    def resident_bytes(self, addresses: Sequence[BlockAddress]) -> int:
        """Payload bytes of those of ``addresses`` that are resident (sizing an answer)."""
        return sum(b.length for a in addresses if (b := self.ram.get(a.key)) is not None)

    def miss_reason(self, address: BlockAddress) -> str:
        """Why ``address`` is not here, in words."""
        record = self.index.get(address.key)
        if record is None:
            return "unknown block"
        if not record.present:
            return f"{record.gone_reason.text}; its metadata is kept until {self.gone_ttl:.0f} s after it went"
        return "not resident in any tier this daemon has"

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes], layer: int) -> LookupResult:
        self.counters.lookups += 1
        for i, digest in enumerate(digests):
            if len(digest) != DIGEST_BYTES:
                raise InvalidArgument(f"digests[{i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes (BLAKE3-256)")
        ram = 0
        for digest in digests:
            if index_key(digest, layer) not in self.ram:
                break
            ram += 1
        return LookupResult(longest=ram, ram=ram)

    # -- delete -------------------------------------------------------------------------------

    def delete(self, addresses: Sequence[BlockAddress]) -> tuple[int, int]:
        """Remove blocks from every tier and the index; returns (deleted, not_found).
        A block being read or written raises FailedPrecondition and nothing is deleted."""
        addresses = list(dict.fromkeys(addresses))   # the same block twice counts once
        keys = [a.key for a in addresses]
        for address, key in zip(addresses, keys):
            busy = self.ram.busy_reason(key)
            if busy is not None:
                raise FailedPrecondition(f"block {address} is in use ({busy}); nothing was deleted")
        records = self.index.get_many(keys)
        deleted = 0
        for key, record in zip(keys, records):
            try:
                in_ram = self.ram.delete(key)
            except BlockBusy as exc:  # pragma: no cover - checked above, same thread
                raise FailedPrecondition(str(exc)) from None
            if in_ram or (record is not None and record.present):
                deleted += 1
        self.index.write(deletes=[k for k, r in zip(keys, records) if r is not None])
        self.counters.deletes += deleted
        return deleted, len(keys) - deleted

    # -- listing and stats --------------------------------------------------------------------

    def list_blocks(self, *, model: str = "", tier: str = "", page_token: bytes = b"",
                    page_size: int = 100, max_scan: int = 10_000) -> tuple[list[BlockRecord], bytes]:
        """A page of index records in key order, filtered by model and tier
        (``ram``, ``ssd``, ``gone`` or empty for all). The token continues the listing;
        an empty token means the end."""
        if page_token and len(page_token) != DIGEST_BYTES:
            raise InvalidArgument("page_token is not one this daemon returned")
        want = {"": None, "ram": Tier.RAM, "ssd": Tier.SSD, "gone": Tier.NONE}
        if tier not in want:
            raise InvalidArgument(f"tier must be one of ram, ssd, gone or empty; got {tier!r}")
        page_size = max(1, min(page_size or 100, 1000))
        out: list[BlockRecord] = []
        last = b""
        scanned = 0
        for key, record in self.index.scan(page_token or None):
            last = key
            scanned += 1
            if (not model or record.model == model) and _tier_matches(record, want[tier]):
                out.append(record)
                if len(out) == page_size:
                    break
            if scanned >= max_scan:
                break
        else:
            return out, b""
        return out, last

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "ram_blocks": len(self.ram),
            "ram_bytes": self.ram.used_bytes,
            "ram_reserved_bytes": self.ram.slabs.reserved_bytes,
            "ram_capacity_bytes": self.ram.capacity,
            "ram_evictions": self.ram.evictions,
            "index_entries": self.index.count_estimate(),
            "puts": c.puts, "put_bytes": c.put_bytes, "hits": c.hits, "misses": c.misses,
            "hit_bytes": c.hit_bytes, "lookups": c.lookups, "deletes": c.deletes,
        }

    # -- maintenance --------------------------------------------------------------------------

    def _on_ram_evict(self, blocks: list[RamBlock]) -> None:
        """The RAM tier dropped ``blocks`` (inside a request): note it; _write_index tells the
        index once per request, not once per victim."""
        now = self.clock()
        for block in blocks:
            key = block.key
            self._touched.discard(key)
            record = self._pending.get(key)
            if record is not None:          # stored earlier in this very batch
                self._pending[key] = record.gone(GoneReason.EVICTED, now)
            else:
                self._evicted.add(key)

    def _write_index(self) -> None:
        """One index write for the request: its new records and its evictions' tombstones.

        If the index cannot be written, the request's new blocks leave RAM again (what the
        index does not know must not be served) and Unavailable says so."""
        puts: list[tuple[bytes, BlockRecord | bytes]] = list(self._pending.items())
        new_keys = [key for key, record in puts if record.present]
        evicted, self._evicted = list(self._evicted), set()
        self._pending.clear()
        try:
            if evicted:
                puts += self.index.without_tier(evicted, Tier.RAM, GoneReason.EVICTED, self.clock())
            self.index.write(puts)
        except Exception as exc:
            for key in new_keys:
                if self.ram.busy_reason(key) is None:
                    self.ram.delete(key)
            log.error("index write failed", extra={"fields": {"blocks": len(new_keys), "error": str(exc)}})
            raise Unavailable(f"the index cannot be written ({exc}); none of the {len(new_keys)} new blocks "
                              "of this request were kept") from exc

    def flush_last_seen(self) -> int:
        """Write the last-seen time of blocks used since the previous flush (batched, off the
        hot path); returns how many records were updated."""
        if not self._touched:
            return 0
        keys, self._touched = list(self._touched), set()
        puts = self.index.with_last_seen(keys, self.clock())
        self.index.write(puts)
        return len(puts)


def _tier_matches(record: BlockRecord, tier: Tier | None) -> bool:
    if tier is None:
        return True
    if tier == Tier.NONE:
        return not record.present
    return bool(record.tiers & tier)
