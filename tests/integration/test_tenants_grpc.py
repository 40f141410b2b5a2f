"""Tenants on the gRPC API (issue 41, docs/security.md): real daemons, real users made for the
test, real client certificates. A tenant's socket admits its own uids alone (the kernel refuses
everyone else at connect), and every call on it acts as that tenant; a client certificate names
its tenant on mutual-TLS listeners. Either way, one tenant never finds, fetches, deletes, lists
or counts another's blocks saved under the same digests, and refusals are counted by reason.
A caller that spoofs another's cache_salt (or any namespace) computes the other's digests
exactly, as these tests send the same digests from both tenants: they are mapped to the
spoofer's own addresses, so it gains nothing."""

from __future__ import annotations

import asyncio
import datetime
import errno
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvcached.api.convert import address_from_pb, address_to_pb
from kvcached.client import KvCacheClient
from kvcached.codecs import codec_named
from kvcached.events.schema import decode_batch
from kvcached.peers import protocol as pp
from kvcached.peers.certs import make_cluster
from kvcached.peers.lane_client import LaneClient
from kvcached.peers.session import PullSink
from kvcached.peers.tls import PeerAuth
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import BlockAddress
from tests.integration.conftest import DaemonProcess, run_cli, wait_for
from tests.integration.test_events import replay
from tests.integration.test_operations import free_tcp_port
from tests.integration.test_peers import Cluster, connected, dial
from tests.integration.test_upgrade import Service
from tests.integration.users import as_user, needs_users

DIGEST = bytes(range(32))
NEVER = bytes(range(1, 33))
ADDRESS = BlockAddress(DIGEST)


def connects(path: Path) -> Callable[[], str]:
    def work() -> str:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(path))
            return "connected"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
        finally:
            s.close()
    return work


def code_of(call: Callable[[], Any]) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return None


