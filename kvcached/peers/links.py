"""The peer tier's connections: a :class:`PeerLink` per peer, and :class:`PeerLinks`, which dials
them, keeps them alive and backs off from those that fail.

Each link holds this daemon's QUIC connection to one peer (dialled at start and again after it
drops, pinged when idle so a dead peer is noticed within the keepalive and the pull deadline),
the session ticket of its last verified connection (resumption, 0-RTT pulls), the announcements
waiting to go to the peer, the peer's health (kvcached.peers.directory.PeerHealth: down after
``fail_limit`` failures in a row, backed off, tried again) and its bulk lane (a
kvcached.peers.lane_client.LaneClient, left alone for ``lane_retry_s`` after it fails). Whoever
uses a link (the fetch, the homes' Locates, the announcer) goes through the public methods here:
:meth:`PeerLinks.client`, :meth:`PeerLinks.over_lane`, :meth:`PeerLinks.dial_failed`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from kvcached.peers import protocol as p
from kvcached.peers.directory import PeerHealth
from kvcached.peers.lane import LANE_MODES
from kvcached.peers.lane_client import LaneClient
from kvcached.peers.lane_mac import MacRefused
from kvcached.peers.link_coding import link_coding
from kvcached.peers.nixl_pull import NixlPuller
from kvcached.peers.quic import PeerClientProtocol
from kvcached.peers.session import PeerGone
from kvcached.peers.tls import TICKET_LIFETIME_S, PeerAuth, PeerRefused, QuicOptions

__all__ = ["PeerLink", "PeerLinks", "LinkSettings", "PeerCounters", "LANE_FAILURES", "why"]

log = logging.getLogger("kvcached.peers")

KEEPALIVE_S = 2.0           # an idle connection is pinged this often
REDIAL_S = 1.0              # a peer that is up but not connected is dialled again this often
T = TypeVar("T")
#: How a lane fails when it cannot be had or breaks (the request then goes over QUIC). Anything
#: else a lane raises sends the request over QUIC too, logged as a warning: a lane's own fault
#: must never cost a block QUIC could have brought.
LANE_FAILURES = (OSError, ssl.SSLError, PeerRefused, PeerGone, asyncio.TimeoutError, p.ProtocolError, MacRefused)


@dataclass(frozen=True)
class LinkSettings:
    """What the links take of the peer tier's settings (kvcached.peers.tier.PeerSettings)."""

    options: QuicOptions = QuicOptions()
    pull_timeout_s: float = 2.0
    fail_limit: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    max_payload: int = 16 << 20
    lane: str = "tls"
    lane_retry_s: float = 30.0
    lane_stripes: int = 1
    link_codec: str = "auto"                   # kvcached.peers.link_coding: "auto", "none" or a codec's name


@dataclass
class PeerCounters:
    """The peer tier's counters (Stats ``peer_*``): the links, the fetches and the serving
    side each count theirs here."""

    pulled: int = 0            # blocks that arrived whole and verified
    pulled_bytes: int = 0
    missed: int = 0            # blocks no peer sent in time
    corrupt: int = 0           # copies that failed their checksum
    failed: int = 0            # pulls that failed (timeout, connection lost, error answer)
    hedged: int = 0            # pulls also asked of a second peer
    served: int = 0            # blocks sent to peers
    served_bytes: int = 0
    other_tenant: int = 0      # blocks a Pull asked for as another tenant's than their record's: not sent
    lane_pulls: int = 0        # pulls made over a lane
    lane_fallbacks: int = 0    # pulls and Locates that went over QUIC because the lane could not be had or broke


