"""The peer tier through real daemon processes on loopback, with certificates from `kvcached certs`.

Three daemons (node-a, node-b, node-c) each listen for QUIC on their own UDP port and list the
other two as peers. Blocks put on one are found and fetched on the others (gRPC Get and an
agent's load); announcements, drops, mirror_pulls, a peer killed mid-pull, and certificates
that must be refused are each checked against what the daemons really do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import time
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from aioquic.quic import events as quic_events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from kvcached.peers import protocol as pp
from kvcached.peers import stream as ps
from kvcached.peers.quic import PeerClientProtocol
from kvcached.peers.tls import ALPN, PeerAuth, QuicOptions
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent import Agent
from kvcached_agent.address import BlockAddress
from tests.certificates import expired_certificate

from .conftest import DaemonProcess, run_cli, wait_for
from .test_peer_tier import free_port

NODES = ("node-a", "node-b", "node-c")
KIB = 1 << 10


def free_udp_port() -> int:
    """A port number free for UDP (QUIC) and TCP (the bulk lane listens on the same number)."""
    return free_port()



def blocks(n: int, size: int = 64 * KIB, seed: int = 0) -> dict[BlockAddress, bytes]:
    return {BlockAddress(blake3.blake3(b"peer-%d-%d" % (seed, i)).digest()):
            blake3.blake3(b"payload-%d-%d" % (seed, i)).digest(length=size + i) for i in range(n)}


class Cluster:
    def __init__(self, root: Path, names: tuple[str, ...] = NODES) -> None:
        self.root = root
        self.certs = root / "certs"
        result = run_cli(["certs", "--dir", str(self.certs), *names])
        assert result.returncode == 0, result.stderr
        self.ports = {name: free_udp_port() for name in names}
        self.daemons: dict[str, DaemonProcess] = {}
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in self.ports.items()}
        self.lane = "tls"                 # what pulls go over ([quic] lane)

    def daemon(self, name: str, *overrides: str, cert: str | None = None, peers: dict[str, str] | None = None,
               start: bool = True) -> DaemonProcess:
        state = self.root / name
        state.mkdir(exist_ok=True)
        peers = peers if peers is not None else {n: a for n, a in self.addresses.items() if n != name}
        listed = ", ".join(f'{{ name = "{n}", address = "{a}" }}' for n, a in peers.items())
        cert = cert or name
        d = DaemonProcess(state, [
            f'quic.listen="{self.addresses[name]}"', f"quic.peers=[{listed}]",
            f'quic.ca="{self.certs / "ca.pem"}"', f'quic.cert="{self.certs / (cert + ".pem")}"',
            f'quic.key="{self.certs / (cert + "-key.pem")}"', "quic.max_datagram_size=16000",
            "quic.pull_timeout_s=2", "quic.backoff_s=0.5", "quic.backoff_max_s=2", f'quic.lane="{self.lane}"',
            *overrides])
        self.daemons[name] = d
        return d.start() if start else d

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


def get_while_killed(puller: DaemonProcess, holder: DaemonProcess, data: dict[BlockAddress, bytes]) -> dict[str, Any]:
    """``puller``'s Get of ``data`` while ``holder`` dies mid-pull: the holder is frozen while the
    pull is sent, then runs for 5 ms at most and is killed; whatever it managed to send in those,
    the rest is cut off. (A plain kill 50 ms after the pull started raced the pull: a mac lane
    sent all 48 MiB sooner.) What came back: counts, seconds, whether every payload was exact."""
    import threading

    outcome: dict[str, Any] = {}

    def pull() -> None:
        t0 = time.monotonic()
        with puller.client() as client:
            got, missing = client.get(list(data), allow_partial=True)
        outcome.update(got=len(got), missing=len(missing), seconds=time.monotonic() - t0,
                       exact=all(f.payload == data[f.address] for f in got))

    assert holder.proc is not None
    os.kill(holder.proc.pid, signal.SIGSTOP)
    thread = threading.Thread(target=pull)
    thread.start()
    time.sleep(0.2)
    os.kill(holder.proc.pid, signal.SIGCONT)
    time.sleep(0.005)
    holder.stop(signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    return outcome


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path)
    yield c
    c.stop()


def peer_stats(d: DaemonProcess) -> dict[str, pb.PeerStats]:
    with d.client() as c:
        return {p.name: p for p in c.stats().peers}


def connected(d: DaemonProcess, *names: str) -> bool:
    stats = peer_stats(d)
    return all(stats[n].connected for n in names)


def lookup(d: DaemonProcess, data: dict[BlockAddress, bytes]) -> pb.LookupResponse:
    with d.client() as c:
        return c.lookup([a.digest for a in data])


LANES = pytest.mark.parametrize("lane", ["tls", "mac"])


@LANES
def test_blocks_put_on_one_daemon_are_found_and_fetched_bit_exact_on_the_others(cluster: Cluster, lane: str) -> None:
    cluster.lane = lane
    a = cluster.daemon("node-a")
    b = cluster.daemon("node-b")
    c = cluster.daemon("node-c", "kv.mirror_pulls=false")
    for d, others in ((a, ("node-b", "node-c")), (b, ("node-a", "node-c")), (c, ("node-a", "node-b"))):
        wait_for(lambda: connected(d, *others), text="peers connected")
    data = blocks(12)
    with a.client() as client:
        client.put(list(data.items()), model="llama")
    wait_for(lambda: lookup(b, data).peer == 12, text="b learns a's blocks")
    r = lookup(b, data)
    assert (r.longest, r.ram, r.ssd, r.peer) == (12, 0, 0, 12)

    with b.client() as client:                       # mirror_pulls on: b keeps them and says so
        got, missing = client.get(list(data))
        assert not missing and {f.address: f.payload for f in got} == data
    r = lookup(b, data)
    assert r.ram == 12
    wait_for(lambda: peer_stats(c)["node-b"].blocks == 12, text="c hears b announce its mirrored copies")
    with b.client() as client:
        s = client.stats()
        assert s.peer_pulled == 12 and s.peer_corrupt == 0
        assert s.peer_lane_pulls >= 1 and s.peer_lane_fallbacks == 0     # over the lane, in this mode

    with c.client() as client:                       # mirror_pulls off: read, then not kept
        got, _ = client.get(list(data)[:4])
        assert {f.address: f.payload for f in got} == dict(list(data.items())[:4])
        assert client.lookup([x.digest for x in data]).ram == 0
    time.sleep(0.3)
    assert peer_stats(a)["node-c"].blocks == 0      # c announced nothing

    with a.client() as client:                       # a drop propagates
        client.delete(list(data)[:6])
    wait_for(lambda: peer_stats(c)["node-a"].blocks == 6, text="c hears a's drops")


@LANES
def test_an_agent_load_pulls_from_a_peer_into_its_arena_slots(cluster: Cluster, lane: str) -> None:
    cluster.lane = lane
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="a and b connected")
    layer_bytes = 32 * KIB
    tokens = list(range(16 * 8))
    with Agent.connect(str(a.state / "agent.sock"), agent_id="writer", model="m", dtype="float16",
                       block_tokens=16, num_layers=1, layer_block_bytes=layer_bytes) as writer:
        addresses = writer.addresses(writer.hash_tokens(tokens))
        tensors = [torch.randint(-1000, 1000, (layer_bytes // 2,), dtype=torch.int16).view(torch.float16)
                   for _ in addresses]
        assert not writer.save(addresses, tensors).skipped
    wait_for(lambda: lookup_digests(b, addresses) == len(addresses), text="b learns a's blocks")
    with Agent.connect(str(b.state / "agent.sock"), agent_id="reader", model="m", dtype="float16",
                       block_tokens=16, num_layers=1, layer_block_bytes=layer_bytes) as reader:
        assert reader.lookup([x.digest for x in addresses]).peer == len(addresses)
        out = [torch.zeros_like(t) for t in tensors]
        result = reader.load(addresses, out)
        assert not result.missing
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(out, tensors))
    with b.client() as client:
        s = client.stats()
        assert s.peer_lane_pulls >= 1 and s.peer_lane_fallbacks == 0


def lookup_digests(d: DaemonProcess, addresses: list[BlockAddress]) -> int:
    with d.client() as c:
        return c.lookup([x.digest for x in addresses]).peer


@LANES
def test_a_peer_killed_mid_pull_is_a_miss_within_the_deadline_and_used_again_after_it_restarts(
        cluster: Cluster, lane: str) -> None:
    cluster.lane = lane
    a = cluster.daemon("node-a")
    b = cluster.daemon("node-b", "kv.mirror_pulls=false")
    c = cluster.daemon("node-c")
    wait_for(lambda: connected(b, "node-a", "node-c"), text="b connected")
    only_a = blocks(48, size=1024 * KIB, seed=1)        # big enough that the pull is still going when a dies
    shared = blocks(4, seed=2)
    with a.client() as client:
        for i in range(0, 48, 8):
            client.put(list(only_a.items())[i:i + 8])
        client.put(list(shared.items()))
    with c.client() as client:
        client.put(list(shared.items()))
    wait_for(lambda: lookup(b, only_a).peer == 48 and lookup(b, shared).peer == 4, text="b learns")

    outcome = get_while_killed(b, a, only_a)
    assert outcome["seconds"] < 2 + 1.5, outcome        # pull_timeout_s = 2, and some slack
    assert outcome["exact"] and outcome["missing"] > 0, outcome

    with b.client() as client:                            # the other peer keeps serving
        got, missing = client.get(list(shared))
        assert not missing and {f.address: f.payload for f in got} == shared
    wait_for(lambda: not peer_stats(b)["node-a"].connected, text="b sees a gone")

    a = cluster.daemon("node-a")                          # same state dir; RAM-only blocks are lost...
    with a.client() as client:
        client.put(list(only_a.items())[:8])              # ...so put some again
    wait_for(lambda: peer_stats(b)["node-a"].up and peer_stats(b)["node-a"].connected, timeout=30,
             text="b uses a again after it restarts")
    first8 = dict(list(only_a.items())[:8])
    wait_for(lambda: lookup(b, first8).peer == 8, text="b learns a's new blocks")
    with b.client() as client:
        got, missing = client.get(list(first8))
        assert not missing and {f.address: f.payload for f in got} == first8


def test_a_peer_whose_certificate_is_not_the_expected_name_is_refused_and_logged(cluster: Cluster) -> None:
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    # node-b presents node-c's certificate: a dials "node-b" and must refuse it; b's own dial to
    # a presents node-c's name, which a does not list: a's server refuses that one too.
    b = cluster.daemon("node-b", cert="node-c", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: "peer refused" in a.log(), text="a refuses")
    wait_for(lambda: "none of them a configured peer" in a.log() or "doesn't match" in a.log()
             or "refused for 'node-b'" in a.log(), text="a logs why")
    stats = peer_stats(a)["node-b"]
    assert not stats.connected
    data = blocks(3)
    with b.client() as client:
        client.put(list(data.items()))
    time.sleep(0.5)
    assert lookup(a, data).peer == 0                      # nothing b says is heard
    with a.client() as client:                            # and a still serves
        client.put(list(blocks(1, seed=9).items()))


# -- a hand-driven peer in this process (real QUIC, real certificates) -------------------------

class Recorder(PeerClientProtocol):
    """A client protocol that also keeps the raw answers of streams it did not start itself."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.raw: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.handshake: quic_events.HandshakeCompleted | None = None
        self.terminated: quic_events.ConnectionTerminated | None = None

    def quic_event_received(self, event: quic_events.QuicEvent) -> None:
        if isinstance(event, quic_events.StreamDataReceived) and event.stream_id in self.raw:
            self.raw[event.stream_id] += event.data
            if event.end_stream:
                self.ended.add(event.stream_id)
            return
        if isinstance(event, quic_events.HandshakeCompleted):
            self.handshake = event
        if isinstance(event, quic_events.ConnectionTerminated):
            self.terminated = event
        super().quic_event_received(event)

    def send_raw(self, data: bytes, end: bool = True) -> int:
        sid = self._quic.get_next_available_stream_id()
        self.raw[sid] = bytearray()
        self._quic.send_stream_data(sid, data, end_stream=end)
        self.transmit()
        return sid