@needs_users
def test_a_tenant_socket_admits_its_tenant_alone_and_every_call_acts_as_it(
        make_daemon: Any, users: Callable[[], tuple[int, int]], socket_dir: Path) -> None:
    (a_uid, a_gid), (b_uid, b_gid), (c_uid, c_gid) = users(), users(), users()
    alice_sock, bob_sock = socket_dir / "alice.sock", socket_dir / "bob.sock"
    d = make_daemon(f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}",
                    f'tenants.sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}')
    # The kernel decides who may open each socket.
    assert as_user(a_uid, a_gid, connects(alice_sock)) == {"ok": "connected"}
    assert as_user(a_uid, a_gid, connects(bob_sock)) == {"ok": "EACCES"}
    assert as_user(b_uid, b_gid, connects(bob_sock)) == {"ok": "connected"}
    assert as_user(c_uid, c_gid, connects(alice_sock)) == {"ok": "EACCES"}, "a user no tenant maps is let in"

    with KvCacheClient(f"unix:{alice_sock}") as alice, KvCacheClient(f"unix:{bob_sock}") as bob, \
            d.client() as operator:
        assert alice.put([(ADDRESS, b"alice" * 100)]).stored == 1
        assert alice.lookup([DIGEST]).longest == 1
        assert [f.payload for f in alice.get([ADDRESS])[0]] == [b"alice" * 100]
        assert alice.get([ADDRESS])[0][0].address == ADDRESS, "answers name blocks as the caller sent them"
        # Bob, with the same digest: a miss, as for a digest nobody stored.
        assert bob.lookup([DIGEST]).longest == 0
        found, misses = bob.get([ADDRESS, BlockAddress(NEVER)], allow_partial=True)
        assert not found and [m.reason for m in misses][0] == [m.reason for m in misses][1]
        assert code_of(lambda: bob.get([ADDRESS])) == code_of(lambda: bob.get([BlockAddress(NEVER)])) \
            == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: bob.get_stream([ADDRESS])) == grpc.StatusCode.NOT_FOUND
        assert bob.delete([ADDRESS]).not_found == 1 and alice.lookup([DIGEST]).longest == 1, "bob deleted alice's block"
        assert bob.put([(ADDRESS, b"bob" * 100)]).stored == 1, "the same digest is bob's own block"
        assert [f.payload for f in bob.get_stream([ADDRESS])[0]] == [b"bob" * 100]
        assert [f.payload for f in alice.get([ADDRESS])[0]] == [b"alice" * 100]
        # Each lists its own blocks, under the addresses they are stored at; the operator, all.
        mine = list(bob.list_blocks())
        assert [(b.tenant, b.nbytes) for b in mine] == [("bob", 300)]
        assert [(b.tenant, b.nbytes) for b in alice.list_blocks()] == [("alice", 500)]
        assert mine[0].address.digest != DIGEST, "listed under bob's own address, not the digest he sent"
        assert sorted(b.tenant for b in operator.list_blocks()) == ["alice", "bob"]
        # Each tenant's Stats counts its own; the whole store's counts, and Admin, are the operator's.
        own = bob.stats()
        assert (own.tiers[0].blocks, own.tiers[0].bytes, own.puts, own.hits, own.misses) == (1, 300, 1, 1, 5), own
        assert (own.index_entries, own.lookups, own.agents) == (0, 1, 0), "its own lookup, nothing of the whole store"
        assert (alice.stats().puts, alice.stats().tiers[0].blocks) == (1, 1)
        listed = run_cli(["ls", "--target", d.target, "--tenant", "bob"])
        assert listed.returncode == 0 and listed.stdout.count("tenant bob") == 1 and "alice" not in listed.stdout
        stat = run_cli(["stat", "--json", "--target", f"unix:{bob_sock}"])
        assert stat.returncode == 0 and '"puts": "1"' in stat.stdout, stat
        admin = pb_grpc.AdminStub(bob.channel)
        assert code_of(lambda: admin.GetConfig(pb.GetConfigRequest())) == grpc.StatusCode.PERMISSION_DENIED
        with KvCacheClient(f"unix:{bob_sock}", tenant="alice") as posing:
            assert code_of(lambda: posing.lookup([DIGEST])) == grpc.StatusCode.PERMISSION_DENIED
        # The operator: its own digests are the default tenant's; it may act as any tenant.
        assert operator.lookup([DIGEST]).longest == 0 and operator.stats().puts == 2
        with d.client(tenant="alice") as as_alice, d.client(tenant="nobody") as unknown:
            assert as_alice.lookup([DIGEST]).longest == 1
            assert code_of(lambda: unknown.lookup([DIGEST])) == grpc.StatusCode.INVALID_ARGUMENT
            dropped = run_cli(["drop", "--json", "--target", d.target, "--tenant", "alice", DIGEST.hex()])
            assert json.loads(dropped.stdout) == {"evicted": 1, "busy": 0, "not_found": 0}, dropped
            assert alice.lookup([DIGEST]).longest == 0 and bob.lookup([DIGEST]).longest == 1
            refused = run_cli(["drop", "--target", f"unix:{bob_sock}", DIGEST.hex()])
            assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr, refused
            both = run_cli(["drop", "--target", d.target, "--model", "m", DIGEST.hex()])
            assert both.returncode == 2 and "not both" in both.stderr
            assert alice.put([(ADDRESS, b"again" * 10)], model="m").stored == 1
            by_model = pb_grpc.AdminStub(as_alice.channel).Evict(pb.EvictRequest(model="m"),
                                                                 metadata=[("kvcached-tenant", "bob")])
            assert by_model.evicted == 0 and alice.lookup([DIGEST]).longest == 1, "evicting bob's model took alice's"
    assert "tenants.sockets" not in d.log() and "Traceback" not in d.log()


