"""The bulk lane (kvcached.peers.lane, [quic] lane = "tls"): pulls over TLS 1.3 on TCP beside
QUIC, with real sockets and real certificates, on the peer-tier harness of test_peer_tier.py."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest

from kvcached.certs import make_cluster
from kvcached.peers import protocol as p
from kvcached.peers.lane import LaneClient, client_context
from kvcached.peers.quic import PullSink
from kvcached.peers.tls import PeerAuth, PeerRefused
from tests.certificates import expired_certificate
from tests.integration.test_peer_tier import (
    SIZE,
    A,
    B,
    C,
    Cluster,
    cluster,
    get_exact,
    items,
    test_checksum_mismatch_falls_back_to_another_holder,
    test_dead_holder_misses_within_deadline_goes_down_and_comes_back,
    test_delete_drops_and_snapshot_replaces,
    test_hedged_pull_asks_the_next_holder,
    test_hedged_pull_does_not_wait_for_the_slow_peer,
    test_peer_metrics_count_pulls_and_show_peers_up,
    test_put_announced_then_pulled,
    until,
)
from tests.unit.conftest import payload

# The peer tier's tests that hold whatever carries the pulls, run again here over the lane.
__all__ = ["test_checksum_mismatch_falls_back_to_another_holder",
           "test_dead_holder_misses_within_deadline_goes_down_and_comes_back",
           "test_delete_drops_and_snapshot_replaces", "test_hedged_pull_asks_the_next_holder",
           "test_hedged_pull_does_not_wait_for_the_slow_peer", "test_peer_metrics_count_pulls_and_show_peers_up",
           "test_put_announced_then_pulled"]


@pytest.fixture(autouse=True)
def over_the_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Cluster, "lane", "tls")


class Collect(PullSink):
    """A sink with a buffer per block."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, bytearray] = {}
        self.arrived_: list[bytes] = []
        self.missed_: list[p.Miss] = []

    def slot(self, block: p.Block) -> memoryview:
        buf = self.buffers[block.digest] = bytearray(block.payload_length)
        return memoryview(buf)

    def arrived(self, block: p.Block) -> None:
        assert block.verify(bytes(self.buffers[block.digest]))
        self.arrived_.append(block.digest)

    def missed(self, miss: p.Miss) -> None:
        self.missed_.append(miss)


