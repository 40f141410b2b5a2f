"""The shared-memory arena that holds every RAM-tier byte.

One file of ``size`` bytes (a memfd sealed against resizing, or a file on tmpfs or hugetlbfs:
kvcached.host.shared_memory), mapped shared. Agents in
engine processes receive the same file descriptor over the agent socket (SCM_RIGHTS) and map it
too, so block bytes move between GPU and arena without crossing any socket. Pages are allocated
lazily by the kernel as slots are first written.
"""

from __future__ import annotations

import mmap
import os

from kvcached.host.shared_memory import MemfdFiles

__all__ = ["SharedArena", "advise_huge_pages"]

# No huge pages reserved for the whole mapping at once on hugetlbfs (there, each tenant's arena
# would reserve the tier's size): the slab allocator bounds what all arenas hold together.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0)


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for huge pages behind ``mapping`` (MADV_HUGEPAGE), where the kernel's shmem THP
    setting allows them (/sys/kernel/mm/transparent_hugepage/shmem_enabled ``advise``, or
    ``within_size``/``always``, which need no asking). Pages that move between tenants' arenas
    are then punched and zeroed 2 MiB at a time: about 10x cheaper than 4 KiB ones
    (docs/operations.md). Nothing happens where the kernel says no."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        pass


class SharedArena:
    """A ``size``-byte shared mapping of ``fd``: a file a predecessor left (systemd's file
    descriptor store, an upgrade's handover, a file-backed arena's directory), or one new from
    kvcached.host.shared_memory (``adopted=False``); without ``fd`` a new memfd. The arena owns
    ``fd`` once constructed."""

    def __init__(self, size: int, name: str = "kvcached-arena", fd: int | None = None, *,
                 adopted: bool | None = None) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self.adopted = fd is not None if adopted is None else adopted
        self.fd = fd if fd is not None else MemfdFiles().make(name, size)
        try:
            self._map = mmap.mmap(self.fd, size, MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
            advise_huge_pages(self._map)
        except BaseException:
            if fd is None:
                os.close(self.fd)
            raise
        self.view = memoryview(self._map)

    @property
    def inode(self) -> int:
        return os.fstat(self.fd).st_ino

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the arena at ``offset`` (one memcpy)."""
        self.view[offset:offset + len(data)] = data

    def release(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` back to the kernel (a hole punched in
        the memfd: MADV_REMOVE on a shared mapping of it). Every mapping of the range, in this
        process and every agent's, reads zeros after; the memory is free for anyone."""
        self._map.madvise(mmap.MADV_REMOVE, offset, length)

    def read(self, offset: int, length: int) -> bytes:
        """A copy of ``length`` bytes at ``offset``."""
        return self.view[offset:offset + length].tobytes()

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)