async def dial(address: str, auth: PeerAuth | None, name: str, *, certs: Path, ticket=None, tickets=None,  # type: ignore[no-untyped-def]
               with_cert: bool = True) -> Recorder:
    config = (auth.configuration(QuicOptions(16000), server_name=name) if auth is not None else
              QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=name,
                                cadata=(certs / "ca.pem").read_bytes(), verify_mode=ssl.CERT_REQUIRED,
                                max_datagram_size=16000))
    if ticket is not None:
        config.session_ticket = ticket
    quic = QuicConnection(configuration=config, session_ticket_handler=(tickets.append if tickets is not None else None))
    host, port = address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_datagram_endpoint(
        lambda: Recorder(quic, auth=auth or PeerAuth((certs / "ca.pem").read_bytes(), "", "", []), peer=name,
                         max_payload=1 << 20), local_addr=("127.0.0.1", 0))
    proto.early = ticket is not None
    proto.connect((host, int(port)))
    return proto


async def settle(proto: Recorder, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proto.handshake is None and proto.terminated is None:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)


@pytest.mark.parametrize("kind", ["other-ca", "expired"])
def test_a_bad_certificate_is_refused_on_both_sides(cluster: Cluster, kind: str) -> None:
    if kind == "other-ca":
        run_cli(["certs", "--dir", str(cluster.root / "rogue"), "node-b"])
        bad = cluster.root / "rogue" / "node-b.pem", cluster.root / "rogue" / "node-b-key.pem"
    else:
        bad = expired_certificate(cluster.certs, cluster.root / "expired", "node-b")
    ca = cluster.certs / "ca.pem"     # b trusts the cluster CA, so a's server gets to see (and refuse) b's certificate
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"], "node-c": cluster.addresses["node-c"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]}, start=False)
    b.overrides += ["--set", f'quic.cert="{bad[0]}"', "--set", f'quic.key="{bad[1]}"', "--set", f'quic.ca="{ca}"']
    b.overrides = [o for o in b.overrides if o != "--set"]
    b.start()
    c = cluster.daemon("node-c", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: "client certificate refused" in a.log(), text="a's server refuses b's certificate")
    wait_for(lambda: "peer connection refused" in a.log() and "peer=node-b" in a.log(),
             text="a's client refuses b's server certificate")
    expected = "unable to get local issuer" if kind == "other-ca" else "no longer valid"
    assert expected in a.log().split("peer connection refused", 1)[1].split("\n", 1)[0]
    wait_for(lambda: "peer connection refused" in b.log(), text="b is told why")
    wait_for(lambda: not peer_stats(b)["node-a"].up,
             text="b marks a down after repeated refusals (and backs off)")
    assert not peer_stats(a)["node-b"].connected
    data = blocks(2, seed=5)
    with b.client() as client:
        client.put(list(data.items()))
    wait_for(lambda: connected(c, "node-a"), text="a good peer still connects")
    with a.client() as client:
        client.put(list(data.items()))
    wait_for(lambda: lookup(c, data).peer == 2, text="c learns a's blocks")
    with c.client() as client:
        got, missing = client.get(list(data))
        assert not missing


