"""kvcached.tiers.slabs: size classes and the slab allocator (pure bookkeeping, no bytes)."""

from __future__ import annotations

import random

import pytest

from kvcached.tiers.slabs import PAGE, SlabAllocator, size_classes

KIB = 1 << 10
MIB = 1 << 20


def roundup(n: int) -> int:
    return -(-n // PAGE) * PAGE


# ---------------------------------------------------------------------------------------------
# size classes


@pytest.mark.parametrize("top", [PAGE, 64 * KIB, 1 * MIB, 16 * MIB, 10 * MIB, 9 * MIB + 1, 5000, 1])
def test_size_classes_shape(top: int) -> None:
    classes = size_classes(top)
    assert classes == sorted(set(classes)), "sorted, no duplicates"
    assert classes[0] == PAGE
    assert classes[-1] == roundup(top)
    assert all(c % PAGE == 0 for c in classes)


@pytest.mark.parametrize("top", [64 * KIB, 1 * MIB, 16 * MIB])
def test_every_power_of_two_is_a_class(top: int) -> None:
    classes = set(size_classes(top))
    p = PAGE
    while p <= top:
        assert p in classes, p
        p *= 2


def _class_for(classes: list[int], n: int) -> int:
    return next(c for c in classes if c >= n)


@pytest.mark.parametrize("top", [64 * KIB, 16 * MIB, 10 * MIB + 12345])
def test_waste_bound(top: int) -> None:
    """From 16 KiB up a block's slot is less than 1.25x its size (quarter steps); below that the
    4 KiB granularity rules: the slot is the size rounded up to 4 KiB (waste < 4 KiB)."""
    classes = size_classes(top)
    rng = random.Random(top)
    sizes = {PAGE, top} | {c + d for c in classes for d in (-1, 0, 1)} | {rng.randint(PAGE, top) for _ in range(2000)}
    for n in sorted(s for s in sizes if PAGE <= s <= top):
        slot = _class_for(classes, n)
        if n >= 16 * KIB:
            assert slot < 1.25 * n, (n, slot)
        else:
            assert slot == roundup(n), (n, slot)


def test_waste_bound_does_not_hold_below_16_kib() -> None:
    """The module docstring promises at most a fifth of a slot wasted; with 4 KiB slots that is
    impossible for blocks just over 4, 8 or 12 KiB (documented here, not a code bug)."""
    classes = size_classes(1 * MIB)
    assert _class_for(classes, 4 * KIB + 1) == 8 * KIB
    assert _class_for(classes, 12 * KIB + 1) == 16 * KIB


def test_class_for() -> None:
    a = SlabAllocator(4 * 64 * KIB, 64 * KIB)
    assert a.classes[a.class_for(1)] == PAGE
    assert a.classes[a.class_for(PAGE)] == PAGE
    assert a.classes[a.class_for(PAGE + 1)] == 2 * PAGE
    assert a.classes[a.class_for(64 * KIB)] == 64 * KIB
    for bad in (0, -1, 64 * KIB + 1):
        with pytest.raises(ValueError):
            a.class_for(bad)


# ---------------------------------------------------------------------------------------------
# allocator


def test_geometry() -> None:
    a = SlabAllocator(10 * 64 * KIB + 5, 64 * KIB)
    assert a.nslabs == 10 and a.capacity == 10 * 64 * KIB and a.slab_bytes == 64 * KIB
    assert a.free_slabs == 10 and a.used_slots == 0 and a.reserved_bytes == 0
    odd = SlabAllocator(1 * MIB, 60 * KIB + 1)
    assert odd.slab_bytes == 64 * KIB and odd.nslabs == 16
    with pytest.raises(ValueError, match="holds no slab"):
        SlabAllocator(64 * KIB - 1, 64 * KIB)


def test_allocate_until_full() -> None:
    a = SlabAllocator(4 * 64 * KIB, 64 * KIB)
    cls = a.class_for(PAGE)
    slots = []
    while (slot := a.allocate(cls)) is not None:
        slots.append(slot)
    assert len(slots) == 4 * 16 == len(set(slots))
    assert a.free_slabs == 0 and a.used_slots == 64 and a.reserved_bytes == a.capacity
    assert a.allocate(cls) is None
    assert a.allocate(a.class_for(64 * KIB)) is None, "another class finds no free slab either"
    a.free(slots[10])
    assert a.allocate(a.class_for(64 * KIB)) is None, "one free 4 KiB slot is no slab"
    assert a.allocate(cls) == slots[10], "the freed slot is handed out again"
    assert a.allocate(cls) is None


def test_empty_slab_returns_to_the_pool_and_serves_another_class() -> None:
    a = SlabAllocator(2 * 64 * KIB, 64 * KIB)
    small, big = a.class_for(16 * KIB), a.class_for(64 * KIB)
    smalls = [a.allocate(small) for _ in range(8)]      # two slabs of four 16 KiB slots
    assert None not in smalls and a.free_slabs == 0
    assert a.allocate(big) is None
    first_slab = [s for s in smalls if a.slab_of(s) == a.slab_of(smalls[0])]
    assert len(first_slab) == 4
    for s in first_slab[:-1]:
        a.free(s)
        assert a.free_slabs == 0, "a slab with a slot in use stays in its class"
    a.free(first_slab[-1])
    assert a.free_slabs == 1
    assert a.class_of_slab(a.slab_of(smalls[0])) == -1
    slot = a.allocate(big)
    assert slot is not None and a.slab_of(slot) == a.slab_of(smalls[0])
    assert a.class_of_slab(a.slab_of(slot)) == big and a.slot_size(slot) == 64 * KIB
    assert a.reserved_bytes == 4 * 16 * KIB + 64 * KIB


def test_partial_slab_is_used_before_a_free_one() -> None:
    a = SlabAllocator(4 * 64 * KIB, 64 * KIB)
    cls = a.class_for(16 * KIB)
    s1 = a.allocate(cls)
    assert a.free_slabs == 3
    s2 = a.allocate(cls)
    assert a.free_slabs == 3 and a.slab_of(s1) == a.slab_of(s2)


def test_double_free_raises() -> None:
    a = SlabAllocator(2 * 64 * KIB, 64 * KIB)
    cls = a.class_for(PAGE)
    s1, s2 = a.allocate(cls), a.allocate(cls)
    a.free(s1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s1)
    a.free(s2)      # the slab is now free
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s2)
    assert a.used_slots == 0 and a.reserved_bytes == 0 and a.free_slabs == 2


