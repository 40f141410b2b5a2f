"""The peer tier: pulls from the other daemons of the cluster, and serving theirs.

:class:`PeerTier` composes the parts, each in a room of its own:

- the servers: QUIC (kvcached.peers.server, the pulls peers make of this daemon and their
  announcements) and the bulk lane's (kvcached.peers.lane_server);
- the connections this daemon makes: :class:`~kvcached.peers.links.PeerLinks`, a link per peer,
  dialled, kept alive, backed off;
- where blocks are: a :class:`~kvcached.peers.locator.Locator`, static peers' directory or a
  cluster's homes, chosen here once;
- the fetches: :class:`~kvcached.peers.fetch.Fetch`, with hedging and deadlines;
- the announcer: what the index gained and dropped, batched every ANNOUNCE_S to the links that
  must hear of it, and each link's listing when it connects.

The store calls :meth:`PeerTier.held` in Lookup and :meth:`PeerTier.fetch` when every local tier
misses (flow 5 of DESIGN.md; the store sees the tier as kvcached.store.peer_pulls.PeerTierLike);
the tier reaches the store through :class:`~kvcached.peers.store_link.StoreLink` only. A fetch
has one deadline (``[quic] pull_timeout_s``): whatever has not arrived by then is a miss, never
a hang.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvcached.errors import KvError
from kvcached.index import PresenceFeed
from kvcached.peers import protocol as p
from kvcached.peers.directory import wire_key
from kvcached.peers.fetch import Fetch, FetchSettings, Reserve, split
from kvcached.peers.handshakes import HandshakeLimits
from kvcached.peers.homes import HomeLocator
from kvcached.peers.lane import LANE_MODES
from kvcached.peers.lane_mac import LaneKeys
from kvcached.peers.lane_server import MAX_LANES, LaneServer
from kvcached.peers.links import LinkSettings, PeerCounters, PeerLink, PeerLinks
from kvcached.peers.locator import Locator, StaticLocator
from kvcached.peers.nixl_holder import NixlHolder
from kvcached.peers.nixl_leases import NixlLeases
from kvcached.peers.nixl_pull import NixlPuller
from kvcached.peers.quic import PeerClientProtocol, PeerServerProtocol
from kvcached.peers.server import GuardedQuicServer
from kvcached.peers.session import PeerHandler
from kvcached.peers.store_link import StoreLink, serve_pull
from kvcached.peers.tls import PeerAuth, QuicOptions, ServerTickets
from kvcached_agent.address import BlockAddress

__all__ = ["PeerTier", "PeerSettings", "PeerLink", "PeerCounters"]

log = logging.getLogger("kvcached.peers")

ANNOUNCE_S = 0.05            # announcements are batched this long
SNAPSHOT_PART = 16384        # addresses per Snapshot part (~590 KB)
SERVE_MAX_PULLS = 64         # pulls served at once; more are answered Miss(OVERLOADED)


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
    link_codec: str = "auto"                   # lane pulls coded: "auto" (where it measures faster), "none", a codec
    member: str | None = None                  # in a cluster ([cluster] etcd): this daemon's member name
    replicas: int = 2                          # in a cluster: home nodes of each block
    placement_bits: int = 18                   # in a cluster: 2**bits placement buckets
    nixl_hold_s: float = 10.0                  # NIXL lane: how long a puller's lease keeps its blocks pinned at most
    nixl_leases_per_peer: int = 16             # NIXL lane: leases one peer may hold at once

    def links(self) -> LinkSettings:
        return LinkSettings(self.options, self.pull_timeout_s, self.fail_limit, self.backoff_s, self.backoff_max_s,
                            self.max_payload, self.lane, self.lane_retry_s, self.lane_stripes, self.link_codec)


class PeerTier(PeerHandler):
    """See the module. ``store``: what the peer side reaches of the store; ``member``: in a
    cluster, set in ``settings`` (the homes locate blocks), else the static ``peers``."""

    def __init__(self, store: StoreLink, auth: PeerAuth, settings: PeerSettings,
                 clock: Callable[[], float] = time.monotonic, nixl: Any = None) -> None:
        self.store, self.auth, self.settings, self.clock = store, auth, settings, clock
        s = settings
        self.connections = PeerLinks(auth, s.links(), clock, on_connected=self._send_listing)
        for name, address in s.peers.items():
            self.connections.add(name, address, dial=False)
        self.locator: Locator = (HomeLocator(self.connections, s.member, s.replicas, s.placement_bits,
                                             store.present_wire_keys, s.hedge_s, s.pull_timeout_s)
                                 if s.member else StaticLocator(self.connections))
        #: In a cluster: what keeps the membership (kvcached.cluster.etcd.EtcdMembership, set by
        #: the daemon), for Stats.
        self.membership: Any = None
        self.tickets = ServerTickets(time.time)
        self.serving = 0
        self._server: Any = None
        self._server_protocol: GuardedQuicServer | None = None
        self._listing = 0
        self.lane_server: LaneServer | None = None
        self.lane_keys = LaneKeys() if settings.lane == "mac" else None
        #: The NIXL lane's holder side, where ``nixl`` (a NixlEndpoint over the RAM tier's arena) is
        #: given: the tier closes it when it stops.
        self.nixl_endpoint = nixl
        self.nixl = (NixlHolder(nixl, NixlLeases(s.nixl_hold_s, s.nixl_leases_per_peer, clock), self.pull)
                     if nixl is not None else None)
        self.connections.nixl = NixlPuller(nixl) if nixl is not None else None      # and pulls over it
        #: What this daemon's index gained and dropped, announced to peers (set it as the
        #: index's ``presence`` too).
        self.presence = PresenceFeed()

    @property
    def links(self) -> dict[str, PeerLink]:
        return self.connections.links

    @property
    def counters(self) -> PeerCounters:
        return self.connections.counters

    # -- lifecycle --

    async def start(self, quic_fd: int | None = None, lane_fd: int | None = None) -> None:
        """Listen (QUIC, and the lane's TCP port) and dial the peers. ``quic_fd``, ``lane_fd``:
        listening sockets a predecessor passed at an upgrade (kvcached.lifecycle.handover), used instead
        of binding; QUIC connections to the predecessor are not carried over (peers dial again)."""
        loop = asyncio.get_running_loop()
        if self.settings.listen is not None:
            host, port = self.settings.listen
            config = self.auth.configuration(self.settings.options)
            protocol = functools.partial(PeerServerProtocol, auth=self.auth, tickets=self.tickets, handler=self,
                                         lane_keys=self.lane_keys, nixl=self.nixl)
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
        self.connections.spawn(self._announcer())
        self.connections.spawn(self.locator.start())
        self.connections.start()

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
        await self.connections.stop()
        if self._server_protocol is not None:
            self._server_protocol.close()      # closes every connection peers opened here, then the socket
        if self.lane_server is not None:
            await self.lane_server.stop()
        if self.nixl is not None:
            self.nixl.close()                  # every pin a puller could still read is released
            self.nixl_endpoint.close()         # then NIXL lets go of the arena
        await asyncio.sleep(0)

    # -- membership (a cluster) --

    def apply_membership(self, members: dict[str, tuple[str, int]], me: str) -> None:
        """The live members are now ``members`` (name -> QUIC address; ``me``, this daemon, is
        left out): links to those gone are closed, links to those new dialled, a member
        registered at a new address dialled there; only members may connect here; the locator
        follows (a cluster's placement: the homes of moved buckets hear of this daemon's blocks)."""
        wanted = {name: addr for name, addr in members.items() if name != me}
        left = [name for name, link in self.links.items() if wanted.get(name) != link.address]
        for name in left:
            self.connections.remove(name)
        for name, address in wanted.items():
            if name not in self.links:
                self.connections.add(name, address)
        self.auth.peer_names = frozenset(wanted)
        for name in left:                # what it sent is forgotten below: it must connect anew to be heard
            if self._server_protocol is not None:
                self._server_protocol.close_peer(name)
        self.locator.members_changed(set(wanted), [name for name in left if name not in wanted])

    # -- announcements and listings --

    async def _send_listing(self, link: PeerLink, client: PeerClientProtocol) -> None:
        """Send ``link``'s peer the listing of this daemon's blocks it must know of (all of them
        to a static peer, those homed there to a home), as Snapshot parts."""
        link.snapshotting = True
        link.pending.clear()          # changes from now on are sent after the listing
        try:
            loop = asyncio.get_running_loop()
            keys = await loop.run_in_executor(None, self.store.present_wire_keys)
            keys = await loop.run_in_executor(None, self.locator.listing_for, link.name, keys)
            self._listing = (self._listing + 1) & 0xFFFFFFFF or 1
            parts = [keys[i:i + SNAPSHOT_PART] for i in range(0, len(keys), SNAPSHOT_PART)] or [[]]
            for i, part in enumerate(parts):
                if not client.usable:
                    return
                client.send_event(p.Snapshot(i, i == len(parts) - 1, [split(k) for k in part]), self._listing)
                await asyncio.sleep(0)
            log.info("snapshot sent", extra={"fields": {"peer": link.name, "blocks": len(keys)}})
        except Exception:
            log.exception("sending a snapshot failed", extra={"fields": {"peer": link.name}})
        finally:
            link.snapshotting = False

    async def _announcer(self) -> None:
        """Every ANNOUNCE_S: what the index recorded since (this daemon's blocks gained and
        dropped) to the locator, which queues it for the links that must hear of it, then each
        verified link's queue sent (a link in the middle of its listing waits for it)."""
        while True:
            await asyncio.sleep(ANNOUNCE_S)
            changes = self.presence.take()
            if changes:
                self.locator.changed(dict(changes))     # the last change of each key wins
            self.locator.tick()
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

    # -- the store's side: lookup and fetch (kvcached.store.peer_pulls.PeerTierLike) --

    @property
    def asks_homes(self) -> bool:
        """Whether where blocks are must be asked of their homes (a cluster: :meth:`locate`
        before a Lookup counts peers) rather than known here already (static peers)."""
        return self.locator.asks_homes

    async def locate(self, digests: Sequence[bytes], layer: int) -> None:
        """Ask whoever keeps where these blocks are, so :meth:`held` can say (within the pull
        deadline; what is not answered by then counts as held by no peer)."""
        try:
            async with asyncio.timeout(self.settings.pull_timeout_s):
                await self.locator.locate([wire_key(d, layer) for d in digests])
        except TimeoutError:
            pass

    def held(self, digests: Sequence[bytes], layer: int) -> list[bool]:
        """Per digest, whether a usable peer holds it (Lookup's peer column)."""
        holders = self.locator.holders()
        return [bool(holders(wire_key(d, layer))) for d in digests]

    def may_hold(self) -> Callable[[BlockAddress], bool]:
        """A view, for one look at a batch: whether a fetch of an address may find it (a usable
        peer holds it, or nobody was asked yet and the fetch will ask)."""
        holders, unasked = self.locator.holders(), self.locator.unasked

        def may(address: BlockAddress) -> bool:
            key = wire_key(address.digest, address.layer)
            return unasked(key) or bool(holders(key))
        return may

    async def fetch(self, addresses: Sequence[BlockAddress], reserve: Reserve,
                    abort: Callable[[Any], None], tenant: str = "") -> list[tuple[BlockAddress, Any, p.Block]]:
        """Pull ``addresses``, ``tenant``'s blocks (a Tenant.tag), from the peers that hold them,
        into slots from ``reserve`` (``abort`` gives one back). Returns what arrived verified,
        within the deadline."""
        s = self.settings
        fetch = Fetch(self.connections, self.locator.holders, FetchSettings(s.pull_timeout_s, s.hedge_s, s.max_payload),
                      {wire_key(a.digest, a.layer): a for a in addresses}, reserve, abort,
                      self.clock() + s.pull_timeout_s, tenant)
        try:
            async with asyncio.timeout(s.pull_timeout_s):   # in this task: no task, no loop turn
                await self.locator.locate(list(fetch.wanted))
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
        if not self.locator.event(peer, message, request_id):
            log.warning("listing part out of order dropped",
                        extra={"fields": {"peer": peer, "part": getattr(message, "part", None)}})

    def answer_locate(self, peer: str, request: p.Locate) -> p.Located:
        return self.locator.answer_locate(request)

    def exists(self, peer: str, request: p.Exists) -> int:
        return self.store.local_prefix(request.digests, request.layer)

    async def pull(self, peer: str, request: p.AnyPull) -> list[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss]:
        if self.serving >= SERVE_MAX_PULLS:
            return [p.Miss(d, layer, p.MissReason.OVERLOADED) for d, layer in request.addresses]
        self.serving += 1
        try:
            return await self.serve_pull(request.addresses, request.max_payload, request.tenant)
        except KvError:
            return [p.Miss(d, layer, p.MissReason.BUSY) for d, layer in request.addresses]
        finally:
            self.serving -= 1

    async def serve_pull(self, rows: Sequence[tuple[bytes, int]], max_payload: int,
                         tenant: str = "") -> list[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss]:
        """A peer's Pull of ``tenant``'s blocks, answered from this daemon's RAM and SSD
        (kvcached.peers.store_link)."""
        return await serve_pull(self.store, rows, max_payload, self.counters, tenant)

    # -- stats --

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        cluster = {**self.locator.stats(), **(self.membership.stats() if self.membership else {})}
        return {"peers": {name: {"up": link.health.usable(now), "state": link.health.state.value,
                                 "connected": link.verified, "blocks": self.locator.blocks_of(name),
                                 "last_error": link.health.last_error}
                          for name, link in self.links.items()},
                **{f"peer_{k}": v for k, v in vars(self.counters).items()},
                **({"cluster": cluster} if cluster else {})}

    def nixl_stats(self) -> dict[str, int]:
        """The NIXL lane (empty where this daemon does not run it): as holder, leases held,
        NixlPulls answered and answered overloaded, leases by how they ended; as puller, blocks
        read and published, dropped for their checksum, pulls that fell back (``pull_*``)."""
        if self.nixl is None:
            return {}
        puller = self.connections.nixl
        assert puller is not None
        return {"leases": len(self.nixl.leases), "answered": self.nixl.answered, "overloaded": self.nixl.overloaded,
                **{f"leases_{k}": v for k, v in vars(self.nixl.leases.counters).items()},
                **{f"pull_{k}": v for k, v in vars(puller.counters).items()}}

    def server_stats(self) -> dict[str, Any]:
        """The QUIC server's connection state and what its bounds refused (handshakes.py), and
        the lane server's; empty where this daemon does not listen."""
        server = self._server_protocol
        if server is None:
            return {}
        lanes = self.lane_server
        return {"quic_handshakes": server.table.handshaking, "quic_connections": server.table.connections,
                "quic_retries": server.retries, "quic_dropped_datagrams": server.dropped,
                "quic_refused": dict(server.table.refused),
                **({"lane_refused": lanes.counters.refused + sum(
                    link.lane.refused for link in self.links.values() if link.lane is not None),
                    "lane_bad_seals": lanes.counters.bad_seals, "lane_stalled": lanes.counters.stalled,
                    "lane_handshakes": lanes.handshakes, "lane_connections": lanes.lanes,
                    "lane_limited": dict(lanes.table.refused), "lane_coded_blocks": lanes.counters.coded_blocks,
                    "lane_coded_saved_bytes": lanes.counters.coded_saved_bytes,
                    "lane_coded_pulls": self.connections.coding.coded_pulls}
                   if lanes is not None else {})}


def _announcements(pending: dict[bytes, bool]) -> list[p.Announce | p.Drop]:
    gained = [split(k) for k, held in pending.items() if held]
    dropped = [split(k) for k, held in pending.items() if not held]
    out: list[p.Announce | p.Drop] = []
    for i in range(0, len(dropped), p.MAX_BATCH):
        out.append(p.Drop(dropped[i:i + p.MAX_BATCH]))
    for i in range(0, len(gained), p.MAX_BATCH):
        out.append(p.Announce(gained[i:i + p.MAX_BATCH]))
    return out
