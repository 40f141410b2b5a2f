"""SSD shares by tenant (kvcached.tiers.ssd_shares) on a real SSD tier, a real RocksDB index and
a real arena: eviction for room takes only blocks of tenants over their shares, so a noisy
tenant never evicts another's blocks below that tenant's share; room nobody uses is lent and
taken back; each tenant's blocks and bytes are counted, and the boot reconcile counts them
again. Both eviction orders: the index's queue (lru) and an in-memory policy (s3fifo)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvcached.config import ConfigError, load_config
from kvcached.index import BlockIndex, Tier
from kvcached.policies import make_keyed_policy
from kvcached.policies.clock import ClockPolicy
from kvcached.store import PutItem, Store
from kvcached.store.ssd_reconcile import reconcile_ssd
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import file_bytes
from kvcached.tiers.ssd_shares import SsdShares
from kvcached.tiers.ssd_usage import SsdUsage
from tests.unit.conftest import KIB, SLAB, FakeClock, SyncStore, address, payload

BLOCK = 30 * KIB
FILE = file_bytes(BLOCK)
A, B = range(1000, 2000), range(2000, 3000)     # block numbers of tenants a and b


@pytest.fixture
def shared_store(index: BlockIndex, clock: FakeClock, tmp_path: Path,
                 event_loop_for_store: asyncio.AbstractEventLoop) -> Iterator[Callable[..., SyncStore]]:
    made: list[tuple[SsdTier, SharedArena]] = []

    def make(shares: dict[str, int], capacity: int, ssd_policy: str = "lru") -> SyncStore:
        arena = SharedArena(64 * SLAB, name="kvcached-ssd-shares-test")
        tier = SsdTier(str(tmp_path / "ssd"), capacity, durability="none", threads=2)
        tier.open()
        made.append((tier, arena))

        async def build() -> Store:
            return Store(RamTier(arena, SLAB, ClockPolicy(), count_tenants=True), index, ssd=tier, clock=clock,
                         ssd_order=make_keyed_policy(ssd_policy) if ssd_policy != "lru" else None,
                         count_tenants=True, ssd_shares=shares)
        store = event_loop_for_store.run_until_complete(build())
        store.ssd_reconciled = True
        tier.reconciled(0, 0, 0, {})             # as the boot reconcile does: the tier's size is known
        return SyncStore(store, event_loop_for_store)

    yield make
    for tier, arena in made:
        event_loop_for_store.run_until_complete(tier.close())
        arena.close()


def save(store: SyncStore, clock: FakeClock, tenant: str, numbers: range | list[int]) -> None:
    """Blocks of ``tenant``, one at a time (each older than the next), written back to SSD."""
    for n in numbers:
        clock.advance(1)
        store.put([PutItem(address(n), payload(n, BLOCK), model="m", tenant=tenant)])
        assert store.demote() == 1


def on_ssd(index: BlockIndex, numbers: range | list[int]) -> list[int]:
    return [n for n in numbers if (r := index.get(address(n).key)) is not None and r.tiers & Tier.SSD]


ORDERS = pytest.mark.parametrize("ssd_policy", ["lru", "s3fifo"])


@ORDERS
def test_a_noisy_tenant_evicts_its_own_blocks_never_anothers_within_its_share(
        shared_store: Callable[..., SyncStore], index: BlockIndex, clock: FakeClock, ssd_policy: str) -> None:
    store = shared_store({"a": 4 * FILE, "b": 4 * FILE}, capacity=8 * FILE, ssd_policy=ssd_policy)
    save(store, clock, "b", B[:3])                   # b: 3 files, within its share, the oldest
    save(store, clock, "a", A[:10])                  # a fills the rest and more
    assert store.ssd.used_bytes == 13 * FILE > store.ssd.capacity
    store.evict_ssd()
    assert on_ssd(index, B[:3]) == list(B[:3]), "b is within its share: none of its blocks went"
    assert store.ssd.used_bytes <= store.ssd.capacity
    assert store.ssd.held_by_tenant("a") == (5, 5 * BLOCK), "a kept what b does not use (lent room)"
    assert store.ssd.held_by_tenant("b") == (3, 3 * BLOCK)
    if ssd_policy == "lru":
        assert on_ssd(index, A[:10]) == list(A[5:10]), "a's oldest went first"


@ORDERS
def test_lent_room_is_taken_back(shared_store: Callable[..., SyncStore], index: BlockIndex, clock: FakeClock,
                                 ssd_policy: str) -> None:
    store = shared_store({"a": 4 * FILE, "b": 4 * FILE}, capacity=8 * FILE, ssd_policy=ssd_policy)
    save(store, clock, "a", A[:8])                   # a fills the whole tier: half of it lent by b
    assert store.evict_ssd() == 0, "within capacity: nothing goes"
    save(store, clock, "b", B[:4])                   # b comes back for its share
    store.evict_ssd()
    assert on_ssd(index, B[:4]) == list(B[:4])
    assert store.ssd.held_by_tenant("a")[0] == 4, "a is back to its share"
    save(store, clock, "a", A[8:10])                 # a over its share again: its own blocks go
    store.evict_ssd()
    assert on_ssd(index, B[:4]) == list(B[:4]) and store.ssd.held_by_tenant("a")[0] == 4


def test_a_tenant_without_a_share_only_borrows(shared_store: Callable[..., SyncStore], index: BlockIndex,
                                               clock: FakeClock) -> None:
    """The default tenant has no share here: all it holds is lent, and it goes first, even
    newer than the shared tenant's blocks."""
    store = shared_store({"a": 6 * FILE}, capacity=8 * FILE)
    save(store, clock, "a", A[:4])
    save(store, clock, "", range(1, 5))              # the default tenant's newer blocks
    save(store, clock, "a", A[4:6])                  # a within its share: 10 files on an 8-file tier
    store.evict_ssd()
    assert on_ssd(index, A[:6]) == list(A[:6])
    assert on_ssd(index, range(1, 5)) == [3, 4], "the borrower's two oldest went"