@pytest.fixture
def tls_tenants(make_daemon: Any, tmp_path: Path) -> tuple[Any, Any, int]:
    certs, _ = make_cluster(tmp_path / "certs", ["node-a", "alice-engine", "bob-engine", "admin", "stranger"])
    nameless = _certificate_without_names(certs.ca, tmp_path / "certs")
    cert, key = certs.nodes["node-a"]
    port, metrics = free_tcp_port(), free_tcp_port()
    d = make_daemon(f'metrics.listen="127.0.0.1:{metrics}"', "grpc.tls=true", f'grpc.tls_cert="{cert}"',
                    f'grpc.tls_key="{key}"', f'grpc.tls_ca="{certs.ca}"',
                    f'grpc.listen=["unix:{tmp_path / "kvcached.sock"}", "127.0.0.1:{port}"]',
                    'tenants.certs={ alice = ["alice-engine"], bob = ["bob-engine"] }', 'tenants.operators=["admin"]',
                    'tenants.default=""')
    certs.nodes["nameless"] = nameless
    d.metrics = metrics
    return d, certs, port


def _certificate_without_names(ca: Path, directory: Path) -> tuple[Path, Path]:
    """A client certificate the cluster CA signed that carries neither a DNS name nor a CN."""
    ca_cert = x509.load_pem_x509_certificate(ca.read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "x")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    cert_path, key_path = directory / "nameless.pem", directory / "nameless-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def stub(port: int, certs: Any, client: str, tenant: str | None = None) -> tuple[grpc.Channel, Any]:
    cert, key = certs.nodes[client]
    creds = grpc.ssl_channel_credentials(certs.ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "node-a")])
    return channel, pb_grpc.KvCacheStub(channel)


def test_client_certificates_name_tenants_on_mutual_tls(tls_tenants: Any) -> None:
    d, certs, port = tls_tenants
    put = pb.PutRequest(blocks=[pb.Block(address=address_to_pb(ADDRESS), payload=b"a" * 64)])
    lookup = pb.LookupRequest(digests=[DIGEST])
    get = pb.GetRequest(addresses=[address_to_pb(ADDRESS)])
    a_ch, alice = stub(port, certs, "alice-engine")
    b_ch, bob = stub(port, certs, "bob-engine")
    o_ch, operator = stub(port, certs, "admin")
    with a_ch, b_ch, o_ch:
        assert alice.Put(put).stored == 1 and alice.Lookup(lookup).longest == 1
        assert bob.Lookup(lookup).longest == 0
        assert code_of(lambda: bob.Get(get)) == grpc.StatusCode.NOT_FOUND
        assert bob.Delete(pb.DeleteRequest(addresses=[address_to_pb(ADDRESS)])).not_found == 1
        assert alice.Get(get).blocks[0].payload == b"a" * 64
        assert operator.Lookup(lookup, metadata=[("kvcached-tenant", "alice")]).longest == 1
        assert operator.Stats(pb.StatsRequest()).puts == 1
        assert code_of(lambda: bob.Lookup(lookup, metadata=[("kvcached-tenant", "alice")])) == \
            grpc.StatusCode.PERMISSION_DENIED
    for who, why in (("stranger", "names no tenant"), ("nameless", "carries no DNS subjectAltName")):
        channel, caller = stub(port, certs, who)
        with channel:
            with pytest.raises(grpc.RpcError) as refused:
                caller.Lookup(lookup)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and why in refused.value.details()
    with d.client() as local:                 # the daemon's Unix socket: the operator
        assert local.lookup([DIGEST]).longest == 0 and local.stats().puts == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics}/metrics", timeout=10).read().decode()
    for reason in ("no_tenant", "no_certificate_name", "other_tenant"):
        assert f'kvcached_grpc_tenant_refusals_total{{reason="{reason}"}} 1.0' in text, reason


