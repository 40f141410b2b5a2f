"""A cluster through real daemon processes and a real etcd (docs/cluster.md).

Six daemons register in one etcd ([cluster] etcd), learn each other from it, and keep where
blocks are at the blocks' home nodes only. Blocks put on some are found (Lookup's peer column)
and fetched bit-exact (Get) on the others; a daemon killed leaves every view within the lease
and its blocks stop being offered, one that stops leaves at once and is found again after it
restarts; a home lost is rebuilt from the holders; etcd away keeps the daemons serving with the
last membership and adds nobody until it is back; a partition between network namespaces serves
what each side reaches and converges after healing; agents load through the homes, and a stalled
holder and home are hedged around.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Iterator

import blake3
import pytest

from kvcached.cluster.placement import Placement
from kvcached.peers.directory import wire_key
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress
from tests.etcd_server import EtcdServer, etcd_binary
from tests.netns import Hosts, netns_usable

from .conftest import DaemonProcess, run_cli, wait_for
from .test_operations import free_tcp_port, scrape
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


def linked(daemons: list[DaemonProcess]) -> bool:
    """Whether each daemon's connection to every other is up and passed mutual TLS."""
    views = [stats(d).peers for d in daemons]
    return all(len(peers) == len(daemons) - 1 and all(peer.up and peer.connected for peer in peers) for peers in views)


def peer_count(d: DaemonProcess, data: dict[BlockAddress, bytes]) -> int:
    with d.client() as c:
        return c.lookup([a.digest for a in data]).peer


def longest(d: DaemonProcess, data: dict[BlockAddress, bytes]) -> int:
    """How much of ``data`` (as one chain) a Get on ``d`` can return: held here or by a peer."""
    with d.client() as c:
        return c.lookup([a.digest for a in data]).longest


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
    metrics_port = free_tcp_port()
    daemons = [cluster.daemon(name, *([f'metrics.listen="127.0.0.1:{metrics_port}"'] if name == "node-c" else []))
               for name in NODES]
    wait_for(lambda: converged(daemons, set(NODES)), timeout=20, text="every daemon sees every member")
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
    samples = scrape(metrics_port)                        # promtool checks the page
    assert samples["kvcached_cluster_members"] == 6 and samples["kvcached_cluster_etcd_reachable"] == 1
    assert samples['kvcached_cluster_locates_total{outcome="ok"}'] >= 1
    assert samples["kvcached_cluster_home_records"] == stats(c).cluster.home_records


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


@pytest.mark.slow
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


def test_a_daemon_whose_certificate_does_not_carry_its_name_refuses_to_start(cluster: Cluster) -> None:
    d = cluster.daemon("node-a", cert="node-b", start=False)
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(20) != 0
    assert "cluster.name" in d.log() and "node-a" in d.log()


