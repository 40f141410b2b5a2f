"""A cluster through real daemon processes and a real etcd (docs/cluster.md).

Six daemons register in one etcd ([cluster] etcd), learn each other from it, and keep where
blocks are at the blocks' home nodes only. Blocks put on some are found (Lookup's peer column)
and fetched bit-exact (Get) on the others; a daemon killed leaves every view within the lease
and its blocks stop being offered; a home lost is rebuilt from the holders; etcd away keeps the
daemons serving with the last membership and adds nobody until it is back.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Iterator

import blake3
import pytest

from kvcached.cluster.member import Member, member_key
from kvcached.cluster.placement import Placement
from kvcached.peers.directory import wire_key
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress
from tests.etcd_server import EtcdServer, etcd_binary

from .conftest import DaemonProcess, run_cli, wait_for
from .test_peer_tier import free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (make system-deps)")]

NODES = tuple(f"node-{c}" for c in "abcdef")
LEASE_S = 2
PREFIX = "/kvcached-test"
KIB = 1 << 10


def blocks(n: int, seed: str, size: int = 16 * KIB) -> dict[BlockAddress, bytes]:
    return {BlockAddress(blake3.blake3(f"cluster-{seed}-{i}".encode()).digest()):
            blake3.blake3(f"payload-{seed}-{i}".encode()).digest(length=size + i) for i in range(n)}


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.certs = root / "certs"
        result = run_cli(["certs", "--dir", str(self.certs), *NODES, "node-x"])
        assert result.returncode == 0, result.stderr
        self.etcd = EtcdServer(root / "etcd")
        self.etcd.start()
        self.daemons: dict[str, DaemonProcess] = {}

    def daemon(self, name: str, *overrides: str, cert: str | None = None, start: bool = True) -> DaemonProcess:
        state = self.root / name
        state.mkdir(exist_ok=True)
        cert = cert or name
        d = DaemonProcess(state, [
            f'quic.listen="127.0.0.1:{free_port()}"', f'quic.ca="{self.certs / "ca.pem"}"',
            f'quic.cert="{self.certs / (cert + ".pem")}"', f'quic.key="{self.certs / (cert + "-key.pem")}"',
            "quic.max_datagram_size=16000", "quic.pull_timeout_s=2", "quic.backoff_s=0.3", "quic.backoff_max_s=1",
            f'cluster.etcd=["{self.etcd.endpoint}"]', f'cluster.name="{name}"', f"cluster.lease_s={LEASE_S}",
            f'cluster.prefix="{PREFIX}"', "cluster.placement_bits=10", *overrides])
        self.daemons[name] = d
        return d.start() if start else d

    def stop(self) -> None:
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
        self.etcd.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.stop()


def stats(d: DaemonProcess) -> pb.StatsResponse:
    with d.client() as c:
        return c.stats()


def members(d: DaemonProcess) -> set[str]:
    return set(stats(d).cluster.members)


def converged(daemons: list[DaemonProcess], names: set[str]) -> bool:
    return all(members(d) == names for d in daemons)


def peer_count(d: DaemonProcess, data: dict[BlockAddress, bytes]) -> int:
    with d.client() as c:
        return c.lookup([a.digest for a in data]).peer


def get_all(d: DaemonProcess, data: dict[BlockAddress, bytes]) -> dict[BlockAddress, bytes]:
    """What a Get of ``data``'s addresses returns (allow_partial: the blocks that came)."""
    with d.client() as c:
        got, _ = c.get(list(data), allow_partial=True)
    return {f.address: f.payload for f in got}


def homes(addresses: list[BlockAddress], names: set[str]) -> dict[BlockAddress, tuple[str, ...]]:
    """The home nodes of each block, computed as the daemons do (cluster.placement_bits=10)."""
    placement = Placement(2, bits=10)
    placement.set_members(names)
    return {a: placement.homes_of(placement.bucket_of_key(wire_key(a.digest, a.layer))) for a in addresses}


def start_all(cluster: Cluster, names: tuple[str, ...] = NODES) -> list[DaemonProcess]:
    daemons = [cluster.daemon(name) for name in names]
    wait_for(lambda: converged(daemons, set(names)), timeout=20, text="every daemon sees every member")
    return daemons


def test_six_daemons_find_and_fetch_each_others_blocks_bit_exact(cluster: Cluster) -> None:
    daemons = start_all(cluster)
    a, b, c = daemons[:3]
    on_a, on_b = blocks(40, "a"), blocks(40, "b")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    with b.client() as client:
        client.put(list(on_b.items()), model="llama")
    for d in daemons[2:]:
        wait_for(lambda d=d: peer_count(d, on_a) == 40 and peer_count(d, on_b) == 40, timeout=10,
                 text=f"{d.state.name} finds a's and b's blocks through their homes")
        assert get_all(d, on_a) == on_a and get_all(d, on_b) == on_b        # bit-exact
    # the records are at the blocks' homes only: 2 homes a block, none holding the whole list
    records = {d.state.name: stats(d).cluster.home_records for d in daemons}
    placed = homes(list(on_a) + list(on_b), set(NODES))
    expected = {name: sum(name in h for h in placed.values()) for name in NODES}
    assert sum(records.values()) >= sum(expected.values())                 # c..f mirrored what they pulled
    assert all(records[n] < len(placed) for n in NODES), records
    served = sum(stats(d).cluster.served_locates for d in daemons)
    assert served > 0