@needs_users
def test_tenants_and_their_sockets_survive_an_upgrade(users: Callable[[], tuple[int, int]], socket_dir: Path,
                                                      tmp_path: Path) -> None:
    """Blocks stored before tenants stay the default tenant's; a tenant's blocks and its
    socket's ACL are the same after ``kvcached upgrade`` (the successor binds its own)."""
    (a_uid, a_gid), (b_uid, _) = users(), users()
    alice_sock, bob_sock = socket_dir / "alice.sock", socket_dir / "bob.sock"
    d = DaemonProcess(tmp_path, ["kv.ram_gib=0.25"]).start()
    with d.client() as before:
        assert before.put([(BlockAddress(NEVER), b"old" * 10)]).stored == 1
    d.stop()
    d = DaemonProcess(tmp_path, ["kv.ram_gib=0.25", f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}",
                                 f'tenants.sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}']).start()
    service = Service(d)
    try:
        with KvCacheClient(f"unix:{alice_sock}") as alice:
            assert alice.put([(ADDRESS, b"alice" * 10)]).stored == 1
        service.upgrade()
        with KvCacheClient(f"unix:{alice_sock}") as alice, KvCacheClient(f"unix:{bob_sock}") as bob, \
                d.client() as operator:
            assert [f.payload for f in alice.get([ADDRESS])[0]] == [b"alice" * 10]
            assert bob.lookup([DIGEST]).longest == 0 and alice.lookup([NEVER]).longest == 0
            assert [f.payload for f in operator.get([BlockAddress(NEVER)])[0]] == [b"old" * 10], "the default's"
        assert as_user(a_uid, a_gid, connects(alice_sock)) == {"ok": "connected"}
        assert as_user(a_uid, a_gid, connects(bob_sock)) == {"ok": "EACCES"}, "the successor's socket admits alice"
    finally:
        service.stop()


def test_a_pull_across_daemons_keeps_the_tenant(tmp_path: Path) -> None:
    """Two daemons sharing the tenant key (as a cluster must): alice's block saved on one is
    found and pulled by alice on the other (over the bulk lane, the Pull naming her), recorded
    there as hers; bob finds nothing. A raw QUIC Pull of her address naming another tenant is a
    miss, counted; so is a CodedPull of it over the lane (its tenant check is the Pull's)."""
    key = tmp_path / "tenants.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    cluster = Cluster(tmp_path, ("node-a", "node-b"))
    sock = {name: {t: tmp_path / f"{name[-1]}-{t}.sock" for t in ("alice", "bob")} for name in ("node-a", "node-b")}
    try:
        a_metrics = free_tcp_port()
        for name in ("node-a", "node-b"):
            cluster.daemon(name, f'tenants.key_file="{key}"', "tenants.uids={ alice = [4242], bob = [4243] }",
                           f'tenants.sockets={{ alice = "{sock[name]["alice"]}", bob = "{sock[name]["bob"]}" }}',
                           *([f'metrics.listen="127.0.0.1:{a_metrics}"'] if name == "node-a" else []))
        a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
        wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="peers connected")
        with KvCacheClient(f"unix:{sock['node-a']['alice']}") as alice_a:
            assert alice_a.put([(ADDRESS, b"alice" * 100)]).stored == 1
        with KvCacheClient(f"unix:{sock['node-b']['alice']}") as alice_b, \
                KvCacheClient(f"unix:{sock['node-b']['bob']}") as bob_b, b.client() as operator_b:
            wait_for(lambda: alice_b.lookup([DIGEST]).peer == 1, text="b learns of alice's block")
            assert bob_b.lookup([DIGEST]).longest == 0 and operator_b.lookup([DIGEST]).longest == 0
            assert [f.payload for f in alice_b.get([ADDRESS])[0]] == [b"alice" * 100]
            assert [b.tenant for b in operator_b.list_blocks()] == ["alice"], "the pulled copy is recorded as alice's"
            assert alice_b.lookup([DIGEST]).ram == 1 and bob_b.lookup([DIGEST]).longest == 0
            assert code_of(lambda: bob_b.get([ADDRESS])) == grpc.StatusCode.NOT_FOUND
        with a.client() as operator_a:
            stored = address_from_pb(next(iter(operator_a.list_blocks())).address)   # alice's keyed address on node-a
        # A member that names the wrong tenant for that address gets a miss: the holder checks
        # the record's tenant as it checks the digest.
        answers = asyncio.run(_raw_pulls(cluster, (stored.digest, stored.layer), ["bob", "", "alice"]))
        assert answers == {"bob": "miss NOT_FOUND", "": "miss NOT_FOUND", "alice": "block"}, answers
        coded = asyncio.run(_coded_lane_pulls(cluster, (stored.digest, stored.layer), ["bob", "", "alice"]))
        assert coded == {"bob": "miss NOT_FOUND", "": "miss NOT_FOUND", "alice": "coded block"}, coded
        text = urllib.request.urlopen(f"http://127.0.0.1:{a_metrics}/metrics", timeout=10).read().decode()
        assert 'kvcached_quic_pulls_other_tenant_total 4.0' in text
    finally:
        cluster.stop()


