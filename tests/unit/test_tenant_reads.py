"""Every read checks whose block it serves (docs/security.md, "Tenants"), on a real arena, a
real RocksDB index and a real SSD tier: a caller who sends another tenant's stored address as
its own (the default tenant sends addresses unchanged) finds, fetches, pins, sizes, plans,
deletes and overwrites nothing of it, whether the block is in RAM or only on SSD (which is
then not promoted for the caller); each such block is counted. The owner and the operator
(tenant None) see it as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvcached.errors import NotFound
from kvcached.index import BlockIndex
from kvcached.policies.clock import ClockPolicy
from kvcached.store import Miss, Pinned, PutItem, SlotRefusal, Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from tests.unit.conftest import KIB, SLAB, FakeClock, SyncStore, address, payload

BLOCK = 8 * KIB
ALICE = range(100, 108)


@pytest.fixture
def tenant_store(index: BlockIndex, clock: FakeClock, tmp_path: Path,
                 event_loop_for_store: asyncio.AbstractEventLoop) -> Iterator[Callable[[bool], SyncStore]]:
    """A store that counts tenants (several configured), with or without an SSD tier (write-through)."""
    made: list[tuple[SsdTier | None, SharedArena]] = []

    def make(ssd: bool) -> SyncStore:
        arena = SharedArena(16 * SLAB, name="kvcached-tenant-reads")
        tier = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="none", threads=2) if ssd else None
        if tier is not None:
            tier.open()
        made.append((tier, arena))

        async def build() -> Store:
            return Store(RamTier(arena, SLAB, ClockPolicy(), count_tenants=True), index, ssd=tier, clock=clock,
                         count_tenants=True, write_policy="write_through" if ssd else "write_back")
        store = event_loop_for_store.run_until_complete(build())
        store.ssd_reconciled = True
        if tier is not None:
            tier.reconciled(0, 0, 0, {})
        return SyncStore(store, event_loop_for_store)

    yield make
    for tier, arena in made:
        if tier is not None:
            event_loop_for_store.run_until_complete(tier.close())
        arena.close()


def alices(store: SyncStore) -> list:
    """Alice's blocks stored; their addresses (what the operator's event stream once named)."""
    addresses = [address(n) for n in ALICE]
    result = store.put([PutItem(a, payload(n, BLOCK), model="m", tenant="alice") for n, a in zip(ALICE, addresses)])
    assert result.stored == len(addresses)
    return addresses


@pytest.mark.parametrize("where", ["ram", "ssd only"])
@pytest.mark.parametrize("caller", ["", "bob"])
def test_another_tenants_stored_address_reads_as_never_stored(tenant_store: Callable[[bool], SyncStore],
                                                              where: str, caller: str) -> None:
    store = tenant_store(True)
    addresses = alices(store)
    if where == "ssd only":
        assert store.drop_from_ram([a.key for a in addresses])[0] == len(addresses)
    digests = [a.digest for a in addresses]
    before = store.stats()

    with pytest.raises(NotFound, match="unknown block"):
        store.get(addresses, tenant=caller)
    found, misses = store.get(addresses, allow_partial=True, tenant=caller)
    assert found == [] and {m.reason for m in misses} == {"unknown block"}
    pinned = store.pin(addresses, allow_partial=True, tenant=caller)
    assert all(isinstance(p, Miss) and p.reason == "unknown block" for p in pinned)
    looked = store.lookup(digests, 0, tenant=caller)
    assert (looked.longest, looked.ram, looked.ssd) == (0, 0, 0)
    seen = store.present(digests, 0, tenant=caller)
    assert not any(seen.ram + seen.ssd)
    plan, held = store.plan(digests, 0, 0.01, BLOCK, tenant=caller)
    assert held == 0 and plan.load == 0
    assert store.stored_bytes(addresses, caller) == 0
    assert store.delete(addresses, tenant=caller) == (0, len(addresses))
    assert store.reserve([(a, BLOCK) for a in addresses], caller) == [SlotRefusal.DECLINED] * len(addresses)
    put = store.put([PutItem(a, b"x" * BLOCK, model="m", tenant=caller) for a in addresses])
    assert (put.stored, put.present, put.declined) == (0, 0, len(addresses))

    after = store.stats()
    assert after["other_tenant_blocks"] - before["other_tenant_blocks"] >= 5 * len(addresses)
    assert after["ssd_reads"] == before["ssd_reads"], "nothing was promoted for the stranger"
    assert after["promotions"] == before["promotions"]
    # The owner and the operator read every byte as stored, nothing overwritten or deleted.
    for owner in ("alice", None):
        got, missing = store.get(addresses, allow_partial=True, tenant=owner)
        assert not missing and [f.payload for f in got] == [payload(n, BLOCK) for n in ALICE]
        assert store.lookup(digests, 0, tenant=owner).longest == len(addresses)


def test_ram_only_tier_checks_the_owner_of_each_block(tenant_store: Callable[[bool], SyncStore]) -> None:
    store = tenant_store(False)
    addresses = alices(store)
    digests = [a.digest for a in addresses]
    assert store.lookup(digests, 0, tenant="").ram == 0
    assert store.lookup(digests, 0, tenant="alice").ram == len(addresses)
    assert store.lookup(digests, 0, tenant=None).ram == len(addresses)
    results = store.pin(addresses, allow_partial=True, tenant="alice")
    assert all(isinstance(r, Pinned) for r in results)
    for r in results:
        store.unpin(r)
    # A chain whose first half is the caller's own and second half another's counts the first half.
    mine = [address(n) for n in range(200, 204)]
    store.put([PutItem(a, payload(n, BLOCK), model="m") for n, a in zip(range(200, 204), mine)])
    chain = [a.digest for a in mine + addresses]
    assert store.lookup(chain, 0, tenant="").longest == len(mine)
    assert store.lookup(chain, 0, tenant=None).longest == len(chain)
