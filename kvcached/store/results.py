"""What the store's rooms take and hand back: plain records, no behaviour.

``Counters`` are the store's running totals (read by Stats and the Prometheus collector, also
from its scrape thread: plain ints, read without a lock). ``Reached`` says how far one read had
to go, for read accounting (kvcached.store.reads).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from kvcached.index import GoneReason
from kvcached.tiers.ram import RamBlock
from kvcached_agent.address import BlockAddress

__all__ = ["CommitOutcome", "Counters", "Fetched", "LookupResult", "Miss", "Pinned", "PutItem", "PutResult", "Reached",
           "SlotRefusal"]


@dataclass(frozen=True, slots=True)
class PutItem:
    address: BlockAddress
    payload: bytes | memoryview
    model: str = ""
    checksum: bytes = b""      # empty: the daemon computes it; else it must match
    tenant: str = ""           # whose block (kvcached.tenants Tenant.tag); "": the default tenant's


@dataclass(frozen=True, slots=True)
class Fetched:
    address: BlockAddress
    payload: bytes
    checksum: bytes


class Pinned(NamedTuple):
    """A block held for a reader: its bytes stay put until :meth:`Store.unpin`. A named tuple,
    not a frozen dataclass: one is made per block loaded, and its init is the cheaper."""

    address: BlockAddress
    block: RamBlock
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Miss:
    """A block a read did not find: why, in words for people, and ``gone``, why the index says it
    went (CORRUPT: its SSD copy failed verification), for code that acts on it."""

    address: BlockAddress
    reason: str
    gone: GoneReason = GoneReason.NONE


class SlotRefusal(enum.StrEnum):
    """Why :meth:`Store.reserve` handed out no slot for an entry."""

    PRESENT = "present"      # RAM or SSD has the block: nothing to write
    BUSY = "busy"            # another writer has it reserved
    FULL = "full"            # no room, or agents and readers already hold half the RAM tier
    INVALID = "invalid"      # a size outside 1..max_block_bytes
    DECLINED = "declined"    # the admission policy does not take it yet: nothing to write


class CommitOutcome(enum.StrEnum):
    """What became of a written block :meth:`Store.commit_written` did not keep."""

    FAILED = "failed"        # write_through: it could not be published on SSD
    UNKNOWN = "unknown"      # not a reserved block (any more)
    DECLINED = "declined"    # write_through: the SSD write budget refused it


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest-prefix hit counts: per tier, and ``longest`` where each block is in some tier."""

    longest: int
    ram: int
    ssd: int = 0
    gpu: int = 0
    peer: int = 0


@dataclass(frozen=True, slots=True)
class Presence:
    """Per block of a Present, each on its own: whether each tier holds it (``gpu``: the asking
    agent's GPU)."""

    gpu: list[bool]
    ram: list[bool]
    ssd: list[bool]
    peer: list[bool]


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    lookups: int = 0
    loads_skipped_ssd: int = 0         # held blocks a load plan skipped as slower than recomputing them
    loads_skipped_peer: int = 0
    deletes: int = 0
    promotions: int = 0
    demotions: int = 0
    ssd_evictions_ttl: int = 0
    ssd_evictions_capacity: int = 0
    ssd_evictions_admin: int = 0
    ssd_full_disk_evictions: int = 0   # SSD blocks a forced eviction dropped (also in ssd_evictions_capacity / _ttl)
    ssd_corrupt: int = 0
    declined: int = 0              # new blocks the admission policy did not take
    ssd_budget_declined: int = 0   # publishes the SSD write budget refused (kept in RAM only)
    held_written: int = 0          # write_through_selective: held blocks that earned their SSD write
    other_tenant: int = 0          # blocks a caller named that are another tenant's: answered as never stored


@dataclass(slots=True)
class TenantCounts:
    """One tenant's puts and reads (kvcached.tenants): what its own Stats answers."""

    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    lookups: int = 0


class TenantTally:
    """Puts and reads by tenant tag, counted where several tenants are configured (``on``);
    the tags are the configuration's names, so the table stays as small as that. The
    operator's calls (tag None) count as the default tenant's."""

    def __init__(self, on: bool = False) -> None:
        self.on = on
        self.by: dict[str, TenantCounts] = {}

    def of(self, tag: str) -> TenantCounts:
        counts = self.by.get(tag)
        if counts is None:
            counts = self.by[tag] = TenantCounts()
        return counts

    def put(self, tag: str | None, nbytes: int, blocks: int = 1) -> None:
        if self.on:
            counts = self.of(tag or "")
            counts.puts += blocks
            counts.put_bytes += nbytes

    def lookup(self, tag: str | None) -> None:
        if self.on:
            self.of(tag or "").lookups += 1

    def read(self, tag: str | None, hits: int, hit_bytes: int, misses: int) -> None:
        if self.on:
            counts = self.of(tag or "")
            counts.hits += hits
            counts.hit_bytes += hit_bytes
            counts.misses += misses


@dataclass(slots=True)
class Reached:
    """How far one read had to go: blocks promoted from SSD and pulled from peers for it, and
    whether the peer tier was in play."""

    peers: bool
    promoted: int = 0
    pulled: int = 0


@dataclass(slots=True)
class PutResult:
    stored: int = 0
    present: int = 0
    declined: int = 0      # not stored: the admission policy (or the SSD write budget) declined them