class _Answers(PullSink):
    def __init__(self) -> None:
        self.got: list[str] = []

    def slot(self, block: pp.Block) -> memoryview:
        return memoryview(bytearray(block.payload_length))

    def arrived(self, block: pp.Block) -> None:
        self.got.append("block")

    def missed(self, miss: pp.Miss) -> None:
        self.got.append(f"miss {pp.MissReason(miss.reason).name}")

    def arrived_coded(self, block: pp.Block, coded: memoryview) -> None:
        self.got.append("coded block")


async def _raw_pulls(cluster: Cluster, row: tuple[bytes, int], tenants: list[str]) -> dict[str, str]:
    """Pull ``row`` from node-a over QUIC as node-b (its certificate), once naming each tenant."""
    auth = PeerAuth.from_files(str(cluster.certs / "ca.pem"), str(cluster.certs / "node-b.pem"),
                               str(cluster.certs / "node-b-key.pem"), ["node-a"])
    peer = await dial(cluster.addresses["node-a"], auth, "node-a", certs=cluster.certs)
    await asyncio.wait_for(peer.ready, 5)
    out = {}
    for tenant in tenants:
        sink = _Answers()
        await asyncio.wait_for(peer.pull([row], sink, tenant), 5)
        out[tenant] = " ".join(sink.got)
    peer.close()
    return out


async def _coded_lane_pulls(cluster: Cluster, row: tuple[bytes, int], tenants: list[str]) -> dict[str, str]:
    """Pull ``row`` from node-a over its TLS lane as node-b, a CodedPull (planes-zstd) naming
    each tenant in turn."""
    auth = PeerAuth.from_files(str(cluster.certs / "ca.pem"), str(cluster.certs / "node-b.pem"),
                               str(cluster.certs / "node-b-key.pem"), ["node-a"])
    host, port = cluster.addresses["node-a"].rsplit(":", 1)
    lane = LaneClient(auth, "node-a", (host, int(port)), 1 << 20, mode="tls")
    codec = codec_named("planes-zstd")
    assert codec is not None
    out = {}
    try:
        for tenant in tenants:
            sink = _Answers()
            assert await asyncio.wait_for(lane.pull([row], sink, tenant=tenant, codec=codec.code), 5) == codec.code
            out[tenant] = " ".join(sink.got)
    finally:
        await lane.close()
    return out


def _stored(subs: dict[str, zmq.Socket[bytes]], seconds: float) -> dict[str, list[Any]]:
    """The BlockStored events each subscriber gets within ``seconds``."""
    poller = zmq.Poller()
    for sub in subs.values():
        poller.register(sub, zmq.POLLIN)
    out: dict[str, list[Any]] = {name: [] for name in subs}
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        for name, sub in subs.items():
            while sub.poll(0):
                _topic, _seq, payload = sub.recv_multipart()
                out[name] += [e for e in decode_batch(payload).events if type(e).__name__ == "BlockStored"]
        poller.poll(int(left * 1000) + 1)
    return out


