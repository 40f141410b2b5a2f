"""Agent writes and reads in the store: slots, commits with background checksums, the GPU view
in lookups. Real arena, real RocksDB, real SSD files where a tier is needed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest

from kvcached.errors import FailedPrecondition
from kvcached.index import BlockIndex, Tier
from kvcached.store import Pinned, PutItem, Store
from kvcached.store.gpu_view import GpuView, GpuViewFull
from kvcached.tiers.ram import WRITING, RamBlock, RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached_agent.integrity import payload_checksum
from tests.unit.conftest import ARENA, KIB, SLAB, FakeClock, SyncStore, address, digest, payload


def write(store: SyncStore, block: RamBlock, data: bytes) -> None:
    """What an agent does between Allocate and Commit: copy into the slot."""
    offset = store.offset_of(block)
    store.ram.arenas.get(0).view[offset:offset + len(data)] = data


def settle(store: SyncStore) -> None:
    """Let background checksumming finish."""
    while store.inflight.hashing or store.inflight.background:
        store._loop.run_until_complete(asyncio.sleep(0.001))


def save(store: SyncStore, ns: list[int], size: int = 8 * KIB) -> list[RamBlock]:
    blocks = store.reserve([(address(n), size) for n in ns])
    assert all(isinstance(b, RamBlock) for b in blocks), blocks
    for n, block in zip(ns, blocks):
        write(store, block, payload(n, size))
    assert store.commit_written([(address(n), b) for n, b in zip(ns, blocks)], "m") == [None] * len(ns)
    return blocks  # type: ignore[return-value]


def test_saved_blocks_are_recorded_with_their_checksum(store: SyncStore, index: BlockIndex) -> None:
    save(store, [1, 2])
    assert address(1).key in store.ram                 # visible at once
    assert store.delete([address(3)]) == (0, 1)
    settle(store)
    record = index.get(address(1).key)
    assert record is not None and record.checksum == payload_checksum(payload(1, 8 * KIB)) and record.model == "m"
    found, _ = store.get([address(1), address(2)])
    assert [f.payload for f in found] == [payload(1, 8 * KIB), payload(2, 8 * KIB)]
    assert store.pinned_bytes == 0 and store.counters.puts == 2


def test_a_get_right_after_commit_waits_for_the_record(store: SyncStore) -> None:
    save(store, [1])
    assert store.inflight.hashing                              # not checksummed yet
    found, misses = store.get([address(1)])            # waits instead of dropping an unrecorded block
    assert not misses and found[0].payload == payload(1, 8 * KIB)


def test_reserve_statuses(store: SyncStore) -> None:
    save(store, [1])
    settle(store)
    first = store.reserve([(address(2), 4 * KIB)])
    out = store.reserve([(address(1), 4 * KIB), (address(2), 4 * KIB), (address(3), 0),
                         (address(4), SLAB + 1)])
    assert out == ["present", "busy", "invalid", "invalid"]
    assert isinstance(first[0], RamBlock) and first[0].refs == WRITING


def test_agents_hold_at_most_half_the_tier(store: SyncStore) -> None:
    out = store.reserve([(address(n), SLAB) for n in range(3)])
    assert [isinstance(b, RamBlock) for b in out] == [True, True, False] and out[2] == "full"
    assert store.pinned_bytes == 2 * SLAB == store.max_pinned_bytes
    for n, block in enumerate(out[:2]):
        store.abort_reserved(block, address(n))        # type: ignore[arg-type]
    assert store.pinned_bytes == 0 and len(store.ram) == 0 and store.ram.slabs.used_slots == 0


def test_reservations_evict_idle_blocks_and_record_the_tombstones(store: SyncStore, index: BlockIndex) -> None:
    for n in range(4):
        store.put([PutItem(address(100 + n), payload(n, SLAB))])
    out = store.reserve([(address(1), SLAB)])
    assert isinstance(out[0], RamBlock)
    gone = [n for n in range(4) if address(100 + n).key not in store.ram]
    assert len(gone) == 1
    record = index.get(address(100 + gone[0]).key)
    assert record is not None and not record.present


def test_committing_twice_or_after_abort_is_unknown(store: SyncStore) -> None:
    [block] = store.reserve([(address(1), KIB)])
    store.abort_reserved(block, address(1))            # type: ignore[arg-type]
    assert store.commit_written([(address(1), block)], "m") == ["unknown"]   # type: ignore[list-item]
    [block] = save(store, [2])
    assert store.commit_written([(address(2), block)], "m") == ["unknown"]
    settle(store)


def test_delete_waits_for_the_record_then_deletes(store: SyncStore, index: BlockIndex) -> None:
    save(store, [1])
    assert store.delete([address(1)]) == (1, 0)
    settle(store)
    assert address(1).key not in store.ram and index.get(address(1).key) is None


def test_pinned_loads_block_delete(store: SyncStore) -> None:
    save(store, [1])
    [pinned] = store.pin([address(1)])
    assert isinstance(pinned, Pinned)
    with pytest.raises(FailedPrecondition):
        store.delete([address(1)])
    store.unpin(pinned)
    assert store.delete([address(1)]) == (1, 0)


def test_lookup_counts_the_agents_gpu(store: SyncStore) -> None:
    save(store, [1, 2])
    settle(store)
    store.gpu.add_agent(7, "a", 100)
    store.gpu.pinned(7, [digest(3), digest(4)])
    chain = [digest(n) for n in (1, 2, 3, 4, 5)]
    mine = store.lookup(chain, 0, agent=7)
    assert (mine.ram, mine.gpu, mine.longest) == (2, 0, 4)       # RAM 1-2, then its GPU 3-4
    store.gpu.pinned(7, [digest(1), digest(2)])
    assert store.lookup(chain, 0, agent=7).gpu == 4
    anyone = store.lookup(chain, 0)
    assert (anyone.gpu, anyone.longest) == (4, 2)                 # a Get returns only RAM/SSD blocks
    assert store.stats()["agents"] == 1 and store.stats()["gpu_blocks"] == 4


@pytest.fixture
def ssd_store(ram: RamTier, index: BlockIndex, clock: FakeClock, tmp_path: Path,
              event_loop_for_store: asyncio.AbstractEventLoop) -> Iterator[SyncStore]:
    ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="none", commit_s=0.001, threads=2)
    ssd.open()
    store = Store(ram, index, ssd=ssd, write_policy="write_through", clock=clock)
    store.ssd_reconciled = True
    yield SyncStore(store, event_loop_for_store)
    event_loop_for_store.run_until_complete(ssd.close())


def test_write_through_commit_answers_once_on_ssd(ssd_store: SyncStore, index: BlockIndex) -> None:
    save(ssd_store, [1, 2])                      # returns only after the publish
    for n in (1, 2):
        record = index.get(address(n).key)
        assert record is not None and record.tiers & Tier.SSD
    assert not ssd_store.ram.dirty
    assert ssd_store.reserve([(address(1), KIB)]) == ["present"]


def test_write_back_commit_is_demoted_after_its_record(ssd_store: SyncStore, index: BlockIndex) -> None:
    ssd_store.write_policy = "write_back"
    save(ssd_store, [1])
    assert ssd_store.demote() == 0               # not checksummed yet: not written back
    settle(ssd_store)
    assert ssd_store.demote() == 1
    record = index.get(address(1).key)
    assert record is not None and record.tiers & Tier.SSD


# -- the GPU view alone ------------------------------------------------------------------------

def test_gpu_view_prefixes_and_overlap() -> None:
    view = GpuView(max_blocks=4)
    view.add_agent(1, "a", 10)
    view.add_agent(2, "b", 20)
    chain = [digest(n) for n in range(5)]
    view.pinned(1, chain[:3])
    view.pinned(2, chain[:1] + chain[2:4])
    assert view.prefix(1, chain) == 3 and view.prefix(2, chain) == 1 and view.prefix(99, chain) == 0
    assert [(i.agent_id, n) for i, n in view.overlap(chain)] == [("a", 3), ("b", 1)]
    view.evicted(1, [chain[1], digest(77)])
    assert view.prefix(1, chain) == 1 and view.longest(chain) == 1
    assert view.held(2, chain) == {chain[0], chain[2], chain[3]}
    with pytest.raises(GpuViewFull):
        view.pinned(2, [digest(8), digest(9)])     # 3 + 2 > 4: all or nothing
    assert view.prefix(2, chain) == 1 and len(view.held(2, [digest(8)])) == 0
    assert view.drop_agent(1) == 2 and view.drop_agent(1) == 0
    assert [i.agent_id for i, _ in view.overlap(chain)] == ["b"]


def test_arena_fixture_is_what_these_tests_assume() -> None:
    assert ARENA == 4 * SLAB


def test_engine_keys_are_kept_only_for_blocks_reserved_or_stored(store: SyncStore, index: BlockIndex) -> None:
    """KV events: keys offered before a save reach the block's record once it is reserved and
    recorded (or at once if it is stored already), and go again when the reservation is given
    back; keys of blocks never reserved stay out of the index (bounded while they wait)."""
    from kvcached.index.format import record_route
    from kvcached.index.presence import TierFeed
    index.tier_feed = TierFeed()

    def route(n: int) -> bytes | None:
        raw = index.raw(address(n).key)
        return None if raw is None else record_route(raw)

    store.keep_routes([(digest(n), address(n).layer, b"keys%d" % n) for n in (1, 2, 3)])
    save(store, [1])
    settle(store)
    assert index.get(address(1).key).route == b"keys1"          # type: ignore[union-attr]
    blocks = store.reserve([(address(2), 8 * KIB)])
    store.abort_reserved(blocks[0], address(2))          # type: ignore[arg-type]
    assert [route(n) for n in (1, 2, 3)] == [b"keys1", None, None]
    assert len(store.routes) == 1, "the given-back reservation's keys went; block 3's still wait"
    store.keep_routes([(digest(1), address(1).layer, b"again")])
    assert store.reserve([(address(1), 8 * KIB)]) == ["present"]      # stored already: its keys are kept
    assert route(1) == b"again" and index.get(address(1).key).model == "m"   # type: ignore[union-attr]
    store.routes.limit = 2
    store.keep_routes([(digest(n), address(n).layer, b"k") for n in range(10, 20)])
    assert len(store.routes) == 2, "keys waiting for a reservation are bounded"
    settle(store)


def test_engine_keys_that_cannot_be_written_leave_the_reservation_standing(
        ram: RamTier, clock: FakeClock, event_loop_for_store: asyncio.AbstractEventLoop, tmp_path: Path) -> None:
    """A block found stored already gets its offered keys at once, in its record; with the index
    on a full disk that write is refused, and the Allocate still answers PRESENT (the keys are an
    extra: the block keeps its digest name), with nothing lost."""
    import os
    import time

    from kvcached.index import IndexUnwritable
    from kvcached.index.format import record_route
    from kvcached.index.presence import TierFeed
    from tests.disks import fill, small_tmpfs
    with small_tmpfs(tmp_path / "disk", "4m") as mnt:
        index = BlockIndex(mnt / "index")
        index.tier_feed = TierFeed()
        store = SyncStore(event_loop_for_store.run_until_complete(_build(ram, index, clock)), event_loop_for_store)
        save(store, [1])
        settle(store)
        hog = fill(mnt)
        with pytest.raises(IndexUnwritable):
            while True:
                index.write([(os.urandom(32), os.urandom(200))])
        store.keep_routes([(digest(1), address(1).layer, b"keys")])
        assert store.reserve([(address(1), 8 * KIB)]) == ["present"]
        raw = index.raw(address(1).key)
        assert raw is not None and record_route(raw) is None, "the block is there, under its digest name"
        hog.unlink()
        deadline = time.monotonic() + 10
        while not index.recover(time.monotonic()):       # writable again, so it closes cleanly
            assert time.monotonic() < deadline, index.unwritable_reason
            time.sleep(0.05)
        index.close()


async def _build(ram: RamTier, index: BlockIndex, clock: FakeClock) -> Store:
    return Store(ram, index, gone_ttl=3600.0, clock=clock)
