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

Each slab in use has an *owner* (a tenant's arena, kvcached.tiers.arenas): a slot of owner O
comes from a slab O holds, so a slab's bytes lie in one arena. A slab that empties stays *warm*
with its last owner (its pages still hold that owner's bytes): the owner takes it back first.
Another owner takes it only when no clean slab is left, and then ``release`` is told first, so
the caller gives its pages back to the kernel (punched out of the old owner's memfd) before the
new owner's bytes go anywhere. Each slab is thus committed in at most one arena: the arenas
together never hold more than the allocator's capacity.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from kvcached.tiers.slot_directory import Geometry

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
    owner: int = -1             # the arena it is in (while free: whose bytes it may still hold; -1 none)
    nslots: int = 0
    free: list[int] = field(default_factory=list)   # free slot indexes (a stack)
    used: bytearray = field(default_factory=bytearray)  # 1 per slot in use


class SlabAllocator:
    """Hands out arena slots by size class. Pure bookkeeping: offsets, never bytes."""

    def __init__(self, capacity: int, slab_bytes: int,
                 release: Callable[[int, int], None] | None = None) -> None:
        """``release(owner, slab)``: called before a free slab that may still hold ``owner``'s
        bytes goes to another owner (None: one owner only, nothing to release)."""
        self.classes = size_classes(slab_bytes)
        self.slab_bytes = self.classes[-1]
        self.nslabs = capacity // self.slab_bytes
        if self.nslabs < 1:
            raise ValueError(f"arena of {capacity} bytes holds no slab of {self.slab_bytes} bytes")
        self.capacity = self.nslabs * self.slab_bytes
        self.slots_per_slab_max = self.slab_bytes // PAGE
        self._slabs = [_Slab() for _ in range(self.nslabs)]
        self._free_slabs = list(range(self.nslabs - 1, -1, -1))     # clean: nobody's bytes
        self._warm: dict[int, dict[int, None]] = {}     # owner -> free slabs with its bytes (ordered set)
        # per owner, per class: slabs that still have a free slot (dict as an ordered set)
        self._partial: dict[int, list[dict[int, None]]] = {}
        self._release = release
        self.released = 0           # slabs handed from one owner to another (released first)
        self.used_slots = 0
        self.reserved_bytes = 0     # bytes of the slots handed out

    @classmethod
    def geometry(cls, arena_bytes: int, slab_bytes: int) -> Geometry:
        """The slot layout a tier over ``arena_bytes`` with ``slab_bytes`` slabs has (what its
        slot directory must describe)."""
        slabs = cls(arena_bytes, slab_bytes)
        return Geometry(arena_bytes, slabs.slab_bytes, slabs.nslabs * slabs.slots_per_slab_max)

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

    def owner_of_slab(self, slab: int) -> int:
        """The owner of a slab in use (-1: free)."""
        slab_ = self._slabs[slab]
        return slab_.owner if slab_.cls >= 0 else -1

    def owner_of(self, slot: int) -> int:
        """The owner of ``slot``'s slab (whose arena its bytes are in)."""
        return self._slabs[slot // self.slots_per_slab_max].owner

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
        return len(self._free_slabs) + sum(len(w) for w in self._warm.values())

    def _partials(self, owner: int) -> list[dict[int, None]]:
        partial = self._partial.get(owner)
        if partial is None:
            partial = self._partial[owner] = [{} for _ in self.classes]
        return partial

    def _take_free(self, owner: int) -> int | None:
        """A free slab for ``owner``: its own warm one, a clean one, or (released first)
        another owner's warm one; None when no slab is free."""
        warm = self._warm.get(owner)
        if warm:
            slab_index = next(iter(warm))
            del warm[slab_index]
            return slab_index
        if self._free_slabs:
            return self._free_slabs.pop()
        for other, slabs in self._warm.items():
            if slabs:
                slab_index = next(iter(slabs))
                del slabs[slab_index]
                if self._release is not None:
                    self._release(other, slab_index)
                self.released += 1
                return slab_index
        return None

    def _open(self, slab_index: int, cls: int, owner: int) -> _Slab:
        slab = self._slabs[slab_index]
        slab.cls = cls
        slab.owner = owner
        slab.nslots = self.slab_bytes // self.classes[cls]
        slab.free = list(range(slab.nslots - 1, -1, -1))
        slab.used = bytearray(slab.nslots)
        self._partials(owner)[cls][slab_index] = None
        return slab

    # -- changes ------------------------------------------------------------------------------

    def allocate(self, cls: int, owner: int = 0) -> int | None:
        """A free slot of class ``cls`` in a slab of ``owner``'s, or None when neither such a
        slot nor a free slab is left."""
        partial = (self._partial.get(owner) or self._partials(owner))[cls]
        if partial:
            slab_index = next(iter(partial))
        else:
            taken = self._take_free(owner)
            if taken is None:
                return None
            slab_index = taken
            self._open(slab_index, cls, owner)
        slab = self._slabs[slab_index]
        index = slab.free.pop()
        slab.used[index] = 1
        if not slab.free:
            del partial[slab_index]
        self.used_slots += 1
        self.reserved_bytes += self.classes[cls]
        return slab_index * self.slots_per_slab_max + index

    def allocate_at(self, slot: int, cls: int, owner: int = 0) -> None:
        """Take ``slot`` as a slot of class ``cls`` in ``owner``'s arena (a successor placing the
        blocks its predecessor left, kvcached.store.adoption). ValueError if the slot is taken,
        outside the arena, or in a slab that serves another class or owner."""
        if not 0 <= cls < len(self.classes):
            raise ValueError(f"size class {cls} does not exist")
        if not 0 <= slot < self.nslabs * self.slots_per_slab_max:
            raise ValueError(f"slot {slot} is outside the arena")
        slab_index, index = divmod(slot, self.slots_per_slab_max)
        slab = self._slabs[slab_index]
        if slab.cls < 0:
            if slab.owner >= 0 and slab.owner != owner:
                raise ValueError(f"slot {slot} is in a slab that may hold another owner's bytes")
            if slab.owner >= 0:
                del self._warm[owner][slab_index]
            else:
                self._free_slabs.remove(slab_index)
            self._open(slab_index, cls, owner)
        elif slab.cls != cls:
            raise ValueError(f"slot {slot} is in a slab of another size class")
        elif slab.owner != owner:
            raise ValueError(f"slot {slot} is in a slab of another owner")
        if index >= slab.nslots or slab.used[index]:
            raise ValueError(f"slot {slot} is taken or not a slot of its slab")
        slab.used[index] = 1
        if slab.free[-1] == index:      # slots placed in order come off the top of the stack: O(1)
            slab.free.pop()
        else:
            slab.free.remove(index)
        if not slab.free:
            del self._partial[owner][cls][slab_index]
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
        partial = self._partial[slab.owner][cls]
        if len(slab.free) == slab.nslots:
            partial.pop(slab_index, None)
            slab.cls, slab.nslots, slab.free, slab.used = -1, 0, [], bytearray()
            warm = self._warm.get(slab.owner)
            if warm is None:
                warm = self._warm[slab.owner] = {}
            warm[slab_index] = None
        else:
            partial[slab_index] = None
