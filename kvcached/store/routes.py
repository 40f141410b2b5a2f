"""The engine's keys of blocks (KV events, docs/events.md): offered by an agent before a save,
kept in the index once the block is reserved (or found stored already), dropped when its
reservation is given back.

An agent's Route arrives before its Allocate, perhaps on another connection (the vLLM
connector's scheduler names the blocks its workers save). Keys are held here until then, so a
block never stored (admission declined it, no room, another writer had it) leaves nothing in the
index. Held keys are bounded: the oldest go first, and a block whose keys went is published by
its digest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvcached.index import BlockIndex

__all__ = ["RouteKeys"]


class RouteKeys:
    """Keys offered and not yet placed, at most ``limit`` of them (index key to encoded keys)."""

    def __init__(self, index: BlockIndex, limit: int = 1 << 16) -> None:
        self.index = index
        self.limit = limit
        self._offered: OrderedDict[bytes, bytes] = OrderedDict()

    def offer(self, entries: Iterable[tuple[bytes, bytes]]) -> None:
        offered = self._offered
        for key, blob in entries:
            offered[key] = blob
            offered.move_to_end(key)
        while len(offered) > self.limit:
            offered.popitem(last=False)

    def placed(self, keys: Iterable[bytes]) -> None:
        """These blocks are reserved for writing, or stored already: keep their offered keys."""
        offered = self._offered
        if not offered:
            return
        found = [(key, blob) for key in keys if (blob := offered.pop(key, None)) is not None]
        if found:
            self.index.put_routes(found)

    def abandoned(self, keys: Iterable[bytes]) -> None:
        """These reservations were given back or their blocks not kept: their keys go."""
        keys = list(keys)
        if keys:
            self.index.delete_routes(keys)

    def __len__(self) -> int:
        return len(self._offered)
