"""A full listing that comes in ordered parts (sans-I/O).

A daemon sends another its whole list of blocks (all of them to a static peer, those homed there
to a home) as Snapshot frames: parts 0, 1, ... under one listing id, the last one flagged. The
receiver keeps what it knew of the sender until the last part is in, then replaces it all at
once, so a listing cut short (the connection lost, a part out of order) changes nothing.
:class:`PartedListings` gathers the parts, one listing per sender; the static peers' directory
(kvcached.peers.directory) and the homes' records (kvcached.cluster.location) both use it.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["PartedListings", "OUT_OF_ORDER"]


class _OutOfOrder:
    def __repr__(self) -> str:
        return "OUT_OF_ORDER"


OUT_OF_ORDER = _OutOfOrder()     # what part() answers for a part that does not follow the last one


class PartedListings:
    """Each sender's listing in progress: its id, the next part due, the keys so far."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, int, set[bytes]]] = {}

    def part(self, sender: str, listing: int, part: int, last: bool,
             keys: Iterable[bytes]) -> set[bytes] | _OutOfOrder | None:
        """One part of ``sender``'s listing ``listing``: the whole listing's keys once ``last``
        is in, None while parts are still due, OUT_OF_ORDER (and the listing abandoned) for a
        part that does not follow the last one under the same id. Part 0 always starts anew."""
        current = (listing, 0, set()) if part == 0 else self._open.get(sender)
        if current is None or current[0] != listing or current[1] != part:
            self._open.pop(sender, None)
            return OUT_OF_ORDER
        current[2].update(keys)
        if last:
            self._open.pop(sender, None)
            return current[2]
        self._open[sender] = (listing, part + 1, current[2])
        return None

    def forget(self, sender: str) -> None:
        """Drop ``sender``'s listing in progress (it left, or its connection was reset)."""
        self._open.pop(sender, None)
