"""The peer tier end to end in one process: real Stores (memfd arena, RocksDB index), each with a
real PeerTier over QUIC on 127.0.0.1 and mutual TLS with certificates from kvcached.peers.certs.
Tests run their own event loop (asyncio.run). In one process, but over real sockets: an integration test."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import random
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from kvcached.index import BlockIndex
from kvcached.peers import protocol as p
from kvcached.peers import quic as quic_layer
from kvcached.peers import stream as st
from kvcached.peers.certs import make_cluster
from kvcached.peers.directory import PeerState, wire_key
from kvcached.peers.handshakes import HandshakeLimits
from kvcached.peers.quic import PeerClientProtocol, PeerServerProtocol
from kvcached.peers.tier import PeerSettings, PeerTier
from kvcached.peers.tls import ALPN, PeerAuth, QuicOptions
from kvcached.policies.clock import ClockPolicy
from kvcached.store import LookupResult, PutItem, Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from tests.certificates import expired_certificate
from tests.unit.conftest import KIB, SLAB, address, payload

A, B, C = "node-a", "node-b", "node-c"
OPTIONS = QuicOptions(max_datagram_size=16000)
SIZE = 6 * KIB
ALL = (1 << 62) - 1          # every peer's bit, for PeerDirectory.holders


BIND_TRIES = 3


def free_port() -> int:
    """A port number free for UDP (QUIC) and TCP (the lane) on 127.0.0.1, below the kernel's
    ephemeral range: tests kill a daemon and start it again on its port, and a port from that
    range could meanwhile be given to any socket that binds or connects without one (seen in
    CI: a restarted peer could not bind its QUIC port). Ports are drawn at random there, so
    two workers seldom draw the same one, and each is checked free for both protocols."""
    low = _ephemeral_low()
    rng = random.Random()
    while True:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            try:
                s.bind(("127.0.0.1", port))
                t.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


async def until(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


class Node:
    """One daemon's store; its tier is started and stopped by the Cluster."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.arena = SharedArena(16 * SLAB, name=f"kvcached-peer-test-{name}")
        self.ram = RamTier(self.arena, SLAB, ClockPolicy())
        self.index = BlockIndex(root / f"index-{name}")
        self.store = Store(self.ram, self.index)
        self.tier: PeerTier | None = None

    @property
    def t(self) -> PeerTier:
        assert self.tier is not None
        return self.tier

    def close(self) -> None:
        self.index.close()
        gc.collect()                  # arena slices kept alive by finished tasks
        with contextlib.suppress(BufferError):
            self.arena.close()


class Cluster:
    #: What pulls go over unless a test says: QUIC here (this module tests it); test_lane.py runs
    #: the tests that hold for any transport again with "tls".
    lane = "quic"

    def __init__(self, tmp_path: Path, names: tuple[str, ...], settings: dict[str, Any]) -> None:
        self.names, self.settings = names, settings
        self.files, _ = make_cluster(tmp_path / "certs", [A, B, C])
        self.ports = {name: free_port() for name in names}   # peers need each other's address up front
        self.nodes = {name: Node(name, tmp_path) for name in names}
        self.nixl: dict[str, Any] = {}          # name -> the NixlEndpoint its tier serves the NIXL lane with

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def auth(self, name: str, peers: list[str] | None = None) -> PeerAuth:
        cert, key = self.files.nodes[name]
        return PeerAuth.from_files(str(self.files.ca), str(cert), str(key),
                                   [n for n in self.names if n != name] if peers is None else peers)

    def addr(self, name: str) -> tuple[str, int]:
        return ("127.0.0.1", self.ports[name])

    async def start(self, name: str) -> PeerTier:
        node = self.nodes[name]
        kw = {"pull_timeout_s": 1.0, "hedge_s": 0.05, "fail_limit": 3, "backoff_s": 1.0, "lane": self.lane} | self.settings
        peers = {n: self.addr(n) for n in self.names if n != name}
        tier = PeerTier(node.store, self.auth(name), PeerSettings(listen=self.addr(name), peers=peers,
                                                                  options=OPTIONS, **kw), nixl=self.nixl.get(name))
        await tier.start()
        assert tier.address == self.addr(name)
        node.tier = tier                       # wired as daemon._start_peers does
        node.store.peers = tier
        node.index.presence = tier.presence
        return tier

    async def stop(self, name: str) -> None:
        node = self.nodes[name]
        if node.tier is not None:
            node.index.presence = None
            node.store.peers = None
            await node.tier.stop()
            node.tier = None

    async def connected(self) -> None:
        """Every running tier holds a verified connection to every other running one."""
        up = [n for n in self.names if self.nodes[n].tier is not None]
        await until(lambda: all((cl := self.nodes[n].t.links[m].client) is not None and cl.verified and cl.usable
                                for n in up for m in up if m != n), "all peers connected")


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, names: tuple[str, ...] = (A, B, C), **settings: Any) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path, names, settings)
    try:
        for attempt in range(BIND_TRIES):
            try:
                for name in names:
                    await c.start(name)
                break
            except OSError as exc:
                # A port drawn free was taken before the tier bound it (another test process's:
                # seen in a full run on a busy machine). Peers know each other's ports from the
                # start, so all stop and all draw again.
                if exc.errno != errno.EADDRINUSE or attempt == BIND_TRIES - 1:
                    raise
                for name in names:
                    await c.stop(name)
                c.ports = {name: free_port() for name in names}
        await c.connected()
        yield c
    finally:
        for name in names:
            await c.stop(name)
        await asyncio.sleep(0.05)             # let the closes go out
        for node in c.nodes.values():
            node.close()


