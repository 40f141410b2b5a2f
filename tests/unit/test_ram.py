"""kvcached.tiers.ram (with the real memfd arena): states, round trips, eviction in budget."""

from __future__ import annotations

import os
import random

import pytest

from kvcached.policies.arc import ArcPolicy
from kvcached.policies.clock import ClockPolicy
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import WRITING, BlockBusy, RamBlock, RamFull, RamTier
from tests.unit.conftest import ARENA, KIB, SLAB, EvictionLog, payload


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def put(ram: RamTier, n: int, size: int = SLAB) -> RamBlock:
    block = ram.reserve(key(n), size)
    ram.write(block, payload(n, size))
    ram.commit(block)
    return block


def assert_within_budget(ram: RamTier) -> None:
    assert ram.used_bytes <= ram.slabs.reserved_bytes <= ram.capacity
    assert ram.used_bytes == sum(b.length for b in ram.blocks())
    assert ram.slabs.used_slots == len(ram)


def assert_bytes_intact(ram: RamTier) -> None:
    for block in ram.blocks():
        if block.refs != WRITING:
            n = int.from_bytes(block.key, "big")
            assert ram.read(block) == payload(n, block.length), f"block {n} damaged"


# ---------------------------------------------------------------------------------------------
# arena


def test_arena_is_a_sealed_memfd_shared_with_other_mappings() -> None:
    import fcntl
    import mmap

    arena = SharedArena(1 << 20)
    try:
        seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(OSError):
            os.ftruncate(arena.fd, 4096)
        arena.write(8192, b"hello")
        other = mmap.mmap(arena.fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ)   # as an agent maps it
        try:
            assert other[8192:8197] == b"hello"
        finally:
            other.close()
        assert arena.read(8192, 5) == b"hello"
    finally:
        arena.close()
    with pytest.raises(ValueError):
        SharedArena(0)


# ---------------------------------------------------------------------------------------------
# write path and states


def test_round_trip_bit_exact() -> None:
    arena = SharedArena(2 * ARENA)
    try:
        ram = RamTier(arena, SLAB, ClockPolicy())
        sizes = [1, 4095, 4096, 4097, 12345, SLAB - 1, SLAB]     # 5 classes, 6 slabs: no eviction
        blocks = [put(ram, i, size) for i, size in enumerate(sizes)]
        for i, (block, size) in enumerate(zip(blocks, sizes)):
            got = ram.get(key(i))
            assert got == block and got.length == size and got.refs == 0
            assert ram.slabs.offset(got.slot) % 4096 == 0
            assert ram.read(got) == payload(i, size)
            assert arena.read(ram.slabs.offset(got.slot), size) == payload(i, size) == ram.view(got).tobytes()
        assert ram.used_bytes == sum(sizes) and ram.evictions == 0
        assert_within_budget(ram)
    finally:
        arena.close()


def test_write_accepts_a_memoryview(ram: RamTier) -> None:
    data = bytearray(payload(1, 5000))
    block = ram.reserve(key(1), len(data))
    ram.write(block, memoryview(data))
    ram.commit(block)
    assert ram.read(block) == bytes(data)


def test_writing_block_is_invisible_and_not_evictable(ram: RamTier) -> None:
    writing = ram.reserve(key(0), SLAB)
    assert writing.refs == WRITING
    assert ram.get(key(0)) is None and key(0) not in ram
    assert len(ram) == 1 and ram.used_bytes == SLAB
    assert ram.busy_reason(key(0)) == "being written"
    for n in range(1, 4):
        put(ram, n)
    # Arena full: the next reserve must evict a committed block, never the one being written.
    put(ram, 4)
    assert key(1) not in ram and ram.get(key(4)) is not None
    with pytest.raises(BlockBusy):
        ram.pin(writing)
    for n in range(5, 12):
        put(ram, n)
    assert ram.holds(writing), "the WRITING block survived a stream of evictions"
    ram.write(writing, payload(0, SLAB))
    ram.commit(writing)
    assert ram.get(key(0)) == writing and ram.read(writing) == payload(0, SLAB)


def test_write_and_commit_checks(ram: RamTier) -> None:
    block = ram.reserve(key(1), 100)
    with pytest.raises(ValueError):
        ram.write(block, b"x" * 99)
    ram.write(block, b"x" * 100)
    ram.commit(block)
    with pytest.raises(ValueError):
        ram.commit(block)
    with pytest.raises(ValueError):
        ram.write(block, b"y" * 100)
    with pytest.raises(ValueError):
        ram.abort(block)
    assert ram.read(block) == b"x" * 100