def test_ttl_still_applies_within_a_share(shared_store: Callable[..., SyncStore], index: BlockIndex,
                                          clock: FakeClock) -> None:
    store = shared_store({"a": 4 * FILE, "b": 4 * FILE}, capacity=8 * FILE)
    save(store, clock, "b", B[:2])
    clock.advance(8 * 86400.0)                       # past the SSD TTL (7 days)
    assert store.evict_ssd() == 2 and store.ssd.held_by_tenant("b") == (0, 0)


def test_counts_by_tenant_follow_delete_drop_and_the_boot_reconcile(
        shared_store: Callable[..., SyncStore], index: BlockIndex, clock: FakeClock) -> None:
    store = shared_store({"a": 4 * FILE}, capacity=16 * FILE)
    save(store, clock, "a", A[:3])
    save(store, clock, "b", B[:2])
    store.delete([address(A[0])])
    assert store.drop_from_ssd([address(B[0]).key]) == (1, 0, 0)
    assert store.ssd.held_by_tenant("a") == (2, 2 * BLOCK) and store.ssd.held_by_tenant("b") == (1, BLOCK)
    assert store.ssd.usage.used_by("a") == 2 * FILE
    report = reconcile_ssd(index, store.ssd)         # what a restart counts from the records
    assert {t: (u.blocks, u.file_bytes) for t, u in report.by_tenant.items()} == {"a": (2, 2 * FILE), "b": (1, FILE)}
    store.ssd.reconciled(report.on_ssd, report.on_ssd_bytes, report.on_ssd_file_bytes, report.by_tenant)
    assert store.ssd.held_by_tenant("b") == (1, BLOCK)


def test_eviction_round_counts_what_it_chose(tmp_path: Path) -> None:
    usage = SsdUsage(str(tmp_path), 1 << 30)
    for _ in range(3):
        usage.added(BLOCK, "a")
    usage.added(BLOCK, "b")
    shares = SsdShares({"a": FILE, "b": FILE}, usage)
    assert shares.anyone_over()
    step = shares.round()
    assert not step.take("b", FILE), "b is at its share"
    assert step.take("a", FILE) and step.take("a", FILE)
    assert not step.take("a", FILE), "a is back at its share once two are chosen"
    usage.removed(BLOCK, "a")
    usage.removed(BLOCK, "a")
    assert not shares.anyone_over()


def write_config(tmp_path: Path, tenants: str, ssd_gib: float = 1.0) -> str:
    path = tmp_path / "kvcached.toml"
    path.write_text(f"[kv]\nram_gib = 0.25\nssd_gib = {ssd_gib}\nindex_dir = \"{tmp_path}/index\"\n"
                    f"ssd_dir = \"{tmp_path}/ssd\"\n[tenants]\nuids = {{ a = [60001], b = [60002] }}\n{tenants}\n")
    return str(path)


@pytest.mark.parametrize(("tenants", "ssd_gib", "error"), [
    ("ssd_shares = { c = 0.5 }", 1.0, "tenants.ssd_shares.c: no tenant called c"),
    ("ssd_shares = { a = 0.75, b = 0.5 }", 1.0, "tenants.ssd_shares: the shares add up to"),
    ("ssd_shares = { a = 0.5 }", 0, "the SSD tier is off"),
    ("ssd_shares = { a = -1 }", 1.0, "tenants.ssd_shares"),
])
def test_bad_ssd_shares_are_refused_at_start(tmp_path: Path, tenants: str, ssd_gib: float, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(write_config(tmp_path, tenants, ssd_gib))


def test_ssd_shares_in_bytes_or_fractions(tmp_path: Path) -> None:
    from kvcached.tenants import ssd_shares
    config = load_config(write_config(tmp_path, "ssd_shares = { a = 0.5, b = 1048576 }"))
    assert ssd_shares(config) == {"a": 1 << 29, "b": 1 << 20}
