"""What each RAM slot holds, in a memfd of its own, so it outlives the process that wrote it.

The arena's bytes live in a memfd (kvcached.tiers.arena) that systemd's file descriptor store or
an upgrade's handover keeps alive when the daemon goes away. Bytes alone are no use to a
successor: it must know which block each slot holds. The RAM tier writes that here as it
changes, with plain stores into shared memory (no system call, no index write on the hot path),
so the directory is exactly the tier's state at the instant the process died:

- ``reserved`` writes the key, length, size class and owner (whose arena the slot is in), then
  the state WRITING;
- ``committed`` sets DIRTY or CLEAN (``set_clean`` keeps that in step);
- ``freed`` sets FREE.

A successor reads the committed entries (:meth:`SlotDirectory.committed_entries`). After a
clean handover it trusts them; after a crash it trusts nothing it has not checked: the block's
index record must say RAM with the same length, and the slot's bytes must hash to the record's
BLAKE3 checksum (kvcached.store.adoption). A slot a process died writing is WRITING here, and a
torn entry never matches its record: neither is ever served.

Each tenant's blocks lie in an arena of its own (kvcached.tiers.arenas); a slot's *owner* says
which. The owners' table says whose each owner is, as a BLAKE3 digest of the tenant's tag (a
successor matches it against the tenants it has; the record of every block names its tenant
too, and a block is taken up only where both agree).

Layout (little-endian): a 4 KiB header (magic, version, the arena's geometry), the owners'
table (256 entries of 32 bytes: a tag's digest, zeros where unused), then columns indexed by
slot id: state (u8), owner (u8), size class (u16), length (u64), key (32 bytes). A successor
adopts a directory only with the same geometry (arena size, slab size, slot ids); other
configurations start clean. Version 1 (one arena, no owners) is read as the default tenant's
owner 0 alone (:meth:`SlotDirectory.adopt` gives its entries, then a version-2 directory takes
over). Agents never receive this file: only the daemon writes it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Iterator

import blake3

from kvcached.host.shared_memory import MemfdFiles, SharedFiles

__all__ = ["SlotDirectory", "SlotEntry", "Geometry", "FREE", "WRITING", "DIRTY", "CLEAN", "OWNERS", "owner_digest"]

FREE, WRITING, DIRTY, CLEAN = 0, 1, 2, 3
MAGIC = b"KVSLOTS\0"
VERSION = 2
HEADER = struct.Struct("<8sIIQQQ")     # magic, version, pad, arena bytes, slab bytes, slot ids
HEADER_BYTES = 4096
KEY_BYTES = 32
OWNERS = 256                           # owner ids 0..255
OWNER_BYTES = 32
NO_OWNER = bytes(OWNER_BYTES)


def owner_digest(tag: str) -> bytes:
    """What the owners' table keeps of a tenant's tag."""
    return blake3.blake3(b"kvcached slot owner\0" + tag.encode()).digest()
_COMMITTED = bytes(1 if state in (DIRTY, CLEAN) else 0 for state in range(256))   # bytes.translate table


@dataclass(frozen=True, slots=True)
class Geometry:
    """The arena's layout a directory describes: a successor with another one starts clean."""

    arena_bytes: int
    slab_bytes: int
    slots: int


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """A committed slot: its id, size class, payload length, block key, and whether a copy is
    on SSD (clean)."""

    slot: int
    cls: int
    length: int
    key: bytes
    clean: bool
    owner: int = 0


