"""The admin API and its safety, against real daemon processes: who may call what on which
listener (Unix socket, mutual TLS, read-only TCP), the refusal of a public plaintext listener,
the Admin service's calls, and SIGHUP."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvcached.api.access import STATE_CHANGING
from kvcached.client import KvCacheClient
from kvcached.peers.certs import make_cluster
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import BlockAddress
from tests.integration.conftest import run_cli, wait_for
from tests.integration.test_operations import free_tcp_port

READ_ONLY = {"/kvcached.v1.KvCache/" + m for m in ("Get", "GetStream", "Lookup", "Stats", "ListBlocks", "Overlap")} | {
    "/kvcached.v1.Admin/" + m for m in ("GetConfig", "ListAgents", "ListPeers", "ReconcileStatus")}


def test_every_method_is_classified_read_only_or_state_changing() -> None:
    methods = {f"/{service.full_name}/{m.name}" for service in pb.DESCRIPTOR.services_by_name.values()
               for m in service.methods}
    assert methods == READ_ONLY | STATE_CHANGING and not READ_ONLY & STATE_CHANGING


def test_the_unix_socket_has_the_configured_mode_and_group(make_daemon) -> None:
    d = make_daemon('grpc.socket_mode="0640"', 'grpc.socket_group="65534"')
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == 65534
    d.stop()


# ---------------------------------------------------------------------------------------------
# TCP listeners


def channel(port: int, certs: Any, client: str | None, ca: Path | None = None) -> grpc.Channel:
    ca_pem = (ca or certs.ca).read_bytes()
    if client is None:
        creds = grpc.ssl_channel_credentials(ca_pem)
    else:
        cert, key = certs.nodes[client]
        creds = grpc.ssl_channel_credentials(ca_pem, key.read_bytes(), cert.read_bytes())
    return grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "node-a")])


def every_state_changing_call(ch: grpc.Channel) -> dict[str, grpc.RpcError | None]:
    """Call each state-changing method once with a harmless request; the error of each."""
    kv, admin = pb_grpc.KvCacheStub(ch), pb_grpc.AdminStub(ch)
    digest = os.urandom(32)
    block = pb.Block(address=pb.BlockAddress(digest=digest), payload=b"x" * 4096)
    calls = {
        "Put": lambda: kv.Put(pb.PutRequest(blocks=[block]), timeout=10),
        "PutStream": lambda: kv.PutStream(iter([pb.PutChunk(address=pb.BlockAddress(digest=digest), total_length=4096,
                                                            data=b"x" * 4096)]), timeout=10),
        "Delete": lambda: kv.Delete(pb.DeleteRequest(addresses=[pb.BlockAddress(digest=digest)]), timeout=10),
        "Evict": lambda: admin.Evict(pb.EvictRequest(digests=[digest]), timeout=10),
        "Drain": lambda: admin.Drain(pb.DrainRequest(tier=pb.TIER_RAM), timeout=10),
        "SetLogLevel": lambda: admin.SetLogLevel(pb.SetLogLevelRequest(level="info"), timeout=10),
    }
    out: dict[str, grpc.RpcError | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except grpc.RpcError as exc:
            out[name] = exc
    assert {f"/kvcached.v1.KvCache/{n}" for n in ("Put", "PutStream", "Delete")} | {
        f"/kvcached.v1.Admin/{n}" for n in ("Evict", "Drain", "SetLogLevel")} == set(STATE_CHANGING)
    return out


@pytest.fixture
def tls_daemon(make_daemon, tmp_path: Path) -> tuple[Any, Any, int, int]:
    certs, _ = make_cluster(tmp_path / "certs", ["node-a", "admin"])
    cert, key = certs.nodes["node-a"]
    mtls, open_port = free_tcp_port(), free_tcp_port()
    d = make_daemon("grpc.tls=true", f'grpc.tls_cert="{cert}"', f'grpc.tls_key="{key}"', f'grpc.tls_ca="{certs.ca}"',
                    f'grpc.listen=["unix:{tmp_path / "kvcached.sock"}", "127.0.0.1:{mtls}"]',
                    f'grpc.read_only_listen=["127.0.0.1:{open_port}"]')
    return d, certs, mtls, open_port


def test_mutual_tls_serves_everything_to_a_client_certificate_and_nothing_without(tls_daemon, tmp_path: Path) -> None:
    d, certs, mtls, _ = tls_daemon
    with channel(mtls, certs, "admin") as ch:
        errors = every_state_changing_call(ch)
        assert all(e is None or e.code() != grpc.StatusCode.PERMISSION_DENIED for e in errors.values()), errors
        stub = pb_grpc.KvCacheStub(ch)
        digest = os.urandom(32)
        stub.Put(pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=digest), payload=b"y" * 4096)]), timeout=10)
        assert stub.Lookup(pb.LookupRequest(digests=[digest]), timeout=10).longest == 1
    other, _ = make_cluster(tmp_path / "other-ca", ["admin"])
    for label, ch in (("no client certificate", channel(mtls, certs, None)),
                      ("a certificate from another CA", channel(mtls, other, "admin", ca=certs.ca))):
        with ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KvCacheStub(ch).Put(pb.PutRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, label       # refused in the TLS handshake
    with KvCacheClient(d.target) as c:                    # the Unix socket still serves everything
        assert c.stats().puts == 2             # every_state_changing_call's Put, then the one above


def test_the_read_only_listener_refuses_every_state_changing_call(tls_daemon) -> None:
    d, certs, _, open_port = tls_daemon
    with channel(open_port, certs, None) as ch:          # TLS, no client certificate
        errors = every_state_changing_call(ch)
        for name, error in errors.items():
            assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "changes state" in error.details() and "mutual TLS" in error.details()
        kv = pb_grpc.KvCacheStub(ch)
        assert kv.Stats(pb.StatsRequest(), timeout=10).puts == 0          # read-only calls are served
        assert kv.Lookup(pb.LookupRequest(digests=[os.urandom(32)]), timeout=10).longest == 0
        assert pb_grpc.AdminStub(ch).ListPeers(pb.ListPeersRequest(), timeout=10).peers == []


def test_plaintext_tcp_is_read_only_and_refused_off_loopback_unless_insecure(make_daemon, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = make_daemon(f'grpc.listen=["unix:{tmp_path / "kvcached.sock"}", "127.0.0.1:{port}"]')
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        errors = every_state_changing_call(ch)
        assert all(e is not None and e.code() == grpc.StatusCode.PERMISSION_DENIED for e in errors.values())
        assert pb_grpc.KvCacheStub(ch).Stats(pb.StatsRequest(), timeout=10).puts == 0
    d.stop()

    sock = f"unix:{tmp_path / 'x.sock'}"
    r = run_cli(["serve", "--set", f'grpc.listen=["{sock}", "0.0.0.0:{free_tcp_port()}"]'], cwd=tmp_path)
    assert r.returncode == 2
    assert "grpc.listen: plaintext gRPC on the non-loopback address 0.0.0.0:" in r.stderr and "grpc.insecure" in r.stderr
    r = run_cli(["serve", "--set", f'grpc.read_only_listen=["0.0.0.0:{free_tcp_port()}"]'], cwd=tmp_path)
    assert r.returncode == 2 and "grpc.read_only_listen: plaintext gRPC" in r.stderr
    r = run_cli(["serve", "--set", "grpc.tls=true"], cwd=tmp_path)
    assert r.returncode == 2 and "grpc.tls_cert: required when grpc.tls is true (or set quic.cert)" in r.stderr

    d = make_daemon(f'grpc.listen=["unix:{tmp_path / "kvcached.sock"}", "0.0.0.0:{free_tcp_port()}"]',
                    "grpc.insecure=true")
    assert "plaintext gRPC on a non-loopback address (grpc.insecure)" in d.log()
    d.stop()


# ---------------------------------------------------------------------------------------------
# the Admin service


def admin(d: Any) -> tuple[Any, Any]:
    ch = grpc.insecure_channel(d.target)
    return ch, pb_grpc.AdminStub(ch)


def test_evict_by_model_and_by_tier_and_drain(make_daemon) -> None:
    d = make_daemon()
    a = [BlockAddress(os.urandom(32)) for _ in range(6)]
    b = [BlockAddress(os.urandom(32)) for _ in range(4)]
    ch, stub = admin(d)
    with d.client() as c, ch:
        c.put([(x, os.urandom(8192)) for x in a], model="model-a")
        c.put([(x, os.urandom(8192)) for x in b], model="model-b")
        r = stub.Evict(pb.EvictRequest(model="model-a"), timeout=10)                  # every tier
        assert (r.evicted, r.busy, r.not_found) == (6, 0, 0)
        assert c.lookup([x.digest for x in a]).longest == 0 and c.lookup([x.digest for x in b]).longest == 4
        wait_for(lambda: all(pb.TIER_SSD in i.tiers for i in c.list_blocks(model="model-b")), 10,
                 "write-back to put model-b on SSD")
        r = stub.Evict(pb.EvictRequest(digests=[x.digest for x in b[:2]], tier=pb.TIER_RAM), timeout=10)
        assert (r.evicted, r.busy, r.not_found) == (2, 0, 0)
        got, _ = c.get(b)                                                             # promoted back from SSD
        assert len(got) == 4
        r = stub.Evict(pb.EvictRequest(digests=[b[3].digest], tier=pb.TIER_SSD), timeout=10)
        assert r.evicted == 1
        tiers = {i.address.digest: list(i.tiers) for i in c.list_blocks(model="model-b")}
        assert tiers[b[3].digest] == [pb.TIER_RAM]
        r = stub.Drain(pb.DrainRequest(tier=pb.TIER_RAM), timeout=30)
        assert r.dropped == 4 and r.busy == 0 and r.written_back == 1                 # b[3] was written back first
        assert c.stats().tiers[0].blocks == 0 and len(c.get(b)[0]) == 4               # nothing lost
        for request, code, text in (
                (pb.EvictRequest(), grpc.StatusCode.INVALID_ARGUMENT, "either a model or digests"),
                (pb.EvictRequest(model="m", tier=pb.TIER_GPU), grpc.StatusCode.INVALID_ARGUMENT, "tier must be"),
                (pb.EvictRequest(digests=[b"short"]), grpc.StatusCode.INVALID_ARGUMENT, "digests[0] is 5 bytes")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Evict(request, timeout=10)
            assert err.value.code() == code and text in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Drain(pb.DrainRequest(tier=pb.TIER_SSD), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d.stop()


def test_config_agents_peers_reconcile_and_log_level(make_daemon, tmp_path: Path) -> None:
    certs, _ = make_cluster(tmp_path / "certs", ["node-a", "node-b"])
    cert, key = certs.nodes["node-a"]
    d = make_daemon(f'quic.listen="127.0.0.1:{free_tcp_port()}"', f'quic.ca="{certs.ca}"', f'quic.cert="{cert}"',
                    f'quic.key="{key}"', 'quic.peers=[{ name = "node-b", address = "127.0.0.1:9" }]')
    ch, stub = admin(d)
    with ch:
        text = stub.GetConfig(pb.GetConfigRequest(), timeout=10).toml
        assert 'cert = "<redacted>"' in text and 'key = "<redacted>"' in text and str(cert) not in text
        assert 'ram_gib = 0.125' in text
        assert stub.ListAgents(pb.ListAgentsRequest(), timeout=10).agents == []
        from kvcached_agent import protocol as ap
        from kvcached_agent.client import AgentClient  # an agent connects: it is listed
        hello = ap.Hello(agent_id="worker-0", model="m", dtype="bf16", block_tokens=16, num_layers=2,
                         layer_block_bytes=4096)
        agent = AgentClient(str(d.state / "agent.sock"), hello, heartbeat=False)
        try:
            agents = stub.ListAgents(pb.ListAgentsRequest(), timeout=10).agents
            assert [(x.agent_id, x.pid) for x in agents] == [("worker-0", os.getpid())]
        finally:
            agent.close()
        peers = stub.ListPeers(pb.ListPeersRequest(), timeout=10).peers
        assert [(p.name, p.address) for p in peers] == [("node-b", "127.0.0.1:9")] and not peers[0].connected
        status = stub.ReconcileStatus(pb.ReconcileStatusRequest(), timeout=10)
        assert status.ssd_enabled
        assert stub.SetLogLevel(pb.SetLogLevelRequest(level="debug"), timeout=10).previous == "info"
        assert stub.SetLogLevel(pb.SetLogLevelRequest(level="warning", logger="kvcached.peers"),
                                timeout=10).previous == "debug"
        with pytest.raises(grpc.RpcError) as err:
            stub.SetLogLevel(pb.SetLogLevelRequest(level="loud"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "debug, info, warning, error" in err.value.details()
    assert "log level changed" in d.log()
    d.stop()


def test_sighup_applies_what_it_can_and_names_the_rest(make_daemon, tmp_path: Path) -> None:
    config = tmp_path / "kvcached.toml"
    config.write_text('[log]\nlevel = "info"\n[kv]\nssd_ttl = "7d"\n')
    import subprocess

    from tests.integration.conftest import KVCACHED

    d = make_daemon(start=False)
    log = open(tmp_path / "hup.log", "wb")
    d.log_path = tmp_path / "hup.log"
    d.proc = subprocess.Popen(KVCACHED + ["serve", "--config", str(config), *d.args()], cwd=tmp_path, stdout=log,
                              stderr=log)
    log.close()
    d.wait_ready()
    config.write_text('[log]\nlevel = "debug"\n[kv]\nssd_ttl = "1d"\nprefetch_policy = "timeout"\n[quic]\nhedge_ms = 20\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "configuration reloaded" in d.log(), 10, "the reload to be logged")
    line = next(x for x in d.log().splitlines() if "configuration reloaded" in x)
    assert "applied=kv.ssd_ttl,kv.prefetch_policy,log.level" in line and "needs_restart=quic.hedge_ms" in line, line
    config.write_text('[kv]\nssd_ttl = "forever"\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload refused" in d.log(), 10, "the refused reload to be logged")
    assert "reload refused; nothing changed" in d.log() and "kv.ssd_ttl" in d.log()
    with d.client() as c:
        assert c.stats().puts == 0                  # still serving
    assert d.stop() == 0
