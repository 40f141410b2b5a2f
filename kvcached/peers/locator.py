"""Where blocks are: one interface, two ways (the peer tier holds one, chosen at construction).

- :class:`StaticLocator`, for the static ``[quic] peers``: every daemon announces every block it
  gains and drops to every other, and each keeps a copy of who holds what
  (kvcached.peers.directory.PeerDirectory). Right for a handful of nodes.
- :class:`~kvcached.peers.homes.HomeLocator`, for a cluster (``[cluster] etcd``): each block's
  location is kept by its home nodes only; a daemon tells the homes of what it gains and drops,
  keeps the records of the blocks it homes, and asks the homes of the blocks it looks for.

The peer tier, the fetch and the announcer use a :class:`Locator` only through this interface:
no code branches on which one it is.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Sequence

from kvcached.peers import protocol as p
from kvcached.peers.directory import PeerDirectory, wire_key
from kvcached.peers.links import PeerLinks

__all__ = ["Locator", "StaticLocator", "Holders", "apply_event"]

#: The usable peers that hold a wire key, in the order to ask them (one look's view).
Holders = Callable[[bytes], list[str]]


class Locator(abc.ABC):
    """Who holds which block, for the peer tier (see the module). Runs on the event loop."""

    #: Whether where blocks are must be asked of other daemons (:meth:`locate`) before a
    #: Lookup can count peers, rather than known here already.
    asks_homes: ClassVar[bool]

    @abc.abstractmethod
    def holders(self) -> Holders:
        """A view of who holds what, for one plan or one Lookup: a function from a wire key to
        the usable peers that hold it (peers' health taken now, once)."""

    def unasked(self, key: bytes) -> bool:
        """Whether a fetch of ``key`` should try although no holder is known: nobody was asked
        yet (a cluster's homes are asked by the fetch itself). By default never."""
        return False

    async def locate(self, keys: Sequence[bytes]) -> None:
        """Ask whoever keeps the locations of ``keys`` (bounded by the caller's deadline). By
        default there is nobody to ask: the locations are here already."""

    @abc.abstractmethod
    def changed(self, changes: dict[bytes, bool]) -> None:
        """What this daemon's index gained (True) and dropped (False): into the pending
        announcements of the links that must hear of it."""

    @abc.abstractmethod
    def listing_for(self, peer: str, keys: Sequence[bytes]) -> list[bytes]:
        """Of this daemon's blocks (``keys``), those to list to ``peer`` when it connects."""

    @abc.abstractmethod
    def event(self, peer: str, message: p.Announce | p.Drop | p.Snapshot, request_id: int) -> bool:
        """``peer``'s announcement or listing part; False for a listing part out of order."""

    def answer_locate(self, request: p.Locate) -> p.Located:
        """Who holds each address asked, from the records kept here as a home; by default none."""
        return p.Located([() for _ in request.addresses])

    def members_changed(self, names: set[str], gone: Sequence[str]) -> None:
        """The peers are now ``names``; ``gone`` left (what they announced is forgotten)."""

    def tick(self) -> None:
        """Every announcement round (ANNOUNCE_S): expire what is due. By default nothing."""

    async def start(self) -> None:
        """Once the tier starts. By default nothing."""

    @abc.abstractmethod
    def blocks_of(self, peer: str) -> int:
        """How many blocks ``peer`` is known here to hold (Stats)."""

    def stats(self) -> dict[str, Any]:
        """Counters for Stats (a cluster's); by default none."""
        return {}


class StaticLocator(Locator):
    """The static ``[quic] peers``: everything announced to everyone, a full copy here."""

    asks_homes = False

    def __init__(self, links: PeerLinks) -> None:
        self.links = links
        self.directory = PeerDirectory(list(links.links))

    def holders(self) -> Holders:
        now, directory = self.links.clock(), self.directory
        mask = directory.mask(link.name for link in self.links if link.health.usable(now))
        return lambda key: directory.holders(key, mask)

    def changed(self, changes: dict[bytes, bool]) -> None:
        for link in self.links:       # peers not connected now get a snapshot when they are
            if link.verified:
                link.pending.update(changes)

    def listing_for(self, peer: str, keys: Sequence[bytes]) -> list[bytes]:
        return list(keys)

    def event(self, peer: str, message: p.Announce | p.Drop | p.Snapshot, request_id: int) -> bool:
        d = self.directory
        return apply_event(message, request_id, lambda keys: d.announce(peer, keys), lambda keys: d.drop(peer, keys),
                           lambda listing, part, last, keys: d.snapshot(peer, listing, part, last, keys))

    def members_changed(self, names: set[str], gone: Sequence[str]) -> None:
        for name in gone:
            if name in self.directory.bit:
                self.directory.forget(name)

    def blocks_of(self, peer: str) -> int:
        return self.directory.count(peer)


def apply_event(message: p.Announce | p.Drop | p.Snapshot, request_id: int, gained: Callable[[list[bytes]], Any],
                dropped: Callable[[list[bytes]], Any],
                listing: Callable[[int, int, bool, list[bytes]], bool]) -> bool:
    """A peer's announcement (``gained``), drop (``dropped``) or listing part (``listing``: its
    id, part number, whether last, keys), by wire key; False for a listing part out of order."""
    keys = [wire_key(d, layer) for d, layer in message.addresses]
    if isinstance(message, p.Announce):
        gained(keys)
    elif isinstance(message, p.Drop):
        dropped(keys)
    else:
        return listing(request_id, message.part, message.last, keys)
    return True