@dataclass
class PeerLink:
    """This daemon's connection to one peer, dialled when first needed and then kept; the
    session ticket of its last verified connection (resumption, 0-RTT pulls); the
    announcements waiting to go to it."""

    name: str
    address: tuple[str, int]
    health: PeerHealth
    client: PeerClientProtocol | None = None
    ticket: SessionTicket | None = None
    ticket_at: float = 0.0                     # when the ticket came, by the links' clock
    pending: dict[bytes, bool] = field(default_factory=dict)   # wire key -> held (announce) or not (drop)
    snapshotting: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    transport: Any = None
    lane: LaneClient | None = None
    lane_retry_at: float = 0.0                 # the lane failed: QUIC until then
    nixl_retry_at: float = 0.0                 # NIXL failed with this peer: the lane or QUIC until then
    task: "asyncio.Task[None] | None" = None   # the dial loop (cancelled when the member leaves)

    @property
    def verified(self) -> bool:
        """Whether its connection is up and passed mutual TLS."""
        return self.client is not None and self.client.verified


class PeerLinks:
    """The links, by peer name (see the module). ``on_connected(link, client)`` runs once a
    connection's handshake completes (the tier sends its listing then); ``counters`` are the
    peer tier's (these count its lane fallbacks)."""

    def __init__(self, auth: PeerAuth, settings: LinkSettings, clock: Callable[[], float] = time.monotonic,
                 on_connected: Callable[[PeerLink, PeerClientProtocol], Awaitable[None]] | None = None) -> None:
        self.auth, self.settings, self.clock = auth, settings, clock
        self.on_connected = on_connected or _nothing
        self.links: dict[str, PeerLink] = {}
        self.counters = PeerCounters()
        #: Whether each pull asks for its blocks coded for the wire ([quic] link_codec).
        self.coding = link_coding(settings.link_codec, clock)
        #: Where this daemon pulls over NIXL ([quic] nixl): its NixlPuller (set by the peer tier).
        self.nixl: NixlPuller | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def __iter__(self) -> Iterator[PeerLink]:
        return iter(self.links.values())

    def get(self, name: str) -> PeerLink | None:
        return self.links.get(name)

    def usable(self, name: str, now: float) -> bool:
        """Whether ``name`` is a link whose peer is worth asking now."""
        link = self.links.get(name)
        return link is not None and link.health.usable(now)

    # -- lifecycle --

    def add(self, name: str, address: tuple[str, int], dial: bool = True) -> PeerLink:
        """A link to ``name`` at ``address``; with ``dial``, its dial loop starts now."""
        s = self.settings
        link = self.links[name] = PeerLink(name, address, PeerHealth(name, s.fail_limit, s.backoff_s, s.backoff_max_s))
        if dial:
            link.task = self.spawn(self._dial(link))
        return link

    def start(self) -> None:
        """Start the dial loops of links added without one."""
        for link in self.links.values():
            if link.task is None:
                link.task = self.spawn(self._dial(link))

    def remove(self, name: str) -> None:
        """Close ``name``'s link and forget it (the member left, or moved)."""
        link = self.links.pop(name, None)
        if link is None:
            return
        if link.task is not None:
            link.task.cancel()
        if link.client is not None:
            link.client.forget_pings()
            link.client.close()
        if link.transport is not None:
            link.transport.close()
        if link.lane is not None:
            self.spawn(link.lane.close())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for link in self.links.values():
            if link.client is not None:
                link.client.forget_pings()      # a keep-alive cancelled mid-ping: nobody will read its answer
                link.client.close()
            if link.transport is not None:
                link.transport.close()
        for link in self.links.values():
            if link.lane is not None:
                await link.lane.close()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` in a task the links keep until it ends (cancelled at :meth:`stop`)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- dialling, resumption, keepalive --

    async def _dial(self, link: PeerLink) -> None:
        """Keep a connection to ``link``'s peer, so this daemon's snapshot and announcements
        reach it before any pull needs them: dialled at start, and again after it drops (every
        REDIAL_S while the peer is up, after its backoff while it is down)."""
        quiet = False
        while True:
            client = link.client
            if client is not None and client.usable:
                await self._keepalive(link, client)
                continue
            if link.health.usable(self.clock()):
                try:
                    await self.client(link, self.clock() + self.settings.pull_timeout_s)
                    quiet = False
                    continue
                except Exception as exc:
                    self.dial_failed(link, exc)
                    if not quiet:
                        log.info("peer not reachable", extra={"fields": {"peer": link.name, "reason": why(exc)}})
                        quiet = True          # said once until it connects
            await asyncio.sleep(max(REDIAL_S, link.health.retry_at - self.clock()))

    async def _keepalive(self, link: PeerLink, client: PeerClientProtocol) -> None:
        """Until ``client`` closes: ping it when idle, so a peer that died (no close ever comes
        over UDP) is noticed within KEEPALIVE_S plus the pull deadline, not the idle timeout."""
        closed = asyncio.ensure_future(client.wait_closed())
        try:
            while not closed.done():
                await asyncio.wait({closed}, timeout=KEEPALIVE_S)
                if closed.done() or not client.verified:
                    continue
                try:
                    await asyncio.wait_for(client.ping(), self.settings.pull_timeout_s)
                    if client.usable and link.health.succeeded():
                        log.info("peer up", extra={"fields": {"peer": link.name}})
                except (asyncio.TimeoutError, ConnectionError) as exc:
                    client.forget_pings()
                    self.dial_failed(link, exc if str(exc) else TimeoutError("no answer to a keep-alive ping"))
                    client.close()
                    if link.client is client:
                        link.client = None
                    return
        finally:
            closed.cancel()

    def dial_failed(self, link: PeerLink, exc: BaseException) -> None:
        """A request or connection attempt to ``link``'s peer failed. A connection that never
        completed, or one to a peer now marked down, is closed (a dead peer's connection would
        otherwise linger until its idle timeout): the next request dials afresh."""
        went_down = link.health.failed(self.clock(), why(exc))
        client = link.client
        if client is not None and (not client.verified or went_down):
            client.close()
            link.client = None
        if went_down:
            log.warning("peer down", extra={"fields": {"peer": link.name, "reason": why(exc),
                                                       "retry_s": round(link.health.retry_at - self.clock(), 2)}})

    async def client(self, link: PeerLink, deadline: float) -> PeerClientProtocol:
        """The link's connection, dialled if there is none. With a fresh session ticket it is
        returned at once, before the handshake completes (0-RTT: Pull and Exists only)."""
        client = link.client
        if client is not None and client.usable and (client.verified or client.early):
            return client
        async with link.lock:
            client = link.client
            if client is not None and client.usable:
                if not (client.verified or client.early):
                    await asyncio.wait_for(asyncio.shield(client.ready), max(deadline - self.clock(), 0.001))
                return client
            loop = asyncio.get_running_loop()
            host, port = link.address
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            family, _, _, _, addr = infos[0]
            config = self.auth.configuration(self.settings.options, server_name=link.name)
            early = link.ticket is not None and self.clock() - link.ticket_at < TICKET_LIFETIME_S
            if early:
                config.session_ticket, link.ticket = link.ticket, None       # single use
            quic = QuicConnection(configuration=config, session_ticket_handler=functools.partial(self._ticket, link))
            factory = functools.partial(PeerClientProtocol, quic, auth=self.auth, peer=link.name,
                                        max_payload=self.settings.max_payload)
            if link.transport is not None:
                link.transport.close()
            link.transport, client = await loop.create_datagram_endpoint(
                factory, local_addr=("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            client.early = early
            client.connect(addr)
            link.client = client
            self.spawn(self._watch(link, client))
            if not early:
                await asyncio.wait_for(asyncio.shield(client.ready), max(deadline - self.clock(), 0.001))
        return client

    def lane(self, link: PeerLink, client: PeerClientProtocol) -> LaneClient | None:
        """The lane to pull from ``link``'s peer over, or None (lanes off, the peer's QUIC
        handshake not complete yet, or the lane failed a short while ago)."""
        if self.settings.lane not in LANE_MODES or not client.verified or self.clock() < link.lane_retry_at:
            return None
        if link.lane is None:
            link.lane = LaneClient(self.auth, link.name, link.address, self.settings.max_payload,
                                   mode=self.settings.lane, stripes=self.settings.lane_stripes)
        return link.lane

    async def over_lane(self, link: PeerLink, client: PeerClientProtocol,
                         request: Callable[[LaneClient, tuple[bytes, bytes] | None, float], Awaitable[T]],
                         setup_s: float) -> T | None:
        """``request(lane, key, setup_s)`` over ``link``'s lane (``setup_s``: the most opening a
        lane may take, so that QUIC still has time for the same request); None where there is
        no lane, or it could not be had or broke (then counted and left alone for a while: the
        caller goes over QUIC). Only a cancellation passes through."""
        lane = self.lane(link, client)
        if lane is None:
            return None
        try:
            key = await client.lane_key() if lane.mode == "mac" else None
            return await request(lane, key, setup_s)
        except LANE_FAILURES as exc:
            self.lane_failed(link, exc)
        except Exception as exc:             # not a way a lane should fail: QUIC all the same, and said
            log.warning("lane failed unexpectedly; pulling over QUIC", exc_info=True,
                        extra={"fields": {"peer": link.name, "error": type(exc).__name__}})
            self.lane_failed(link, exc)
        return None

    def nixl_usable(self, link: PeerLink, client: PeerClientProtocol) -> bool:
        """Whether to pull from ``link``'s peer over NIXL now (NIXL on here, the session
        verified, and NIXL did not fail with this peer a short while ago)."""
        return self.nixl is not None and client.verified and self.clock() >= link.nixl_retry_at

    def nixl_failed(self, link: PeerLink, exc: BaseException) -> None:
        """NIXL could not be used with ``link``'s peer: counted, left alone for ``lane_retry_s``
        (what is left of the pull goes over the lane or QUIC), said once each time."""
        assert self.nixl is not None
        self.nixl.counters.fallbacks += 1
        link.nixl_retry_at = self.clock() + self.settings.lane_retry_s
        log.info("NIXL not usable; pulling over the lane or QUIC",
                 extra={"fields": {"peer": link.name, "reason": why(exc), "retry_s": self.settings.lane_retry_s}})

    def lane_failed(self, link: PeerLink, exc: BaseException) -> None:
        self.counters.lane_fallbacks += 1
        link.lane_retry_at = self.clock() + self.settings.lane_retry_s
        log.info("lane not usable; pulling over QUIC", extra={"fields": {"peer": link.name, "reason": why(exc),
                                                                         "retry_s": self.settings.lane_retry_s}})

    def _ticket(self, link: PeerLink, ticket: SessionTicket) -> None:
        link.ticket, link.ticket_at = ticket, self.clock()

    async def _watch(self, link: PeerLink, client: PeerClientProtocol) -> None:
        """Once the handshake of ``client`` completes: send the snapshot, then announcements;
        when the connection ends, forget it."""
        try:
            await client.ready
        except Exception:
            pass
        else:
            log.info("peer connected", extra={"fields": {"peer": link.name, "resumed": client.early}})
            await self.on_connected(link, client)    # the peer is up once it answers (a ping, a pull): it may still refuse us
        await client.wait_closed()
        if link.client is client:
            link.client = None
            link.pending.clear()
            link.snapshotting = False
        if client.refused:
            log.warning("peer connection refused", extra={"fields": {"peer": link.name, "reason": client.refused}})
            self.dial_failed(link, PeerGone(f"refused: {client.refused}"))    # backs off like any failure


async def _nothing(link: PeerLink, client: PeerClientProtocol) -> None:
    return None


def why(exc: BaseException) -> str:
    """An exception in a few words, for the log and the peer's last error."""
    return str(exc) or type(exc).__name__
