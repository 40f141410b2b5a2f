"""kvcached.store over a real RAM tier (memfd arena) and a real index (RocksDB), clock by hand."""

from __future__ import annotations

import blake3
import pytest

from kvcached.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier
from kvcached.index.boot import reconcile_at_boot
from kvcached.policies.clock import ClockPolicy
from kvcached.store import Fetched, LookupResult, Pinned, PutItem, Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from kvcached_agent.address import BlockAddress
from kvcached_agent.integrity import payload_checksum
from tests.unit.conftest import KIB, SLAB, FakeClock, SyncStore, address, digest, payload

T0 = 1_000_000.0


def item(n: int, size: int = 4 * KIB, *, model: str = "m", layer: int = 0, checksum: bytes = b"") -> PutItem:
    return PutItem(address(n, layer), payload(n, size), model=model, checksum=checksum)


def stored_keys(store: Store) -> tuple[set[bytes], list[bytes]]:
    """What the RAM tier holds and what the index holds."""
    return {b.key for b in store.ram.blocks()}, [k for k, _ in store.index.scan()]


def assert_nothing_stored(store: Store) -> None:
    assert stored_keys(store) == (set(), [])
    assert store.ram.used_bytes == 0 and store.ram.slabs.reserved_bytes == 0
    assert store.counters.puts == 0


def evict_by_filling(store: Store, start: int = 1000, count: int = 32) -> None:
    """Put enough slab-sized blocks, one batch each, to push every older block out of RAM. Each
    is read twice in the tier after its put, so it is as frequent as anything older: a scan-resistant policy
    (ARC, S3-FIFO) keeps frequent old blocks against one-off new ones, rightly."""
    for n in range(start, start + count):
        store.put([item(n, SLAB)])
        block = store.ram.get(address(n).key)
        store.ram.read(block)                 # the tier's own reads: the store's counters stay as they were
        store.ram.read(block)


# ---------------------------------------------------------------------------------------------
# put and get


def test_put_get_round_trip(store: Store) -> None:
    items = [item(1, 1), item(2, 5000), item(3, SLAB, model="Llama-3 · 8B"), item(4, 100, layer=7)]
    r = store.put(items)
    assert (r.stored, r.present) == (4, 0)
    found, misses = store.get([i.address for i in items])
    assert misses == []
    assert [f.address for f in found] == [i.address for i in items]
    assert [f.payload for f in found] == [bytes(i.payload) for i in items]
    assert [f.checksum for f in found] == [blake3.blake3(i.payload).digest() for i in items]
    rec = store.index.get(items[2].address.key)
    assert rec == BlockRecord(items[2].address.digest, 0, "Llama-3 · 8B", SLAB, found[2].checksum, T0, T0, Tier.RAM)
    assert store.index.get(items[3].address.key).layer == 7
    c = store.counters
    assert (c.puts, c.put_bytes, c.hits, c.misses) == (4, 1 + 5000 + SLAB + 100, 4, 0)
    assert c.hit_bytes == c.put_bytes


def test_same_digest_other_layer_is_another_block(store: Store) -> None:
    store.put([item(1, 100, layer=0)])
    with pytest.raises(NotFound):
        store.get([address(1, 1)])
    store.put([PutItem(address(1, 1), b"other layer")])
    assert store.get([address(1, 1)])[0][0].payload == b"other layer"
    assert store.get([address(1, 0)])[0][0].payload == payload(1, 100)


def test_put_accepts_memoryview(store: Store) -> None:
    data = bytearray(payload(5, 3000))
    store.put([PutItem(address(5), memoryview(data))])
    assert store.get([address(5)])[0][0].payload == bytes(data)


def test_already_present_is_counted(store: Store, clock: FakeClock) -> None:
    store.put([item(1), item(2)])
    clock.advance(5)
    r = store.put([item(2), item(3), item(3)])
    assert (r.stored, r.present) == (1, 2)
    assert store.counters.puts == 3
    assert store.index.get(address(2).key).created == T0, "a present block keeps its record"
    assert len(store.ram) == 3


