"""The RAM tier's arenas: one shared-memory arena per owner (a tenant), so an agent maps its own
tenant's bytes and nobody else's (docs/security.md, "The arena").

Every arena is a memfd of the tier's whole size (kvcached.tiers.arena): address space, not
memory. Pages are committed only where a slot was written, and the slab allocator
(kvcached.tiers.slabs) gives each slab to one owner at a time, so the arenas together commit at
most the tier's capacity: one RAM budget, ``kv.ram_gib``. When a slab passes from one owner to
another, its pages are punched out of the old owner's memfd first (:meth:`Arenas.release`): the
kernel takes them back, and the new owner's arena gets fresh zeroed pages of its own. A mapping
cannot be revoked from another process, and none needs to be: an agent of the old owner that
reads the range later reads zeros of its own memfd, never the new owner's bytes.

An agent that page-locks arena memory for DMA (cudaHostRegister) would keep pages a punch took
out of the arena: where slabs change owner, each arena has a table of slab generations beside
it (:class:`SlabGenerations`, handed to agents read-only), bumped before each punch, by which
agents lock a recycled slab again (kvcached_agent.slab_pins).

Owner 0 is the default tenant's and the only one where no tenants are configured: one arena,
as before tenants. Arenas are made on first use (an agent of the tenant connects, or a block of
its is stored), and ``on_made`` is told of each (the fd store keeps it, NIXL registers it).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from typing import Callable, Iterator

from kvcached.host.shared_memory import MemfdFiles, SharedFiles
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram_errors import RamFull
from kvcached.tiers.ram_shares import OVERFLOW, RamShares
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import SlotDirectory
from kvcached_agent.slab_pins import GENERATIONS_HEADER, GENERATIONS_MAGIC

__all__ = ["Arenas", "SlabGenerations", "TenantArenas", "fd_name", "owner_of_fd_name"]

F_SEAL_FUTURE_WRITE = 0x0010        # Linux 5.1: no new writable mapping, no write(); this one's stays

log = logging.getLogger("kvcached.ram")

FD_NAME = "kvcached-arena"          # owner 0's, as before tenants; owner N's: "kvcached-arena.N"


def fd_name(owner: int) -> str:
    """The name an owner's arena has in systemd's fd store and an upgrade's handover."""
    return FD_NAME if owner == 0 else f"{FD_NAME}.{owner}"


def owner_of_fd_name(name: str) -> int | None:
    """The owner an fd name of :func:`fd_name` names (None: not an arena's)."""
    if name == FD_NAME:
        return 0
    head, _, tail = name.partition(".")
    return int(tail) if head == FD_NAME and tail.isdigit() and 0 < int(tail) < 256 else None


class SlabGenerations:
    """A generation per slab of one arena, in a memfd this mapping alone may write (sealed
    against any other writer: agents map it read-only; layout: kvcached_agent.slab_pins)."""

    def __init__(self, slab_bytes: int, slabs: int, name: str) -> None:
        size = GENERATIONS_HEADER.size + 4 * slabs
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            GENERATIONS_HEADER.pack_into(self._map, 0, GENERATIONS_MAGIC, 1, 0, slab_bytes, slabs)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.slab_bytes = slab_bytes
        self.generation = memoryview(self._map)[GENERATIONS_HEADER.size:size].cast("I")

    def bump(self, slab: int) -> None:
        self.generation[slab] = (self.generation[slab] + 1) & 0xFFFFFFFF

    def close(self) -> None:
        self.generation.release()
        self._map.close()
        os.close(self.fd)


