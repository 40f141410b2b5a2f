"""Which slabs of a recyclable arena an agent has page-locked for DMA (cudaHostRegister), and
when to lock them again. No I/O here: the registering is passed in.

A daemon with several tenants gives each its own arena and moves memory between them a slab at
a time: before a slab passes to another tenant, its pages are punched out of this tenant's
memfd (docs/security.md, "The arena"). Pages an agent page-locked stay locked after the punch,
but they are no longer the arena's: a DMA into them would go where the daemon never looks. So
such a daemon hands agents a second, read-only memfd beside the arena: a *generation* per slab,
bumped before each punch. An agent locks the slabs it copies through one at a time, records
the generation it locked each at, and locks a slab again (letting go of the old pages) when
the generation moved. It reads the generation once it holds the slots it copies (a reservation
or a load's pin): the daemon punches only slabs with no slot in use, so the generation it read
stays true until the copy is done.

Layout of the generations file (little-endian): magic ``KVSLABG\\0``, version (u32), pad
(u32), slab bytes (u64), slabs (u64), 32 bytes of nothing, then a u32 per slab.
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import Callable

__all__ = ["GENERATIONS_HEADER", "GENERATIONS_MAGIC", "SlabGenerationsView", "SlabPins"]

GENERATIONS_MAGIC = b"KVSLABG\0"
GENERATIONS_HEADER = struct.Struct("<8sIIQQ32x")
SWEEP_S = 1.0          # at most this often, slabs locked at an old generation are let go


class SlabGenerationsView:
    """A read-only view of a generations file: ``slab_bytes`` and the generation of each slab."""

    def __init__(self, fd: int) -> None:
        size = GENERATIONS_HEADER.size
        self._map = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        magic, version, _, self.slab_bytes, self.slabs = GENERATIONS_HEADER.unpack_from(self._map, 0)
        if magic != GENERATIONS_MAGIC or version != 1 or len(self._map) < size + 4 * self.slabs or self.slab_bytes <= 0:
            self._map.close()
            raise ValueError("not a slab generations file of version 1")
        self.generation = memoryview(self._map)[size:size + 4 * self.slabs].cast("I")

    def close(self) -> None:
        self.generation.release()
        self._map.close()


class SlabPins:
    """Keeps the slabs a copy touches locked at their current generation. ``register(offset,
    length)`` and ``unregister(offset)`` lock and let go of an arena range (cudaHostRegister
    and cudaHostUnregister of the mapping's bytes); ``clock`` for the sweep."""

    def __init__(self, generations: SlabGenerationsView, register: Callable[[int, int], None],
                 unregister: Callable[[int], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.generations = generations
        self._register, self._unregister, self._clock = register, unregister, clock
        self._locked: dict[int, int] = {}       # slab -> the generation it was locked at
        self._next_sweep = clock() + SWEEP_S
        self.relocked = 0                       # slabs locked again after the daemon recycled them

    @property
    def locked(self) -> dict[int, int]:
        return dict(self._locked)

    def cover(self, offset: int, nbytes: int) -> None:
        """Every slab of ``[offset, offset + nbytes)`` locked at its current generation."""
        size, gens, locked = self.generations.slab_bytes, self.generations.generation, self._locked
        for slab in range(offset // size, (offset + max(nbytes, 1) - 1) // size + 1):
            now = gens[slab]
            had = locked.get(slab)
            if had == now:
                continue
            if had is not None:
                self._unregister(slab * size)
                self.relocked += 1
            self._register(slab * size, size)
            locked[slab] = now
        if self._clock() >= self._next_sweep:
            self.sweep()

    def sweep(self) -> None:
        """Let go of slabs locked at a generation that has moved on (their pages are no longer
        the arena's: only this lock keeps them)."""
        self._next_sweep = self._clock() + SWEEP_S
        gens = self.generations.generation
        for slab, had in list(self._locked.items()):
            if gens[slab] != had:
                self._unregister(slab * self.generations.slab_bytes)
                del self._locked[slab]

    def close(self) -> None:
        for slab in list(self._locked):
            self._unregister(slab * self.generations.slab_bytes)
        self._locked.clear()