def test_reserve_rejects_bad_sizes_and_duplicates(ram: RamTier) -> None:
    put(ram, 1, 100)
    with pytest.raises(ValueError, match="already present"):
        ram.reserve(key(1), 100)
    ram.reserve(key(2), 100)
    with pytest.raises(ValueError, match="already present"):
        ram.reserve(key(2), 100)        # still being written
    for size in (0, SLAB + 1):
        with pytest.raises(ValueError):
            ram.reserve(key(3), size)
    assert len(ram) == 2 and ram.used_bytes == 200


def test_abort_frees_the_slot(ram: RamTier) -> None:
    blocks = [ram.reserve(key(n), SLAB) for n in range(4)]
    assert ram.slabs.free_slabs == 0
    ram.abort(blocks[2])
    assert len(ram) == 3 and ram.used_bytes == 3 * SLAB and ram.slabs.free_slabs == 1
    assert ram.busy_reason(key(2)) is None and ram.get(key(2)) is None
    again = ram.reserve(key(2), SLAB)
    assert again.slot == blocks[2].slot
    assert_within_budget(ram)


# ---------------------------------------------------------------------------------------------
# readers and removal


def test_pin_unpin(ram: RamTier) -> None:
    block = put(ram, 1)
    ram.pin(block)
    ram.pin(block)
    assert block.refs == 2 and ram.busy_reason(key(1)) == "2 readers"
    with pytest.raises(BlockBusy, match="2 readers"):
        ram.delete(key(1))
    ram.unpin(block)
    ram.unpin(block)
    with pytest.raises(ValueError):
        ram.unpin(block)
    assert ram.busy_reason(key(1)) is None
    assert ram.delete(key(1)) is True
    assert ram.delete(key(1)) is False
    assert len(ram) == 0 and ram.used_bytes == 0 and ram.slabs.reserved_bytes == 0


def test_a_hold_is_not_a_use(arena: SharedArena) -> None:
    """The daemon's own holds (a new block until it is recorded, a block being written to SSD)
    do not tell the policy: a block saved once is still in ARC's T1; a reader's pin moves it."""
    ram = RamTier(arena, SLAB, ArcPolicy())
    block = put(ram, 1)
    assert ram.hold(block) and block.refs == 1
    ram.unpin(block)
    policy = ram.policy
    assert isinstance(policy, ArcPolicy) and block.id in policy.t1
    ram.pin(block)
    assert block.id in policy.t2 and block.refs == 1
    ram.unpin(block)
    ram.delete(key(1))
    assert not ram.hold(block), "a block that left the tier is not held"


def test_delete_of_a_writing_block_raises(ram: RamTier) -> None:
    ram.reserve(key(1), 10)
    with pytest.raises(BlockBusy, match="being written"):
        ram.delete(key(1))
    assert len(ram) == 1