class Arenas:
    """The arenas of a tier of ``size`` bytes, by owner id (0..255), new ones made as ``files``
    (``kv.arena``; memfds by default)."""

    def __init__(self, size: int, adopted: dict[int, SharedArena] | None = None,
                 files: SharedFiles | None = None) -> None:
        self.size = size
        self.files = files if files is not None else MemfdFiles()
        self._arenas: dict[int, SharedArena] = dict(adopted or {})
        self._generations: dict[int, SlabGenerations] = {}
        self._slab_bytes = 0             # slabs change owner: each arena has its generations (see track)
        self.on_made: list[Callable[[int, SharedArena], None]] = []
        self.released_bytes = 0          # given back to the kernel as slabs changed owner

    def __len__(self) -> int:
        return len(self._arenas)

    def __contains__(self, owner: int) -> bool:
        return owner in self._arenas

    def items(self) -> Iterator[tuple[int, SharedArena]]:
        return iter(list(self._arenas.items()))

    def get(self, owner: int) -> SharedArena:
        """Owner ``owner``'s arena, made now if it has none yet."""
        arena = self._arenas.get(owner)
        if arena is None:
            name = fd_name(owner)
            arena = self._arenas[owner] = SharedArena(self.size, name, self.files.make(name, self.size), adopted=False)
            for listener in self.on_made:
                listener(owner, arena)
        if self._slab_bytes and owner not in self._generations:
            self._generations[owner] = SlabGenerations(self._slab_bytes, self.size // self._slab_bytes,
                                                       f"{fd_name(owner)}-generations")
        return arena

    def track(self, slab_bytes: int) -> Callable[[int, int], None]:
        """Slabs of ``slab_bytes`` (a size class's multiple: SlabAllocator rounds it up to 4
        KiB) change owner here: every arena gets its generations. What the slab allocator calls
        before a slab passes to another owner."""
        self._slab_bytes = -(-slab_bytes // 4096) * 4096
        for owner in list(self._arenas):
            self.get(owner)
        return self.release_slab(self._slab_bytes)

    def agent_fds(self, owner: int) -> list[int]:
        """What an agent of ``owner``'s is handed: its arena, and the arena's slab generations
        where slabs change owner (read-only to it: the memfd is sealed against other writers)."""
        arena = self.get(owner)
        generations = self._generations.get(owner)
        return [arena.fd] if generations is None else [arena.fd, generations.fd]

    def view(self, owner: int) -> memoryview:
        arena = self._arenas.get(owner)
        return (arena if arena is not None else self.get(owner)).view

    def release(self, owner: int, offset: int, length: int) -> None:
        """Give owner's pages of the range back to the kernel (a slab leaving it)."""
        arena = self._arenas.get(owner)
        if arena is not None:
            generations = self._generations.get(owner)
            if generations is not None:       # first: an agent's lock on these pages is stale from now
                for slab in range(offset // generations.slab_bytes, (offset + length - 1) // generations.slab_bytes + 1):
                    generations.bump(slab)
            arena.release(offset, length)
            self.released_bytes += length

    def slot_bytes(self, slabs: SlabAllocator) -> Callable[[int, int], memoryview]:
        """A view of ``length`` bytes at a slot of ``slabs``, in the arena of the slot's owner."""
        offset_of, owner_of, view = slabs.offset, slabs.owner_of, self.view

        def slot_bytes(slot: int, length: int) -> memoryview:
            offset = offset_of(slot)
            return view(owner_of(slot))[offset:offset + length]
        return slot_bytes

    def release_slab(self, slab_bytes: int) -> Callable[[int, int], None]:
        """What the slab allocator calls before a slab passes to another owner."""
        def release(owner: int, slab: int) -> None:
            self.release(owner, slab * slab_bytes, slab_bytes)
        return release

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        for generations in self._generations.values():
            generations.close()
        self._arenas.clear()
        self._generations.clear()


class TenantArenas:
    """Which arena each tenant's blocks lie in: the owner id its RAM shares count it under
    (kvcached.tiers.ram_shares; None: the default tenant's owner 0 alone), its arena made and
    named in the slot directory on first use, so a successor knows whose each arena is."""

    def __init__(self, arenas: Arenas, shares: RamShares | None, directory: SlotDirectory | None) -> None:
        self.arenas, self.shares, self.directory = arenas, shares, directory
        self._named: set[int] = set()
        self._name(0)              # the default tenant's, always there (a successor takes up the arenas with it)

    def owner_for(self, tag: str) -> int:
        """``tag``'s owner id (a Tenant.tag); RamFull past the owners counted."""
        owner = 0 if self.shares is None else self.shares.owner_id(tag)
        if owner not in self._named:
            if self.tag_of(owner) == OVERFLOW:
                raise RamFull("RAM tier: no arena left for another tenant (255 owners)")
            self.arenas.get(owner)
            self._name(owner)
        return owner

    def tag_of(self, owner: int) -> str:
        """The tenant (a Tenant.tag) whose arena owner ``owner`` is."""
        return self.shares.names[owner] if self.shares is not None else ""

    def has(self, owner: int) -> bool:
        """Whether ``owner`` has an arena here (a predecessor's, taken up), naming it if so."""
        if owner not in self.arenas or (owner and self.shares is None):
            return False
        self._name(owner)
        return True

    def _name(self, owner: int) -> None:
        if owner not in self._named:
            if self.directory is not None:
                self.directory.name_owner(owner, self.tag_of(owner))
            self._named.add(owner)

