"""The peer tier: pulls from the other daemons of the cluster, and serving theirs.

:class:`PeerTier` owns the QUIC server (the pulls peers make of this daemon, and their
announcements), one :class:`PeerLink` per configured peer (the pulls this daemon makes, and its
own announcements), the :class:`~kvcached.peers.directory.PeerDirectory` of who holds what and
each peer's health. The store calls :meth:`PeerTier.prefix` in Lookup and :meth:`PeerTier.fetch`
when every local tier misses (flow 5 of DESIGN.md).

A fetch has one deadline (``[quic] pull_timeout_s``): whatever has not arrived by then is a miss,
never a hang. Each block goes to the first usable peer that holds it; a pull that has not
finished after ``hedge_ms`` is also asked of the next holder, and the first copy in wins. A
payload is written straight into the arena slot the store reserved for it, and its BLAKE3
checksum is checked against the Block head before the store sees it: a damaged copy is dropped,
counted, and the next holder is asked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence, TypeVar

from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from kvcached.errors import KvError
from kvcached.index import PresenceFeed
from kvcached.peers import protocol as p
from kvcached.peers.directory import PeerDirectory, PeerHealth, wire_key
from kvcached.peers.handshakes import HandshakeLimits
from kvcached.peers.homes import HomeLocator
from kvcached.peers.lane import LANE_MODES
from kvcached.peers.lane_client import LaneClient
from kvcached.peers.lane_mac import LaneKeys, MacRefused
from kvcached.peers.lane_server import MAX_LANES, LaneServer
from kvcached.peers.quic import PeerClientProtocol, PeerServerProtocol
from kvcached.peers.server import GuardedQuicServer
from kvcached.peers.session import PeerGone, PeerHandler, PullSink
from kvcached.peers.store_link import serve_pull
from kvcached.peers.tls import TICKET_LIFETIME_S, PeerAuth, PeerRefused, QuicOptions, ServerTickets
from kvcached_agent.address import BlockAddress

__all__ = ["PeerTier", "PeerSettings", "PeerLink", "PeerCounters"]

log = logging.getLogger("kvcached.peers")

ANNOUNCE_S = 0.05            # announcements are batched this long
SNAPSHOT_PART = 16384        # addresses per Snapshot part (~590 KB)
PULL_BATCH = 64              # addresses per Pull: big enough to keep the pipe full, small enough to hedge
KEEPALIVE_S = 2.0           # an idle connection is pinged this often
REDIAL_S = 1.0              # a peer that is up but not connected is dialled again this often
SERVE_MAX_PULLS = 64         # pulls served at once; more are answered Miss(OVERLOADED)

Reserve = Callable[[BlockAddress, int], "tuple[Any, memoryview] | None"]
T = TypeVar("T")
#: How a lane fails when it cannot be had or breaks (the request then goes over QUIC). Anything
#: else a lane raises sends the request over QUIC too, logged as a warning: a lane's own fault
#: must never cost a block QUIC could have brought.
LANE_FAILURES = (OSError, ssl.SSLError, PeerRefused, PeerGone, asyncio.TimeoutError, p.ProtocolError, MacRefused)


@dataclass(frozen=True)
class PeerSettings:
    listen: tuple[str, int] | None
    peers: dict[str, tuple[str, int]]          # name -> (host, port)
    options: QuicOptions = QuicOptions()
    pull_timeout_s: float = 2.0
    hedge_s: float = 0.05
    fail_limit: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    max_payload: int = 16 << 20
    limits: HandshakeLimits = HandshakeLimits()
    lane: str = "tls"                          # pulls over a lane (kvcached.peers.lane): "tls" or "mac"; "quic": none
    lane_retry_s: float = 30.0                 # a lane that could not be had is tried again after this
    lane_stripes: int = 1                      # connections one large pull is split over (1: none)
    lane_max_connections: int = MAX_LANES      # verified lanes this daemon's lane server keeps at once
    member: str | None = None                  # in a cluster ([cluster] etcd): this daemon's member name
    replicas: int = 2                          # in a cluster: home nodes of each block
    placement_bits: int = 18                   # in a cluster: 2**bits placement buckets


@dataclass
class PeerCounters:
    pulled: int = 0            # blocks that arrived whole and verified
    pulled_bytes: int = 0
    missed: int = 0            # blocks no peer sent in time
    corrupt: int = 0           # copies that failed their checksum
    failed: int = 0            # pulls that failed (timeout, connection lost, error answer)
    hedged: int = 0            # pulls also asked of a second peer
    served: int = 0            # blocks sent to peers
    served_bytes: int = 0
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
    ticket_at: float = 0.0                     # when the ticket came, by the tier's clock
    pending: dict[bytes, bool] = field(default_factory=dict)   # wire key -> held (announce) or not (drop)
    snapshotting: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    transport: Any = None
    lane: LaneClient | None = None
    lane_retry_at: float = 0.0                 # the lane failed: QUIC until then
    task: "asyncio.Task[None] | None" = None   # the dial loop (cancelled when the member leaves)


class PeerTier(PeerHandler):
    def __init__(self, store: Any, auth: PeerAuth, settings: PeerSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.auth, self.settings, self.clock = store, auth, settings, clock
        s = settings
        self.links = {name: PeerLink(name, addr, PeerHealth(name, s.fail_limit, s.backoff_s, s.backoff_max_s))
                      for name, addr in s.peers.items()}
        self.directory = PeerDirectory(list(self.links))
        #: In a cluster: where blocks are, kept by their home nodes (None: the static [quic] peers,
        #: each announcing everything to every other, kept in ``directory``).
        self.homes = HomeLocator(self, s.member, s.replicas, s.placement_bits) if s.member else None
        #: In a cluster: what keeps the membership (kvcached.cluster.etcd.EtcdMembership, set by
        #: the daemon), for Stats.
        self.membership: Any = None
        self.tickets = ServerTickets(time.time)
        self.counters = PeerCounters()
        self.serving = 0
        self._server: Any = None
        self._server_protocol: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listing = 0
        self.lane_server: LaneServer | None = None
        self.lane_keys = LaneKeys() if settings.lane == "mac" else None
        #: What this daemon's index gained and dropped, announced to peers (set it as the
        #: index's ``presence`` too).
        self.presence = PresenceFeed()

    # -- lifecycle --

    async def start(self, quic_fd: int | None = None, lane_fd: int | None = None) -> None:
        """Listen (QUIC, and the lane's TCP port) and dial the peers. ``quic_fd``, ``lane_fd``:
        listening sockets a predecessor passed at an upgrade (kvcached.handover), used instead
        of binding; QUIC connections to the predecessor are not carried over (peers dial again)."""
        loop = asyncio.get_running_loop()
        if self.settings.listen is not None:
            host, port = self.settings.listen
            config = self.auth.configuration(self.settings.options)
            protocol = functools.partial(PeerServerProtocol, auth=self.auth, tickets=self.tickets, handler=self,
                                         lane_keys=self.lane_keys)
            where: dict[str, Any] = ({"sock": socket.socket(fileno=quic_fd)} if quic_fd is not None
                                     else {"local_addr": (host, port)})
            self._server, self._server_protocol = await loop.create_datagram_endpoint(
                lambda: GuardedQuicServer(configuration=config, create_protocol=protocol, limits=self.settings.limits),
                **where)
            if self.settings.lane in LANE_MODES:   # TCP, the QUIC port's number
                self.lane_server = LaneServer(self.auth, self, mode=self.settings.lane, keys=self.lane_keys,
                                              limits=self.settings.limits, max_lanes=self.settings.lane_max_connections)
                try:
                    await self.lane_server.start(host, self._server.get_extra_info("sockname")[1], lane_fd)
                except OSError:
                    self._server.close()
                    raise
        self._spawn(self._announcer())
        if self.homes is not None:
            self._spawn(self._own_listing())
        for link in self.links.values():
            link.task = self._spawn(self._dial(link))

    async def _own_listing(self) -> None:
        """In a cluster: this daemon's blocks it is a home of, into its own records."""
        assert self.homes is not None
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(None, self.store.index.present_wire_keys)
        self.homes.own_listing(keys)

    @property
    def listening_fds(self) -> dict[str, int]:
        """The listening sockets, by handover name (what an upgrade passes on)."""
        fds = {}
        if self._server is not None:
            fds["quic"] = self._server.get_extra_info("socket").fileno()
        if self.lane_server is not None:
            fds["lane"] = self.lane_server.listening_fd
        return fds

    @property
    def address(self) -> tuple[str, int] | None:
        """The UDP address the server listens on (port 0 in the config: the one it got)."""
        return self._server.get_extra_info("sockname")[:2] if self._server is not None else None

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for link in self.links.values():
            if link.client is not None:
                link.client.forget_pings()      # a keep-alive cancelled mid-ping: nobody will read its answer
                link.client.close()
            if link.transport is not None:
                link.transport.close()
        if self._server is not None:
            self._server_protocol.close()      # closes every connection peers opened here, then the socket
        if self.lane_server is not None:
            await self.lane_server.stop()
        for link in self.links.values():
            if link.lane is not None:
                await link.lane.close()
        await asyncio.sleep(0)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- membership (a cluster) --

    def apply_membership(self, members: dict[str, tuple[str, int]]) -> None:
        """The cluster's live members are now ``members`` (name -> QUIC address; this daemon's
        own entry is left out): links to those gone are closed, links to those new dialled, a
        member registered at a new address dialled there; only members may connect here; the
        placement follows, and the homes of moved buckets hear of this daemon's blocks."""
        assert self.homes is not None, "apply_membership is for a cluster ([cluster] etcd)"
        me = self.homes.me
        wanted = {name: addr for name, addr in members.items() if name != me}
        left = [name for name, link in self.links.items() if wanted.get(name) != link.address]
        for name in left:
            self._close_link(self.links.pop(name))
        for name, address in wanted.items():
            if name not in self.links:
                s = self.settings
                link = self.links[name] = PeerLink(name, address,
                                                   PeerHealth(name, s.fail_limit, s.backoff_s, s.backoff_max_s))
                link.task = self._spawn(self._dial(link))
        self.auth.peer_names = frozenset(wanted)
        gone = [name for name in left if name not in wanted]
        for name in left:                # what it sent is forgotten below: it must connect anew to be heard
            if self._server_protocol is not None:
                self._server_protocol.close_peer(name)
        moves = self.homes.members_changed(set(wanted), gone)
        if len(moves):
            self._spawn(self.homes.republish(moves))

    def _close_link(self, link: PeerLink) -> None:
        if link.task is not None:
            link.task.cancel()
        if link.client is not None:
            link.client.forget_pings()
            link.client.close()
        if link.transport is not None:
            link.transport.close()
        if link.lane is not None:
            self._spawn(link.lane.close())

    # -- links: dialling, resumption, announcements --

    def usable_mask(self) -> int:
        """The directory's mask of the usable peers (static peers; 0 in a cluster, which keeps
        no directory: :meth:`holders_of` asks each link)."""
        if self.homes is not None:
            return 0
        now = self.clock()
        return self.directory.mask(name for name, link in self.links.items() if link.health.usable(now))

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
                    await self._client(link, self.clock() + self.settings.pull_timeout_s)
                    quiet = False
                    continue
                except Exception as exc:
                    self._dial_failed(link, exc)
                    if not quiet:
                        log.info("peer not reachable", extra={"fields": {"peer": link.name, "reason": _why(exc)}})
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
                    self._dial_failed(link, exc if str(exc) else TimeoutError("no answer to a keep-alive ping"))
                    client.close()
                    if link.client is client:
                        link.client = None
                    return
        finally:
            closed.cancel()

    def _dial_failed(self, link: PeerLink, exc: BaseException) -> None:
        """A request or connection attempt to ``link``'s peer failed. A connection that never
        completed, or one to a peer now marked down, is closed (a dead peer's connection would
        otherwise linger until its idle timeout): the next request dials afresh."""
        went_down = link.health.failed(self.clock(), _why(exc))
        client = link.client
        if client is not None and (not client.verified or went_down):
            client.close()
            link.client = None
        if went_down:
            log.warning("peer down", extra={"fields": {"peer": link.name, "reason": _why(exc),
                                                       "retry_s": round(link.health.retry_at - self.clock(), 2)}})

    async def _client(self, link: PeerLink, deadline: float) -> PeerClientProtocol:
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
            self._spawn(self._watch(link, client))
            if not early:
                await asyncio.wait_for(asyncio.shield(client.ready), max(deadline - self.clock(), 0.001))
        return client

    def _lane(self, link: PeerLink, client: PeerClientProtocol) -> LaneClient | None:
        """The lane to pull from ``link``'s peer over, or None (lanes off, the peer's QUIC
        handshake not complete yet, or the lane failed a short while ago)."""
        if self.settings.lane not in LANE_MODES or not client.verified or self.clock() < link.lane_retry_at:
            return None
        if link.lane is None:
            link.lane = LaneClient(self.auth, link.name, link.address, self.settings.max_payload,
                                   mode=self.settings.lane, stripes=self.settings.lane_stripes)
        return link.lane

    async def _over_lane(self, link: PeerLink, client: PeerClientProtocol,
                         request: Callable[[LaneClient, tuple[bytes, bytes] | None, float], Awaitable[T]],
                         setup_s: float) -> T | None:
        """``request(lane, key, setup_s)`` over ``link``'s lane (``setup_s``: the most opening a
        lane may take, so that QUIC still has time for the same request); None where there is
        no lane, or it could not be had or broke (then counted and left alone for a while: the
        caller goes over QUIC). Only a cancellation passes through."""
        lane = self._lane(link, client)
        if lane is None:
            return None
        try:
            key = await client.lane_key() if lane.mode == "mac" else None
            return await request(lane, key, setup_s)
        except LANE_FAILURES as exc:
            self._lane_failed(link, exc)
        except Exception as exc:             # not a way a lane should fail: QUIC all the same, and said
            log.warning("lane failed unexpectedly; pulling over QUIC", exc_info=True,
                        extra={"fields": {"peer": link.name, "error": type(exc).__name__}})
            self._lane_failed(link, exc)
        return None

    def _lane_failed(self, link: PeerLink, exc: BaseException) -> None:
        self.counters.lane_fallbacks += 1
        link.lane_retry_at = self.clock() + self.settings.lane_retry_s
        log.info("lane not usable; pulling over QUIC", extra={"fields": {"peer": link.name, "reason": _why(exc),
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
            await self._snapshot(link, client)    # the peer is up once it answers (a ping, a pull): it may still refuse us
        await client.wait_closed()
        if link.client is client:
            link.client = None
            link.pending.clear()
            link.snapshotting = False
        if client.refused:
            log.warning("peer connection refused", extra={"fields": {"peer": link.name, "reason": client.refused}})
            self._dial_failed(link, PeerGone(f"refused: {client.refused}"))    # backs off like any failure

    async def _snapshot(self, link: PeerLink, client: PeerClientProtocol) -> None:
        """Send ``link``'s peer the listing of this daemon's blocks: all of them (static peers),
        or those it is a home of (a cluster)."""
        link.snapshotting = True
        link.pending.clear()          # changes from now on are sent after the listing
        try:
            loop = asyncio.get_running_loop()
            keys = await loop.run_in_executor(None, self.store.index.present_wire_keys)
            if self.homes is not None:
                keys = await loop.run_in_executor(None, self.homes.listing_for, link, keys)
            self._listing = (self._listing + 1) & 0xFFFFFFFF or 1
            parts = [keys[i:i + SNAPSHOT_PART] for i in range(0, len(keys), SNAPSHOT_PART)] or [[]]
            for i, part in enumerate(parts):
                if not client.usable:
                    return
                client.send_event(p.Snapshot(i, i == len(parts) - 1, [_split(k) for k in part]), self._listing)
                await asyncio.sleep(0)
            log.info("snapshot sent", extra={"fields": {"peer": link.name, "blocks": len(keys)}})
        except Exception:
            log.exception("sending a snapshot failed", extra={"fields": {"peer": link.name}})
        finally:
            link.snapshotting = False

    def _take_changes(self) -> None:
        """Move what the index recorded since the last round (wire keys this daemon now holds,
        and no longer holds) into each live peer's pending announcements; peers not connected
        now get a snapshot when they are."""
        changes = self.presence.take()
        if self.homes is not None:       # a cluster: to the homes of these blocks only
            if changes:
                self.homes.changed(dict(changes))     # the last change of each key wins
            return
        live = [link for link in self.links.values() if link.client is not None and link.client.verified]
        for link in live:
            link.pending.update(changes)

    async def _announcer(self) -> None:
        while True:
            await asyncio.sleep(ANNOUNCE_S)
            self._take_changes()
            if self.homes is not None:
                self.homes.expire()
            for link in self.links.values():
                client = link.client
                if link.snapshotting or not link.pending or client is None or not client.verified:
                    continue
                pending, link.pending = link.pending, {}
                try:
                    for message in _announcements(pending):
                        client.send_event(message)
                except Exception:
                    log.exception("sending announcements failed", extra={"fields": {"peer": link.name}})

    # -- the store's side: lookup and fetch --

    @property
    def asks_homes(self) -> bool:
        """Whether where blocks are must be asked of their homes (a cluster: :meth:`locate`
        before a Lookup counts peers) rather than known here already (static peers)."""
        return self.homes is not None

    async def locate(self, digests: Sequence[bytes], layer: int) -> None:
        """In a cluster: ask the homes where these blocks are, so :meth:`held` can say (within
        the pull deadline; what is not answered by then counts as held by no peer)."""
        if self.homes is not None:
            try:
                async with asyncio.timeout(self.settings.pull_timeout_s):
                    await self.homes.locate([wire_key(d, layer) for d in digests])
            except TimeoutError:
                pass

    def held(self, digests: Sequence[bytes], layer: int) -> list[bool]:
        """Per digest, whether a usable peer holds it (Lookup's peer column; in a cluster, as
        the homes said within LOCATION_TTL_S)."""
        if self.homes is None and not len(self.directory):
            return [False] * len(digests)
        usable = self.usable_mask()
        return [bool(self.holders_of(wire_key(d, layer), usable)) for d in digests]

    def holds(self, address: BlockAddress, usable: int) -> bool:
        """Whether a fetch of ``address`` may find it: a usable peer holds it (static), or the
        homes said so or were not asked yet (a cluster: the fetch asks them)."""
        key = wire_key(address.digest, address.layer)
        if self.homes is not None and self.homes.known(key) is None:
            return bool(self.links)
        return bool(self.holders_of(key, usable))

    def holders_of(self, key: bytes, usable: int) -> list[str]:
        """The usable peers that hold ``key``, in the order to ask them."""
        if self.homes is None:
            return self.directory.holders(key, usable)
        now, links = self.clock(), self.links
        return [name for name in self.homes.known(key) or () if name in links and links[name].health.usable(now)]

    async def fetch(self, addresses: Sequence[BlockAddress], reserve: Reserve,
                    abort: Callable[[Any], None]) -> list[tuple[BlockAddress, Any, p.Block]]:
        """Pull ``addresses`` from the peers that hold them, into slots from ``reserve``
        (``abort`` gives one back). Returns what arrived verified, within the deadline."""
        fetch = _Fetch(self, {wire_key(a.digest, a.layer): a for a in addresses}, reserve, abort,
                       self.clock() + self.settings.pull_timeout_s)
        try:
            async with asyncio.timeout(self.settings.pull_timeout_s):   # in this task: no task, no loop turn
                if self.homes is not None:
                    await self.homes.locate(list(fetch.wanted))
                await fetch.run()
        except TimeoutError:
            pass
        finally:
            fetch.close()
        self.counters.missed += len(fetch.wanted) - len(fetch.got)
        return list(fetch.got.values())

    # -- PeerHandler: what peers ask of this daemon --

    def connected(self, peer: str) -> None:
        log.info("peer dialled in", extra={"fields": {"peer": peer}})

    def event(self, peer: str, message: p.Announce | p.Drop | p.Snapshot, request_id: int) -> None:
        if peer not in self.links:       # verified, yet not a member now (it left since it connected)
            log.warning("announcement from a peer not configured here ignored", extra={"fields": {"peer": peer}})
            return
        if self.homes is not None:
            if not self.homes.event(peer, message, request_id):
                log.warning("listing part out of order dropped", extra={"fields": {"peer": peer}})
            return
        keys = [wire_key(d, layer) for d, layer in message.addresses]
        if isinstance(message, p.Announce):
            self.directory.announce(peer, keys)
        elif isinstance(message, p.Drop):
            self.directory.drop(peer, keys)
        elif not self.directory.snapshot(peer, request_id, message.part, message.last, keys):
            log.warning("snapshot part out of order dropped", extra={"fields": {"peer": peer, "part": message.part}})

    def answer_locate(self, peer: str, request: p.Locate) -> p.Located:
        if self.homes is None:
            return super().answer_locate(peer, request)
        return self.homes.answer(request)

    def exists(self, peer: str, request: p.Exists) -> int:
        return self.store.local_prefix(request.digests, request.layer)

    async def pull(self, peer: str, request: p.Pull) -> list[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss]:
        if self.serving >= SERVE_MAX_PULLS:
            return [p.Miss(d, layer, p.MissReason.OVERLOADED) for d, layer in request.addresses]
        self.serving += 1
        try:
            return await self.serve_pull(request.addresses, request.max_payload)
        except KvError:
            return [p.Miss(d, layer, p.MissReason.BUSY) for d, layer in request.addresses]
        finally:
            self.serving -= 1

    async def serve_pull(self, rows: Sequence[tuple[bytes, int]],
                         max_payload: int) -> list[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss]:
        """A peer's Pull, answered from this daemon's RAM and SSD (kvcached.peers.store_link)."""
        return await serve_pull(self.store, rows, max_payload, self.counters)

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        return {"peers": {name: {"up": link.health.usable(now), "state": link.health.state.value,
                                 "connected": bool(link.client and link.client.verified),
                                 "blocks": self.directory.count(name) if self.homes is None else 0,
                                 "last_error": link.health.last_error}
                          for name, link in self.links.items()},
                **{f"peer_{k}": v for k, v in vars(self.counters).items()},
                **({"cluster": {**self.homes.stats(), **(self.membership.stats() if self.membership else {})}}
                   if self.homes is not None else {})}

    def server_stats(self) -> dict[str, Any]:
        """The QUIC server's connection state and what its bounds refused (handshakes.py);
        empty where this daemon does not listen."""
        server: GuardedQuicServer | None = self._server_protocol
        if server is None:
            return {}
        return {"quic_handshakes": server.table.handshaking, "quic_connections": server.table.connections,
                "quic_retries": server.retries, "quic_dropped_datagrams": server.dropped,
                "quic_refused": dict(server.table.refused),
                **({"lane_refused": self.lane_server.counters.refused + sum(
                    link.lane.refused for link in self.links.values() if link.lane is not None),
                    "lane_bad_seals": self.lane_server.counters.bad_seals,
                    "lane_stalled": self.lane_server.counters.stalled,
                    "lane_handshakes": self.lane_server.handshakes, "lane_connections": self.lane_server.lanes,
                    "lane_limited": dict(self.lane_server.table.refused)}
                   if self.lane_server is not None else {})}


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _split(key: bytes) -> tuple[bytes, int]:
    return key[:32], int.from_bytes(key[32:36], "little")


def _announcements(pending: dict[bytes, bool]) -> list[p.Announce | p.Drop]:
    gained = [_split(k) for k, held in pending.items() if held]
    dropped = [_split(k) for k, held in pending.items() if not held]
    out: list[p.Announce | p.Drop] = []
    for i in range(0, len(dropped), p.MAX_BATCH):
        out.append(p.Drop(dropped[i:i + p.MAX_BATCH]))
    for i in range(0, len(gained), p.MAX_BATCH):
        out.append(p.Announce(gained[i:i + p.MAX_BATCH]))
    return out


class _Fetch:
    """One fetch: which peer was asked for which block, what arrived, what is still wanted."""

    def __init__(self, tier: PeerTier, wanted: dict[bytes, BlockAddress], reserve: Reserve,
                 abort: Callable[[Any], None], deadline: float) -> None:
        self.tier, self.wanted, self.reserve, self.abort = tier, wanted, reserve, abort
        self.deadline = deadline                 # by the tier's clock
        self.got: dict[bytes, tuple[BlockAddress, Any, p.Block]] = {}
        self.tried: dict[bytes, set[str]] = {k: set() for k in wanted}
        self.sinks: list[_Sink] = []
        self.losers: set[asyncio.Future[None]] = set()   # attempts (tasks) cancelled because another won

    def _plan(self, keys: Iterable[bytes]) -> dict[str, list[bytes]]:
        """Each key not in yet to the first usable holder not asked yet."""
        usable = self.tier.usable_mask()
        plan: dict[str, list[bytes]] = {}
        for key in keys:
            if key in self.got:
                continue
            for name in self.tier.holders_of(key, usable):
                if name not in self.tried[key]:
                    plan.setdefault(name, []).append(key)
                    break
        return plan

    async def run(self) -> None:
        while True:
            plan = self._plan(self.wanted)
            if not plan:
                return
            pulls = [(name, keys[i:i + PULL_BATCH]) for name, keys in plan.items()
                     for i in range(0, len(keys), PULL_BATCH)]
            if len(pulls) == 1:            # the common case: awaited here, a loop turn sooner
                await self._hedged(*pulls[0])
            else:
                await asyncio.gather(*(self._hedged(name, keys) for name, keys in pulls))

    async def _hedged(self, name: str, keys: list[bytes]) -> None:
        """Pull ``keys`` from ``name`` in this task (no task of its own: none to start, none to
        wait on, a loop turn or two less per fetch). If that has not brought them all within
        ``hedge_s``, the keys still missing are asked of their next holders too, in tasks; the
        first to bring every key wins and the others are stopped (their streams closed). The
        attempt in this task is stopped by cancelling this task once, marked as a lost race:
        the cancel is taken back here, so a deadline's cancel still ends the fetch."""
        task = asyncio.current_task()
        assert task is not None
        hedges: set[asyncio.Future[None]] = set()
        first_running = True
        won = False                            # a hedge brought every key while the first attempt ran

        def settled(_: asyncio.Future[None]) -> None:
            nonlocal won
            if first_running and not won and all(k in self.got for k in keys):
                won = True                     # stop the first attempt
                self.losers.add(task)
                task.cancel()

        def hedge() -> None:
            for other, rest in self._plan(k for k in keys if k not in self.got).items():
                self.tier.counters.hedged += 1
                attempt = asyncio.ensure_future(self._attempt(other, rest))
                attempt.add_done_callback(settled)
                hedges.add(attempt)

        timer = asyncio.get_running_loop().call_later(self.tier.settings.hedge_s, hedge)
        try:
            try:
                await self._attempt(name, keys)
            except asyncio.CancelledError:
                if not won:
                    raise                      # the deadline: the fetch ends (the hedges too, below)
                task.uncancel()
            finally:
                first_running = False
                timer.cancel()
                self.losers.discard(task)
            pending = {h for h in hedges if not h.done()}
            while pending and not all(k in self.got for k in keys):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Hedges still running lost the race, or the deadline passed: stop their streams, and
            # wait until they have, so nothing is written into a slot once the fetch gave it back.
            pending = {h for h in hedges if not h.done()}
            for attempt in pending:
                if all(k in self.got for k in keys):
                    self.losers.add(attempt)
                attempt.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _attempt(self, name: str, keys: list[bytes]) -> None:
        tier = self.tier
        for key in keys:
            self.tried[key].add(name)
        link = tier.links.get(name)
        if link is None:                       # the member left since the plan was made
            return
        sink = _Sink(self, name, set(keys))
        self.sinks.append(sink)
        try:
            client = await tier._client(link, tier.clock() + tier.settings.pull_timeout_s)
            lane_sink = sink

            async def over_lane(lane: LaneClient, key: tuple[bytes, bytes] | None, setup_s: float) -> bool:
                await lane.pull([_split(k) for k in keys], lane_sink, key, setup_s)
                return True

            # Half of what is left for opening a lane: a lane that cannot be had leaves QUIC the rest.
            if await tier._over_lane(link, client, over_lane, (self.deadline - tier.clock()) / 2):
                tier.counters.lane_pulls += 1
                keys = []
            else:                               # no lane, or it failed: what it left goes over QUIC
                sink.close()                    # slots of payloads cut short on the lane go back
                keys = [k for k in keys if k not in self.got]
                sink = _Sink(self, name, set(keys))
                self.sinks.append(sink)
            if keys:
                await client.pull([_split(k) for k in keys], sink)
        except (PeerGone, OSError, p.ProtocolError, asyncio.TimeoutError, RuntimeError) as exc:
            tier.counters.failed += 1
            tier._dial_failed(link, exc)
        except asyncio.CancelledError:
            if asyncio.current_task() not in self.losers:      # the deadline passed, not a lost hedge race
                tier.counters.failed += 1
                tier._dial_failed(link, TimeoutError(f"no answer within {tier.settings.pull_timeout_s:g} s"))
            raise
        else:
            if link.health.succeeded():
                log.info("peer up", extra={"fields": {"peer": name}})
        finally:
            sink.close()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class _Sink(PullSink):
    """Answers of one pull from one peer: payloads into reserved slots, checked on arrival."""

    def __init__(self, fetch: _Fetch, peer: str, keys: set[bytes]) -> None:
        self.fetch, self.peer, self.keys = fetch, peer, keys
        self.open: dict[bytes, tuple[Any, memoryview]] = {}   # reserved, payload not all in
        self.closed = False

    def slot(self, block: p.Block) -> memoryview | None:
        key = wire_key(block.digest, block.layer)
        fetch = self.fetch
        if self.closed or key not in self.keys or key in fetch.got or key in self.open:
            return None
        if block.payload_length > fetch.tier.settings.max_payload:
            return None
        reserved = fetch.reserve(fetch.wanted[key], block.payload_length)
        if reserved is None:
            return None
        self.open[key] = reserved
        return reserved[1][:block.payload_length]

    def arrived(self, block: p.Block) -> None:
        # Checked on the event loop. A worker thread (BLAKE3 releases the GIL) was tried and
        # dropped: in an ad-hoc timing on the 2-core machines here it was slower, taking CPU
        # from the peer's sending process and the loop's reads (no benchmark measures it).
        key = wire_key(block.digest, block.layer)
        handle, view = self.open.pop(key)
        fetch, counters = self.fetch, self.fetch.tier.counters
        if key in fetch.got or not block.verify(view[:block.payload_length]):
            if key not in fetch.got:
                counters.corrupt += 1
                log.warning("pulled block failed its checksum; dropped",
                            extra={"fields": {"peer": self.peer, "digest": block.digest.hex(), "layer": block.layer}})
            fetch.abort(handle)
            return
        counters.pulled += 1
        counters.pulled_bytes += block.payload_length
        fetch.got[key] = (fetch.wanted[key], handle, block)

    def missed(self, miss: p.Miss) -> None:
        pass                     # another holder is asked in the next round, if there is one

    def close(self) -> None:
        """No more answers are taken; slots whose payload did not all arrive are given back."""
        self.closed = True
        for handle, _ in self.open.values():
            self.fetch.abort(handle)
        self.open.clear()
