"""The NIXL lane's holder side, over the QUIC session (issue 43; docs/peers.md, "The NIXL lane").

A verified peer asks NixlOpen: it gets this daemon's NIXL agent metadata and its arena's base and
size (:class:`~kvcached.peers.nixl_transfer.NixlEndpoint`, the arena registered once). It asks
NixlPull: the blocks are pinned as for any pull (kvcached.peers.store_link, the same tenant and
size checks) and answered, row by row, with where each lies in the arena, its length, checksum
and model; the pins form one lease (:class:`~kvcached.peers.nixl_leases.NixlLeases`) that its
NixlDone, its ``hold_s`` or the end of the session ends. The bytes then leave by the peer's
NIXL READ, which this daemon does not see: what it vouches for is the checksum it sent over the
authenticated session, which the puller checks.

A thin asyncio layer: the leases' expiry runs on a timer of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Hashable

from kvcached.peers import protocol as p
from kvcached.peers.nixl_leases import NixlLeases

__all__ = ["AnswerPull", "NixlHolder"]

log = logging.getLogger("kvcached.peers")

AnswerPull = Callable[[str, p.AnyPull], Awaitable[list[Any]]]   # PeerHandler.pull


class NixlHolder:
    """Serves the NIXL lane's control for one daemon: ``endpoint`` (a NixlEndpoint over the RAM
    tier's arena), ``leases`` (what pullers may still read), ``pull`` (how a pull is answered
    out of the store: PeerHandler.pull)."""

    def __init__(self, endpoint: Any, leases: NixlLeases, pull: AnswerPull) -> None:
        self.endpoint, self.leases, self._pull = endpoint, leases, pull
        self._timer: asyncio.TimerHandle | None = None
        self.answered = 0               # NixlPulls answered
        self.overloaded = 0             # NixlPulls answered overloaded: the peer held its most leases

    def agent(self) -> p.NixlAgent:
        bases = tuple(self.endpoint.bases)
        return p.NixlAgent(self.endpoint.base, self.endpoint.size, self.endpoint.metadata,
                           bases if len(bases) > 1 else ())

    async def pull(self, peer: str, session: Hashable, request: p.NixlPull) -> p.NixlSpans:
        """Pin the blocks of ``request`` and say where they lie, under a lease of ``peer``'s on
        ``session``."""
        if not self.leases.room(peer):
            self.overloaded += 1
            return p.NixlSpans(0, 0, [p.NixlSpan(missing=p.MissReason.OVERLOADED)] * len(request.addresses))
        answers = await self._pull(peer, p.pull_of(request.addresses, request.max_payload, request.tenant))
        spans: list[p.NixlSpan] = []
        releases: list[Callable[[], None]] = []
        try:
            for answer in answers:
                if isinstance(answer, p.Miss):
                    spans.append(p.NixlSpan(missing=answer.reason))
                    continue
                head, view, release = answer
                try:
                    offset = self.endpoint.offset_of(view)
                except ValueError:          # an arena made after NIXL registered them: not over this lane
                    release()
                    spans.append(p.NixlSpan(missing=p.MissReason.BUSY))
                    continue
                releases.append(release)
                spans.append(p.NixlSpan(offset, head.payload_length, head.checksum, head.model))
        except BaseException:
            for release in releases:
                release()
            raise
        lease = self.leases.grant(peer, session, releases)
        if releases and not lease:              # the peer's leases filled up meanwhile: released already
            self.overloaded += 1
            spans = [p.NixlSpan(missing=p.MissReason.OVERLOADED)] * len(spans)
        self.answered += 1
        self._arm()
        return p.NixlSpans(lease, int(self.leases.hold_s * 1000), spans)

    def done(self, peer: str, lease: int) -> None:
        self.leases.done(peer, lease)
        self._arm()

    def session_ended(self, session: Hashable) -> None:
        if self.leases.end_session(session):
            self._arm()

    def close(self) -> None:
        """Release every lease and stop the timer (the endpoint is the caller's to close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.leases.close()

    def _arm(self) -> None:
        """The timer set for the next lease to run out (none while none is held)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        when = self.leases.next_expiry()
        if when is not None:
            delay = max(0.0, when - self.leases.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        gone = self.leases.expire()
        if gone:
            log.info("NIXL leases expired unread", extra={"fields": {"leases": gone}})
        self._arm()