@pytest.mark.slow
@pytest.mark.skipif(not netns_usable(), reason="network namespaces need root and the ip tool")
def test_a_partition_serves_what_each_side_reaches_and_converges_after_healing(tmp_path: Path) -> None:
    """Hosts h1 (a, b, c) and h2 (d, e, f) in their own network namespaces, etcd beside the bridge.
    h2 is cut from h1 and from etcd: h1 drops h2's daemons within the lease and serves its own
    blocks; h2 keeps its last view, serves only what it can reach; after healing, every view
    is whole again and every block is found and fetched bit-exact everywhere."""
    hosts = Hosts()
    try:
        h1, h2 = hosts.add("h1"), hosts.add("h2")
        result = run_cli(["certs", "--dir", str(tmp_path / "certs"), *NODES])
        assert result.returncode == 0, result.stderr
        etcd = EtcdServer(tmp_path / "etcd", host=hosts.gateway)
        etcd.start()
        cluster = Cluster.__new__(Cluster)
        cluster.root, cluster.certs, cluster.etcd, cluster.daemons = tmp_path, tmp_path / "certs", etcd, {}
        try:
            placed = {"node-a": h1, "node-b": h1, "node-c": h1, "node-d": h2, "node-e": h2, "node-f": h2}
            daemons = {}
            for name, ns in placed.items():
                d = cluster.daemon(name, start=False)
                d.overrides[0] = f'quic.listen="{hosts.hosts[ns]}:{7400 + NODES.index(name)}"'
                d.prefix = hosts.exec(ns)
                daemons[name] = d.start()
            everyone = list(daemons.values())
            wait_for(lambda: converged(everyone, set(NODES)), timeout=30, text="every daemon sees every member")
            on_a, on_d = blocks(30, "part-a"), blocks(30, "part-d")
            with daemons["node-a"].client() as client:
                client.put(list(on_a.items()), model="llama")
            with daemons["node-d"].client() as client:
                client.put(list(on_d.items()), model="llama")
            b, e = daemons["node-b"], daemons["node-e"]
            wait_for(lambda: peer_count(b, on_d) == 30 and peer_count(e, on_a) == 30, timeout=15, text="all found")

            hosts.cut(h2, hosts.hosts[h1])
            hosts.cut(h2, hosts.gateway)
            side1 = [daemons[n] for n in ("node-a", "node-b", "node-c")]
            wait_for(lambda: converged(side1, {"node-a", "node-b", "node-c"}), timeout=LEASE_S + 4,
                     text="h1 drops h2's daemons")
            wait_for(lambda: peer_count(b, on_a) == 30, timeout=5, text="a's blocks rehomed on h1")
            assert get_all(b, on_a) == on_a                                        # h1 serves its own
            assert peer_count(b, on_d) == 0 and get_all(b, on_d) == {}             # and offers nothing of h2's
            got = get_all(e, {**on_a, **on_d})                                    # h2: what it can reach, all exact
            assert all(on_d[a] == v for a, v in got.items()) and not set(got) & set(on_a)
            assert members(e) == set(NODES)                                        # etcd away: the last view kept

            hosts.heal()
            wait_for(lambda: converged(everyone, set(NODES)), timeout=30, text="views converge after healing")
            for d in everyone:            # some hold some blocks themselves now (mirrored pulls): in some tier
                try:
                    wait_for(lambda d=d: longest(d, on_a) == 30 and longest(d, on_d) == 30, timeout=15,
                             text=f"{d.state.name} finds every block after healing")
                except AssertionError:
                    import sys
                    pl = homes(list(on_a) + list(on_d), set(NODES))
                    with d.client() as c:
                        for name, data in (("a", on_a), ("d", on_d)):
                            for x in data:
                                r = c.lookup([x.digest])
                                if not r.longest:
                                    print("MISS", name, x.digest.hex()[:8], pl[x], file=sys.stderr)
                    for name, dd in daemons.items():
                        print(name, stats(dd).cluster, file=sys.stderr)
                    raise
            assert get_all(b, on_d) == on_d and get_all(e, on_a) == on_a
        finally:
            cluster.stop()
    finally:
        hosts.close()