def test_put_again_after_eviction_stores_again(store: Store, clock: FakeClock) -> None:
    store.put([item(1)])
    evict_by_filling(store)
    assert not store.index.get(address(1).key).present
    clock.advance(10)
    assert store.put([item(1)]).stored == 1
    rec = store.index.get(address(1).key)
    assert rec.present and rec.tiers == Tier.RAM and rec.created == T0 + 10 and rec.gone_reason == GoneReason.NONE
    assert store.get([address(1)])[0][0].payload == payload(1, 4 * KIB)


def test_correct_checksum_is_accepted(store: Store) -> None:
    p = payload(1, 7000)
    assert store.put([PutItem(address(1), p, checksum=blake3.blake3(p).digest())]).stored == 1
    assert store.get([address(1)])[0][0].checksum == blake3.blake3(p).digest()


def test_wrong_checksum_is_data_loss_and_stores_nothing(store: Store) -> None:
    good = item(1)
    bad = item(2, checksum=blake3.blake3(b"something else").digest())
    with pytest.raises(DataLoss, match=f"block 1 \\({address(2)}\\).*checksum.*nothing was stored"):
        store.put([good, bad])
    assert_nothing_stored(store)


@pytest.mark.parametrize("bad, words", [
    (PutItem(address(9), b"x", checksum=b"\x00" * 31), "checksum must be 32 bytes"),
    (PutItem(address(9), b"x", checksum=b"\x00" * 64), "got 64"),
    (PutItem(address(9), b""), "empty payload"),
    (PutItem(address(9), b"x" * (SLAB + 1)), f"over the limit of {SLAB} bytes"),
], ids=["checksum-31", "checksum-64", "empty", "oversize"])
def test_invalid_item_stores_nothing(store: Store, bad: PutItem, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words) as info:
        store.put([item(1), item(2), bad, item(3)])
    assert str(info.value).startswith(f"block 2 ({address(9)}): ")
    assert_nothing_stored(store)


def test_empty_batch(store: Store) -> None:
    r = store.put([])
    assert (r.stored, r.present) == (0, 0)
    assert store.get([]) == ([], [])


def test_get_unknown_block(store: Store) -> None:
    with pytest.raises(NotFound) as info:
        store.get([address(1)])
    assert str(info.value) == f"block {address(1)}: unknown block"
    assert store.counters.misses == 1


def test_get_evicted_block(store: Store) -> None:
    store.put([item(1)])
    evict_by_filling(store)
    with pytest.raises(NotFound, match="evicted") as info:
        store.get([address(1)])
    assert str(info.value).startswith(f"block {address(1)}: evicted")
    rec = store.index.get(address(1).key)
    assert (rec.tiers, rec.gone_reason, rec.gone_at) == (Tier.NONE, GoneReason.EVICTED, T0)


def test_get_names_the_first_miss_and_counts_the_rest(store: Store) -> None:
    store.put([item(2)])
    with pytest.raises(NotFound, match=r"unknown block \(and 2 more of 4\)"):
        store.get([address(1), address(2), address(3), address(4)])
    assert (store.counters.hits, store.counters.misses) == (1, 3)


def test_get_allow_partial(store: Store) -> None:
    store.put([item(1), item(3)])
    evict_by_filling(store, count=8)
    store.put([item(3)])
    store.put([item(5)])
    found, misses = store.get([address(n) for n in (5, 1, 3, 4)], allow_partial=True)
    assert [f.address for f in found] == [address(5), address(3)]
    assert all(isinstance(f, Fetched) for f in found)
    assert [(m.address, m.reason.split(";")[0]) for m in misses] == [(address(1), "evicted"), (address(4), "unknown block")]


def test_get_after_a_restart(store: Store, index: BlockIndex, clock: FakeClock) -> None:
    """RAM-only blocks are lost when the daemon restarts; the index says so."""
    store.put([item(1)])
    clock.advance(30)
    counts = reconcile_at_boot(index, clock(), store.gone_ttl)
    assert counts["lost_at_restart"] == 1
    arena = SharedArena(4 * SLAB)
    try:
        fresh = SyncStore(Store(RamTier(arena, SLAB, ClockPolicy()), index, gone_ttl=store.gone_ttl, clock=clock),
                          store._loop)
        with pytest.raises(NotFound, match="lost at restart") as info:
            fresh.get([address(1)])
        assert "3600 s" in str(info.value)
        assert fresh.lookup([digest(1)], 0).longest == 0
        assert fresh.put([item(1)]).stored == 1
        assert fresh.get([address(1)])[0][0].payload == payload(1, 4 * KIB)
        assert index.get(address(1).key).present
    finally:
        arena.close()


