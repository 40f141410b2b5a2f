"""The holder's side of the NIXL lane: which pinned blocks a puller may still read (sans-I/O; the
clock is passed in).

On the NIXL lane the holder answers a NixlPull with where the blocks lie in its arena and keeps
them pinned while the puller reads them over NIXL: nothing it could evict or overwrite may sit
in a slot a reader was told about. The pins of one answer form a lease. A lease ends when the
puller says NixlDone, when its ``hold_s`` passes (a puller that died or forgot), or when the
QUIC session that got it ends, whichever comes first; each way releases every pin once.

What a peer can make the holder keep is bounded: ``max_per_peer`` leases at once (a NixlPull
over that is answered as overloaded), each at most a NixlPull's MAX_ROWS blocks and ``hold_s``
long. Lease ids are random 64-bit numbers and only the peer that was granted one can end it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

__all__ = ["NixlLeases", "LeaseCounters"]

Release = Callable[[], None]


@dataclass
class LeaseCounters:
    granted: int = 0
    done: int = 0          # ended by the puller's NixlDone
    expired: int = 0       # ended by hold_s passing
    ended: int = 0         # ended with the session that got them
    refused: int = 0       # NixlPulls over max_per_peer


@dataclass
class _Lease:
    peer: str
    session: Hashable
    releases: Sequence[Release]
    expires_at: float


@dataclass
class NixlLeases:
    """The leases this holder granted (see the module)."""

    hold_s: float
    max_per_peer: int
    clock: Callable[[], float]
    counters: LeaseCounters = field(default_factory=LeaseCounters)

    def __post_init__(self) -> None:
        if self.hold_s <= 0 or self.max_per_peer < 1:
            raise ValueError(f"leases of {self.hold_s} s, {self.max_per_peer} a peer: both must be positive")
        self._leases: dict[int, _Lease] = {}
        self._per_peer: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def room(self, peer: str) -> bool:
        """Whether ``peer`` may be granted one more lease now."""
        return self._per_peer.get(peer, 0) < self.max_per_peer

    def grant(self, peer: str, session: Hashable, releases: Sequence[Release]) -> int:
        """A lease over ``releases`` (the pins of one answer) for ``peer`` on ``session``: its id.
        Where ``peer`` holds ``max_per_peer`` leases already, the pins are released at once and
        0 is returned (the caller answers the pull as overloaded); so is an empty grant."""
        if not releases or not self.room(peer):
            self.counters.refused += bool(releases)
            _release(releases)
            return 0
        lease = secrets.randbits(64) or 1
        while lease in self._leases:
            lease = secrets.randbits(64) or 1
        self._leases[lease] = _Lease(peer, session, releases, self.clock() + self.hold_s)
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self.counters.granted += 1
        return lease

    def done(self, peer: str, lease: int) -> bool:
        """``peer`` read what it wanted of ``lease``: its pins go. An unknown lease, or another
        peer's, is ignored (False)."""
        held = self._leases.get(lease)
        if held is None or held.peer != peer:
            return False
        self._end(lease)
        self.counters.done += 1
        return True

    def expire(self) -> int:
        """End the leases whose time passed; how many."""
        now = self.clock()
        gone = [lease for lease, held in self._leases.items() if held.expires_at <= now]
        for lease in gone:
            self._end(lease)
        self.counters.expired += len(gone)
        return len(gone)

    def end_session(self, session: Hashable) -> int:
        """The QUIC session ``session`` ended: so do the leases granted over it; how many."""
        gone = [lease for lease, held in self._leases.items() if held.session is session]
        for lease in gone:
            self._end(lease)
        self.counters.ended += len(gone)
        return len(gone)

    def next_expiry(self) -> float | None:
        """When the next lease runs out by the clock (None: none held)."""
        return min((held.expires_at for held in self._leases.values()), default=None)

    def close(self) -> None:
        """Release every lease (the daemon stops)."""
        for lease in list(self._leases):
            self._end(lease)

    def _end(self, lease: int) -> None:
        held = self._leases.pop(lease)
        left = self._per_peer[held.peer] - 1
        if left:
            self._per_peer[held.peer] = left
        else:
            del self._per_peer[held.peer]
        _release(held.releases)


def _release(releases: Sequence[Release]) -> None:
    for release in releases:
        release()
