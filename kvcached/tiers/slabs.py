"""Slot allocator of the RAM arena: size-classed slabs (no I/O, no memory of its own).

The arena is cut into equal *slabs* of ``slab_bytes`` (the largest block size). A slab is
either free or serves one *size class*, cut into equal slots of that class's size. Classes run
from 4 KiB upward with four steps per power of two (x1, x1.25, x1.5, x1.75, all 4 KiB
multiples): a block of 16 KiB or more gets a slot under 1.25 times its size, a smaller one
wastes less than 4 KiB, and power-of-two blocks (the usual KV block) waste nothing. Every slot
starts on a 4 KiB boundary, as O_DIRECT reads and cudaHostRegister want.

This is memcached's slab design: allocation and free are O(1), there is no fragmentation
across classes, and a slab moves between classes when it empties (the RAM tier empties a whole
slab when another class needs room; see RamTier).

A *slot id* is ``slab * slots_per_slab_max + index``: stable, dense enough to key arrays by.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["SlabAllocator", "size_classes", "PAGE"]

PAGE = 4096


def size_classes(max_bytes: int) -> list[int]:
    """Slot sizes from 4 KiB to ``max_bytes`` (the last class is ``max_bytes`` rounded up to 4 KiB)."""
    top = -(-max_bytes // PAGE) * PAGE
    out: set[int] = {top}
    base = PAGE
    while base < top:
        for quarter in (4, 5, 6, 7):
            size = -(-(base * quarter // 4) // PAGE) * PAGE
            if size < top:
                out.add(size)
        base *= 2
    return sorted(out)


@dataclass(slots=True)
class _Slab:
    cls: int = -1               # size class index, -1 when free
    nslots: int = 0
    free: list[int] = field(default_factory=list)   # free slot indexes (a stack)
    used: bytearray = field(default_factory=bytearray)  # 1 per slot in use


class SlabAllocator:
    """Hands out arena slots by size class. Pure bookkeeping: offsets, never bytes."""

    def __init__(self, capacity: int, slab_bytes: int) -> None:
        self.classes = size_classes(slab_bytes)
        self.slab_bytes = self.classes[-1]
        self.nslabs = capacity // self.slab_bytes
        if self.nslabs < 1:
            raise ValueError(f"arena of {capacity} bytes holds no slab of {self.slab_bytes} bytes")
        self.capacity = self.nslabs * self.slab_bytes
        self.slots_per_slab_max = self.slab_bytes // PAGE
        self._slabs = [_Slab() for _ in range(self.nslabs)]
        self._free_slabs = list(range(self.nslabs - 1, -1, -1))
        # per class: slabs that still have a free slot (dict as an ordered set)
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]
        self.used_slots = 0
        self.reserved_bytes = 0     # bytes of the slots handed out

    # -- queries ------------------------------------------------------------------------------

    def class_for(self, nbytes: int) -> int:
        """Index of the smallest class that holds ``nbytes``; ValueError if none does."""
        if nbytes <= 0 or nbytes > self.slab_bytes:
            raise ValueError(f"block of {nbytes} bytes is outside 1..{self.slab_bytes}")
        return bisect.bisect_left(self.classes, nbytes)

    def slab_of(self, slot: int) -> int:
        return slot // self.slots_per_slab_max

    def class_of_slab(self, slab: int) -> int:
        return self._slabs[slab].cls

    def slot_size(self, slot: int) -> int:
        return self.classes[self._slabs[self.slab_of(slot)].cls]

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in the arena."""
        slab, index = divmod(slot, self.slots_per_slab_max)
        return slab * self.slab_bytes + index * self.classes[self._slabs[slab].cls]

    def slots_of(self, slab: int) -> range:
        """Every slot id of ``slab`` (used or not)."""
        base = slab * self.slots_per_slab_max
        return range(base, base + self._slabs[slab].nslots)

    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    # -- changes ------------------------------------------------------------------------------

    def allocate(self, cls: int) -> int | None:
        """A free slot of class ``cls``, or None when neither a slot nor a free slab is left."""
        partial = self._partial[cls]
        if partial:
            slab_index = next(iter(partial))
        elif self._free_slabs:
            slab_index = self._free_slabs.pop()
            slab = self._slabs[slab_index]
            slab.cls = cls
            slab.nslots = self.slab_bytes // self.classes[cls]
            slab.free = list(range(slab.nslots - 1, -1, -1))
            slab.used = bytearray(slab.nslots)
            partial[slab_index] = None
        else:
            return None
        slab = self._slabs[slab_index]
        index = slab.free.pop()
        slab.used[index] = 1
        if not slab.free:
            del partial[slab_index]
        self.used_slots += 1
        self.reserved_bytes += self.classes[cls]
        return slab_index * self.slots_per_slab_max + index

    def allocate_at(self, slot: int, cls: int) -> None:
        """Take ``slot`` as a slot of class ``cls`` (a successor placing the blocks its
        predecessor left, kvcached.store.adoption). ValueError if the slot is taken, outside the
        arena, or in a slab that serves another class."""
        if not 0 <= cls < len(self.classes):
            raise ValueError(f"size class {cls} does not exist")
        if not 0 <= slot < self.nslabs * self.slots_per_slab_max:
            raise ValueError(f"slot {slot} is outside the arena")
        slab_index, index = divmod(slot, self.slots_per_slab_max)
        slab = self._slabs[slab_index]
        if slab.cls < 0:
            self._free_slabs.remove(slab_index)
            slab.cls = cls
            slab.nslots = self.slab_bytes // self.classes[cls]
            slab.free = list(range(slab.nslots - 1, -1, -1))
            slab.used = bytearray(slab.nslots)
            self._partial[cls][slab_index] = None
        elif slab.cls != cls:
            raise ValueError(f"slot {slot} is in a slab of another size class")
        if index >= slab.nslots or slab.used[index]:
            raise ValueError(f"slot {slot} is taken or not a slot of its slab")
        slab.used[index] = 1
        if slab.free[-1] == index:      # slots placed in order come off the top of the stack: O(1)
            slab.free.pop()
        else:
            slab.free.remove(index)
        if not slab.free:
            del self._partial[cls][slab_index]
        self.used_slots += 1
        self.reserved_bytes += self.classes[cls]

    def free(self, slot: int) -> None:
        """Give ``slot`` back; a slab whose last slot comes back becomes free for any class."""
        if not 0 <= slot < self.nslabs * self.slots_per_slab_max:
            raise ValueError(f"slot {slot} is outside the arena")
        slab_index, index = divmod(slot, self.slots_per_slab_max)
        slab = self._slabs[slab_index]
        if slab.cls < 0 or index >= slab.nslots or not slab.used[index]:
            raise ValueError(f"slot {slot} is not allocated")
        cls = slab.cls
        slab.used[index] = 0
        slab.free.append(index)
        self.used_slots -= 1
        self.reserved_bytes -= self.classes[cls]
        if len(slab.free) == slab.nslots:
            self._partial[cls].pop(slab_index, None)
            slab.cls, slab.nslots, slab.free, slab.used = -1, 0, [], bytearray()
            self._free_slabs.append(slab_index)
        else:
            self._partial[cls][slab_index] = None