def items(ns: range) -> list[PutItem]:
    return [PutItem(address(n), payload(n, SIZE), model="m") for n in ns]


def addrs(ns: range) -> list[Any]:
    return [address(n) for n in ns]


def digests(ns: range) -> list[bytes]:
    return [address(n).digest for n in ns]


def holders(node: Node, n: int) -> list[str]:
    return node.t.locator.directory.holders(wire_key(address(n).digest, 0), ALL)


async def get_exact(node: Node, ns: range) -> None:
    found, misses = await node.store.get(addrs(ns))
    assert misses == [] and [f.payload for f in found] == [payload(n, SIZE) for n in ns]


# ---------------------------------------------------------------------------------------------
# announcements, lookup, pulls


@pytest.mark.parametrize("mirror", [True, False])
def test_put_announced_then_pulled(tmp_path: Path, mirror: bool) -> None:
    async def body() -> None:
        async with cluster(tmp_path) as c:
            b, n = c[B], 4
            b.store.mirror_pulls = mirror
            await c[A].store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n and c[C].t.locator.directory.count(A) == n, "announcements")
            r = b.store.lookup(digests(range(n)), 0)
            assert (r.ram, r.peer, r.longest) == (0, n, n)
            await get_exact(b, range(n))
            assert b.t.counters.pulled == n and b.t.counters.corrupt == 0
            assert c[A].t.counters.served == n
            if mirror:
                assert b.store.lookup(digests(range(n)), 0).ram == n
                await until(lambda: c[C].t.locator.directory.count(B) == n, "C learns that B holds them")
                assert holders(c[C], 0) == [A, B]
                await get_exact(b, range(n))           # served from B's RAM now
                assert b.t.counters.pulled == n
            else:
                assert b.store.lookup(digests(range(n)), 0).ram == 0
                assert all(b.index.get(a.key) is None for a in addrs(range(n)))
                assert b.ram.used_bytes == 0 and b.ram.slabs.reserved_bytes == 0
                await asyncio.sleep(0.3)               # several announcement rounds: nothing goes out
                assert c[C].t.locator.directory.count(B) == 0 and c[A].t.locator.directory.count(B) == 0
    asyncio.run(body())


