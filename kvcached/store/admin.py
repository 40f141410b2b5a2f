"""Operator actions on blocks: Delete, dropping RAM copies (Admin Evict, Drain), and listing.

:func:`delete` removes blocks from every tier and the index; :func:`drop_from_ram` drops RAM
copies the SSD tier also holds (or, without one, any idle block); :func:`list_blocks` pages
through the index. Dropping SSD copies is the SSD evictor's (kvcached.store.ssd_evictor), writing
every RAM-only block back the SSD mover's. The index is written before files are removed: a
crash in between leaves an orphan file, never a dangling record. Runs on the event loop.
"""

from __future__ import annotations

from typing import Sequence

from kvcached.errors import FailedPrecondition, InvalidArgument
from kvcached.index import BlockIndex, BlockRecord, Tier
from kvcached.store.inflight import InFlight
from kvcached.store.ledger import RecordLedger
from kvcached.store.parts import tiers_for_writer
from kvcached.store.results import Counters
from kvcached.store.ssd_evictor import SsdEvictor, header_of
from kvcached.tiers.ram import BlockBusy, RamBlock, RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached_agent.address import DIGEST_BYTES, BlockAddress

__all__ = ["delete", "drop_from_ram", "list_blocks"]

_TIERS = {"": None, "ram": Tier.RAM, "ssd": Tier.SSD, "gone": Tier.NONE}


async def delete(ram: RamTier, index: BlockIndex, ssd: SsdTier | None, evictor: SsdEvictor | None,
                 ledger: RecordLedger, inflight: InFlight, counters: Counters, addresses: Sequence[BlockAddress],
                 *, skip_busy: bool = False, tenant: str | None = None) -> tuple[int, int]:
    """Remove blocks from every tier and the index; returns (deleted, not_found). Waits for the
    daemon's own SSD writes and reads of them to finish; a block that a client is reading or
    writing raises FailedPrecondition and nothing is deleted, or with ``skip_busy`` is left
    alone (counted in neither number). ``tenant`` (a Tenant.tag; None: the operator's call,
    any block): a block of another tenant is not found, as one never stored (counted)."""
    addresses = list(dict.fromkeys(addresses))   # the same block twice counts once
    keys = [a.key for a in addresses]
    theirs: set[bytes] = set()
    if tenant is not None and keys:
        theirs = {k for k, tiers in zip(keys, tiers_for_writer(ram, index, keys, tenant)) if tiers is None}
        counters.other_tenant += len(theirs)
        addresses = [a for a in addresses if a.key not in theirs]
        keys = [a.key for a in addresses]
    await inflight.settled(keys)
    busy_keys = {key: busy for key in keys if (busy := ram.busy_reason(key)) is not None}
    if busy_keys and not skip_busy:
        address = next(a for a in addresses if a.key in busy_keys)
        raise FailedPrecondition(f"block {address} is in use ({busy_keys[address.key]}); nothing was deleted")
    keys = [k for k in keys if k not in busy_keys]
    records = index.get_many(keys)
    deleted = 0
    for key, record in zip(keys, records):
        try:
            in_ram = ram.delete(key)
        except BlockBusy as exc:  # pragma: no cover - checked above, same thread
            raise FailedPrecondition(str(exc)) from None
        if in_ram or (record is not None and record.present):
            deleted += 1
    ledger.delete_records([k for k, r in zip(keys, records) if r is not None])
    if ssd is not None and evictor is not None:
        for key, record in zip(keys, records):
            if record is not None and record.tiers & Tier.SSD:
                ssd.remove_now(key, header_of(record), record.tenant)
        evictor.forget(keys)
    counters.deletes += deleted
    return deleted, len(keys) - deleted + len(theirs)


def drop_from_ram(ram: RamTier, index: BlockIndex, ssd_on: bool, ledger: RecordLedger, inflight: InFlight,
                  keys: Sequence[bytes]) -> tuple[int, int, int]:
    """Drop the RAM copies of these blocks; returns (dropped, busy, absent). With an SSD tier
    (``ssd_on``) only copies already on SSD go (the index keeps the SSD copy); without one, any
    idle block goes and becomes a tombstone, as an eviction would. Blocks being read, written or
    written back, and dirty ones, count as busy."""
    victims: list[RamBlock] = []
    busy = absent = 0
    keys = list(dict.fromkeys(keys))
    on_ssd = ([r is not None and bool(r.tiers & Tier.SSD) for r in index.get_many(keys)]
              if ssd_on else [True] * len(keys))
    for key, kept in zip(keys, on_ssd):
        block = ram.get(key)
        if block is None:
            absent += 1
        elif block.refs != 0 or key in inflight.publishing or key in inflight.hashing or not kept:
            busy += 1
        else:
            victims.append(block)
    if victims:
        ram.drop(victims)
        ledger.commit()
    return len(victims), busy, absent


def list_blocks(index: BlockIndex, *, model: str = "", tier: str = "", page_token: bytes = b"",
                page_size: int = 100, max_scan: int = 10_000,
                tenant: str | None = None) -> tuple[list[BlockRecord], bytes]:
    """A page of index records in key order, filtered by model, tier (``ram``, ``ssd``,
    ``gone`` or empty for all) and tenant (a Tenant.tag, "" the default's; None: every
    tenant's). The token continues the listing; an empty token means the end."""
    if page_token and len(page_token) != DIGEST_BYTES:
        raise InvalidArgument("page_token is not one this daemon returned")
    if tier not in _TIERS:
        raise InvalidArgument(f"tier must be one of ram, ssd, gone or empty; got {tier!r}")
    want = _TIERS[tier]
    page_size = max(1, min(page_size or 100, 1000))
    out: list[BlockRecord] = []
    last = b""
    scanned = 0
    for key, record in index.scan(page_token or None):
        last = key
        scanned += 1
        if ((not model or record.model == model) and _tier_matches(record, want)
                and (tenant is None or record.tenant == tenant)):
            out.append(record)
            if len(out) == page_size:
                break
        if scanned >= max_scan:
            break
    else:
        return out, b""
    return out, last


def _tier_matches(record: BlockRecord, tier: Tier | None) -> bool:
    if tier is None:
        return True
    if tier == Tier.NONE:
        return not record.present
    return bool(record.tiers & tier)
