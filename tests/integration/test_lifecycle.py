"""Restart, clean shutdown, and refusing a second daemon: real processes, real RocksDB."""

from __future__ import annotations

import os
import signal
import socket

import grpc
import pytest

from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress, chain_digests


def test_restart_keeps_metadata_and_reports_ram_blocks_gone(make_daemon) -> None:
    """RAM only (no SSD tier): after a restart the blocks are gone, their metadata is not."""
    digests = chain_digests(list(range(160)), 16, model="m", dtype="fp16")
    blocks = [(BlockAddress(d, 5), os.urandom(20000)) for d in digests]
    d = make_daemon("kv.ssd_gib=0")
    with d.client() as c:
        c.put(blocks, model="restart-model")
        before = {i.address.digest: i for i in c.list_blocks()}
    assert d.stop() == 0
    assert not d.socket.exists(), "the daemon removes its socket on a clean stop"

    d2 = make_daemon("kv.ssd_gib=0", state=d.state)
    with d2.client() as c:
        after = {i.address.digest: i for i in c.list_blocks()}
        # metadata persists: same blocks, sizes, checksums, model, creation time
        assert after.keys() == before.keys()
        for digest, info in after.items():
            old = before[digest]
            assert (info.nbytes, info.checksum, info.model, info.created) == (old.nbytes, old.checksum, old.model, old.created)
            assert list(info.tiers) == [] and "lost at restart" in info.gone_reason
        # ... but the bytes lived only in RAM: reported gone, never served
        assert c.lookup(digests, layer=5).longest == 0
        with pytest.raises(grpc.RpcError) as err:
            c.get([blocks[0][0]])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "lost at restart" in err.value.details()
        assert len(list(c.list_blocks(tier=pb.TIER_GONE))) == len(digests)
        assert list(c.list_blocks(tier=pb.TIER_RAM)) == []
        # and a block can be stored again under the same address
        c.put(blocks[:1])
        (got,), _ = c.get([blocks[0][0]])
        assert got.payload == blocks[0][1]
    assert d2.stop(signal.SIGINT) == 0
    assert "index reconciled" in d2.log() and "lost_at_restart=10" in d2.log()


def test_sigterm_lets_in_flight_requests_finish(make_daemon) -> None:
    """Streams that have started when SIGTERM arrives run to the end (within grpc.grace_s);
    the daemon then exits 0."""
    d = make_daemon("grpc.grace_s=15")
    address = BlockAddress(b"\x07" * 32)
    payload = os.urandom(8 << 20)
    with d.client() as c:
        c.put([(address, payload)])
        request = pb.GetRequest(addresses=[pb.BlockAddress(digest=address.digest)])
        streams = [c.stub.GetStream(request, timeout=20) for _ in range(4)]
        firsts = [next(s) for s in streams]          # each stream is now in flight
        d.proc.send_signal(signal.SIGTERM)
        for first, stream in zip(firsts, streams):
            assert first.data + b"".join(chunk.data for chunk in stream) == payload
    assert d.stop() == 0
    assert "stopped" in d.log()


def test_second_daemon_refuses_a_socket_in_use(make_daemon) -> None:
    first = make_daemon()
    second = make_daemon(state=first.state, start=False)
    second.start(wait=False)
    assert second.proc.wait(30) == 1
    assert "in use" in second.log()
    with first.client() as c:       # the first one is untouched and still serving
        assert c.stats().version
    assert first.socket.exists()


def test_second_daemon_refuses_an_index_in_use(make_daemon, tmp_path) -> None:
    first = make_daemon()
    other = tmp_path / "other"
    other.mkdir()
    second = make_daemon(f'kv.index_dir="{first.state / "index"}"', state=other, start=False)
    second.start(wait=False)
    assert second.proc.wait(30) == 1
    assert "in use by another process" in second.log()


def test_stale_socket_file_is_replaced(make_daemon, tmp_path) -> None:
    path = tmp_path / "kvcached.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()                    # a socket file nobody listens on: what a crash leaves
    d = make_daemon()
    with d.client() as c:
        assert c.stats().version


def test_regular_file_in_socket_place_is_not_clobbered(make_daemon, tmp_path) -> None:
    (tmp_path / "kvcached.sock").write_text("precious")
    d = make_daemon(start=False)
    d.start(wait=False)
    assert d.proc.wait(30) == 1
    assert (tmp_path / "kvcached.sock").read_text() == "precious"
    assert "not a socket" in d.log()


def test_sigterm_with_a_stalled_stream_still_stops_cleanly(make_daemon) -> None:
    """A client that stops reading mid-stream cannot wedge shutdown: after grpc.grace_s its
    stream is cancelled, its pins released, and the daemon closes the index and exits 0."""
    d = make_daemon("grpc.grace_s=1")
    address = BlockAddress(b"\x09" * 32)
    with d.client() as c:
        c.put_stream([(address, os.urandom(8 << 20))])
        stream = c.stub.GetStream(pb.GetRequest(addresses=[pb.BlockAddress(digest=address.digest)] * 4), timeout=60)
        next(stream)                                  # ... and never read again
        assert d.stop() == 0
    log = d.log()
    assert "stopped" in log and "shutdown step failed" not in log and "Traceback" not in log
    d2 = make_daemon(state=d.state)                   # the index was closed properly
    with d2.client() as c:
        assert c.stats().index_entries >= 1