def test_delete_drops_and_snapshot_replaces(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b = c[A], c[B]
            await a.store.put(items(range(6)))
            await until(lambda: b.t.locator.directory.count(A) == 6, "announcements")
            assert await a.store.delete(addrs(range(2))) == (2, 0)
            await until(lambda: b.t.locator.directory.count(A) == 4, "the Drop")
            assert holders(b, 0) == holders(b, 1) == [] and holders(b, 2) == [A]
            assert b.store.lookup(digests(range(6)), 0).peer == 0

            await c.stop(A)                             # A is away; what it deletes now nobody hears
            assert await a.store.delete(addrs(range(2, 4))) == (2, 0)
            await asyncio.sleep(0.2)
            assert b.t.locator.directory.count(A) == 4         # old knowledge stands until A's next listing
            await c.start(A)
            await until(lambda: b.t.locator.directory.count(A) == 2, "A's snapshot on reconnect")
            assert [holders(b, n) for n in range(6)] == [[], [], [], [], [A], [A]]
            assert b.store.lookup(digests(range(4, 6)), 0).peer == 2
    asyncio.run(body())


def test_lookup_counts_peers_for_a_chain_all_in_ram(tmp_path: Path) -> None:
    """Lookup answers what is true per tier: a chain held whole in RAM here that a peer holds
    too counts in ``peer``, as it would for a chain that goes past RAM."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b = c[A], c[B]
            await a.store.put(items(range(6)))
            await b.store.put(items(range(4)))
            await until(lambda: b.t.locator.directory.count(A) == 6, "announcements")
            assert b.store.lookup(digests(range(4)), 0) == LookupResult(longest=4, ram=4, ssd=0, gpu=0, peer=4)
            assert b.store.lookup(digests(range(6)), 0) == LookupResult(longest=6, ram=4, ssd=0, gpu=0, peer=6)
            assert b.store.lookup(digests(range(6, 8)), 0).peer == 0
    asyncio.run(body())


def test_stopped_tier_closes_its_peers_connections(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            link = c[B].t.links[A]
            old = link.client
            assert old is not None and old.usable
            await c.stop(A)
            # a CONNECTION_CLOSE takes one datagram (and ~3 PTO of draining); without it B notices
            # only when a keep-alive ping sent after the stop goes unanswered for pull_timeout_s (1 s)
            await until(lambda: not old.usable, "B's connection to A to close", 0.8)
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# damaged copies


def corrupt(node: Node, n: int) -> None:
    """Flip a byte of the block's bytes in the arena: its index checksum stays the good one."""
    block = node.ram.get(address(n).key)
    assert block is not None
    view = node.ram.view(block)
    view[100] ^= 0xFF
    view.release()


def test_checksum_mismatch_falls_back_to_another_holder(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, hedge_s=0.5) as c:   # no hedging: A's bad copy arrives first
            a, b = c[A], c[B]
            await a.store.put(items(range(2)))
            await c[C].store.put(items(range(1)))
            await until(lambda: b.t.locator.directory.count(A) == 2 and b.t.locator.directory.count(C) == 1, "announcements")
            corrupt(a, 0)
            corrupt(a, 1)
            await get_exact(b, range(1))                 # A's copy fails its checksum, C's is taken
            assert b.t.counters.corrupt == 1 and a.t.counters.served >= 1 and c[C].t.counters.served == 1

            reserved, used, blocks = b.ram.slabs.reserved_bytes, b.ram.used_bytes, len(b.ram)
            found, misses = await b.store.get(addrs(range(1, 2)), allow_partial=True)   # only A holds it
            assert found == [] and [m.address for m in misses] == [address(1)]
            assert b.t.counters.corrupt == 2
            key = address(1).key
            assert b.ram.get(key) is None and b.index.get(key) is None and key not in b.ram
            assert (b.ram.slabs.reserved_bytes, b.ram.used_bytes, len(b.ram)) == (reserved, used, blocks)
            assert b.store.lookup(digests(range(1, 2)), 0).ram == 0
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# deadline, health, hedging


def test_dead_holder_misses_within_deadline_goes_down_and_comes_back(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), pull_timeout_s=1.0, fail_limit=2, backoff_s=0.5) as c:
            a, b, n = c[A], c[B], 3
            link = b.t.links[A]
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await c.stop(A)
            for _ in range(2):
                start = time.monotonic()
                found, misses = await b.store.get(addrs(range(n)), allow_partial=True)
                assert time.monotonic() - start < 1.0 + 0.75
                assert found == [] and len(misses) == n
                if link.health.state is PeerState.DOWN:
                    break
            assert link.health.state is PeerState.DOWN and link.health.last_error
            assert b.t.counters.failed >= 1 and b.t.counters.missed >= n
            r = b.store.lookup(digests(range(n)), 0)
            assert (r.peer, r.longest) == (0, 0)       # a down peer's blocks are not offered
            start = time.monotonic()
            found, _ = await b.store.get(addrs(range(n)), allow_partial=True)
            assert found == [] and time.monotonic() - start < 0.25   # a miss at once, no round trip

            await c.start(A)
            await until(lambda: b.store.lookup(digests(range(n)), 0).peer == n, "A's backoff to end")
            await get_exact(b, range(n))               # the peer is used again ...
            assert link.health.state is PeerState.UP and link.health.failures == 0   # ... and is up
    asyncio.run(body())


