"""The shared-memory arena that holds every RAM-tier byte.

One memfd (anonymous, sealed against resizing) of ``size`` bytes, mapped shared. Agents in
engine processes receive the same file descriptor over the agent socket (SCM_RIGHTS) and map it
too, so block bytes move between GPU and arena without crossing any socket. Pages are allocated
lazily by the kernel as slots are first written.
"""

from __future__ import annotations

import fcntl
import mmap
import os

__all__ = ["SharedArena"]


class SharedArena:
    """A ``size``-byte shared mapping backed by a memfd."""

    def __init__(self, size: int, name: str = "kvcached-arena") -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # No one (daemon bug or agent) may shrink the file under a live mapping: that would
            # turn reads of the tail into SIGBUS.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the arena at ``offset`` (one memcpy)."""
        self.view[offset:offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        """A copy of ``length`` bytes at ``offset``."""
        return self.view[offset:offset + length].tobytes()

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)
