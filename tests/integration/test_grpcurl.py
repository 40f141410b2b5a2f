"""The real grpcurl binary against a running daemon: reflection, health, and API calls."""

from __future__ import annotations

import base64
import json
import subprocess

from kvcached_agent.address import chain_digests

from .conftest import grpcurl_binary


def grpcurl(daemon, *args: str, data: dict | None = None, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [grpcurl_binary(), "-plaintext", "-unix", *flags]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [str(daemon.socket), *args]   # grpcurl [flags] ADDRESS (list|describe|METHOD) [SYMBOL]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_list_and_describe(daemon) -> None:
    r = grpcurl(daemon, "list")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {"kvcached.v1.KvCache", "kvcached.v1.Admin", "grpc.health.v1.Health",
                                     "grpc.reflection.v1alpha.ServerReflection"}
    r = grpcurl(daemon, "describe", "kvcached.v1.KvCache")
    assert r.returncode == 0, r.stderr
    for method in ("Put", "PutStream", "Get", "GetStream", "Lookup", "Delete", "Stats", "ListBlocks"):
        assert f"rpc {method}" in r.stdout
    r = grpcurl(daemon, "describe", "kvcached.v1.BlockAddress")
    assert "optional uint32 layer" in r.stdout


def test_health_check(daemon) -> None:
    r = grpcurl(daemon, "grpc.health.v1.Health/Check")
    assert r.returncode == 0 and json.loads(r.stdout) == {"status": "SERVING"}
    r = grpcurl(daemon, "grpc.health.v1.Health/Check", data={"service": "kvcached.v1.KvCache"})
    assert json.loads(r.stdout) == {"status": "SERVING"}


def test_put_get_lookup_stats(daemon) -> None:
    digests = chain_digests(list(range(48)), 16, model="grpcurl", dtype="bfloat16")
    payloads = [bytes([i]) * 3000 for i in range(3)]
    blocks = [{"address": {"digest": b64(d)}, "payload": b64(p), "model": "grpcurl"} for d, p in zip(digests[:2], payloads)]
    r = grpcurl(daemon, "kvcached.v1.KvCache/Put", data={"blocks": blocks})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"stored": 2}

    r = grpcurl(daemon, "kvcached.v1.KvCache/Get", data={"addresses": [{"digest": b64(digests[1])}]})
    assert r.returncode == 0, r.stderr
    (block,) = json.loads(r.stdout)["blocks"]
    assert base64.b64decode(block["payload"]) == payloads[1] and len(base64.b64decode(block["checksum"])) == 32

    r = grpcurl(daemon, "kvcached.v1.KvCache/Lookup", data={"digests": [b64(d) for d in digests]})
    assert r.returncode == 0, r.stderr
    lookup = json.loads(r.stdout)
    assert lookup.pop("ssd", 2) == 2, "written back to SSD, or not yet"
    assert lookup == {"longest": 2, "ram": 2}

    r = grpcurl(daemon, "kvcached.v1.KvCache/Stats")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["puts"] == "2" and stats["tiers"][0]["tier"] == "TIER_RAM" and stats["tiers"][0]["blocks"] == "2"

    r = grpcurl(daemon, "kvcached.v1.KvCache/ListBlocks", data={"model": "grpcurl", "tier": "TIER_RAM"})
    assert len(json.loads(r.stdout)["blocks"]) == 2


def test_errors_are_readable(daemon) -> None:
    r = grpcurl(daemon, "kvcached.v1.KvCache/Get", data={"addresses": [{"digest": b64(b"short")}]})
    assert r.returncode != 0 and "InvalidArgument" in r.stderr and "digest must be 32 bytes, got 5" in r.stderr
    r = grpcurl(daemon, "kvcached.v1.KvCache/Get", data={"addresses": [{"digest": b64(b"\0" * 32)}]})
    assert r.returncode != 0 and "NotFound" in r.stderr and "unknown block" in r.stderr


def test_overlap_shows_each_agents_gpu_prefix(daemon) -> None:
    import os
    import time

    from kvcached_agent import Agent

    digests = chain_digests(list(range(64)), 16, model="grpcurl", dtype="bfloat16")
    agent = Agent.connect(str(daemon.state / "agent.sock"), agent_id="router-test", model="grpcurl",
                          dtype="bfloat16", block_tokens=16, num_layers=1, layer_block_bytes=4096)
    try:
        agent.report_pinned(digests[:3])
        agent.report_evicted(digests[1:2])
        deadline = time.monotonic() + 10
        while True:    # events have no answer: poll until the daemon has seen them
            r = grpcurl(daemon, "kvcached.v1.KvCache/Overlap", data={"digests": [b64(d) for d in digests]},
                        flags=("-emit-defaults",))
            assert r.returncode == 0, r.stderr
            (entry,) = json.loads(r.stdout)["agents"]
            if entry["prefix"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert entry == {"session": entry["session"], "agent_id": "router-test", "pid": os.getpid(), "prefix": 1}
        r = grpcurl(daemon, "kvcached.v1.KvCache/Lookup", data={"digests": [b64(d) for d in digests]},
                flags=("-emit-defaults",))
        assert json.loads(r.stdout)["gpu"] == 1
    finally:
        agent.close()
    r = grpcurl(daemon, "kvcached.v1.KvCache/Overlap", data={"digests": [b64(b"short")]})
    assert r.returncode != 0 and "InvalidArgument" in r.stderr and "digests[0] is 5 bytes" in r.stderr