def slow_serving(node: Node, delay: float) -> None:
    serve = node.t.serve_pull

    async def slow(*args: Any, **kw: Any) -> Any:
        await asyncio.sleep(delay)
        return await serve(*args, **kw)
    node.t.serve_pull = slow                           # type: ignore[method-assign]


async def held_by_a_and_c(c: Cluster, n: int) -> None:
    """Blocks 0..n-1 put on A and C, and B told of both holders."""
    for name in (A, C):
        await c[name].store.put(items(range(n)))
    await until(lambda: c[B].t.locator.directory.count(A) == n and c[B].t.locator.directory.count(C) == n, "announcements")


def test_hedged_pull_asks_the_next_holder(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, hedge_s=0.05, pull_timeout_s=3.0) as c:
            b, n = c[B], 4
            await held_by_a_and_c(c, n)
            slow_serving(c[A], 0.6)                   # A is B's first choice (configuration order)
            start = time.monotonic()
            await get_exact(b, range(n))
            assert time.monotonic() - start < 3.0
            assert b.t.counters.hedged >= 1 and c[C].t.counters.served == n and b.t.counters.failed == 0
    asyncio.run(body())


def test_hedged_pull_does_not_wait_for_the_slow_peer(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, hedge_s=0.05, pull_timeout_s=3.0) as c:
            b, n = c[B], 4
            await held_by_a_and_c(c, n)
            slow_serving(c[A], 1.2)
            start = time.monotonic()
            await get_exact(b, range(n))
            assert time.monotonic() - start < 0.6, "the fetch waited for A although C sent every block"
            # A's attempt ran in the fetch's own task and was stopped by cancelling it once: the
            # cancel was taken back (no CancelledError left pending), and it is no failure of A.
            assert asyncio.current_task().cancelling() == 0          # type: ignore[union-attr]
            assert b.t.counters.failed == 0 and b.t.counters.hedged >= 1
            await asyncio.sleep(0.05)                                # a later await is not cancelled
            await get_exact(b, range(n))
    asyncio.run(body())


def test_a_deadline_with_a_hedge_in_flight_stops_every_attempt_before_the_fetch_returns(tmp_path: Path) -> None:
    """Both holders too slow: the fetch's deadline passes with the first attempt (in the fetch's
    own task) and a hedge (a task of its own) both running. Both are stopped before the fetch
    returns, so no attempt is left that could write into a slot the fetch gave back."""
    async def body() -> None:
        async with cluster(tmp_path, hedge_s=0.05, pull_timeout_s=0.4) as c:
            b, n = c[B], 4
            await held_by_a_and_c(c, n)
            slow_serving(c[A], 1.5)
            slow_serving(c[C], 1.5)
            start = time.monotonic()
            found, misses = await b.store.get(addrs(range(n)), allow_partial=True)
            assert time.monotonic() - start < 1.2 and found == [] and len(misses) == n
            assert b.t.counters.hedged >= 1
            attempts = [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "_Fetch._attempt"]
            assert attempts == [], attempts
            assert b.store.pinned_bytes == 0
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# resumption and 0-RTT