def test_free_of_a_never_allocated_slot_raises() -> None:
    a = SlabAllocator(2 * 64 * KIB, 64 * KIB)
    a.allocate(a.class_for(32 * KIB))          # 2 slots in slab 0
    with pytest.raises(ValueError):
        a.free(1)                              # slot index 1 exists, is free
    with pytest.raises(ValueError):
        a.free(5)                              # beyond the slab's 2 slots
    with pytest.raises(ValueError):
        a.free(a.slots_per_slab_max)           # slab 1 is free


@pytest.mark.parametrize("slot", [-1, 2 * 16 * 1000])
def test_free_of_a_slot_outside_the_arena_raises_value_error(slot: int) -> None:
    a = SlabAllocator(2 * 64 * KIB, 64 * KIB)
    cls = a.class_for(PAGE)
    for _ in range(32):
        a.allocate(cls)
    with pytest.raises(ValueError):
        a.free(slot)
    assert a.used_slots == 32


def test_offsets_aligned_and_disjoint_under_churn() -> None:
    """Random allocate/free of every class; live slots never overlap and stay inside the arena."""
    a = SlabAllocator(32 * 64 * KIB, 64 * KIB)
    rng = random.Random(7)
    live: dict[int, tuple[int, int]] = {}       # slot -> (start, end)
    for step in range(4000):
        if live and (rng.random() < 0.45 or a.free_slabs == 0 and rng.random() < 0.5):
            slot = rng.choice(list(live))
            a.free(slot)
            del live[slot]
        else:
            cls = rng.randrange(len(a.classes))
            slot = a.allocate(cls)
            if slot is None:
                continue
            assert slot not in live
            start = a.offset(slot)
            size = a.slot_size(slot)
            assert size == a.classes[cls]
            assert start % PAGE == 0 and 0 <= start and start + size <= a.capacity
            assert slot in a.slots_of(a.slab_of(slot))
            live[slot] = (start, start + size)
        if step % 200 == 0 or step == 3999:
            ranges = sorted(live.values())
            for (_, end), (start, _) in zip(ranges, ranges[1:]):
                assert end <= start, "overlapping slots"
            assert a.used_slots == len(live)
            assert a.reserved_bytes == sum(e - s for s, e in live.values()) <= a.capacity
    for slot in list(live):
        a.free(slot)
    assert a.used_slots == 0 and a.reserved_bytes == 0 and a.free_slabs == a.nslabs


def test_offsets_of_a_full_class_tile_the_slab() -> None:
    a = SlabAllocator(64 * KIB, 64 * KIB)
    cls = a.class_for(20 * KIB)                # 20 KiB: 3 slots, 4 KiB left over
    slots = [a.allocate(cls) for _ in range(3)]
    assert a.allocate(cls) is None
    assert sorted(a.offset(s) for s in slots) == [0, 20 * KIB, 40 * KIB]
    assert a.reserved_bytes == 60 * KIB
    assert list(a.slots_of(0)) == sorted(slots)
