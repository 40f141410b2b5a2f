"""Bad input gets a clear error and loses nothing; the daemon goes on serving."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from kvcached.client import KvCacheClient
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress

from .conftest import run_cli

A = BlockAddress(b"\xaa" * 32)


# -- configuration: the daemon never starts, exit 2, one line naming the key ------------------

@pytest.mark.parametrize("override, expect", [
    ("kv.ramgib=1", "config: kv.ramgib: unknown key (did you mean 'ram_gib'?)"),
    ("kvv.ram_gib=1", "config: kvv: unknown section"),
    ("kv.ram_gib=-1", "config: kv.ram_gib: must be greater than 0, got -1"),
    ("kv.ram_gib=100000", "config: kv.ram_gib: 100000 GiB is more than this machine's memory"),
    ('kv.ram_gib="lots"', "config: kv.ram_gib: expected a number, got a string 'lots'"),
    ("kv.mirror_pulls=1", "config: kv.mirror_pulls: expected a boolean, got an integer 1"),
    ("kv.ssd_ttl=soon", "config: kv.ssd_ttl: expected a duration"),
    ('grpc.listen=["nohost"]', "config: grpc.listen: expected \"unix:PATH\" or \"HOST:PORT\""),
    ("grpc.max_message_mib=0", "config: grpc.max_message_mib: must be in 1..2047"),
    ('kv.ram_policy="mru"', "config: kv.ram_policy: unknown policy 'mru'; known: arc, clock, lru, s3fifo, slru"),
    ('quic.listen="127.0.0.1:7400"', "config: quic.ca: required when quic.listen or quic.peers is set"),
    ("kv.ram_gib", "config: kv.ram_gib: --set expects section.key=value"),
])
def test_bad_config_exits_2_with_one_line(override: str, expect: str, tmp_path: Path) -> None:
    r = run_cli(["serve", "--set", override], cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcached: " + expect), r.stderr
    assert not (tmp_path / "var").exists(), "a refused config creates no state"


def test_bad_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text("[kv]\nram_gib = 1\n[metrics]\nlisten = 9000\n")
    r = run_cli(["serve", "--config", str(cfg)], cwd=tmp_path)
    assert r.returncode == 2 and "config: metrics.listen: expected a string, got an integer 9000" in r.stderr
    cfg.write_text("[kv\nram_gib = 1\n")
    r = run_cli(["serve", "--config", str(cfg)], cwd=tmp_path)
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    r = run_cli(["serve", "--config", str(tmp_path / "missing.toml")], cwd=tmp_path)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_print_config_shows_overrides(tmp_path: Path) -> None:
    r = run_cli(["serve", "--print-config", "--set", "kv.ram_gib=2", "--set", 'grpc.listen=["unix:var/k.sock"]',
                 "--set", "kv.ssd_dir=var/x"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert '"ram_gib": 2' in r.stdout and '"unix:var/k.sock"' in r.stdout and '"ssd_dir": "var/x"' in r.stdout


# -- requests: each a clear status, nothing stored, daemon still serving ----------------------

def expect_error(call, code: grpc.StatusCode, *phrases: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for phrase in phrases:
        assert phrase in err.value.details()


def still_serving(c: KvCacheClient, expect_blocks: int = 0) -> None:
    assert c.stats().tiers[0].blocks == expect_blocks


def test_malformed_digest_length(daemon) -> None:
    with daemon.client() as c:
        bad = pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=b"\x01" * 32), payload=b"ok"),
                                    pb.Block(address=pb.BlockAddress(digest=b"\x01" * 31), payload=b"bad")])
        expect_error(lambda: c.stub.Put(bad), grpc.StatusCode.INVALID_ARGUMENT, "blocks[1].address", "32 bytes, got 31")
        expect_error(lambda: c.stub.Lookup(pb.LookupRequest(digests=[b"\x00" * 32, b"\x00" * 33])),
                     grpc.StatusCode.INVALID_ARGUMENT, "33 bytes")
        expect_error(lambda: c.stub.Delete(pb.DeleteRequest(addresses=[pb.BlockAddress(digest=b"")])),
                     grpc.StatusCode.INVALID_ARGUMENT, "got 0")
        still_serving(c, 0)   # the good block of the bad batch was not stored either


def test_unknown_block(daemon) -> None:
    with daemon.client() as c:
        expect_error(lambda: c.get([A]), grpc.StatusCode.NOT_FOUND, str(A), "unknown block")
        expect_error(lambda: c.get_stream([A]), grpc.StatusCode.NOT_FOUND, "unknown block")
        still_serving(c)


def test_get_of_evicted_block(make_daemon) -> None:
    d = make_daemon("kv.max_block_mib=1", "kv.ram_gib=0.00390625", "kv.ssd_gib=0")   # 4 MiB arena, no SSD tier
    with d.client() as c:
        addresses = [BlockAddress(bytes([i]) * 32) for i in range(6)]
        for a in addresses:
            c.put([(a, os.urandom(1 << 20))])
        expect_error(lambda: c.get([addresses[0]]), grpc.StatusCode.NOT_FOUND, "evicted")
        found, misses = c.get(addresses, allow_partial=True)
        assert len(found) == 4 and [m.reason.split(";")[0] for m in misses] == ["evicted", "evicted"]
        still_serving(c, 4)


def test_oversize_messages(make_daemon) -> None:
    d = make_daemon("grpc.max_message_mib=1")
    with d.client(max_message_mib=16) as c:
        big = os.urandom(2 << 20)
        expect_error(lambda: c.put([(A, big)]), grpc.StatusCode.RESOURCE_EXHAUSTED)
        still_serving(c)
        assert c.put_stream([(A, big)]).stored == 1          # the streaming path takes it
        expect_error(lambda: c.get([A]), grpc.StatusCode.RESOURCE_EXHAUSTED, "use GetStream")
        (got,), _ = c.get_stream([A])
        assert got.payload == big
        still_serving(c, 1)


def test_oversize_block_and_empty_payload(daemon) -> None:
    with daemon.client() as c:
        expect_error(lambda: c.put_stream([(A, os.urandom((8 << 20) + 1))]), grpc.StatusCode.INVALID_ARGUMENT,
                     "kv.max_block_mib")
        expect_error(lambda: c.put([(A, b"")]), grpc.StatusCode.INVALID_ARGUMENT, "empty payload")
        still_serving(c)


def test_checksum_mismatch_stores_nothing(daemon) -> None:
    with daemon.client() as c:
        block = pb.Block(address=pb.BlockAddress(digest=A.digest), payload=b"payload", checksum=b"\0" * 32)
        expect_error(lambda: c.stub.Put(pb.PutRequest(blocks=[block])), grpc.StatusCode.DATA_LOSS, "checksum")
        block.checksum = b"\0" * 7
        expect_error(lambda: c.stub.Put(pb.PutRequest(blocks=[block])), grpc.StatusCode.INVALID_ARGUMENT, "32 bytes")
        still_serving(c)


def test_malformed_put_stream(daemon) -> None:
    with daemon.client() as c:
        no_head = iter([pb.PutChunk(data=b"xx")])
        expect_error(lambda: c.stub.PutStream(no_head), grpc.StatusCode.INVALID_ARGUMENT, "first PutStream chunk")
        too_long = iter([pb.PutChunk(address=pb.BlockAddress(digest=A.digest), total_length=2, data=b"xyz")])
        expect_error(lambda: c.stub.PutStream(too_long), grpc.StatusCode.INVALID_ARGUMENT, "more payload bytes")
        short = iter([pb.PutChunk(address=pb.BlockAddress(digest=A.digest), total_length=4, data=b"xy")])
        expect_error(lambda: c.stub.PutStream(short), grpc.StatusCode.INVALID_ARGUMENT, "got 2 payload bytes")
        still_serving(c)


def test_bad_list_requests(daemon) -> None:
    with daemon.client() as c:
        expect_error(lambda: c.stub.ListBlocks(pb.ListBlocksRequest(page_token=b"junk")), grpc.StatusCode.INVALID_ARGUMENT,
                     "page_token")
        expect_error(lambda: c.stub.ListBlocks(pb.ListBlocksRequest(tier=pb.TIER_PEER)), grpc.StatusCode.INVALID_ARGUMENT,
                     "TIER_PEER")
        still_serving(c)


def test_cli_client_errors(daemon, tmp_path: Path) -> None:
    target = ["--target", daemon.target]
    r = run_cli(["get", *target, "ab" * 32, str(tmp_path / "out")])
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "unknown block" in r.stderr
    r = run_cli(["get", *target, "xyz", str(tmp_path / "out")])
    assert r.returncode == 2 and "bad address 'xyz'" in r.stderr
    r = run_cli(["put", *target, "ab" * 32, str(tmp_path / "missing")])
    assert r.returncode == 1 and "No such file" in r.stderr
    (tmp_path / "blk").write_bytes(b"k" * 5000)
    r = run_cli(["put", *target, "--model", "cli", "ab" * 32 + ":7", str(tmp_path / "blk")])
    assert r.returncode == 0, r.stderr
    r = run_cli(["get", *target, "ab" * 32 + ":7", str(tmp_path / "back")])
    assert r.returncode == 0 and (tmp_path / "back").read_bytes() == b"k" * 5000
    r = run_cli(["ls", *target])
    assert r.returncode == 0 and "ab" * 32 + ":7" in r.stdout and "cli" in r.stdout
    r = run_cli(["stat", *target])
    assert r.returncode == 0 and "ram" in r.stdout and "ssd: " in r.stdout and "promotions" in r.stdout
    assert "checksumming saved blocks" in r.stdout and "for SSD I/O" in r.stdout
    r = run_cli(["rm", *target, "ab" * 32 + ":7"])
    assert r.returncode == 0 and "deleted 1" in r.stdout


def test_stalled_reader_cannot_starve_writers(daemon) -> None:
    """Readers may pin at most half the RAM tier: a stream that stalls holds its blocks, puts
    keep working in the other half, and a stream asking for more is refused up front."""
    with daemon.client() as c:
        blocks = [(BlockAddress(bytes([i]) * 32), os.urandom(8 << 20)) for i in range(16)]   # fills the 128 MiB arena
        c.put_stream(blocks)
        half = [pb.BlockAddress(digest=a.digest) for a, _ in blocks[8:16]]
        stalled = c.stub.GetStream(pb.GetRequest(addresses=half), timeout=60)
        next(stalled)                                       # 64 MiB pinned, then nothing read
        expect_error(lambda: c.get_stream([blocks[0][0]]), grpc.StatusCode.RESOURCE_EXHAUSTED, "over half the RAM tier")
        for i in range(20):                                 # writers still find room
            assert c.put_stream([(BlockAddress(bytes([100 + i]) * 32), os.urandom(8 << 20))]).stored == 1
        stalled.cancel()


def test_unknown_tier_enum_and_oversize_model_label(daemon) -> None:
    with daemon.client() as c:
        expect_error(lambda: c.stub.ListBlocks(pb.ListBlocksRequest(tier=99)), grpc.StatusCode.INVALID_ARGUMENT,
                     "cannot filter by tier 99")
        expect_error(lambda: c.put([(A, b"x")], model="m" * 257), grpc.StatusCode.INVALID_ARGUMENT,
                     "model label is over 256 bytes")
        still_serving(c)


def test_sim_command_prints_the_table_and_writes_the_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plot = tmp_path / "plot.svg"
    r = run_cli(["sim", "--workload", "scan_mix", "--policy", "lru", "--policy", "s3fifo", "--scale", "0.02",
                 "--sizes", "0.05,0.5", "--plot", str(plot)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "scan_mix:" in r.stdout and "s3fifo" in r.stdout and "belady" in r.stdout
    assert plot.read_text().startswith("<svg")
    r = run_cli(["sim", "--sizes", "2"])
    assert r.returncode == 2 and "--sizes: shares in (0, 1]" in r.stderr


@pytest.mark.parametrize("key", ["agent.group", "grpc.socket_group"])
def test_an_unknown_socket_group_stops_the_daemon_before_it_listens(tmp_path: Path, key: str) -> None:
    sock = tmp_path / "api.sock"
    r = run_cli(["serve", "--set", f'{key}="no-such-group-kvc"', "--set", f'grpc.listen=["unix:{sock}"]',
                 "--set", f'agent.socket="{tmp_path / "agent.sock"}"', "--set", 'metrics.listen=""',
                 "--set", f'kv.index_dir="{tmp_path / "index"}"', "--set", "kv.ssd_gib=0"], cwd=tmp_path)
    assert r.returncode == 1 and f"cannot start: {key}: no such group 'no-such-group-kvc'" in r.stderr, r.stderr
    assert not sock.exists() and not (tmp_path / "agent.sock").exists()
