"""The engine's keys of blocks (KV events, docs/events.md): offered by an agent before a save,
held while the block is reserved, and written into its record with it (or into the record of a
block found stored already).

An agent's Route arrives before its Allocate, perhaps on another connection (the vLLM
connector's scheduler names the blocks its workers save). Keys are held here until then, so a
block never stored (admission declined it, no room, another writer had it) leaves nothing in the
index. What they may hold is bounded in bytes, since any agent may send them for blocks it never
stores (docs/security.md):

- in all, ``max_bytes`` (each entry costs its encoded keys and :data:`ENTRY_BYTES`), and at most
  ``limit`` entries; past either the oldest go first;
- per connection that offered them (``owner``), a quarter of that: past it that connection's
  own oldest go, so one connection cannot push out another's;
- keys offered and not reserved within ``ttl_s`` go, and so do all a connection offered when
  it ends (:meth:`RouteKeys.release`); keys held for a reservation go with it.

A block whose keys went is published by its digest. No I/O here; the clock is passed in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvcached_agent.address import BlockAddress

__all__ = ["ENTRY_BYTES", "RouteKeys"]

Block = tuple[bytes, int]        # (digest, layer): what a Route names, hashed by Python alone
ENTRY_BYTES = 256                # what an entry costs beside its keys (dict slots, key, tuple, record)


@dataclass(slots=True)
class _Entry:
    blob: bytes
    owner: int
    at: float

    @property
    def size(self) -> int:
        return len(self.blob) + ENTRY_BYTES


class RouteKeys:
    """Keys offered and not yet placed, and keys of reserved blocks not yet recorded (see the
    module for their bounds)."""

    def __init__(self, limit: int = 1 << 16, *, max_bytes: int = 64 << 20, ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.per_owner = max_bytes // 4
        self.ttl_s = ttl_s
        self.clock = clock
        self._offered: dict[Block, _Entry] = {}        # oldest first
        self._held: dict[Block, _Entry] = {}           # oldest first
        self._by_owner: dict[int, dict[Block, None]] = {}   # each owner's offered blocks, oldest first
        self._owner_bytes: dict[int, int] = {}         # offered and held, by owner
        self.bytes = 0
        self.dropped = 0                               # entries dropped for the bounds or for time

    def offer(self, entries: Iterable[tuple[bytes, int, bytes]], owner: int = 0) -> None:
        """Keys of blocks about to be saved: (digest, layer, encoded keys), checked already, from
        the connection ``owner``."""
        now = self.clock()
        self.expire(now)
        mine = self._by_owner.setdefault(owner, {})
        for digest, layer, blob in entries:
            block = (digest, layer)
            self._forget_offer(block)            # a key offered again is the newest
            entry = _Entry(blob, owner, now)
            self._offered[block] = entry
            mine[block] = None
            self._count(owner, entry.size)
            while self._owner_bytes.get(owner, 0) > self.per_owner and mine:
                self._forget_offer(next(iter(mine)), dropped=True)
        self._bound()

    def reserved(self, addresses: Iterable[BlockAddress]) -> None:
        """These blocks are reserved for writing: hold their offered keys for their records."""
        offered, held = self._offered, self._held
        if not offered:
            return
        for address in addresses:
            block = (address.digest, address.layer)
            entry = offered.pop(block, None)
            if entry is not None:
                self._by_owner[entry.owner].pop(block, None)
                stale = held.pop(block, None)
                if stale is not None:
                    self._count(stale.owner, -stale.size)
                held[block] = entry
        self._bound()

    def found(self, addresses: Sequence[BlockAddress]) -> list[tuple[bytes, bytes]]:
        """These blocks are stored already: (index key, their offered keys), for their records now."""
        if not self._offered:
            return []
        out = []
        for a in addresses:
            entry = self._forget_offer((a.digest, a.layer))
            if entry is not None:
                out.append((a.key, entry.blob))
        return out

    def take(self, address: BlockAddress) -> bytes:
        """The held keys of ``address``'s block, now being recorded (b"": none)."""
        if not self._held:
            return b""
        entry = self._held.pop((address.digest, address.layer), None)
        if entry is None:
            return b""
        self._count(entry.owner, -entry.size)
        return entry.blob

    def abandoned(self, addresses: Iterable[BlockAddress]) -> None:
        """These reservations were given back or their blocks not kept: their keys go."""
        if self._held:
            for address in addresses:
                self.take(address)

    def release(self, owner: int) -> None:
        """The connection ``owner`` ended: the keys it offered go (those held for reservations
        stay with them)."""
        for block in list(self._by_owner.get(owner, ())):
            self._forget_offer(block)
        self._by_owner.pop(owner, None)
        if not self._owner_bytes.get(owner):
            self._owner_bytes.pop(owner, None)

    def expire(self, now: float) -> None:
        """Keys offered more than ``ttl_s`` ago and never reserved go."""
        offered = self._offered
        while offered:
            block, entry = next(iter(offered.items()))
            if now - entry.at < self.ttl_s:
                return
            self._forget_offer(block, dropped=True)

    def __len__(self) -> int:
        return len(self._offered) + len(self._held)

    # -- bookkeeping -------------------------------------------------------------------------

    def _count(self, owner: int, size: int) -> None:
        self.bytes += size
        left = self._owner_bytes.get(owner, 0) + size
        if left:
            self._owner_bytes[owner] = left
        else:
            self._owner_bytes.pop(owner, None)

    def _forget_offer(self, block: Block, dropped: bool = False) -> _Entry | None:
        entry = self._offered.pop(block, None)
        if entry is None:
            return None
        mine = self._by_owner.get(entry.owner)
        if mine is not None:
            mine.pop(block, None)
        self._count(entry.owner, -entry.size)
        self.dropped += dropped
        return entry

    def _bound(self) -> None:
        """The oldest go, offered ones first, past ``max_bytes`` or ``limit`` entries in all."""
        while self._offered and (self.bytes > self.max_bytes or len(self) > self.limit):
            self._forget_offer(next(iter(self._offered)), dropped=True)
        held = self._held
        while held and (self.bytes > self.max_bytes or len(held) > self.limit):
            entry = held.pop(next(iter(held)))
            self._count(entry.owner, -entry.size)
            self.dropped += 1
