"""The store with an SSD tier: write-back and write-through, promotion, integrity, SSD eviction,
the boot reconcile. Real RAM arena, real RocksDB, real files; the clock moved by hand."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvcached.errors import NotFound, ResourceExhausted
from kvcached.index import BlockIndex, GoneReason, Tier
from kvcached.store import PutItem, Store
from kvcached.store.ssd_reconcile import reconcile_ssd
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdFull, SsdSpace, SsdTier, SsdTooLarge
from kvcached.tiers.ssd_format import HEADER_BYTES, file_bytes
from tests.disks import fill, small_tmpfs
from tests.unit.conftest import KIB, SLAB, FakeClock, SyncStore, address, digest, payload

TTL = 3600.0


def item(n: int, size: int = 60 * KIB) -> PutItem:
    return PutItem(address(n), payload(n, size), model="m")


@pytest.fixture
def make_store(ram: RamTier, index: BlockIndex, clock: FakeClock, tmp_path: Path,
               event_loop_for_store: asyncio.AbstractEventLoop) -> Iterator[Callable[..., SyncStore]]:
    made: list[SsdTier] = []

    def make(policy: str = "write_back", capacity: int = 1 << 30, directory: Path | None = None,
             durability: str = "none") -> SyncStore:
        ssd = SsdTier(str(directory or tmp_path / "ssd"), capacity, durability=durability, commit_s=0.001,  # type: ignore[arg-type]
                      threads=2)
        ssd.open()
        made.append(ssd)
        store = Store(ram, index, ssd=ssd, write_policy=policy, ssd_ttl=TTL, gone_ttl=TTL, clock=clock)  # type: ignore[arg-type]
        store.ssd_reconciled = True
        return SyncStore(store, event_loop_for_store)

    yield make
    for ssd in made:
        event_loop_for_store.run_until_complete(ssd.close())


def file_of(store: SyncStore, n: int) -> Path:
    a = address(n)
    return Path(store.ssd.path_of(a.key, a.digest, a.layer))


def push_out_of_ram(store: SyncStore, start: int = 1000) -> None:
    """Fill the 4-slab arena with other blocks (written back too, so nothing waits)."""
    for n in range(start, start + 4):
        store.put([item(n, SLAB)])
        store.demote()


def test_write_back_then_promotion(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = make_store()
    store.put([item(1), item(2)])
    assert index.get(address(1).key).tiers == Tier.RAM and store.ram.dirty_bytes == 2 * 60 * KIB
    assert store.demote() == 2
    assert index.get(address(1).key).tiers == Tier.RAM | Tier.SSD and store.ram.dirty_bytes == 0
    assert file_of(store, 1).stat().st_size == file_bytes(60 * KIB)
    push_out_of_ram(store)
    assert index.get(address(1).key).tiers == Tier.SSD, "evicted from RAM, kept on SSD"
    assert store.ram.dirty_evictions == 0
    r = store.lookup([digest(1), digest(2), digest(3)], 0)
    assert (r.longest, r.ram, r.ssd) == (2, 0, 2)
    (f1, f2), _ = store.get([address(1), address(2)])
    assert f1.payload == payload(1, 60 * KIB) and f2.payload == payload(2, 60 * KIB)
    assert store.counters.promotions == 2
    assert index.get(address(1).key).tiers == Tier.RAM | Tier.SSD
    assert store.ram.get(address(1).key).clean, "a promoted block is clean: RAM may drop it freely"
    assert store.put([item(1)]).present == 1


def test_put_of_a_block_only_on_ssd_is_present(make_store: Callable[..., SyncStore]) -> None:
    store = make_store()
    store.put([item(1)])
    store.demote()
    push_out_of_ram(store)
    writes = store.ssd.counters.writes
    r = store.put([item(1)])
    assert (r.stored, r.present) == (0, 1) and store.ssd.counters.writes == writes


def test_write_through_publishes_before_returning(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = make_store("write_through", durability="batch")
    assert store.put([item(1), item(2)]).stored == 2
    assert index.get(address(2).key).tiers == Tier.RAM | Tier.SSD and file_of(store, 2).exists()
    assert store.ram.dirty_bytes == 0 and store.demote() == 0


def test_write_through_batch_bigger_than_ram(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    """Blocks of a write-through batch stay pinned until published: none is evicted by a later
    one of the same batch (it would be acknowledged and lost); the rest is refused."""
    store = make_store("write_through")
    with pytest.raises(ResourceExhausted, match="stored 4 of 6"):
        store.put([item(n) for n in range(1, 7)])
    assert [n for n in range(1, 7) if (r := index.get(address(n).key)) and r.tiers & Tier.SSD] == [1, 2, 3, 4]
    assert all(b.refs == 0 for b in store.ram.blocks())
    assert store.put([item(n) for n in range(5, 7)]).stored == 2, "the rest fits once the first are clean"


@pytest.mark.parametrize("damage", ["payload", "header", "truncate"])
def test_corrupt_file_is_quarantined_never_served(make_store: Callable[..., SyncStore], index: BlockIndex,
                                                  damage: str) -> None:
    store = make_store()
    store.put([item(1)])
    store.demote()
    push_out_of_ram(store)
    path = file_of(store, 1)
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(HEADER_BYTES + 10)
        else:
            pos = HEADER_BYTES + 5000 if damage == "payload" else 40
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(NotFound, match="corrupt"):
        store.get([address(1)])
    assert store.counters.ssd_corrupt == 1 and not path.exists()
    assert len(os.listdir(store.ssd.quarantine_dir)) == 1
    record = index.get(address(1).key)
    assert not record.present and record.gone_reason == GoneReason.CORRUPT
    assert store.ram.get(address(1).key) is None
    assert store.put([item(1)]).stored == 1, "a fresh copy can be stored again"


def test_missing_file_is_a_miss(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = make_store()
    store.put([item(1), item(2)])
    store.demote()
    push_out_of_ram(store)
    file_of(store, 1).unlink()
    found, misses = store.get([address(1), address(2)], allow_partial=True)
    assert [f.address for f in found] == [address(2)] and "missing" in misses[0].reason
    assert index.get(address(1).key).gone_reason == GoneReason.FILE_MISSING


def test_ttl_eviction(make_store: Callable[..., SyncStore], index: BlockIndex, clock: FakeClock) -> None:
    store = make_store()
    store.put([item(1), item(2)])
    store.demote()
    push_out_of_ram(store)            # 1 and 2 only on SSD; 1000.. in RAM and on SSD
    clock.advance(TTL / 2)
    store.get([address(2)])           # a use: 2 stays
    store.flush_last_seen()
    clock.advance(TTL / 2 + 1)
    assert store.evict_ssd() == 5     # 1 and the four RAM blocks, unused for longer than the TTL
    assert not file_of(store, 1).exists() and file_of(store, 2).exists()
    assert index.get(address(1).key).gone_reason == GoneReason.EVICTED
    assert index.get(address(1003).key).tiers == Tier.RAM, "still in RAM"
    assert store.ram.dirty_bytes == 0 and store.demote() == 0, "an evicted SSD copy is not written again"
    assert store.counters.ssd_evictions_ttl == 5


def test_capacity_eviction_lru_with_second_chance(make_store: Callable[..., SyncStore], index: BlockIndex,
                                                  clock: FakeClock) -> None:
    store = make_store(capacity=6 * file_bytes(30 * KIB))
    for n in range(1, 9):
        clock.advance(1)
        store.put([item(n, 30 * KIB)])
        store.demote()
    store.get([address(1)])           # 1 was used again: the evictor gives it a second chance
    store.flush_last_seen()
    assert store.ssd.used_bytes > store.ssd.capacity
    assert store.evict_ssd() == 2
    assert store.ssd.used_bytes <= store.ssd.capacity
    on_ssd = [n for n in range(1, 9) if index.get(address(n).key).tiers & Tier.SSD]
    assert on_ssd == [1, 4, 5, 6, 7, 8]
    assert store.counters.ssd_evictions_capacity == 2


def test_delete_removes_the_file(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = make_store()
    store.put([item(1)])
    store.demote()
    assert store.delete([address(1)]) == (1, 0)
    assert not file_of(store, 1).exists() and index.get(address(1).key) is None and store.ssd.blocks == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 1 MiB."""
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        yield mnt