def test_pinned_block_is_not_evicted(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    pinned = put(ram, 0)
    ram.pin(pinned)
    for n in range(1, 20):
        put(ram, n)
    assert ram.get(key(0)) == pinned and ram.read(pinned) == payload(0, SLAB)
    assert all(b.key != key(0) for batch in evicted for b in batch)
    ram.unpin(pinned)                       # (the read above gave it a second chance)
    for n in range(20, 80):                 # blocks as used as it: any policy gets to it in time
        ram.read(put(ram, n))
        ram.read(ram.get(key(n)))
        if key(0) not in ram:
            break
    assert key(0) not in ram, "idle again: evictable"


def test_a_batch_drop_is_all_or_nothing(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    """vLLM's BlockStatus rules: a batch that holds one block in use or being written drops
    nothing; the policy keeps every block of it."""
    blocks = [put(ram, n, 4096) for n in range(3)]
    writing = ram.reserve(key(9), 4096)
    ram.pin(blocks[1])
    for batch in ([blocks[0], blocks[1], blocks[2]], [blocks[0], writing]):
        with pytest.raises(BlockBusy):
            ram.drop(batch)
        assert all(b.key in ram for b in blocks) and len(ram.policy) == 3 and evicted == []
    ram.unpin(blocks[1])
    ram.drop(blocks)
    assert len(ram) == 1 and len(ram.policy) == 0 and ram.dropped == 3


def test_touched_block_survives_a_round(ram: RamTier) -> None:
    for n in range(4):
        put(ram, n)
    ram.read(ram.get(key(0)))             # a hit: second chance
    put(ram, 4)
    assert key(0) in ram and key(1) not in ram


# ---------------------------------------------------------------------------------------------
# eviction


def test_eviction_stream_stays_in_budget(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    total = 0
    for n in range(64):
        put(ram, n, SLAB)
        total += SLAB
        assert_within_budget(ram)
    assert total == 16 * ram.capacity
    assert len(ram) == 4 and ram.evictions == 60
    assert [b.key for batch in evicted for b in batch] == [key(n) for n in range(60)], "CLOCK: oldest first"
    assert all(len(batch) == 1 for batch in evicted)
    assert_bytes_intact(ram)


def test_evicted_blocks_wait_in_the_outbox(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    first = [put(ram, n) for n in range(4)]
    put(ram, 4)
    assert evicted == [[first[0]]]
    assert evicted[0][0].length == SLAB and evicted[0][0].key == key(0)


def test_same_class_eviction_frees_one_slot(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    for n in range(4 * 16):                  # every slab full of 4 KiB blocks
        put(ram, n, 4 * KIB)
    assert ram.slabs.free_slabs == 0
    put(ram, 100, 4 * KIB)
    assert [len(batch) for batch in evicted] == [1]
    assert len(ram) == 64


def test_cross_class_reclaim_empties_a_whole_slab(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    for n in range(4 * 16):
        put(ram, n, 4 * KIB)
    put(ram, 100, SLAB)                      # needs a whole slab: the oldest block's slab goes
    assert [len(batch) for batch in evicted] == [16]
    assert {b.key for b in evicted[0]} == {key(n) for n in range(16)}
    assert ram.get(key(100)) is not None and len(ram) == 49
    assert_within_budget(ram)
    assert_bytes_intact(ram)


def test_cross_class_reclaim_skips_a_slab_with_a_pinned_block(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    for n in range(4 * 16):
        put(ram, n, 4 * KIB)
    ram.pin(ram.get(key(5)))                 # slab of the oldest blocks is held by a reader
    put(ram, 100, SLAB)
    gone = {b.key for b in evicted[0]}
    assert key(5) not in gone and key(5) in ram
    assert gone == {key(n) for n in range(16, 32)}


def test_mixed_sizes_stay_in_budget_and_intact(arena: SharedArena) -> None:
    """Random sizes 1 KiB..slab force slabs to change class again and again."""
    ram = RamTier(arena, SLAB, ClockPolicy())
    log = EvictionLog(ram)
    rng = random.Random(1)
    pinned: list[RamBlock] = []
    for n in range(400):
        size = rng.choice([KIB, 3 * KIB, 4 * KIB, 5 * KIB, 16 * KIB, 20 * KIB, 33 * KIB, SLAB - 1, SLAB])
        try:
            block = put(ram, n, size)
        except RamFull:
            assert pinned, "RamFull with nothing pinned"
            for p in pinned:
                ram.unpin(p)
            pinned.clear()
            block = put(ram, n, size)
        assert_within_budget(ram)
        if rng.random() < 0.1 and len(pinned) < 2:
            ram.pin(block)
            pinned.append(block)
        if rng.random() < 0.3:
            ram.read(ram.get(key(rng.choice([n, n - 1]))) or block)
        for p in pinned:
            assert ram.get(p.key) == p, "a pinned block was evicted"
    evicted = log.flat()
    assert ram.evictions == len(evicted) > 0
    assert len({b.key for b in evicted}) == len(evicted)
    assert not any(b.key in ram for b in evicted)
    assert_bytes_intact(ram)


def test_all_pinned_raises_ram_full_and_evicts_nothing(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    blocks = [put(ram, n, 16 * KIB) for n in range(16)]   # 4 slabs of the 16 KiB class
    for b in blocks:
        ram.pin(b)
    before = sorted(b.key for b in ram.blocks())
    for size in (16 * KIB, SLAB, 4 * KIB):
        with pytest.raises(RamFull, match="16 blocks"):
            ram.reserve(key(99), size)
        assert sorted(b.key for b in ram.blocks()) == before
        assert evicted == [] and ram.evictions == 0
        assert key(99) not in ram.keys()
    assert_within_budget(ram)
    ram.unpin(blocks[3])
    put(ram, 99, 16 * KIB)
    assert key(3) not in ram and [[b.key for b in batch] for batch in evicted] == [[key(3)]]


def test_all_writing_raises_ram_full(ram: RamTier) -> None:
    for n in range(4):
        ram.reserve(key(n), SLAB)
    with pytest.raises(RamFull):
        ram.reserve(key(9), 1)
    assert len(ram) == 4


def test_cross_class_needs_whole_idle_slab(ram: RamTier, evicted: list[list[RamBlock]]) -> None:
    """Each slab holds one pinned small block: no slab can change class, so a big block does not fit,
    and nothing is evicted, although idle small blocks sit in every slab."""
    for n in range(4 * 16):
        put(ram, n, 4 * KIB)
    for n in (0, 16, 32, 48):
        ram.pin(ram.get(key(n)))
    with pytest.raises(RamFull):
        ram.reserve(key(100), SLAB)
    assert evicted == [] and len(ram) == 64
    put(ram, 101, 4 * KIB)                   # the small class can still evict one of its own
    assert len(evicted) == 1 and evicted[0][0].key not in {key(0), key(16), key(32), key(48)}


def test_dirty_list_keeps_dirty_blocks_oldest_first_and_forgets_the_rest(ram: RamTier) -> None:
    """Blocks cleaned, deleted or dirtied again never show twice; a block dirtied again is the
    youngest dirty block; the count and the bytes follow every change."""
    blocks = [put(ram, n, 4 * KIB) for n in range(6)]
    assert list(ram.dirty) == [key(n) for n in range(6)] and len(ram.dirty) == 6
    ram.mark_clean(blocks[0])
    ram.mark_clean(blocks[3])
    ram.delete(key(1))
    assert list(ram.dirty) == [key(2), key(4), key(5)] and ram.dirty_bytes == 3 * 4 * KIB
    ram.mark_dirty(blocks[3])                         # its SSD copy was lost: dirty again, once
    ram.mark_dirty(blocks[3])
    assert list(ram.dirty) == [key(2), key(4), key(5), key(3)] and len(ram.dirty) == 4
    put(ram, 1, 4 * KIB)                               # the same key again: a new block, at the end
    assert list(ram.dirty)[-1] == key(1) and len(ram.dirty) == 5
    for block in list(ram.blocks()):
        ram.mark_clean(block)
    assert not ram.dirty and list(ram.dirty) == [] and ram.dirty_bytes == 0


def test_dirty_list_stays_bounded_when_blocks_are_cleaned_out_of_order(arena: SharedArena) -> None:
    """A dirty block at the front that never gets written does not let the entries of blocks
    cleaned behind it pile up: the list holds live blocks only, in columns as long as the
    most records ever held at once."""
    ram = RamTier(arena, SLAB, ClockPolicy())
    stuck = put(ram, 0, 4 * KIB)
    for n in range(1, 20_000):
        block = put(ram, n, 4 * KIB)
        ram.mark_clean(block)
        ram.delete(block.key)
    assert list(ram.dirty) == [stuck.key]
    assert len(ram.dirty.queue) == 1 and len(ram.dirty.queue.links.where) <= 1025


def test_a_handle_of_a_block_that_left_reads_as_gone(ram: RamTier) -> None:
    """Handles are made on demand: two of one block are equal, and once the block leaves (its
    record may then serve another block) a handle is no longer held, reads as idle and dirty,
    keeps its key and length, and pins nothing."""
    block = put(ram, 1, 4 * KIB)
    again = ram.get(key(1))
    assert again == block and again is not block and hash(again) == hash(block)
    ram.pin(block)
    assert again.refs == 1 and ram.busy_reason(key(1)) == "1 readers"
    ram.unpin(again)
    ram.mark_clean(block)
    assert again.clean
    ram.delete(key(1))
    successor = put(ram, 2, 4 * KIB)             # takes the freed record
    assert successor.id == block.id and successor != block
    assert not ram.holds(block) and block.refs == 0 and not block.clean and block.hits_to_ssd == 0
    assert (block.key, block.length) == (key(1), 4 * KIB)
    ram.pin(block)
    ram.unpin(block)
    ram.mark_clean(block)
    assert successor.refs == 0 and not successor.clean, "the stale handle changed nothing"
    with pytest.raises(ValueError):
        ram.commit(block)
