"""The store's timed work (kvcached/store/keeper.py), job by job, with a real RAM arena, a real
RocksDB, real SSD files, the loops' periods shortened and the wall clock moved by hand."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvcached.index import BlockIndex
from kvcached.store import PutItem, Store
from kvcached.store import keeper as keeper_module
from kvcached.store.keeper import KeeperSettings, StoreKeeper
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from tests.unit.conftest import KIB, FakeClock, address, payload
from tests.unit.test_index import tombstone


def item(n: int) -> PutItem:
    return PutItem(address(n), payload(n, 8 * KIB), model="m")


async def made(ram: RamTier, index: BlockIndex, tmp_path: Path, clock: FakeClock) -> tuple[Store, SsdTier]:
    ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="none", commit_s=0.001, threads=2)  # type: ignore[arg-type]
    ssd.open()
    store = Store(ram, index, ssd=ssd, write_policy="write_back", ssd_ttl=3600.0, gone_ttl=60.0, clock=clock)
    store.ssd_reconciled = True
    return store, ssd


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():                     # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper_module, "MAINTENANCE_PERIOD_S", 0.02)
    monkeypatch.setattr(keeper_module, "DEMOTE_PERIOD_S", 0.02)
    monkeypatch.setattr(keeper_module, "EVICT_PERIOD_S", 0.02)


def test_write_back_publishes_what_puts_make_dirty_and_a_stop_what_is_left(
        ram: RamTier, index: BlockIndex, tmp_path: Path, clock: FakeClock) -> None:
    async def body() -> None:
        store, ssd = await made(ram, index, tmp_path, clock)
        keeper = StoreKeeper(store, index, KeeperSettings(grace_s=2.0), clock=clock)
        keeper.start()
        await store.put([item(n) for n in range(4)])
        await until(lambda: not store.ram.dirty and ssd.blocks == 4)     # woken by the put
        await keeper.stop()
        keeper.close()
        await ssd.close()
    asyncio.run(body())


@pytest.mark.parametrize("handing_over", [False, True])
def test_a_stop_writes_back_the_dirty_blocks_unless_a_successor_keeps_them(
        ram: RamTier, index: BlockIndex, tmp_path: Path, clock: FakeClock, handing_over: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper_module, "DEMOTE_PERIOD_S", 3600.0)     # only the stop writes back
    async def body() -> None:
        store, ssd = await made(ram, index, tmp_path, clock)
        keeper = StoreKeeper(store, index, KeeperSettings(grace_s=2.0), clock=clock)
        keeper.start()
        await asyncio.sleep(0.05)
        store.demote_wanted.clear()
        await store.put([item(n) for n in range(3)])
        await keeper.stop(handing_over=handing_over)
        assert (len(store.ram.dirty), ssd.blocks) == ((3, 0) if handing_over else (0, 3))
        keeper.close()
        await ssd.close()
    asyncio.run(body())


def test_maintenance_prunes_tombstones_past_the_gone_ttl_by_the_clock_it_is_given(
        ram: RamTier, index: BlockIndex, tmp_path: Path, clock: FakeClock) -> None:
    async def body() -> None:
        store, ssd = await made(ram, index, tmp_path, clock)
        index.write(puts=[(address(n).key, tombstone(n, clock())) for n in range(5)])     # blocks evicted now
        assert len(index.expired_tombstones(clock() + 61, 60.0)) == 5
        keeper = StoreKeeper(store, index, KeeperSettings(), clock=clock)
        keeper.start()
        await asyncio.sleep(0.1)
        assert len(index.expired_tombstones(clock() + 61, 60.0)) == 5     # not due: the clock has not moved
        clock.advance(61)                    # past the gone TTL, and past the first prune's time
        await until(lambda: not index.expired_tombstones(clock(), 60.0))
        await keeper.stop()
        keeper.close()
        await ssd.close()
    asyncio.run(body())


def test_the_policy_saver_and_a_stop_save_what_the_policies_learned(
        ram: RamTier, index: BlockIndex, tmp_path: Path, clock: FakeClock) -> None:
    async def body() -> None:
        from kvcached.index import policy_state
        store, ssd = await made(ram, index, tmp_path, clock)
        keeper = StoreKeeper(store, index, KeeperSettings(policy_save_s=0.05, ram_policy="clock"), clock=clock)
        keeper.start()
        await store.put([item(n) for n in range(3)])
        await until(lambda: policy_state.load_blob(index, policy_state.RAM) is not None)
        await keeper.stop()
        assert keeper.save_policies() > 0
        keeper.close()
        await ssd.close()
    asyncio.run(body())