@needs_users
def test_a_tenants_event_stream_names_its_own_blocks_alone(make_daemon: Any, users: Callable[[], tuple[int, int]],
                                                           socket_dir: Path) -> None:
    (a_uid, a_gid), (b_uid, b_gid) = users(), users()
    alice_sock, bob_sock = socket_dir / "alice.sock", socket_dir / "bob.sock"
    stream = {t: socket_dir / f"{t}-events" for t in ("alice", "bob", "all")}
    d = make_daemon(f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}",
                    f'tenants.sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}',
                    f'tenants.events={{ alice = "ipc://{stream["alice"]}", bob = "ipc://{stream["bob"]}" }}',
                    f'tenants.event_replays={{ alice = "ipc://{socket_dir / "alice-replay"}" }}',
                    f'events.endpoint="ipc://{stream["all"]}"', "events.batch_ms=10")
    assert as_user(a_uid, a_gid, connects(stream["alice"])) == {"ok": "connected"}
    assert as_user(b_uid, b_gid, connects(stream["alice"])) == {"ok": "EACCES"}, "bob may open alice's stream"
    ctx: zmq.Context[Any] = zmq.Context()
    subs = {}
    for name, path in stream.items():
        subs[name] = ctx.socket(zmq.SUB)
        subs[name].setsockopt(zmq.SUBSCRIBE, b"")
        subs[name].connect(f"ipc://{path}")
    time.sleep(0.5)                      # the subscriptions reach the publishers
    try:
        with KvCacheClient(f"unix:{alice_sock}") as alice, KvCacheClient(f"unix:{bob_sock}") as bob:
            assert alice.put([(ADDRESS, b"alice" * 10)]).stored == 1
            assert bob.put([(ADDRESS, b"bob" * 10), (BlockAddress(NEVER), b"b2" * 10)]).stored == 2
        got = _stored(subs, 1.5)
        digests = {name: {e.extra_keys[0][1] for e in events} for name, events in got.items()}
        assert (len(digests["alice"]), len(digests["bob"]), len(digests["all"])) == (1, 2, 3), got
        assert not digests["alice"] & digests["bob"] and digests["alice"] | digests["bob"] == digests["all"]
        replayed = [decode_batch(payload) for _topic, _seq, payload in
                    replay(socket_dir, [(0).to_bytes(8, "big")], ctx, "alice-replay")[:-1]]
        assert {e.extra_keys[0][1] for b in replayed for e in b.events if type(e).__name__ == "BlockStored"} == \
            digests["alice"], "alice's replay holds her batches alone"
        assert as_user(b_uid, b_gid, connects(socket_dir / "alice-replay")) == {"ok": "EACCES"}
    finally:
        for sub in subs.values():
            sub.close(linger=0)
        ctx.term()
    assert d.stop() == 0 and not stream["alice"].exists(), "the stream's socket is removed at a clean stop"


def test_a_tenant_filling_ram_evicts_none_of_anothers_share(make_daemon: Any, tmp_path: Path) -> None:
    """A real daemon, RAM only: alice's blocks within her share stay whatever bob writes."""
    alice_sock, bob_sock = tmp_path / "alice.sock", tmp_path / "bob.sock"
    metrics = free_tcp_port()
    make_daemon("kv.ram_gib=0.0625", "kv.ssd_gib=0", "tenants.uids={ alice = [4242], bob = [4243] }",
                f'tenants.sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}',
                "tenants.ram_shares={ alice = 0.5 }", f'metrics.listen="127.0.0.1:{metrics}"')
    mib = 1 << 20
    mine = [BlockAddress(bytes([1, i]) * 16) for i in range(24)]          # 24 of alice's 32 MiB
    with KvCacheClient(f"unix:{alice_sock}") as alice, KvCacheClient(f"unix:{bob_sock}") as bob:
        for address in mine:
            assert alice.put([(address, bytes([7]) * mib)]).stored == 1
        for i in range(200):                                               # 200 MiB into a 64 MiB tier
            assert bob.put([(BlockAddress(bytes([2, i]) * 16), bytes([i]) * mib)]).stored == 1
        assert alice.lookup([a.digest for a in mine]).ram == len(mine), "bob's writes evicted alice's share"
        assert bob.lookup([bytes([2, 199]) * 16]).ram == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    def metric(prefix: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(prefix)).split()[-1])

    assert metric('kvcached_ram_bytes_by_tenant{tenant="alice"}') == 24 * mib
    assert metric('kvcached_tenant_puts_total{tenant="bob"}') == 200
    assert metric('kvcached_tenant_put_bytes_total{tenant="alice"}') == 24 * mib