def test_pin_and_unpin(store: Store) -> None:
    store.put([item(1), item(3)])
    (pinned,) = store.pin([address(1)])
    assert isinstance(pinned, Pinned) and pinned.address == address(1)
    assert pinned.block.refs == 1 and pinned.checksum == payload_checksum(payload(1, 4 * KIB))
    assert store.ram.view(pinned.block).tobytes() == payload(1, 4 * KIB)
    store.unpin(pinned)
    assert pinned.block.refs == 0


def test_unpin_many_releases_every_pin_even_past_a_bad_one(store: Store) -> None:
    """An agent's Release gives back its loads in one pass (Store.unpin_many): a pin released
    twice raises, after every other one was released and the held bytes counted down."""
    store.put([item(1), item(2), item(3)])
    pins = [p for p in store.pin([address(1), address(2), address(3)]) if isinstance(p, Pinned)]
    assert store.pinned_bytes == 3 * 4 * KIB
    store.unpin(pins[1])
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin_many(pins)
    assert [p.block.refs for p in pins] == [0, 0, 0] and store.pinned_bytes == 0
    again = [p for p in store.pin([address(1), address(3)]) if isinstance(p, Pinned)]
    store.unpin_many(again)
    assert [p.block.refs for p in again] == [0, 0] and store.pinned_bytes == 0


def test_pin_batch_misses(store: Store) -> None:
    store.put([item(1), item(3)])
    with pytest.raises(NotFound, match=f"block {address(2)}: unknown block"):
        store.pin([address(1), address(2), address(3)])
    assert store.ram.get(address(1).key).refs == 0, "a failed pin holds nothing"
    entries = store.pin([address(1), address(2), address(3)], allow_partial=True)
    assert [type(e).__name__ for e in entries] == ["Pinned", "Miss", "Pinned"]
    assert entries[1].reason == "unknown block"
    for e in (entries[0], entries[2]):
        assert e.block.refs == 1
        store.unpin(e)


def test_batch_that_evicts_its_own_blocks_keeps_the_index_true(store: Store) -> None:
    """A batch bigger than the arena pushes its own first blocks out of RAM: the index must not
    record them as resident in RAM."""
    items = [item(n, SLAB) for n in range(6)]       # the arena holds 4
    assert store.put(items).stored == 6
    assert [it.address.key in store.ram for it in items] == [False, False, True, True, True, True]
    for it in items:
        rec = store.index.get(it.address.key)
        assert rec is not None and rec.present == (it.address.key in store.ram), rec
    with pytest.raises(NotFound, match="evicted"):
        store.get([items[0].address])
    assert [r.digest for r in store.list_blocks(tier="ram")[0]] == sorted(
        (i.address.digest for i in items if i.address.key in store.ram), key=lambda d: address(d[3]).key)


def test_ram_full_of_blocks_in_use_is_resource_exhausted(store: Store) -> None:
    store.put([item(n, SLAB) for n in range(3)])
    store.put([item(10, 4 * KIB)])                  # a 4 KiB slab, 15 slots free
    # every block in use (readers past the store's pin budget: agents will hold blocks too)
    blocks = [store.ram.get(address(n).key) for n in (0, 1, 2, 10)]
    for b in blocks:
        store.ram.pin(b)
    with pytest.raises(ResourceExhausted, match="stored 1 of 2 blocks"):
        store.put([item(11, 4 * KIB), item(12, SLAB)])
    assert store.get([address(11)])[0][0].payload == payload(11, 4 * KIB)
    assert store.index.get(address(11).key).present, "the block stored before the failure is indexed"
    assert store.index.get(address(12).key) is None and address(12).key not in store.ram
    for b in blocks:
        store.ram.unpin(b)
    assert store.put([item(12, SLAB)]).stored == 1