def test_full_disk_forces_eviction_then_refuses(make_store: Callable[..., SyncStore], index: BlockIndex,
                                                clock: FakeClock, small_fs: Path) -> None:
    store = make_store("write_through", directory=small_fs / "ssd", durability="batch")
    # 1 MiB holds about 14 files of 64 KiB: later puts hit ENOSPC, evict the oldest, and succeed
    for n in range(1, 25):
        clock.advance(1)
        assert store.put([item(n, 60 * KIB)]).stored == 1
    assert store.ssd.counters.no_space >= 1 and store.counters.ssd_evictions_capacity >= 1
    assert not index.get(address(1).key).present and index.get(address(24).key).tiers & Tier.SSD
    # with nothing left to evict (another file fills the disk) a put is refused cleanly
    store.evict_ssd(need_bytes=1 << 30)
    assert store.ssd.blocks == 0
    with open(small_fs / "hog", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with pytest.raises(ResourceExhausted, match="SSD") as err:
        store.put([item(30, 60 * KIB)])
    assert "stored 0 of 1" in str(err.value)
    assert index.get(address(30).key) is None and store.ram.get(address(30).key) is None
    assert not any(".tmp-" in p.name for p in small_fs.rglob("*")), "nothing partial is left"
    (found,), _ = store.get([address(24)])             # reads go on
    assert found.payload == payload(24, 60 * KIB)


def test_reconcile_cleans_up_after_a_crash(make_store: Callable[..., SyncStore], index: BlockIndex,
                                           tmp_path: Path) -> None:
    store = make_store()
    for n in range(1, 5):                                       # one at a time: no Put waits for a demoter
        store.put([item(n)])                                    # (none runs here) to make room
        store.demote()
    ssd = store.ssd
    file_of(store, 1).unlink()                                  # record without file
    with open(file_of(store, 2), "r+b") as f:                   # header disagrees with the record
        f.seek(12)
        f.write(b"\x09")
    orphan = file_of(store, 3)
    index.write(deletes=[address(3).key])                       # file without record
    stale = Path(str(file_of(store, 4)) + ".tmp-0badbeef")      # an interrupted write of an earlier run
    stale.write_bytes(b"torn")
    fresh_ssd = SsdTier(ssd.directory, 1 << 30)
    fresh_ssd.open()
    report = reconcile_ssd(index, fresh_ssd)
    assert (report.records, report.adopted, report.orphans, report.stale_tmp, report.bad_files) == (3, 1, 1, 1, 1)
    assert sorted(report.lost) == sorted([address(1).key, address(2).key])
    assert not orphan.exists() and not stale.exists() and not file_of(store, 2).exists() and file_of(store, 4).exists()
    restarted = Store(store.ram, index, ssd=fresh_ssd, clock=store.clock)     # the next run's store, same RAM
    restarted.finish_ssd_reconcile(report)
    assert fresh_ssd.blocks == 1 and fresh_ssd.used_bytes == file_bytes(60 * KIB) and fresh_ssd.fresh is None
    assert not index.get(address(1).key).tiers & Tier.SSD and not index.get(address(2).key).tiers & Tier.SSD
    asyncio.get_event_loop().run_until_complete(fresh_ssd.close())


def test_cancelled_get_leaves_nothing_behind(make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    """A client that gives up while its block is read from SSD (cancel, deadline) leaves no
    slot reserved and no future unresolved: the next Get and a Delete work."""
    store = make_store()
    store.put([item(1)])
    store.demote()
    push_out_of_ram(store)
    raw, loop = store._store, store._loop

    async def cancel_mid_read() -> None:
        first = asyncio.ensure_future(raw.get([address(1)]))
        second = asyncio.ensure_future(raw.get([address(1)]))   # waits on the first one's read
        await asyncio.sleep(0)
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await asyncio.gather(*raw.inflight.background, return_exceptions=True)

    loop.run_until_complete(cancel_mid_read())
    assert not raw.inflight.fetching
    assert all(b.refs == 0 for b in store.ram.blocks())
    (found,), _ = store.get([address(1)])
    assert found.payload == payload(1, 60 * KIB)
    assert store.delete([address(1)]) == (1, 0)


def test_write_through_put_of_a_block_being_published_waits_for_it(make_store: Callable[..., SyncStore],
                                                                   index: BlockIndex) -> None:
    """Two write-through Puts of the same block: the second is answered only once the block is
    on SSD, not as soon as it finds it in RAM."""
    store = make_store("write_through", durability="batch")
    raw, loop = store._store, store._loop

    async def both() -> list[bool]:
        seen = []

        async def put_and_check() -> None:
            await raw.put([item(1)])
            seen.append(bool(index.get(address(1).key).tiers & Tier.SSD))

        await asyncio.gather(put_and_check(), put_and_check())
        return seen

    assert loop.run_until_complete(both()) == [True, True]


def test_a_block_put_under_write_back_is_made_durable_by_a_write_through_put(
        make_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = make_store("write_back")
    store.put([item(1)])
    assert index.get(address(1).key).tiers == Tier.RAM
    store.write_policy = "write_through"
    assert store.put([item(1)]).present == 1
    assert index.get(address(1).key).tiers == Tier.RAM | Tier.SSD


# -- Lookup's SSD column for blocks held in RAM too (issue 20, part 2) --------------------------


def ssd_truth(store: SyncStore, ns: list[int]) -> int:
    """The SSD column as the index says it: how many of blocks ``ns``, from the first, have an
    SSD copy."""
    tiers = store.index.tiers_of([address(n).key for n in ns])
    return next((i for i, t in enumerate(tiers) if not t & Tier.SSD), len(ns))


def assert_lookup(store: SyncStore, ns: list[int], ram: int, ssd: int) -> None:
    r = store.lookup([digest(n) for n in ns], 0)
    assert (r.longest, r.ram, r.ssd) == (ram, ram, ssd)
    assert r.ssd == ssd_truth(store, ns), "Lookup's SSD column is what the index says"


def test_lookup_counts_the_ssd_copies_of_a_chain_all_in_ram(policy_store: Callable[..., SyncStore],
                                                            clock: FakeClock) -> None:
    """A block in RAM and on SSD counts in both columns, whether or not the chain goes past
    RAM; SSD copies dropped later stop counting at once."""
    store = policy_store("write_back")
    chain = [1, 2, 3, 4]
    store.put([item(n) for n in chain])
    assert_lookup(store, chain, ram=4, ssd=0)             # dirty: not written back yet
    assert store.demote() == 4
    assert_lookup(store, chain, ram=4, ssd=4)
    assert_lookup(store, chain + [99], ram=4, ssd=4)      # the chain past RAM: the other path agrees
    store.put([item(5)])
    assert_lookup(store, chain + [5], ram=5, ssd=4)       # block 5 is dirty
    assert store.drop_from_ssd([address(2).key]) == (1, 0, 0)
    assert_lookup(store, chain, ram=4, ssd=1)             # block 2 is in RAM only now
    assert store.write_back_all() == 2                    # blocks 2 and 5 published again
    assert_lookup(store, chain + [5], ram=5, ssd=5)
    clock.advance(8 * 86400.0)                            # past the SSD tier's TTL (7 days)
    assert store.evict_ssd() == 5
    assert_lookup(store, chain + [5], ram=5, ssd=0)       # their RAM copies stay, clean


def test_lookup_follows_capacity_eviction_in_the_ssd_policys_order(policy_store: Callable[..., SyncStore]) -> None:
    store = policy_store("write_back", ssd_policy="s3fifo", ssd_capacity=2 * file_bytes(60 * KIB))
    chain = [1, 2, 3, 4]
    store.put([item(n) for n in chain])
    store.demote()
    assert_lookup(store, chain, ram=4, ssd=4)
    assert store.evict_ssd() == 2                         # over kv.ssd_gib: two SSD copies go
    r = store.lookup([digest(n) for n in chain], 0)
    assert r.ram == 4 and r.ssd == ssd_truth(store, chain) < 4


def test_lookup_forgets_an_ssd_copy_when_its_block_is_deleted(policy_store: Callable[..., SyncStore]) -> None:
    """A block deleted and put again is a new block: with the day's SSD budget spent it stays in
    RAM only, and Lookup must not remember the SSD copy the old one had."""
    store = policy_store("write_back", budget=4 * file_bytes(60 * KIB))
    chain = [1, 2, 3, 4]
    store.put([item(n) for n in chain])
    store.demote()
    assert_lookup(store, chain, ram=4, ssd=4)
    assert store.delete([address(1)]) == (1, 0)
    store.put([item(1)])
    store.demote()                                        # the budget refuses it: RAM only, clean
    assert store.ram.get(address(1).key).clean and store.counters.ssd_budget_declined == 1
    assert_lookup(store, chain, ram=4, ssd=0)


def test_lookup_of_blocks_written_through_or_held_back(policy_store: Callable[..., SyncStore]) -> None:
    through = policy_store("write_through")
    through.put([item(n) for n in (1, 2, 3)])
    assert_lookup(through, [1, 2, 3], ram=3, ssd=3)
    held = policy_store("write_through_selective", threshold=2)
    held.put([item(n) for n in (11, 12)])
    assert_lookup(held, [11, 12], ram=2, ssd=0)           # held in RAM until their second hit


# -- counting what happened on a full disk (issue 20, part 2) ---------------------------------


def test_a_write_that_succeeds_after_a_forced_eviction_is_no_error(make_store: Callable[..., SyncStore],
                                                                   small_fs: Path) -> None:
    store = make_store("write_through", directory=small_fs / "ssd", durability="batch")
    store.ssd.reconciled(0, 0, 0)          # as the boot reconcile does: the tier's size is known
    for n in range(1, 25):                 # 1 MiB holds about 14 files of 64 KiB
        assert store.put([item(n, 60 * KIB)]).stored == 1
    c, sc = store.counters, store.ssd.counters
    assert sc.no_space >= 1, "the disk was met full"
    assert sc.write_errors == 0, "every block was published in the end"
    assert c.ssd_full_disk_evictions >= 1 and c.ssd_evictions_capacity == c.ssd_full_disk_evictions
    assert c.ssd_full_disk_evictions <= 2 * sc.no_space, "each forced eviction freed what one block needs"
    assert store.stats()["ssd_write_errors"] == 0 and store.stats()["ssd_full_disk_evictions"] >= 1
    store.evict_ssd(need_bytes=1 << 30)    # then nothing left to evict, and another file fills the disk
    fill(small_fs)
    with pytest.raises(ResourceExhausted, match="is full") as err:
        store.put([item(30, 60 * KIB)])
    assert "nothing was evicted" in str(err.value) and "nothing was stored" in str(err.value)
    assert sc.write_errors == 0, "refused before any write: the Put failed, no SSD write did"


# -- room: what a full disk may cost the SSD tier (issue 20, part 3) --------------------------


def test_room_refusals() -> None:
    """SsdSpace.refusal: never (bigger than kv.ssd_gib or the filesystem), not now even with
    the tier emptied (something else fills the disk), or an eviction may make room."""
    space = SsdSpace("/ssd", capacity=1 << 20, filesystem=8 << 20, free=4096, tier=60 * KIB)
    assert space.refusal(60 * KIB) is None                # a 64 KiB file: evicting the tier makes room
    full = space.refusal(60 * KIB + 1)                    # a 68 KiB file: more than free + tier
    assert isinstance(full, SsdFull) and "is full" in full.strerror and str(68 * KIB) in full.strerror
    too_large = space.refusal(1 << 20)                    # a file over kv.ssd_gib
    assert isinstance(too_large, SsdTooLarge) and str(1 << 20) in too_large.strerror
    roomy = SsdSpace("/ssd", capacity=1 << 30, filesystem=8 << 20, free=8 << 20, tier=0)
    assert isinstance(roomy.refusal(12 << 20), SsdTooLarge), "bigger than the filesystem"
    assert "filesystem of /ssd 8388608 bytes" in roomy.refusal(12 << 20).strerror


def test_write_through_refuses_a_block_the_tier_can_never_hold(policy_store: Callable[..., SyncStore],
                                                              index: BlockIndex) -> None:
    store = policy_store("write_through", ssd_capacity=48 * KIB)
    store.put([item(1, 8 * KIB), item(2, 8 * KIB)])
    with pytest.raises(ResourceExhausted) as err:
        store.put([item(3, 8 * KIB), item(4, 60 * KIB)])
    text = str(err.value)
    assert "block 1" in text and f"{60 * KIB} bytes" in text and f"kv.ssd_gib is {48 * KIB} bytes" in text
    assert "nothing was stored" in text
    assert index.get(address(3).key) is None and index.get(address(4).key) is None
    assert store.ram.get(address(3).key) is None and store.ssd.blocks == 2, "nothing stored, nothing evicted"
    assert store.counters.ssd_evictions_capacity == 0
    (one, two), _ = store.get([address(1), address(2)])
    assert one.payload == payload(1, 8 * KIB) and two.payload == payload(2, 8 * KIB)


def test_write_back_keeps_a_block_the_tier_can_never_hold_in_ram(policy_store: Callable[..., SyncStore],
                                                                 index: BlockIndex) -> None:
    store = policy_store("write_back", ssd_capacity=48 * KIB)
    store.put([item(1, 8 * KIB)])
    assert store.demote() == 1
    store.put([item(2, 60 * KIB)])
    assert store.demote() == 1, "it leaves the dirty list: no write can ever take it"
    assert store.ssd.counters.write_errors == 1 and store.ssd.blocks == 1
    assert index.get(address(2).key).tiers == Tier.RAM and store.ram.get(address(2).key).clean
    assert store.demote() == 0 and store.ssd.counters.write_errors == 1, "not tried again"
    assert store.counters.ssd_evictions_capacity == 0 and index.get(address(1).key).tiers & Tier.SSD
    (found,), _ = store.get([address(2)])
    assert found.payload == payload(2, 60 * KIB)


def test_forced_eviction_is_bounded_when_evicting_frees_nothing(make_store: Callable[..., SyncStore],
                                                                index: BlockIndex, clock: FakeClock,
                                                                small_fs: Path) -> None:
    """The tier's files are held open elsewhere (unlinking them frees no space) and a foreign
    file fills the rest: a write that meets the full disk evicts at most twice what it needs,
    then fails cleanly; the other blocks stay."""
    store = make_store("write_through", directory=small_fs / "ssd", durability="batch")
    for n in range(1, 11):
        clock.advance(1)                   # oldest first in the SSD queue
        store.put([item(n, 60 * KIB)])
    held = [open(file_of(store, n), "rb") for n in range(1, 11)]
    try:
        fill(small_fs)
        with pytest.raises(ResourceExhausted, match="even after evicting"):
            store.put([item(20, 60 * KIB)])
        need = file_bytes(60 * KIB)
        assert store.counters.ssd_full_disk_evictions == 2, f"evicted 2 x {need} bytes at most"
        on_ssd = [n for n in range(1, 11) if index.get(address(n).key).tiers & Tier.SSD]
        assert on_ssd == list(range(3, 11)), "the two oldest went, the rest stay"
        assert store.ssd.counters.write_errors == 1 and store.ssd.counters.no_space == 1
    finally:
        for f in held:
            f.close()
    assert store.put([item(20, 60 * KIB)]).stored == 1, "the two evicted files' space is free now"
    assert store.counters.ssd_full_disk_evictions == 2
    for n in range(3, 11):                 # one at a time: the test arena holds 4 blocks
        (found,), _ = store.get([address(n)])
        assert found.payload == payload(n, 60 * KIB)