def _align(n: int) -> int:
    return -(-n // 8) * 8


class SlotDirectory:
    """The directory over memfd ``fd`` (owned: closed by :meth:`close`); ``version`` 1: a
    predecessor's directory of one arena, read only."""

    def __init__(self, fd: int, geometry: Geometry, version: int = VERSION) -> None:
        self.fd = fd
        self.geometry = geometry
        self.version = version
        n = geometry.slots
        self._table_at = HEADER_BYTES
        self._states_at = HEADER_BYTES + (OWNERS * OWNER_BYTES if version >= 2 else 0)
        self._owners_at = self._states_at + _align(n)
        self._classes_at = self._owners_at + (_align(n) if version >= 2 else 0)
        self._lengths_at = self._classes_at + _align(2 * n)
        self._keys_at = self._lengths_at + 8 * n
        self.size = self._keys_at + KEY_BYTES * n
        # The whole file: on hugetlbfs it is whole huge pages, and only a whole one unmaps.
        self._map = mmap.mmap(fd, max(self.size, os.fstat(fd).st_size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(self._map)
        self._view = view
        self._table = view[self._table_at:self._states_at]
        self._states = view[self._states_at:self._states_at + n]
        self._owners = view[self._owners_at:self._classes_at]
        self._classes = view[self._classes_at:self._classes_at + 2 * n].cast("H")
        self._lengths = view[self._lengths_at:self._lengths_at + 8 * n].cast("Q")
        self._keys = view[self._keys_at:self._keys_at + KEY_BYTES * n]

    @classmethod
    def create(cls, geometry: Geometry, name: str = "kvcached-slots", files: SharedFiles | None = None) -> "SlotDirectory":
        """A new, empty directory in a new file of ``files`` (kv.arena: by default a memfd sealed
        against resizing, like the arena)."""
        fd = (files if files is not None else MemfdFiles()).make(name, cls._size_for(geometry))
        try:
            directory = cls(fd, geometry)
        except BaseException:
            os.close(fd)
            raise
        HEADER.pack_into(directory._map, 0, MAGIC, VERSION, 0, geometry.arena_bytes, geometry.slab_bytes,
                         geometry.slots)
        return directory

    @classmethod
    def adopt(cls, fd: int, geometry: Geometry, page_bytes: int = 1) -> "SlotDirectory":
        """The directory a predecessor left in memfd ``fd``, if it describes ``geometry``;
        ValueError (saying why) otherwise. ``fd`` is owned by the result; on error the caller
        still owns it. A version-1 directory is read as one arena, owner 0's (:attr:`version`
        says so: read its entries, then write a new one). ``page_bytes``: the file's size is
        rounded up to a multiple of it (hugetlbfs: kvcached.host.shared_memory)."""
        have = os.fstat(fd).st_size
        if have < HEADER.size:
            raise ValueError(f"the slot directory is {have} bytes: no header")
        magic, version, _, arena, slab, slots = HEADER.unpack(os.pread(fd, HEADER.size, 0))
        if magic != MAGIC or version not in (1, VERSION):
            raise ValueError(f"not a slot directory of version 1 or {VERSION} (magic {magic!r}, version {version})")
        found = Geometry(arena, slab, slots)
        if found != geometry or have != -(-cls._size_for(geometry, version) // page_bytes) * page_bytes:
            raise ValueError(f"the slot directory describes another arena ({found}); this one is {geometry}")
        return cls(fd, geometry, version)

    @staticmethod
    def _size_for(geometry: Geometry, version: int = VERSION) -> int:
        n = geometry.slots
        extra = OWNERS * OWNER_BYTES + _align(n) if version >= 2 else 0
        return HEADER_BYTES + extra + _align(n) + _align(2 * n) + 8 * n + KEY_BYTES * n

    # -- what the RAM tier writes -------------------------------------------------------------

    def name_owner(self, owner: int, tag: str) -> None:
        """Owner ``owner``'s slots are in the arena of the tenant ``tag``."""
        at = owner * OWNER_BYTES
        self._table[at:at + OWNER_BYTES] = owner_digest(tag)

    def owner_names(self) -> dict[int, bytes]:
        """The owners' table: owner id -> the digest of its tenant's tag (version 1: owner 0,
        the default tenant's, alone)."""
        if self.version < 2:
            return {0: owner_digest("")}
        table = self._table
        return {o: d for o in range(OWNERS) if (d := table[o * OWNER_BYTES:(o + 1) * OWNER_BYTES].tobytes()) != NO_OWNER}

    def reserved(self, slot: int, key: bytes, length: int, cls: int, owner: int = 0) -> None:
        self._states[slot] = WRITING
        at = slot * KEY_BYTES
        self._keys[at:at + KEY_BYTES] = key
        self._lengths[slot] = length
        self._classes[slot] = cls
        self._owners[slot] = owner

    def committed(self, slot: int, clean: bool) -> None:
        self._states[slot] = CLEAN if clean else DIRTY

    def set_clean(self, slot: int, clean: bool) -> None:
        if self._states[slot] in (DIRTY, CLEAN):
            self._states[slot] = CLEAN if clean else DIRTY

    def freed(self, slot: int) -> None:
        self._states[slot] = FREE

    # -- what a successor reads ---------------------------------------------------------------

    def committed_entries(self) -> Iterator[SlotEntry]:
        """Every slot marked DIRTY or CLEAN, in slot order (one pass over a byte per slot id;
        in slot order, a successor's allocator takes each slab's slots off the top of its free
        stack)."""
        states = self._states.tobytes()
        marks = states.translate(_COMMITTED)
        keys, lengths, classes = self._keys, self._lengths, self._classes
        owners = self._owners if self.version >= 2 else bytes(len(states))
        slot = marks.find(1)
        while slot >= 0:
            at = slot * KEY_BYTES
            yield SlotEntry(slot, classes[slot], lengths[slot], keys[at:at + KEY_BYTES].tobytes(), states[slot] == CLEAN,
                            owners[slot])
            slot = marks.find(1, slot + 1)

    def close(self) -> None:
        for view in (self._table, self._states, self._owners, self._classes, self._lengths, self._keys, self._view):
            view.release()
        self._map.close()
        os.close(self.fd)