def test_a_tenant_filling_ssd_evicts_none_of_anothers_share(make_daemon: Any, tmp_path: Path) -> None:
    """A real daemon with a 32 MiB SSD tier written through: alice's blocks within her SSD share
    stay on SSD whatever bob writes; each tenant's Stats and the metrics count its own, and a
    restart (the boot reconcile) counts them again from the index."""
    alice_sock, bob_sock = tmp_path / "alice.sock", tmp_path / "bob.sock"
    metrics = free_tcp_port()
    d = make_daemon("kv.ram_gib=0.0625", "kv.ssd_gib=0.03125", 'kv.write_policy="write_through"',
                    "tenants.uids={ alice = [4242], bob = [4243] }",
                    f'tenants.sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}',
                    "tenants.ssd_shares={ alice = 0.5 }", f'metrics.listen="127.0.0.1:{metrics}"')
    mib = 1 << 20
    mine = [BlockAddress(bytes([1, i]) * 16) for i in range(12)]          # 12 files in alice's 16 MiB
    with KvCacheClient(f"unix:{alice_sock}") as alice, KvCacheClient(f"unix:{bob_sock}") as bob:
        for address in mine:
            assert alice.put([(address, bytes([7]) * mib)]).stored == 1
        for i in range(80):                                                # 80 MiB into a 32 MiB tier
            assert bob.put([(BlockAddress(bytes([2, i]) * 16), bytes([i]) * mib)]).stored == 1
        with d.client() as operator:
            def ssd_tier() -> pb.TierStats:
                return next(t for t in operator.stats().tiers if t.tier == pb.TIER_SSD)
            wait_for(lambda: ssd_tier().bytes <= 32 * mib, timeout=30, text="the SSD tier back within capacity")
        assert alice.lookup([a.digest for a in mine]).ssd == len(mine), "bob's writes evicted alice's share"
        alice_ssd = next(t for t in alice.stats().tiers if t.tier == pb.TIER_SSD)
        assert (alice_ssd.blocks, alice_ssd.bytes) == (12, 12 * mib)
        bob_ssd = next(t for t in bob.stats().tiers if t.tier == pb.TIER_SSD)
        assert 0 < bob_ssd.blocks <= 20 and bob.stats().lookups == 0 and alice.stats().lookups == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    alice_bytes = next(x for x in text.splitlines() if x.startswith('kvcached_ssd_bytes_by_tenant{tenant="alice"}'))
    assert float(alice_bytes.split()[-1]) >= 12 * mib
    assert d.stop() == 0
    d.start()
    with d.client() as operator:
        wait_for(lambda: operator.stats().ssd_reconciled, timeout=30, text="the boot reconcile")
    with KvCacheClient(f"unix:{alice_sock}") as alice:
        alice_ssd = next(t for t in alice.stats().tiers if t.tier == pb.TIER_SSD)
        assert (alice_ssd.blocks, alice_ssd.bytes) == (12, 12 * mib), "the reconcile counts each tenant's blocks"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a ramfs")
def test_a_tenant_socket_on_a_file_system_without_acls_stops_the_start(make_daemon: Any, tmp_path: Path) -> None:
    """ramfs keeps no extended attributes: a socket there cannot admit its tenant alone, and
    the daemon says so rather than serve it open."""
    where = tmp_path / "ramfs"
    where.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], check=True)
    try:
        d = make_daemon("tenants.uids={ alice = [4242] }", f'tenants.sockets={{ alice = "{where / "alice.sock"}" }}',
                        start=False)
        d.start(wait=False)
        assert d.proc.wait(30) != 0                                      # type: ignore[union-attr]
        assert "keeps no POSIX ACLs" in d.log() and "Traceback" not in d.log()
        assert os.listdir(where) == [], "no socket left open to anyone, nor under a temporary name"
        events = make_daemon("tenants.uids={ alice = [4242] }", f'tenants.events={{ alice = "ipc://{where / "ev"}" }}',
                             state=tmp_path / "events", start=False)
        (tmp_path / "events").mkdir(exist_ok=True)
        events.start(wait=False)
        assert events.proc.wait(30) != 0                                 # type: ignore[union-attr]
        assert "keeps no POSIX ACLs" in events.log() and "Traceback" not in events.log(), events.log()
        assert os.listdir(where) == [], "a tenant's event stream: the same"
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