def test_pulls_go_over_the_lane_bit_exact(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane="tls") as c:
            a, b, n = c[A], c[B], 48
            await a.store.put(items(range(n)))
            await until(lambda: b.t.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            assert b.t.counters.lane_pulls >= 1 and b.t.counters.lane_fallbacks == 0
            assert b.t.counters.pulled == n and a.t.lane_server is not None
            assert a.t.lane_server.counters.served_pulls >= 1 and a.t.counters.served == n
            stats = b.t.stats()
            assert stats["peer_lane_pulls"] == b.t.counters.lane_pulls
    asyncio.run(body())


def test_a_lane_that_cannot_be_had_falls_back_to_quic_and_is_counted(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane="tls") as c:
            a, b, n = c[A], c[B], 16
            assert a.t.lane_server is not None
            await a.t.lane_server.stop()                 # A's lane is gone; its QUIC is not
            await a.store.put(items(range(n)))
            await until(lambda: b.t.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            assert b.t.counters.lane_fallbacks == 1 and b.t.counters.lane_pulls == 0
            assert b.t.counters.pulled == n and b.t.counters.failed == 0
            await get_exact(b, range(n))                 # within lane_retry_s: straight to QUIC
            assert b.t.counters.lane_fallbacks == 1
    asyncio.run(body())


def test_the_lane_server_refuses_bad_client_certificates(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane="tls") as c:     # A takes only node-b
            other, _ = make_cluster(tmp_path / "other-ca", [B])
            expired = expired_certificate(c.files.ca.parent, tmp_path / "expired", B)
            cases = {"another CA": other.nodes[B], "expired": expired, "not a peer": c.files.nodes[C]}
            server = c[A].t.lane_server
            assert server is not None
            for case, (cert, key) in cases.items():
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(cadata=c.files.ca.read_text())
                ctx.check_hostname = False
                ctx.load_cert_chain(str(cert), str(key))
                before = server.counters.refused
                reader, writer = await asyncio.open_connection(*c.addr(A), ssl=ctx, server_hostname=A)
                writer.write(p.encode(p.Pull([(payload(1, 32)[:32], 0)], 1 << 20), 1))
                with contextlib.suppress(ConnectionError, ssl.SSLError):
                    assert await asyncio.wait_for(reader.read(1 << 16), 5) == b"", case   # closed, unanswered
                writer.close()
                refused_now = server.counters.refused > before
                # a chain from another CA or an expired certificate fails TLS itself (no count
                # reaches the server's handler); a valid one that names no peer is refused by name
                assert refused_now or case != "not a peer", case
            assert c[A].t.server_stats()["lane_refused"] == server.counters.refused >= 1
            no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            no_cert.load_verify_locations(cadata=c.files.ca.read_text())
            no_cert.check_hostname = False
            reader, writer = await asyncio.open_connection(*c.addr(A), ssl=no_cert, server_hostname=A)
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
            writer.close()
    asyncio.run(body())


def test_a_lane_client_refuses_a_server_with_the_wrong_name(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane="tls") as c:
            # a client of A's that expects node-c at B's address: B's certificate names node-b
            lane = LaneClient(c.auth(A, [C]), C, c.addr(B), 1 << 20)
            with pytest.raises(PeerRefused, match="node-c"):
                await lane.pull([(payload(1, 32)[:32], 0)], Collect())
            await lane.close()
    asyncio.run(body())


def test_a_lane_pull_answers_blocks_and_misses_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane="tls") as c:
            await c[A].store.put(items(range(3)))
            cert, key = c.files.nodes[B]
            lane = LaneClient(PeerAuth.from_files(str(c.files.ca), str(cert), str(key), [A]), A, c.addr(A), 1 << 20)
            wanted = [(it.address.digest, it.address.layer) for it in items(range(3))]
            unknown = (b"\xff" * 32, 0)
            sink = Collect()
            await lane.pull([wanted[0], unknown, wanted[2]], sink)
            assert sink.arrived_ == [wanted[0][0], wanted[2][0]]
            assert [(m.digest, m.reason) for m in sink.missed_] == [(b"\xff" * 32, p.MissReason.NOT_FOUND)]
            assert bytes(sink.buffers[wanted[2][0]]) == payload(2, SIZE)
            sink2 = Collect()
            await lane.pull([wanted[1]], sink2)          # the same connection, kept for the next pull
            assert bytes(sink2.buffers[wanted[1][0]]) == payload(1, SIZE)
            await lane.close()
            assert client_context(lane.auth).minimum_version == ssl.TLSVersion.TLSv1_3
    asyncio.run(body())


def test_a_lane_cut_mid_payload_leaves_no_block_and_quic_brings_it(tmp_path: Path) -> None:
    """The lane breaks in the middle of a payload: the half-written slot is given back, never
    visible, and the pull is made again over QUIC."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 8
            await a.store.put(items(range(n)))
            await until(lambda: b.t.directory.count(A) == n, "announcements")
            server = a.t.lane_server
            assert server is not None

            async def cut(peer: str, writer: asyncio.StreamWriter, frame: p.Frame) -> None:
                message = p.decode(frame)
                assert isinstance(message, p.Pull)
                answers = await server.handler.pull(peer, message)
                head, view, _ = answers[0]                    # type: ignore[misc]
                writer.write(p.encode(head, frame.request_id))
                writer.write(bytes(view[:len(view) // 2]))
                await writer.drain()
                for answer in answers:
                    if not isinstance(answer, p.Miss):
                        answer[2]()
                writer.transport.abort()                      # the lane breaks
            server._request = cut                             # type: ignore[method-assign]
            await get_exact(b, range(n))                      # over QUIC, after the lane broke
            assert b.t.counters.lane_fallbacks == 1 and b.t.counters.corrupt == 0
            assert b.t.counters.pulled == n and b.t.counters.lane_pulls == 0
    asyncio.run(body())


def test_bad_frames_on_a_lane_are_answered_with_errors_and_lose_nothing(tmp_path: Path) -> None:
    """A verified peer that sends a request that is not a Pull, a body that does not parse, then
    a header over the limit: an Error answers each (the last one ends the lane), and the same
    server goes on serving pulls."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(2)))
            cert, key = c.files.nodes[B]
            lane = LaneClient(PeerAuth.from_files(str(c.files.ca), str(cert), str(key), [A]), A, c.addr(A), 1 << 20)
            reader, writer = await lane._connect()

            async def answer() -> p.Error:
                decoder = p.FrameDecoder()
                while True:
                    data = await asyncio.wait_for(reader.read(1 << 16), 5)
                    assert data, "the lane closed without an Error"
                    decoder.feed(data)
                    for item in decoder:
                        message = p.decode(item)
                        assert isinstance(message, p.Error)
                        return message

            writer.write(p.encode(p.Exists(0, [bytes(32)]), 3))
            assert (await answer()).code == p.ErrorCode.UNEXPECTED
            writer.write(p.HEADER.pack(4, p.VERSION, p.Pull.TYPE, 0, 4) + b"\xff\xff\xff\xff")   # 4 billion entries
            assert (await answer()).code in (p.ErrorCode.MALFORMED, p.ErrorCode.TOO_LARGE)
            writer.write(p.HEADER.pack(64 << 20, p.VERSION, p.Pull.TYPE, 0, 5))
            assert (await answer()).code == p.ErrorCode.TOO_LARGE
            assert await asyncio.wait_for(reader.read(1 << 16), 5) == b"", "a lost framing ends the lane"
            writer.close()
            sink = Collect()
            wanted = [(it.address.digest, it.address.layer) for it in items(range(2))]
            await lane.pull(wanted, sink)                 # a fresh lane to the same server
            assert sink.arrived_ == [w[0] for w in wanted]
            await until(lambda: c[A].store.pinned_bytes == 0, "A to release what it sent")
            await lane.close()
    asyncio.run(body())
