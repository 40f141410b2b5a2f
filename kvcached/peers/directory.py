"""Who holds what, and who is worth asking (sans-I/O: the clock is passed in).

:class:`PeerDirectory` keeps, from the peers' announcements and snapshots, which configured peer
holds which block; :class:`PeerHealth` keeps whether a peer answers, with backoff after
repeated failures. The peer tier asks both before any network I/O: a block no usable peer holds
is a miss at once, without a round trip.

Blocks are keyed by their wire address, the 36 bytes ``digest | u32 layer`` (little-endian) that
the peer protocol already carries (:func:`wire_key`): no hashing on the receiving side. Each key
maps to a bit mask of the peers that hold it, so a block held by several peers costs one entry.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from kvcached.cluster.listing import OUT_OF_ORDER, PartedListings

__all__ = ["wire_key", "PeerDirectory", "PeerHealth", "PeerState", "MAX_ENTRIES"]

MAX_ENTRIES = 4_000_000      # keys remembered in all (~110 bytes each); announcements beyond are ignored, counted
_LAYER = struct.Struct("<I")


def wire_key(digest: bytes, layer: int) -> bytes:
    """The 36-byte key of (digest, layer): the block's address as the peer protocol writes it."""
    return digest + _LAYER.pack(layer)


class PeerState(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass
class PeerHealth:
    """One peer's health. ``fail_limit`` failures in a row mark it down for a backoff that starts
    at ``backoff_s`` and doubles up to ``backoff_max_s``; once the backoff is over the peer may
    be tried again (one success brings it back up, one more failure sends it down again for
    twice as long). A peer starts up: it is worth one try."""

    name: str
    fail_limit: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    state: PeerState = PeerState.UP
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    _backoff: float = field(default=0.0, repr=False)

    def usable(self, now: float) -> bool:
        """Whether to offer this peer's blocks and send it pulls now."""
        return self.state is PeerState.UP or now >= self.retry_at

    def succeeded(self) -> bool:
        """A request got an answer. Returns whether the peer just came back up."""
        came_back = self.state is PeerState.DOWN
        self.state, self.failures, self._backoff, self.last_error = PeerState.UP, 0, 0.0, ""
        return came_back

    def failed(self, now: float, reason: str) -> bool:
        """A request got no answer (timeout, connection lost, refused). Returns whether the
        peer just went down."""
        self.failures += 1
        self.last_error = reason
        if self.state is PeerState.DOWN:           # a retry after the backoff failed: back off longer
            self._backoff = min(self._backoff * 2, self.backoff_max_s)
            self.retry_at = now + self._backoff
            return False
        if self.failures < self.fail_limit:
            return False
        self.state = PeerState.DOWN
        self._backoff = self.backoff_s
        self.retry_at = now + self._backoff
        return True


class PeerDirectory:
    """Which peer holds which block, from their Announce, Drop and Snapshot frames.

    A snapshot (the full listing a peer sends when it connects) replaces all that was known of
    that peer once its last part is in; until then the old knowledge stays in use. Parts must
    come in order under one listing id; a part out of order abandons the listing (the peer
    sends a new one on its next connection)."""

    def __init__(self, names: Sequence[str], max_entries: int = MAX_ENTRIES) -> None:
        if len(names) > 62:
            raise ValueError(f"{len(names)} peers: at most 62 are supported")
        self.names = list(names)
        self.bit = {name: 1 << i for i, name in enumerate(self.names)}
        self.max_entries = max_entries
        self.ignored = 0                                # announcements dropped for lack of room
        self._holders: dict[bytes, int] = {}
        self._counts = dict.fromkeys(self.names, 0)
        self._listings = PartedListings()                              # each peer's snapshot in progress

    def __len__(self) -> int:
        return len(self._holders)

    def count(self, peer: str) -> int:
        """Blocks ``peer`` is known to hold."""
        return self._counts[peer]

    def mask(self, peers: Iterable[str]) -> int:
        """The bit mask of ``peers`` (for :meth:`holders` and :meth:`prefix`)."""
        out = 0
        for name in peers:
            out |= self.bit[name]
        return out

    # -- what peers tell us --

    def announce(self, peer: str, keys: Iterable[bytes]) -> None:
        bit, holders, added = self.bit[peer], self._holders, 0
        for key in keys:
            mask = holders.get(key)
            if mask is None:
                if len(holders) >= self.max_entries:
                    self.ignored += 1
                    continue
                holders[key] = bit
                added += 1
            elif not mask & bit:
                holders[key] = mask | bit
                added += 1
        self._counts[peer] += added

    def drop(self, peer: str, keys: Iterable[bytes]) -> None:
        bit, holders, removed = self.bit[peer], self._holders, 0
        for key in keys:
            mask = holders.get(key)
            if mask is not None and mask & bit:
                removed += 1
                if mask == bit:
                    del holders[key]
                else:
                    holders[key] = mask & ~bit
        self._counts[peer] -= removed

    def snapshot(self, peer: str, listing: int, part: int, last: bool, keys: Iterable[bytes]) -> bool:
        """One part of ``peer``'s listing ``listing``. Returns False (and abandons the listing)
        if the part is out of order. On the last part the listing replaces what was known."""
        _ = self.bit[peer]
        listed = self._listings.part(peer, listing, part, last, keys)
        if listed is OUT_OF_ORDER:
            return False
        if isinstance(listed, set):
            self.forget(peer)
            self.announce(peer, listed)
        return True

    def forget(self, peer: str) -> None:
        """Everything ``peer`` was known to hold is forgotten (O(entries); on a new listing)."""
        bit = self.bit[peer]
        if not self._counts[peer]:
            return
        keep = ~bit
        gone = [k for k, m in self._holders.items() if m & bit]
        for key in gone:
            mask = self._holders[key] & keep
            if mask:
                self._holders[key] = mask
            else:
                del self._holders[key]
        self._counts[peer] = 0

    # -- what the store asks --

    def holders(self, key: bytes, usable: int) -> list[str]:
        """The usable peers that hold ``key``, in configuration order."""
        mask = self._holders.get(key, 0) & usable
        if not mask:
            return []
        return [name for name in self.names if mask & self.bit[name]]

    def prefix(self, keys: Sequence[bytes], usable: int) -> int:
        """How many of ``keys``, from the first, some usable peer holds (stopping at the first
        that none does)."""
        holders = self._holders
        n = 0
        for key in keys:
            if not holders.get(key, 0) & usable:
                break
            n += 1
        return n