def test_resumed_connection_pulls_with_0rtt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handshakes: list[tuple[str | None, bool, bool]] = []
    handshake = PeerServerProtocol._handshake

    def spy(self: PeerServerProtocol, event: events.HandshakeCompleted) -> None:
        handshake(self, event)
        handshakes.append((self.peer, event.session_resumed, self.verified))
    monkeypatch.setattr(PeerServerProtocol, "_handshake", spy)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            b, link = c[B], c[B].t.links[A]
            await c[A].store.put(items(range(3)))
            await until(lambda: b.t.locator.directory.count(A) == 3 and link.ticket is not None, "announcements, a ticket")
            old = link.client
            assert old is not None and not old.early
            old.close()
            await asyncio.wait_for(old.wait_closed(), 5)
            await until(lambda: link.client is not None and link.client is not old, "the link dialled again")
            new = link.client
            assert new.early                            # resumed with the ticket: pulls may go as 0-RTT
            await get_exact(b, range(3))
            await until(lambda: (B, True, True) in handshakes, "the server to accept the resumed session", 3)
            assert new.usable and link.client is new
    asyncio.run(body())


class RawClient(PeerClientProtocol):
    """A client that hands the answers on chosen streams over as raw bytes."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.raw: dict[int, bytearray] = {}

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived) and event.stream_id in self.raw:
            self.raw[event.stream_id] += event.data
        else:
            super().quic_event_received(event)


async def dial(config: QuicConfiguration, addr: tuple[str, int], auth: PeerAuth, peer: str) -> tuple[Any, RawClient]:
    loop = asyncio.get_running_loop()
    quic = QuicConnection(configuration=config)
    transport, client = await loop.create_datagram_endpoint(
        lambda: RawClient(quic, auth=auth, peer=peer, max_payload=SLAB), local_addr=("127.0.0.1", 0))
    client.connect(addr)
    return transport, client


def test_state_changing_early_data_is_refused(tmp_path: Path) -> None:
    async def body() -> None:     # Retry under load only: 0-RTT data reaches a server that is not busy
        async with cluster(tmp_path, (A, B), limits=HandshakeLimits(retry="under_load")) as c:
            link = c[B].t.links[A]
            await until(lambda: link.ticket is not None, "a session ticket from A")
            ticket, link.ticket = link.ticket, None
            config = c.auth(B).configuration(OPTIONS, server_name=A)
            config.session_ticket = ticket
            transport, client = await dial(config, c.addr(A), c.auth(B), A)
            try:
                assert not client.ready.done()
                sid = client._quic.get_next_available_stream_id()
                client.raw[sid] = bytearray()
                client._quic.send_stream_data(sid, p.encode(p.Announce([(address(99).digest, 0)]), 7),
                                              end_stream=True)
                client.transmit()                       # goes out as 0-RTT data, before the handshake is done
                await until(lambda: len(client.raw[sid]) >= p.HEADER.size + 4, "an answer", 5)
                decoder = st.FrameDecoder()
                decoder.feed(bytes(client.raw[sid]))
                frame = decoder.next_event()
                assert isinstance(frame, p.Frame) and frame.request_id == 7
                answer = p.decode(frame)
                assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.EARLY_DATA == 5
                assert client._quic.tls.session_resumed
                assert c[A].t.locator.directory.count(B) == 0   # the Announce was not acted on
            finally:
                transport.close()
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# mutual TLS


def test_server_refuses_bad_client_certificates(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:     # A accepts only node-b
            other, _ = make_cluster(tmp_path / "other-ca", [B])

            def client_config(chain: tuple[Path, Path] | None) -> QuicConfiguration:
                config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=A,
                                           cadata=c.files.ca.read_bytes(), verify_mode=ssl.CERT_REQUIRED,
                                           max_datagram_size=OPTIONS.max_datagram_size)
                if chain is not None:
                    config.load_cert_chain(str(chain[0]), str(chain[1]))
                return config

            cases = {"another CA": (client_config(other.nodes[B]), "client certificate refused"),
                     "expired": (client_config(expired_certificate(c.files.ca.parent, tmp_path / "expired", B)),
                                 "client certificate refused"),
                     "not a peer": (client_config(c.files.nodes[C]), "node-c"),
                     "no certificate": (client_config(None), "no certificate")}
            for case, (config, why) in cases.items():
                transport, client = await dial(config, c.addr(A), c.auth(B), A)
                try:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(client.ready), 5)
                        client.send_event(p.Announce([(address(99).digest, 0)]))
                        client.send_event(p.Snapshot(0, True, [(address(98).digest, 0)]), 1)
                    await asyncio.wait_for(client.wait_closed(), 5)
                    assert client.refused is not None and why in client.refused, (case, client.refused)
                    assert len(c[A].t.locator.directory) == 0, case
                finally:
                    transport.close()
            await c[A].store.put(items(range(2)))     # a good peer is still served
            await until(lambda: c[B].t.locator.directory.count(A) == 2, "announcements")
            await get_exact(c[B], range(2))
    asyncio.run(body())


def test_client_refuses_a_server_with_another_name(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            # a tier of A that expects node-c at B's address: B's certificate names node-b
            tier = PeerTier(c[A].store, c.auth(A, [C]), PeerSettings(listen=None, peers={C: c.addr(B)},
                                                                     options=OPTIONS, pull_timeout_s=1.0))
            await tier.start()
            try:
                link = tier.links[C]
                await until(lambda: link.health.last_error, "the dial to fail")
                why = link.health.last_error + " " + str(link.client.refused if link.client else "")
                assert "node-c" in why and "node-b" in why
                assert link.client is None or not link.client.verified
                assert link.health.failures >= 1 and tier.locator.directory.count(C) == 0
            finally:
                await tier.stop()
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# the server's send queue


def server_protocols(node: Node) -> list[PeerServerProtocol]:
    return list(set(node.t._server_protocol._protocols.values()))      # keyed by connection ID: repeats


def test_a_large_pull_goes_out_through_a_bounded_send_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quic_layer, "SEND_QUEUE_BYTES", 16 * KIB)
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 64                  # 384 KiB answered through a 16 KiB queue
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            peaks = [proto.peak_queued for proto in server_protocols(a)]
            assert 0 < max(peaks) <= 16 * KIB, peaks
            assert a.store.pinned_bytes == 0 and a.t.counters.served == n
    asyncio.run(body())


def test_a_peer_that_vanishes_mid_answer_leaves_nothing_pinned(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quic_layer, "SEND_QUEUE_BYTES", 16 * KIB)
    monkeypatch.setattr(quic_layer, "SEND_STALL_S", 0.3)
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, n = c[A], 40                           # 240 KiB: more than aioquic's first congestion window
            await a.store.put(items(range(n)))
            await until(lambda: c[B].t.locator.directory.count(A) == n, "announcements")
            transport, client = await dial(c.auth(B).configuration(OPTIONS, server_name=A), c.addr(A), c.auth(B), A)
            await asyncio.wait_for(client.ready, 5)
            sid = client._quic.get_next_available_stream_id()
            client.raw[sid] = bytearray()
            client._quic.send_stream_data(sid, p.encode(p.Pull([(d, 0) for d in digests(range(n))]), 1),
                                          end_stream=True)
            client.datagram_received = lambda data, addr: None     # deaf from now on: acknowledges nothing
            client.transmit()
            await until(lambda: any(proto._written for proto in server_protocols(a)), "A to start answering")
            await until(lambda: a.store.pinned_bytes == 0, "A to give the stalled answer up", 5)
            assert all(not proto._written for proto in server_protocols(a))
            assert sum(proto.stalled for proto in server_protocols(a)) == 1
            transport.close()
            await c.connected()
            await get_exact(c[B], range(n))           # A goes on serving its real peer
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# metrics


def test_peer_metrics_count_pulls_and_show_peers_up(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvcached.api.metrics import StoreCollector

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 3
            b.store.reads.time_reads(["ram", "peer"])
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            registry = CollectorRegistry(auto_describe=False)
            registry.register(StoreCollector(b.store))
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(generate_latest(registry).decode())
                       for s in family.samples}
            assert samples[("kvcached_quic_pulls_total", (("outcome", "ok"),))] == n
            assert samples[("kvcached_quic_pulls_total", (("outcome", "corrupt"),))] == 0
            assert samples[("kvcached_peer_up", (("peer", A),))] == 1
            assert samples[("kvcached_peer_blocks", (("peer", A),))] == n
            assert samples[("kvcached_hits_total", (("tier", "peer"),))] == n
            assert samples[("kvcached_misses_total", (("tier", "ram"),))] == n
            assert samples[("kvcached_integrity_failures_total", (("tier", "peer"),))] == 0
            assert samples[("kvcached_lookup_seconds_count", (("outcome", "hit"), ("tier", "peer")))] == 1
            assert samples[("kvcached_quic_served_blocks_total", ())] == 0 and a.t.counters.served == n
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# prefetch policies


@pytest.mark.parametrize("policy, answered_within, found_first", [
    ("best_effort", 0.15, 0), ("timeout", 0.2 + 0.15, 0), ("wait_complete", 5.0, 4)])
def test_prefetch_policy_decides_how_long_a_load_waits(tmp_path: Path, policy: str, answered_within: float,
                                                       found_first: int) -> None:
    from kvcached.policies.prefetch import make_prefetch_policy

    async def body() -> None:
        async with cluster(tmp_path, (A, B), pull_timeout_s=5.0) as c:
            a, b, n = c[A], c[B], 4
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            slow_serving(a, 0.8)                                  # A answers after 0.8 s
            b.store.prefetch = make_prefetch_policy(policy, timeout_s=0.2)
            start = time.monotonic()
            found, misses = await b.store.get(addrs(range(n)), allow_partial=True)
            took = time.monotonic() - start
            assert took < answered_within and len(found) == found_first and len(found) + len(misses) == n
            if policy != "wait_complete":
                assert took >= (0.2 if policy == "timeout" else 0.0)
                await until(lambda: all(address(i).key in b.ram for i in range(n)), "the pulls to land anyway", 5)
                start = time.monotonic()
                await get_exact(b, range(n))                     # prefetched: served from RAM at once
                assert time.monotonic() - start < 0.1
    asyncio.run(body())


def test_0rtt_requests_go_again_after_a_retry(tmp_path: Path) -> None:
    """With retry = "always" a resumed client's first flight meets a Retry, and aioquic forgets
    the 0-RTT data it sent before: the client sends those requests again once connected."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(3)))
            link = c[B].t.links[A]
            await until(lambda: link.ticket is not None, "a session ticket from A")
            config = c.auth(B).configuration(OPTIONS, server_name=A)
            config.session_ticket = link.ticket
            transport, client = await dial(config, c.addr(A), c.auth(B), A)
            try:
                asked = asyncio.ensure_future(client.exists(0, digests(range(3))))   # goes as 0-RTT data
                await asyncio.sleep(0)
                assert not client.verified
                assert await asyncio.wait_for(asked, 5) == 3
                assert client._quic._retry_count == 1 and client._quic.tls.session_resumed
            finally:
                transport.close()
    asyncio.run(body())