def test_a_killed_daemon_leaves_every_view_within_the_lease_and_its_blocks_stop_being_offered(cluster: Cluster) -> None:
    daemons = start_all(cluster)
    a, b, c = daemons[:3]
    on_b = blocks(20, "b")
    on_a = blocks(20, "a")
    with b.client() as client:
        client.put(list(on_b.items()), model="llama")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    wait_for(lambda: peer_count(c, on_b) == 20 and peer_count(c, on_a) == 20, timeout=10, text="c finds the blocks")
    b.stop(signal.SIGKILL)
    killed = time.monotonic()
    rest = [d for d in daemons if d is not b]
    wait_for(lambda: converged(rest, set(NODES) - {"node-b"}), timeout=LEASE_S + 3, text="b out of every view")
    assert time.monotonic() - killed <= LEASE_S + 1 + 1.5          # lease + 1 s, plus this test's polling of 5 daemons
    assert peer_count(c, on_b) == 0 and not get_all(c, on_b)        # nothing of b's is offered or served
    assert peer_count(c, on_a) == 20 and get_all(c, on_a) == on_a   # a's still are


def test_a_lost_home_is_rebuilt_from_the_holders(cluster: Cluster) -> None:
    daemons = start_all(cluster)
    by_name = {d.state.name: d for d in daemons}
    a = by_name["node-a"]
    on_a = blocks(60, "home")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    placed = homes(list(on_a), set(NODES))
    # the daemon (not a) that is the first home of the most blocks: the one to lose
    lost = max((n for n in NODES if n != "node-a"), key=lambda n: sum(h[0] == n for h in placed.values()))
    asker = next(d for n, d in by_name.items() if n not in ("node-a", lost))
    wait_for(lambda: peer_count(asker, on_a) == 60, timeout=10, text="blocks found before")
    by_name[lost].stop(signal.SIGKILL)
    wait_for(lambda: lost not in members(asker), timeout=LEASE_S + 3, text="the lost home out of the view")
    started = time.monotonic()
    wait_for(lambda: peer_count(asker, on_a) == 60, timeout=10, text="the blocks found through the new homes")
    assert time.monotonic() - started < 5
    assert stats(a).cluster.republished > 0                          # a told the new homes
    assert get_all(asker, on_a) == on_a


def test_etcd_away_keeps_serving_adds_nobody_and_recovers(cluster: Cluster) -> None:
    names = NODES[:3]
    daemons = start_all(cluster, names)
    a, b, c = daemons
    on_a = blocks(10, "away")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    wait_for(lambda: peer_count(b, on_a) == 10, timeout=10, text="b finds a's blocks")
    cluster.etcd.kill()
    wait_for(lambda: not stats(b).cluster.etcd_reachable, timeout=LEASE_S * 3, text="b notices etcd is away")
    time.sleep(LEASE_S * 1.5)                                       # past every lease: nobody is dropped meanwhile
    assert converged(daemons, set(names))
    assert get_all(c, on_a) == on_a                                 # pulls go on with the last membership
    d = cluster.daemon("node-d")                                    # starts without etcd: serves alone, not added
    time.sleep(1.0)
    assert converged(daemons, set(names)) and members(d) == set()
    cluster.etcd.start()
    wait_for(lambda: converged(daemons + [d], set(names) | {"node-d"}), timeout=20, text="views converge with d")
    wait_for(lambda: peer_count(d, on_a) == 10, timeout=5, text="d finds a's blocks (the homes' listings in)")
    assert get_all(d, on_a) == on_a


def test_a_registration_whose_certificate_says_otherwise_is_never_used(cluster: Cluster) -> None:
    daemons = start_all(cluster, NODES[:2])
    a, b = daemons
    on_a = blocks(8, "x")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    wait_for(lambda: peer_count(b, on_a) == 8, timeout=10, text="b finds a's blocks")
    # "node-x" registered by hand at node-a's address: a's certificate names node-a, not node-x
    quic_port = int(a.overrides[0].split(":")[-1].rstrip('"'))
    import asyncio

    from etcd3aio import Etcd3Client

    async def register() -> None:
        async with Etcd3Client([cluster.etcd.endpoint]) as client:
            await client.kv.put(member_key(PREFIX, "node-x"), Member("node-x", "127.0.0.1", quic_port, quic_port).encode())

    asyncio.run(register())
    wait_for(lambda: "node-x" in members(b), timeout=5, text="b sees the registration")
    time.sleep(1.5)
    peers = {p.name: p for p in stats(b).peers}
    assert not peers["node-x"].connected                             # its certificate check fails: never used
    assert get_all(b, on_a) == on_a                                 # the real members still serve


def test_a_daemon_whose_certificate_does_not_carry_its_name_refuses_to_start(cluster: Cluster) -> None:
    d = cluster.daemon("node-a", cert="node-b", start=False)
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(20) != 0
    assert "cluster.name" in d.log() and "node-a" in d.log()