def test_no_client_certificate_malformed_frames_and_resumption_against_a_live_daemon(cluster: Cluster) -> None:
    a = cluster.daemon("node-a", 'quic.retry="under_load"', peers={"node-c": cluster.addresses["node-c"]})
    data = blocks(2, seed=7)         # Retry under load only: 0-RTT data reaches an idle server
    with a.client() as client:
        client.put(list(data.items()))
    address = cluster.addresses["node-a"]
    good = PeerAuth.from_files(str(cluster.certs / "ca.pem"), str(cluster.certs / "node-c.pem"),
                               str(cluster.certs / "node-c-key.pem"), ["node-a"])

    async def scenario() -> None:
        # no client certificate at all: the handshake completes in aioquic, the daemon closes it
        bare = await dial(address, None, "node-a", certs=cluster.certs)
        await settle(bare)
        await asyncio.sleep(0.3)
        assert bare.terminated is not None and bare.terminated.error_code == 0x101, bare.terminated
        assert "no certificate" in bare.terminated.reason_phrase

        # a verified peer: bad frames cost their stream only
        tickets: list = []
        peer = await dial(address, good, "node-a", certs=cluster.certs, tickets=tickets)
        await asyncio.wait_for(peer.ready, 5)
        garbage = peer.send_raw(b"\x05\x00\x00\x00\x09\x01\x00\x00\x01\x00\x00\x00hello")          # version 9
        oversize = peer.send_raw(pp.HEADER.pack(64 << 20, pp.VERSION, pp.Exists.TYPE, 0, 2))       # 64 MiB body
        unknown = peer.send_raw(pp.HEADER.pack(0, pp.VERSION, 0x42, 0, 3))                          # unknown type
        truncated = peer.send_raw(pp.encode(pp.Exists(0xFFFFFFFF, [a.digest for a in data]), 4)[:-5])
        await asyncio.sleep(0.5)
        for sid, code in ((garbage, pp.ErrorCode.UNSUPPORTED_VERSION), (oversize, pp.ErrorCode.TOO_LARGE),
                          (unknown, pp.ErrorCode.UNKNOWN_TYPE)):
            decoder = ps.FrameDecoder()
            decoder.feed(bytes(peer.raw[sid]))
            frame = decoder.next_event()
            assert isinstance(frame, pp.Frame), (sid, peer.raw[sid])
            error = pp.decode(frame)
            assert isinstance(error, pp.Error) and error.code == code, error
        assert garbage in peer.ended and oversize in peer.ended
        assert not peer.raw[truncated] or truncated in peer.ended     # a half frame then FIN: nothing to act on
        assert await peer.exists(0xFFFFFFFF, [x.digest for x in data]) == 2   # the connection goes on
        await asyncio.sleep(0.3)
        assert tickets, "the daemon issued a session ticket"
        peer.close()
        await asyncio.sleep(0.2)

        # resumption: 0-RTT with the ticket; a Pull as early data is served, an Announce is refused
        again = await dial(address, good, "node-a", certs=cluster.certs, ticket=tickets[-1])
        early_announce = again.send_raw(pp.encode(pp.Announce([(x.digest, x.layer) for x in data]), 9))
        count = await asyncio.wait_for(again.exists(0xFFFFFFFF, [x.digest for x in data]), 5)
        assert count == 2
        await asyncio.wait_for(again.ready, 5)
        assert again.handshake is not None and again.handshake.session_resumed and again.handshake.early_data_accepted
        await asyncio.sleep(0.3)
        decoder = ps.FrameDecoder()
        decoder.feed(bytes(again.raw[early_announce]))
        error = pp.decode(decoder.next_event())  # type: ignore[arg-type]
        assert isinstance(error, pp.Error) and error.code == pp.ErrorCode.EARLY_DATA, error
        again.close()

    asyncio.run(scenario())
    assert "no certificate was presented" in a.log()
    with a.client() as client:                 # the daemon goes on serving
        got, _ = client.get(list(data))
        assert len(got) == 2
