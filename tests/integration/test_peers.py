"""The peer tier through real daemon processes on loopback, with certificates from `kvcached certs`.

Three daemons (node-a, node-b, node-c) each listen for QUIC on their own UDP port and list the
other two as peers. Blocks put on one are found and fetched on the others (gRPC Get and an
agent's load); announcements, drops, mirror_pulls, a peer killed mid-pull, and certificates
that must be refused are each checked against what the daemons really do.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

import blake3
import pytest
import torch

from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent import Agent
from kvcached_agent.address import BlockAddress

from .conftest import DaemonProcess, run_cli

NODES = ("node-a", "node-b", "node-c")
KIB = 1 << 10


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: Callable[[], bool], timeout: float = 20.0, text: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting: {text}")


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
            "quic.pull_timeout_s=2", "quic.backoff_s=0.5", "quic.backoff_max_s=2", *overrides])
        self.daemons[name] = d
        return d.start() if start else d

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()


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


def test_blocks_put_on_one_daemon_are_found_and_fetched_bit_exact_on_the_others(cluster: Cluster) -> None:
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

    with c.client() as client:                       # mirror_pulls off: read, then not kept
        got, _ = client.get(list(data)[:4])
        assert {f.address: f.payload for f in got} == dict(list(data.items())[:4])
        assert client.lookup([x.digest for x in data]).ram == 0
    time.sleep(0.3)
    assert peer_stats(a)["node-c"].blocks == 0      # c announced nothing

    with a.client() as client:                       # a drop propagates
        client.delete(list(data)[:6])
    wait_for(lambda: peer_stats(c)["node-a"].blocks == 6, text="c hears a's drops")


def test_an_agent_load_pulls_from_a_peer_into_its_arena_slots(cluster: Cluster) -> None:
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


def lookup_digests(d: DaemonProcess, addresses: list[BlockAddress]) -> int:
    with d.client() as c:
        return c.lookup([x.digest for x in addresses]).peer


def test_a_peer_killed_mid_pull_is_a_miss_within_the_deadline_and_used_again_after_it_restarts(cluster: Cluster) -> None:
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

    import threading
    outcome: dict[str, object] = {}

    def pull() -> None:
        t0 = time.monotonic()
        with b.client() as client:
            got, missing = client.get(list(only_a), allow_partial=True)
        outcome.update(got=len(got), missing=len(missing), seconds=time.monotonic() - t0,
                       exact=all(f.payload == only_a[f.address] for f in got))

    thread = threading.Thread(target=pull)
    thread.start()
    time.sleep(0.05)
    a.stop(signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
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