def test_nixl_requests_to_a_daemon_without_the_nixl_lane_are_refused_and_the_session_goes_on(tmp_path: Path) -> None:
    """NixlOpen and NixlPull to a daemon that runs no NIXL lane: Error UNAVAILABLE over the
    verified session (nothing pinned), NixlDone ignored; pulls over QUIC still work after."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 2
            await a.store.put(items(range(n)))
            client = b.t.links[A].client
            assert client is not None
            for ask in (client.nixl_open(), client.nixl_pull([(address(i).digest, 0) for i in range(n)])):
                with pytest.raises(p.ProtocolError, match="runs no NIXL lane") as err:
                    await ask
                assert err.value.code == p.ErrorCode.UNAVAILABLE
            client.nixl_done(12345)
            assert a.store.pinned_bytes == 0
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            assert client.usable and b.t.links[A].client is client
    asyncio.run(body())


def test_a_port_taken_after_it_was_drawn_is_drawn_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cluster() itself: a port another process binds between the draw and the tier's bind (as
    another test worker may) makes every node draw again, instead of failing the test."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", free_port()))
    draws = iter([taken.getsockname()[1]])
    real = free_port
    monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(draws, None) or real())

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            assert c.ports[A] != taken.getsockname()[1]
            await c[A].store.put(items(range(2)))
            await until(lambda: c[B].t.locator.directory.count(A) == 2, "announcements")
            await get_exact(c[B], range(2))
    try:
        asyncio.run(body())
    finally:
        taken.close()