def test_readers_may_pin_at_most_half_the_tier(store: Store) -> None:
    store.put([item(n, SLAB) for n in range(4)])
    held = store.pin([address(0), address(1)])       # half the arena: allowed
    assert store.pinned_bytes == 2 * SLAB == store.max_pinned_bytes
    with pytest.raises(ResourceExhausted, match="over half the RAM tier"):
        store.pin([address(2)])
    assert store.ram.get(address(2).key).refs == 0, "a refused pin holds nothing"
    assert store.put([item(9, SLAB)]).stored == 1, "puts still find room"
    for p in held:
        store.unpin(p)
    assert store.pinned_bytes == 0
    (p,) = store.pin([address(9)])
    assert store.read(p, 10, 20) == payload(9, SLAB)[10:30] and store.read(p, SLAB - 4, 100) == payload(9, SLAB)[-4:]
    store.unpin(p)


def test_index_write_failure_keeps_nothing_unindexed(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the index cannot record a batch, its blocks leave RAM: nothing unindexed is served."""
    store.put([item(1)])

    def broken(*args: object, **kw: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.index, "write", broken)
    with pytest.raises(Unavailable, match="none of the 2 new blocks"):
        store.put([item(2), item(3), item(1)])
    monkeypatch.undo()
    assert address(2).key not in store.ram and address(3).key not in store.ram
    assert store.get([address(1)])[0][0].payload == payload(1, 4 * KIB), "blocks stored before are untouched"
    assert store.lookup([address(2).digest], 0).longest == 0


def test_resident_block_without_record_is_a_miss_not_a_crash(store: Store) -> None:
    store.put([item(1), item(2)])
    store.index.write(deletes=[address(1).key])         # as after a lost index write
    found, misses = store.get([address(1), address(2)], allow_partial=True)
    assert [f.address for f in found] == [address(2)]
    assert "index record is missing" in misses[0].reason and address(1).key not in store.ram


# ---------------------------------------------------------------------------------------------
# lookup


def test_lookup_longest_prefix(store: Store) -> None:
    store.put([item(n) for n in (0, 1, 2, 4, 5)])
    d = [digest(n) for n in range(6)]
    assert store.lookup(d, 0) == LookupResult(longest=3, ram=3, ssd=0, gpu=0, peer=0)
    assert store.lookup(d[:2], 0).longest == 2
    assert store.lookup([digest(3)] + d, 0).longest == 0, "a first miss: nothing counts"
    assert store.lookup(d[4:], 0).longest == 2
    assert store.lookup(d, 1).longest == 0, "other layer"
    assert store.lookup([], 0).longest == 0
    assert store.counters.lookups == 6


def test_lookup_after_eviction(store: Store) -> None:
    store.put([item(n) for n in range(3)])
    assert store.lookup([digest(n) for n in range(3)], 0).ram == 3
    evict_by_filling(store)
    assert store.lookup([digest(n) for n in range(3)], 0).ram == 0


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33], ids=["0", "31", "33"])
def test_lookup_bad_digest_length(store: Store, bad: bytes) -> None:
    store.put([item(0)])
    with pytest.raises(InvalidArgument, match=f"digests\\[1\\] is {len(bad)} bytes"):
        store.lookup([digest(0), bad, digest(1)], 0)
    with pytest.raises(InvalidArgument):
        store.lookup([digest(7), bad], 0)            # checked even after a miss


# ---------------------------------------------------------------------------------------------
# delete


def test_delete(store: Store) -> None:
    store.put([item(1), item(2)])
    assert store.delete([address(1), address(3)]) == (1, 1)
    assert address(1).key not in store.ram and store.index.get(address(1).key) is None
    with pytest.raises(NotFound, match="unknown block"):
        store.get([address(1)])
    assert store.get([address(2)])[0]
    assert store.delete([]) == (0, 0)
    assert store.counters.deletes == 1
    assert store.ram.used_bytes == 4 * KIB


def test_delete_of_an_evicted_block_forgets_its_tombstone(store: Store) -> None:
    store.put([item(1)])
    evict_by_filling(store)
    assert store.delete([address(1)]) == (0, 1)
    assert store.index.get(address(1).key) is None


@pytest.mark.parametrize("how", ["pinned", "writing"])
def test_delete_of_a_busy_block_deletes_nothing(store: Store, how: str) -> None:
    store.put([item(1), item(3)])
    if how == "pinned":
        store.put([item(2)])
        store.pin([address(2)])
        words = "1 readers"
    else:
        store.ram.reserve(address(2).key, 100)   # a write in flight (as the agent path does)
        words = "being written"
    with pytest.raises(FailedPrecondition, match=f"block {address(2)} is in use \\({words}\\); nothing was deleted"):
        store.delete([address(1), address(2), address(3)])
    assert {address(1).key, address(3).key} <= stored_keys(store)[0]
    assert address(1).key in stored_keys(store)[1] and address(3).key in stored_keys(store)[1]
    assert store.counters.deletes == 0


def test_delete_of_the_same_block_twice_in_one_call(store: Store) -> None:
    store.put([item(1)])
    deleted, _ = store.delete([address(1), address(1)])
    assert deleted == 1 and store.counters.deletes == 1


# ---------------------------------------------------------------------------------------------
# listing


def _fill_for_listing(store: Store) -> tuple[set[bytes], set[bytes]]:
    """12 blocks of models a/b; the first 6 evicted (tombstones). Returns (resident, gone) keys."""
    store.put([item(n, model="ab"[n % 2]) for n in range(6)])
    evict_by_filling(store, start=100, count=4)      # model "m", the last 4 stay
    store.put([item(n, model="ab"[n % 2]) for n in range(6, 12)])
    index_keys = [k for k, _ in store.index.scan()]
    resident = {k for k in index_keys if k in store.ram}
    gone = set(index_keys) - resident
    assert len(index_keys) == 16 and gone
    return resident, gone


def _list_all(store: Store, **kw: object) -> tuple[list[BlockRecord], int]:
    out: list[BlockRecord] = []
    token = b""
    pages = 0
    while True:
        page, token = store.list_blocks(page_token=token, **kw)  # type: ignore[arg-type]
        out.extend(page)
        pages += 1
        assert pages < 100
        if not token:
            return out, pages
        assert len(token) == 32


def _key_of(r: BlockRecord) -> bytes:
    return BlockAddress(r.digest, r.layer).key


@pytest.mark.parametrize("tier", ["", "ram", "gone", "ssd"])
def test_list_blocks_pages_cover_everything_once(store: Store, tier: str) -> None:
    _fill_for_listing(store)
    everything = [r for _, r in store.index.scan()]
    for model in ("", "a", "b", "m", "nope"):
        want = [r for r in everything
                if (not model or r.model == model)
                and (tier == "" or (tier == "ram" and Tier.RAM in r.tiers) or (tier == "gone" and not r.present))]
        for page_size, max_scan in [(1, 100_000), (3, 100_000), (5, 2), (16, 100_000), (1000, 100_000)]:
            got, pages = _list_all(store, model=model, tier=tier, page_size=page_size, max_scan=max_scan)
            case = (model, page_size, max_scan)
            assert got == want, case
            assert len({_key_of(r) for r in got}) == len(got), case
            if page_size < len(want):
                assert pages > 1, case


def test_list_blocks_tier_filters_match_ram(store: Store) -> None:
    resident, gone = _fill_for_listing(store)
    ram, _ = _list_all(store, tier="ram")
    assert {_key_of(r) for r in ram} == resident
    tomb, _ = _list_all(store, tier="gone")
    assert {_key_of(r) for r in tomb} == gone
    assert all(r.gone_reason == GoneReason.EVICTED for r in tomb)
    assert _list_all(store, tier="ssd")[0] == []


def test_list_blocks_empty_index(store: Store) -> None:
    assert store.list_blocks() == ([], b"")


def test_list_blocks_page_size_bounds(store: Store) -> None:
    store.put([item(n) for n in range(5)])
    assert len(store.list_blocks(page_size=0)[0]) == 5      # 0: the default
    page, token = store.list_blocks(page_size=-3)             # at least one
    assert len(page) == 1 and token


@pytest.mark.parametrize("token", [b"x", b"\x00" * 31, b"\x00" * 33], ids=["1", "31", "33"])
def test_list_blocks_bad_page_token(store: Store, token: bytes) -> None:
    with pytest.raises(InvalidArgument, match="page_token"):
        store.list_blocks(page_token=token)


@pytest.mark.parametrize("tier", ["RAM", "disk", "gpu", " "])
def test_list_blocks_bad_tier(store: Store, tier: str) -> None:
    with pytest.raises(InvalidArgument, match="tier must be one of ram, ssd, gone or empty"):
        store.list_blocks(tier=tier)


# ---------------------------------------------------------------------------------------------
# maintenance and stats


def test_flush_last_seen(store: Store, clock: FakeClock) -> None:
    store.put([item(n) for n in range(4)])
    assert store.flush_last_seen() == 0
    clock.advance(60)
    store.get([address(0)])
    store.put([item(1)])                              # present: a use too
    store.pin([address(2)])
    assert store.flush_last_seen() == 3
    seen = {n: store.index.get(address(n).key) for n in range(4)}
    assert [seen[n].last_seen for n in range(4)] == [T0 + 60] * 3 + [T0]
    assert all(r.created == T0 for r in seen.values())
    assert store.flush_last_seen() == 0, "nothing used since"


def test_flush_last_seen_skips_gone_and_deleted_blocks(store: Store, clock: FakeClock) -> None:
    store.put([item(1), item(2)])
    store.get([address(1), address(2)])
    store.delete([address(2)])
    evict_by_filling(store)
    clock.advance(5)
    assert store.flush_last_seen() == 0
    assert store.index.get(address(2).key) is None
    rec = store.index.get(address(1).key)
    assert not rec.present and rec.last_seen == T0


def test_eviction_tombstone_uses_the_clock(store: Store, clock: FakeClock) -> None:
    store.put([item(1)])
    clock.advance(123)
    evict_by_filling(store)
    rec = store.index.get(address(1).key)
    assert (rec.gone_reason, rec.gone_at, rec.created) == (GoneReason.EVICTED, T0 + 123, T0)


def test_stats(store: Store) -> None:
    s = store.stats()
    assert s["ram_blocks"] == 0 and s["ram_capacity_bytes"] == store.ram.capacity == 4 * SLAB
    store.put([item(1, 5000), item(2, SLAB)])
    store.get([address(1)])
    store.get([address(1), address(7)], allow_partial=True)
    store.lookup([digest(1)], 0)
    store.delete([address(2)])
    s = store.stats()
    assert s["ram_blocks"] == 1
    assert s["ram_bytes"] == 5000
    assert s["ram_reserved_bytes"] == 8 * KIB
    assert s["ram_evictions"] == 0
    assert (s["puts"], s["put_bytes"]) == (2, 5000 + SLAB)
    assert (s["hits"], s["misses"], s["hit_bytes"]) == (2, 1, 10000)
    assert (s["lookups"], s["deletes"]) == (1, 1)
    assert s["index_entries"] >= 0
    evict_by_filling(store, count=5)
    assert store.stats()["ram_evictions"] == 2
    assert store.stats()["ram_blocks"] == 4


def test_payload_checksum_is_blake3_at_every_size() -> None:
    for size in (1, 1000, (1 << 20) - 1, 1 << 20, 3 << 20):
        p = payload(size, size)
        assert payload_checksum(p) == blake3.blake3(p).digest()
        assert payload_checksum(memoryview(p)) == blake3.blake3(p).digest()


def test_the_ledger_takes_what_the_ram_tier_evicted(store: Store) -> None:
    """The RAM tier calls nothing above it: its evictions wait in its outbox, and the request
    that caused them takes them into the index at its commit."""
    store.put([item(1)])
    evict_by_filling(store)
    assert store.ram.take_evicted() == [], "taken by the ledger before the request ended"
    assert store.index.get(address(1).key).gone_reason == GoneReason.EVICTED


def test_re_put_of_present_blocks_skips_hashing_and_copying(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.put([item(1), item(2)])
    hashed: list[int] = []
    hasher = store.writer.hasher
    real = hasher.checksums
    monkeypatch.setattr(hasher, "checksums", lambda ps: hashed.append(len(ps)) or real(ps))
    r = store.put([item(1), item(3), item(2)])
    assert (r.stored, r.present) == (1, 2) and hashed == [1]