def test_an_agent_load_pulls_blocks_found_through_their_homes(cluster: Cluster) -> None:
    import torch

    from kvcached_agent import Agent
    from kvcached_agent import protocol as p

    a, b, c = start_all(cluster, NODES[:3])
    layer_bytes = 32 * KIB
    tokens = list(range(16 * 8))
    shape = dict(model="m", dtype="float16", block_tokens=16, num_layers=1, layer_block_bytes=layer_bytes)
    with Agent.connect(str(a.state / "agent.sock"), agent_id="writer", **shape) as writer:   # type: ignore[arg-type]
        addresses = writer.addresses(writer.hash_tokens(tokens))
        tensors = [torch.randint(-1000, 1000, (layer_bytes // 2,), dtype=torch.int16).view(torch.float16)
                   for _ in addresses]
        assert not writer.save(addresses, tensors).skipped
    with Agent.connect(str(c.state / "agent.sock"), agent_id="reader", **shape) as reader:   # type: ignore[arg-type]
        # Present (each block on its own) asks the homes as Lookup does: every block held at a peer.
        wait_for(lambda: reader.present([x.digest for x in addresses]) == bytes([p.HELD_PEER]) * len(addresses),
                 timeout=10, text="the agent's Present finds a's blocks (c asked their homes)")
        wait_for(lambda: reader.lookup([x.digest for x in addresses]).peer == len(addresses), timeout=10,
                 text="the agent's Lookup counts a's blocks (c asked their homes)")
        out = [torch.zeros_like(t) for t in tensors]
        result = reader.load(addresses, out)
        assert not result.missing
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(out, tensors))


def test_a_stalled_holder_and_home_are_hedged_around(cluster: Cluster) -> None:
    """Blocks held by a and b; a stops answering (SIGSTOP): c's Lookup and Get go to the next
    home and the next holder after the hedge delay, well within the pull deadline."""
    a, b, c = start_all(cluster, NODES[:3])
    shared = blocks(24, "hedge")
    for d in (a, b):
        with d.client() as client:
            client.put(list(shared.items()), model="llama")
    wait_for(lambda: peer_count(c, shared) == 24, timeout=10, text="c finds the blocks")
    time.sleep(2.5)                                         # the location cache (2 s) forgets: c asks again below
    assert a.proc is not None
    a.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert peer_count(c, shared) == 24                  # the homes a is one of: hedged to the others
        got = get_all(c, shared)
        took = time.monotonic() - started
        assert got == shared and took < 1.5, took           # pull_timeout_s is 2: nothing waited for a
    finally:
        a.proc.send_signal(signal.SIGCONT)


def test_a_daemon_that_stops_leaves_at_once_and_is_found_again_after_it_restarts(cluster: Cluster) -> None:
    daemons = start_all(cluster, NODES[:4])
    a, b, c, d = daemons
    on_b = blocks(16, "restart")
    with b.client() as client:
        client.put(list(on_b.items()), model="llama")
    wait_for(lambda: peer_count(c, on_b) == 16, timeout=10, text="c finds b's blocks")
    stopped = time.monotonic()
    assert b.stop() == 0                                            # SIGTERM: the lease is revoked on the way out
    wait_for(lambda: converged([a, c, d], {"node-a", "node-c", "node-d"}), timeout=LEASE_S, text="b gone at once")
    assert time.monotonic() - stopped < LEASE_S                     # not a lease later: it said goodbye
    assert peer_count(c, on_b) == 0
    b.start()                                                       # same name, same state (RAM only: blocks gone)
    wait_for(lambda: converged(daemons, set(NODES[:4])), timeout=10, text="b back in every view")
    with b.client() as client:
        client.put(list(on_b.items()), model="llama")
    wait_for(lambda: peer_count(c, on_b) == 16 and peer_count(a, on_b) == 16, timeout=10, text="b's blocks found again")
    assert get_all(d, on_b) == on_b


@pytest.mark.parametrize("lane", ["mac", "quic"])
def test_locates_and_pulls_over_each_lane_mode(cluster: Cluster, lane: str) -> None:
    """Locates go over the bulk lane where there is one (tls, the default, runs in every test
    above), with keyed seals on a mac lane; over QUIC with lane = "quic"."""
    daemons = [cluster.daemon(name, f'quic.lane="{lane}"') for name in NODES[:3]]
    wait_for(lambda: converged(daemons, set(NODES[:3])), timeout=20, text="every daemon sees every member")
    a, b, c = daemons
    # A member may dial a peer that has not yet seen it join, and be refused (only members may
    # connect): what counts here starts once every connection is up, as it is after a start.
    wait_for(lambda: linked(daemons), timeout=10, text="every daemon connected to every other")
    before = stats(c)
    on_a = blocks(24, f"lane-{lane}")
    with a.client() as client:
        client.put(list(on_a.items()), model="llama")
    wait_for(lambda: peer_count(c, on_a) == 24, timeout=10, text="c finds a's blocks")
    assert get_all(c, on_a) == on_a
    s = stats(c)
    failed = s.cluster.locate_failures - before.cluster.locate_failures
    assert s.cluster.locates > before.cluster.locates and failed == 0 and s.peer_lane_fallbacks == 0, \
        (failed, s.peer_lane_fallbacks, [(peer.name, peer.up, peer.connected, peer.last_error) for peer in s.peers])
    assert (s.peer_lane_pulls >= 1) == (lane != "quic")
