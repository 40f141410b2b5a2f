"""The keys a policy evicted lately, in a few dozen bytes per key of the bound (no I/O).

A policy with ghosts asks one question of them: was this key, now inserted again, evicted a
short while ago? A dict of the keys answers it exactly at some 170 bytes a ghost (an
OrderedDict entry and the 32-byte key object it keeps alive): more than the rest of a RAM
block's record. :class:`GhostFilter` answers it in ``CELLS_PER_KEY`` bytes per key it can
hold (2 to 3 times the bound: 24 to 36 bytes per key of the bound), with a false "yes" for at
most 0.6% of the keys never evicted:

- a Bloom filter (``PROBES`` cells a key, each from 4 of the key's first 16 bytes: the daemon's
  keys are BLAKE3 digests, uniformly random; a shorter key is hashed first) whose cells hold the
  *generation* that last set them, 1 to 3, 0 for none;
- a key is added under the current generation; once ``limit`` keys were added to it, the next
  generation starts and the cells of the one before the previous are cleared (one
  ``bytes.translate`` over the cells: C speed, once per ``limit`` additions);
- a key is a ghost while all its cells hold a live generation (the current or the previous):
  the last ``limit`` to ``2 * limit`` keys added are found, older ones are forgotten, as a FIFO
  of that many keys would forget them.

Keys cannot be taken out (a ghost that comes back stays a ghost until its generation ends,
which asks nothing more of a policy that promotes it either way). The cells are laid out for
``capacity`` keys, at least ``2 * limit``, and laid out again, empty and for ``3 * limit``,
when a policy's bound outgrows them (while its tier fills: nothing has been evicted yet).

At a million keys of bound the cells are 36 MB, whose copy takes some 17 ms (the pages of a
new buffer are faulted in as it is written): :meth:`GhostFilter.state_steps` copies them 256
KiB a step while the filter goes on changing, and sets the cells of the keys added meanwhile
in the copy too, so the copy is the filter as it is when the last step ends.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from typing import Generator, Iterator, Optional

__all__ = ["GhostFilter"]

CELLS_PER_KEY = 12
PROBES = 4              # with 12 cells a key held: a false "yes" for (1 - e^(-4/12))^4, about 0.6%, at most
_NEXT = {1: 2, 2: 3, 3: 1}
_WORDS = struct.Struct("<4I").unpack_from      # the key's first 16 bytes as four 32-bit probes
_SLICE = 256 << 10      # bytes of cells copied in one step of state_steps
_TRIES = 3              # copies in steps begun again when a generation ends meanwhile, before one at once


def _live_table(generation: int) -> bytes:
    """Per cell value, 1 if it is a live generation (``generation`` or the one before)."""
    before = generation - 1 or 3
    return bytes(1 if v in (generation, before) else 0 for v in range(256))


_LIVE = {g: _live_table(g) for g in (1, 2, 3)}
_CLEAR = {g: bytes(0 if v == g else v for v in range(256)) for g in (1, 2, 3)}   # the cells of generation g cleared


class GhostFilter:
    def __init__(self, capacity: int = 64) -> None:
        self._copying: list[list[tuple[int, int, int, int]]] = []   # cells set while state_steps copies
        self._lay_out(capacity)

    def _lay_out(self, capacity: int) -> None:
        self.capacity = max(64, capacity)
        self.cells = bytearray(CELLS_PER_KEY * self.capacity)
        self.generation = 1
        self.added = 0          # keys added in the current generation
        self.previous = 0       # and in the previous one
        self._live = _LIVE[1]

    def __len__(self) -> int:
        """How many keys it remembers (those added in the two live generations)."""
        return self.previous + self.added

    def __contains__(self, key: bytes) -> bool:
        # one call per insert of the policy: written out, a table lookup per cell
        if len(key) < 16:
            key = hashlib.blake2b(key, digest_size=16).digest()
        a, b, c, d = _WORDS(key)
        cells, live = self.cells, self._live
        m = len(cells)
        return bool(live[cells[a % m]] and live[cells[b % m]] and live[cells[c % m]] and live[cells[d % m]])

    def add(self, key: bytes, limit: int) -> None:
        """Remember ``key`` among the last ``limit`` to ``2 * limit`` keys added."""
        if 2 * limit > self.capacity:
            self._lay_out(3 * limit)
        cells, now = self.cells, self.generation
        if len(key) < 16:
            key = hashlib.blake2b(key, digest_size=16).digest()
        m = len(cells)
        a, b, c, d = _WORDS(key)            # as __contains__: one call per eviction of a policy with ghosts
        a, b, c, d = a % m, b % m, c % m, d % m
        cells[a] = cells[b] = cells[c] = cells[d] = now
        if self._copying:
            for cells_set in self._copying:
                cells_set.append((a, b, c, d))
        self.added += 1
        if self.added >= limit:
            self._next_generation()

    def _next_generation(self) -> None:
        """The generation before the previous one ends: its cells are cleared."""
        nxt = _NEXT[self.generation]
        self.cells = self.cells.translate(_CLEAR[nxt])     # a new bytearray: one pass, one copy
        self.generation = nxt
        self.previous, self.added = self.added, 0
        self._live = _LIVE[nxt]

    # -- what survives a restart -------------------------------------------------------------------

    def state(self) -> bytes:
        """The cells, then the generation (one byte), the keys added to it and to the previous
        one (8 bytes each)."""
        return b"".join((self.cells, self._suffix()))

    def _suffix(self) -> bytes:
        return bytes((self.generation,)) + self.added.to_bytes(8, "little") + self.previous.to_bytes(8, "little")

    def _copied(self, cells: bytearray, copy: memoryview) -> Generator[None, None, bool]:
        """Copy ``cells`` into ``copy`` a slice a step; False if they stopped being the filter's."""
        with memoryview(cells) as source:
            for start in range(0, len(cells), _SLICE):
                end = min(start + _SLICE, len(cells))
                copy[start:end] = source[start:end]
                yield None
                if self.cells is not cells:
                    return False
        return True

    def state_steps(self) -> Iterator[Optional[memoryview]]:
        """:meth:`state` in steps (kvcached.policies.base.Steps) while keys go on being added:
        the cells copied ``_SLICE`` bytes a step into memory of the copy's own (a private
        mapping, whose pages are faulted in a step at a time, where one ``bytes`` of 36 MB faults
        them all in at once), then the cells of the keys added meanwhile set in the copy: the
        state as it is after the last step, as a read-only view. A new generation meanwhile
        (its cells are new) begins the copy again; after ``_TRIES`` it is taken at once."""
        for _ in range(_TRIES):
            cells, cells_set = self.cells, list[tuple[int, int, int, int]]()
            copy = memoryview(mmap.mmap(-1, len(cells) + 17, flags=mmap.MAP_PRIVATE))
            self._copying.append(cells_set)
            try:
                whole = yield from self._copied(cells, copy)
                if whole:                    # no step between the last check and this
                    now = self.generation
                    for a, b, c, d in cells_set:
                        copy[a] = copy[b] = copy[c] = copy[d] = now
                    copy[len(cells):] = self._suffix()
            finally:
                self._copying.remove(cells_set)
            if whole:
                yield copy.toreadonly()
                return
        yield memoryview(self.state())

    def restore(self, raw: bytes) -> bool:
        """Take up :meth:`state`; False (nothing changed) if it does not fit: other cells, or
        damaged."""
        if len(raw) < 17:
            return False
        cells, generation = raw[:-17], raw[-17]
        if generation not in _NEXT or not cells or len(cells) % CELLS_PER_KEY or max(cells) > 3:
            return False
        self.capacity = len(cells) // CELLS_PER_KEY
        self.cells = bytearray(cells)
        self.generation = generation
        self._live = _live_table(generation)
        self.added = int.from_bytes(raw[-16:-8], "little")
        self.previous = int.from_bytes(raw[-8:], "little")
        return True
