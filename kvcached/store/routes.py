"""The engine's keys of blocks (KV events, docs/events.md): offered by an agent before a save,
held while the block is reserved, and written into its record with it (or into the record of a
block found stored already).

An agent's Route arrives before its Allocate, perhaps on another connection (the vLLM
connector's scheduler names the blocks its workers save). Keys are held here until then, so a
block never stored (admission declined it, no room, another writer had it) leaves nothing in the
index. Offered keys are bounded, and so are held ones: the oldest go first, and a block whose
keys went is published by its digest. No I/O here.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kvcached_agent.address import BlockAddress

__all__ = ["RouteKeys"]

Block = tuple[bytes, int]        # (digest, layer): what a Route names, hashed by Python alone


class RouteKeys:
    """Keys offered and not yet placed, and keys of reserved blocks not yet recorded; at most
    ``limit`` of each, the oldest going first. Blocks are named by (digest, layer) as the Route
    frame names them: every block a save names passes here, and an index key costs a hash."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._offered: dict[Block, bytes] = {}
        self._held: dict[Block, bytes] = {}

    def offer(self, entries: Iterable[tuple[bytes, int, bytes]]) -> None:
        """Keys of blocks about to be saved: (digest, layer, encoded keys), checked already."""
        offered = self._offered
        for digest, layer, blob in entries:
            block = (digest, layer)
            offered.pop(block, None)             # a key offered again is the newest
            offered[block] = blob
        _bound(offered, self.limit)

    def reserved(self, addresses: Iterable[BlockAddress]) -> None:
        """These blocks are reserved for writing: hold their offered keys for their records."""
        offered, held = self._offered, self._held
        if not offered:
            return
        for address in addresses:
            blob = offered.pop((address.digest, address.layer), None)
            if blob is not None:
                held[(address.digest, address.layer)] = blob
        _bound(held, self.limit)

    def found(self, addresses: Sequence[BlockAddress]) -> list[tuple[bytes, bytes]]:
        """These blocks are stored already: (index key, their offered keys), for their records now."""
        offered = self._offered
        if not offered:
            return []
        return [(a.key, blob) for a in addresses if (blob := offered.pop((a.digest, a.layer), None)) is not None]

    def take(self, address: BlockAddress) -> bytes:
        """The held keys of ``address``'s block, now being recorded (b"": none)."""
        return self._held.pop((address.digest, address.layer), b"") if self._held else b""

    def abandoned(self, addresses: Iterable[BlockAddress]) -> None:
        """These reservations were given back or their blocks not kept: their keys go."""
        held = self._held
        if held:
            for address in addresses:
                held.pop((address.digest, address.layer), None)

    def __len__(self) -> int:
        return len(self._offered) + len(self._held)


def _bound(entries: dict[Block, bytes], limit: int) -> None:
    """Forget the oldest entries past ``limit`` (dicts keep insertion order)."""
    over = len(entries) - limit
    if over > 0:
        for block in [block for block, _ in zip(entries, range(over))]:
            del entries[block]
