"""The bulk lane (kvcached.peers.lane, [quic] lane = "tls" or "mac"): pulls over TCP beside QUIC,
with real sockets and real certificates, on the peer-tier harness of test_peer_tier.py. Tests
that hold for either mode run in both; the certificate tests are tls's, the key and seal tests mac's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from pathlib import Path
from typing import Any, Callable

import pytest

from kvcached.peers import lane as lane_module
from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.certs import make_cluster
from kvcached.peers.lane import LaneConnection, client_context
from kvcached.peers.lane_client import LaneClient
from kvcached.peers.session import PeerGone, PullSink
from kvcached.peers.tls import PeerAuth, PeerRefused
from kvcached.store import PutItem
from tests.certificates import expired_certificate
from tests.integration import test_peer_tier as peer_tier_module
from tests.integration.test_peer_tier import (
    SIZE,
    A,
    B,
    C,
    Cluster,
    cluster,
    get_exact,
    items,
    test_a_deadline_with_a_hedge_in_flight_stops_every_attempt_before_the_fetch_returns,
    test_checksum_mismatch_falls_back_to_another_holder,
    test_dead_holder_misses_within_deadline_goes_down_and_comes_back,
    test_delete_drops_and_snapshot_replaces,
    test_hedged_pull_asks_the_next_holder,
    test_hedged_pull_does_not_wait_for_the_slow_peer,
    test_peer_metrics_count_pulls_and_show_peers_up,
    test_put_announced_then_pulled,
    until,
)
from tests.unit.conftest import address, payload

# The peer tier's tests that hold whatever carries the pulls, run again here over the lane.
__all__ = ["test_a_deadline_with_a_hedge_in_flight_stops_every_attempt_before_the_fetch_returns",
           "test_checksum_mismatch_falls_back_to_another_holder",
           "test_dead_holder_misses_within_deadline_goes_down_and_comes_back",
           "test_delete_drops_and_snapshot_replaces", "test_hedged_pull_asks_the_next_holder",
           "test_hedged_pull_does_not_wait_for_the_slow_peer", "test_peer_metrics_count_pulls_and_show_peers_up",
           "test_put_announced_then_pulled"]


@pytest.fixture(autouse=True, params=["tls", "mac"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs over the lane, in each mode (tests of one mode skip the other)."""
    monkeypatch.setattr(Cluster, "lane", request.param)
    return str(request.param)


def tls_only(mode: str) -> None:
    if mode != "tls":
        pytest.skip("certificates on the lane: tls mode (a mac lane proves a key granted over QUIC)")


def mac_only(mode: str) -> None:
    if mode != "mac":
        pytest.skip("keys and seals: mac mode")


def lane_client(c: Cluster, me: str, server: str, mode: str, **kw: Any) -> LaneClient:
    return LaneClient(c.auth(me, [server]), server, c.addr(server), 1 << 20, mode=mode, **kw)


def grant(c: Cluster, server: str, me: str, mode: str) -> tuple[bytes, bytes] | None:
    """A mac lane key for ``me`` from ``server``'s grants (as its QUIC session would give it)."""
    keys = c[server].t.lane_keys
    return keys.grant(me, object()) if mode == "mac" and keys is not None else None


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
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 48
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            assert b.t.counters.lane_pulls >= 1 and b.t.counters.lane_fallbacks == 0
            assert b.t.counters.pulled == n and a.t.lane_server is not None
            assert a.t.lane_server.counters.served_pulls >= 1 and a.t.counters.served == n
            stats = b.t.stats()
            assert stats["peer_lane_pulls"] == b.t.counters.lane_pulls
    asyncio.run(body())


def test_a_lane_that_cannot_be_had_falls_back_to_quic_and_is_counted(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 16
            assert a.t.lane_server is not None
            await a.t.lane_server.stop()                 # A's lane is gone; its QUIC is not
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            await get_exact(b, range(n))
            assert b.t.counters.lane_fallbacks == 1 and b.t.counters.lane_pulls == 0
            assert b.t.counters.pulled == n and b.t.counters.failed == 0
            await get_exact(b, range(n))                 # within lane_retry_s: straight to QUIC
            assert b.t.counters.lane_fallbacks == 1
    asyncio.run(body())


def test_the_lane_server_refuses_bad_client_certificates(tmp_path: Path, mode: str) -> None:
    tls_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:     # A takes only node-b
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


def test_a_lane_client_refuses_a_server_with_the_wrong_name(tmp_path: Path, mode: str) -> None:
    tls_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            # a client of A's that expects node-c at B's address: B's certificate names node-b
            lane = LaneClient(c.auth(A, [C]), C, c.addr(B), 1 << 20)
            with pytest.raises(PeerRefused, match="node-c"):
                await lane.pull([(payload(1, 32)[:32], 0)], Collect())
            await lane.close()
    asyncio.run(body())


def test_a_lane_pull_answers_blocks_and_misses_in_order(tmp_path: Path, mode: str) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(3)))
            lane, key = lane_client(c, B, A, mode), grant(c, A, B, mode)
            wanted = [(it.address.digest, it.address.layer) for it in items(range(3))]
            unknown = (b"\xff" * 32, 0)
            sink = Collect()
            await lane.pull([wanted[0], unknown, wanted[2]], sink, key)
            assert sink.arrived_ == [wanted[0][0], wanted[2][0]]
            assert [(m.digest, m.reason) for m in sink.missed_] == [(b"\xff" * 32, p.MissReason.NOT_FOUND)]
            assert bytes(sink.buffers[wanted[2][0]]) == payload(2, SIZE)
            sink2 = Collect()
            await lane.pull([wanted[1]], sink2, key)     # the same connection, kept for the next pull
            assert bytes(sink2.buffers[wanted[1][0]]) == payload(1, SIZE)
            assert len(lane._idle) == 1
            await lane.close()
            assert client_context(lane.auth).minimum_version == ssl.TLSVersion.TLSv1_3
    asyncio.run(body())


@pytest.mark.parametrize("run", [False, True], ids=["block", "run of blocks"])
def test_a_lane_cut_mid_payload_leaves_no_block_and_quic_brings_it(tmp_path: Path, run: bool) -> None:
    """The lane breaks in the middle of a payload (of a lone Block, or the second of a Blocks
    run whose first payload came whole): the half-written slot and those reserved after it are
    given back, never visible, and what is missing is pulled again over QUIC."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 8
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            server = a.t.lane_server
            assert server is not None

            async def cut(peer: str, conn: LaneConnection, frame: p.Frame) -> None:
                message = p.decode(frame)
                assert isinstance(message, p.Pull)
                answers = await server.handler.pull(peer, message)
                assert conn.transport is not None
                if run:
                    heads = [answer[0] for answer in answers]              # type: ignore[index]
                    conn.write_frame(p.encode(p.Blocks(heads), frame.request_id))
                    conn.transport.write(bytes(answers[0][1]))            # type: ignore[index]
                    view = answers[1][1]                                   # type: ignore[index]
                else:
                    head, view, _ = answers[0]                    # type: ignore[misc]
                    conn.write_frame(p.encode(head, frame.request_id))
                conn.transport.write(bytes(view[:len(view) // 2]))
                await asyncio.sleep(0.05)
                for answer in answers:
                    if not isinstance(answer, p.Miss):
                        answer[2]()
                conn.transport.abort()                        # the lane breaks
            server._request = cut                             # type: ignore[method-assign]
            await get_exact(b, range(n))                      # over QUIC, after the lane broke
            assert b.t.counters.lane_fallbacks == 1 and b.t.counters.corrupt == 0
            assert b.t.counters.pulled == n and b.t.counters.lane_pulls == 0
            assert b.store.pinned_bytes == 0 and a.store.pinned_bytes == 0
    asyncio.run(body())


def test_bad_frames_on_a_lane_are_answered_with_errors_and_lose_nothing(tmp_path: Path, mode: str) -> None:
    """A verified peer that sends a request that is not a Pull, a body that does not parse, then
    a header over the limit: an Error answers each (the last one ends the lane). On a second
    lane, a Blocks frame sent as a request: an Error, and that lane ends too. The same server
    goes on serving pulls."""
    tls_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(2)))
            cert, key = c.files.nodes[B]
            lane = LaneClient(PeerAuth.from_files(str(c.files.ca), str(cert), str(key), [A]), A, c.addr(A), 1 << 20)
            reader, writer = await asyncio.open_connection(*c.addr(A), ssl=client_context(lane.auth), server_hostname=A)

            async def answer(reader: asyncio.StreamReader = reader) -> p.Error:
                decoder = st.FrameDecoder()
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
            reader, writer = await asyncio.open_connection(*c.addr(A), ssl=client_context(lane.auth), server_hostname=A)
            writer.write(p.encode(p.Blocks([p.Block.of(bytes(32), 0, "m", b"x")]), 6) + b"x")   # an answer, as a request
            error = await answer(reader)
            assert error.code == p.ErrorCode.UNEXPECTED and "Blocks" in error.message
            assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
            writer.close()
            sink = Collect()
            wanted = [(it.address.digest, it.address.layer) for it in items(range(2))]
            await lane.pull(wanted, sink)                 # a fresh lane to the same server
            assert sink.arrived_ == [w[0] for w in wanted]
            await until(lambda: c[A].store.pinned_bytes == 0, "A to release what it sent")
            await lane.close()
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# mac mode: keys, handshake, seals

class Proxy:
    """A TCP relay in front of a lane server that may change what goes down to the client:
    ``tamper(connection index, downstream bytes so far, chunk)`` returns what to send instead."""

    def __init__(self, upstream: tuple[str, int],
                 tamper: Callable[[int, int, bytes], bytes] = lambda i, at, data: data) -> None:
        self.upstream, self.tamper = upstream, tamper
        self.connections = 0
        self.down: list[bytearray] = []          # what the server sent on each connection
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[:2]

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index, self.connections = self.connections, self.connections + 1
        self.down.append(bytearray())
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(1 << 16):
                    if down:
                        at = len(self.down[index])
                        self.down[index] += data
                        data = self.tamper(index, at, data)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True), return_exceptions=True)


class Checking(Collect):
    """A sink that records payloads failing their checksum instead of asserting (the store counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[bytes] = []

    def arrived(self, block: p.Block) -> None:
        if block.verify(bytes(self.buffers[block.digest])):
            self.arrived_.append(block.digest)
        else:
            self.bad.append(block.digest)


async def raw_lane(c: Cluster, server: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*c.addr(server))


async def closed_unanswered(reader: asyncio.StreamReader) -> bool:
    with contextlib.suppress(ConnectionError):
        return await asyncio.wait_for(reader.read(1 << 16), 5) == b""
    return True


def test_a_mac_lane_refuses_who_cannot_prove_the_key(tmp_path: Path, mode: str) -> None:
    """A hello with a key id never granted, one revoked with its QUIC session, or a wrong magic
    is closed unanswered; a known key id with a wrong proof gets the challenge, then is closed;
    each is counted, and nothing is served."""
    mac_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(1)))
            server, keys = c[A].t.lane_server, c[A].t.lane_keys
            assert server is not None and keys is not None
            session = object()
            key_id, key = keys.grant(B, session)
            keys.revoke(session)                           # its QUIC session ended
            hellos = {"never granted": m.HELLO.pack(m.MAGIC, b"\x01" * 16, b"\x02" * 16),
                      "revoked": m.HELLO.pack(m.MAGIC, key_id, b"\x02" * 16),
                      "wrong magic": m.HELLO.pack(b"KVLX", key_id, b"\x02" * 16)}
            for case, hello in hellos.items():
                before = server.counters.refused
                reader, writer = await raw_lane(c, A)
                writer.write(hello)
                assert await closed_unanswered(reader), case
                writer.close()
                assert server.counters.refused == before + 1, case

            key_id, key = keys.grant(B, object())
            handshake = m.ClientHandshake(key_id, b"\x00" * 32)     # the right id, not the key
            reader, writer = await raw_lane(c, A)
            writer.write(handshake.hello)
            challenge = await asyncio.wait_for(reader.readexactly(m.CHALLENGE.size), 5)
            with pytest.raises(m.MacRefused):                     # the server's proof is for the real key
                handshake.challenge(challenge)
            writer.write(m.PROOF.pack(b"\x00" * 32))
            writer.write(p.encode(p.Pull([(items(range(1))[0].address.digest, 0)], 1 << 20), 1))
            assert await closed_unanswered(reader)
            writer.close()
            assert server.counters.refused == 4 and server.counters.served_pulls == 0
            assert c[A].t.server_stats()["lane_refused"] == 4
    asyncio.run(body())


def test_a_mac_lane_refuses_frames_without_a_valid_seal(tmp_path: Path, mode: str) -> None:
    """After a valid handshake: a Pull with no seal, and a sealed Pull replayed from another
    connection (another connection key), each end the lane unanswered and are counted."""
    mac_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(1)))
            server, keys = c[A].t.lane_server, c[A].t.lane_keys
            assert server is not None and keys is not None
            key = keys.grant(B, object())
            pull = p.encode(p.Pull([(items(range(1))[0].address.digest, 0)], 1 << 20), 1)

            async def handshaken() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, m.LaneSecrets]:
                handshake = m.ClientHandshake(*key)
                reader, writer = await raw_lane(c, A)
                writer.write(handshake.hello)
                proof, secrets = handshake.challenge(await asyncio.wait_for(reader.readexactly(m.CHALLENGE.size), 5))
                writer.write(proof)
                return reader, writer, secrets

            reader, writer, secrets = await handshaken()          # a valid sealed pull is answered
            sealed = m.Sealer(secrets.connection_key, m.CLIENT_TO_SERVER).seal(pull) + pull
            writer.write(sealed)
            assert await asyncio.wait_for(reader.read(1 << 16), 5) != b""
            writer.close()

            for case, data in {"no seal": pull, "replayed from another connection": sealed}.items():
                before = server.counters.bad_seals
                reader, writer, _ = await handshaken()
                writer.write(data)
                assert await closed_unanswered(reader), case
                writer.close()
                await until(lambda: server.counters.bad_seals == before + 1, case)
            assert c[A].t.server_stats()["lane_bad_seals"] == 2 and server.counters.served_pulls == 1
    asyncio.run(body())


def test_a_mac_lane_client_refuses_changed_and_replayed_answers(tmp_path: Path, mode: str) -> None:
    """Between client and server: a changed byte in a block's head fails its seal; a payload byte
    changed fails the checksum and is never taken; an answer replayed from an earlier connection
    fails its seal. The client counts each refusal and the pull raises (the tier falls back)."""
    mac_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(2)))
            wanted = [(it.address.digest, it.address.layer) for it in items(range(2))]
            key = grant(c, A, B, mode)
            after_handshake = m.CHALLENGE.size
            seal_frame = p.HEADER.size + m.TAG_BYTES
            head_at = after_handshake + seal_frame + p.HEADER.size + 4   # the first head in the Blocks frame's body
            payload_at = head_at + 2 * (p.Block.FIXED.size + 2 + len("m"))  # after both heads: fixed part, model text

            def flip(at: int) -> Callable[[int, int, bytes], bytes]:
                def tamper(index: int, offset: int, data: bytes) -> bytes:
                    if index == 0 and offset <= at < offset + len(data):
                        data = data[:at - offset] + bytes([data[at - offset] ^ 1]) + data[at - offset + 1:]
                    return data
                return tamper

            async with Proxy(c.addr(A), flip(head_at + 3)) as address:      # a digest byte of the head
                lane = lane_client(c, B, A, mode, keep=0)
                lane.address = address
                with pytest.raises(m.MacRefused):
                    await lane.pull(wanted, Collect(), key)
                assert lane.refused == 1

            async with Proxy(c.addr(A), flip(payload_at + 10)) as address:  # a payload byte
                lane = lane_client(c, B, A, mode, keep=0)
                lane.address = address
                sink = Checking()
                await lane.pull(wanted, sink, key)
                assert sink.bad == [wanted[0][0]] and sink.arrived_ == [wanted[1][0]] and lane.refused == 0

            replayed: dict[str, bool] = {"sent": False}
            proxy = Proxy(c.addr(A))

            def replay(index: int, offset: int, data: bytes) -> bytes:
                if index == 0 or offset + len(data) <= after_handshake:
                    return data                                     # the first connection, and every handshake
                keep = data[:max(after_handshake - offset, 0)]
                if replayed["sent"]:
                    return keep
                replayed["sent"] = True
                return keep + bytes(proxy.down[0][after_handshake:])    # the first connection's answer

            proxy.tamper = replay
            async with proxy as address:
                lane = lane_client(c, B, A, mode, keep=0)
                lane.address = address
                first = Collect()
                await lane.pull(wanted, first, key)
                assert first.arrived_ == [w[0] for w in wanted]
                with pytest.raises(m.MacRefused):
                    await lane.pull(wanted, Collect(), key)
                assert lane.refused == 1 and replayed["sent"]
    asyncio.run(body())


def test_a_mac_key_comes_over_quic_and_dies_with_the_session(tmp_path: Path, mode: str) -> None:
    """B's QUIC session to A gets a key (LaneOpen/LaneKey); A forgets it when that session ends,
    and B's next pull gets a new key from the new session and goes over the lane again."""
    mac_only(mode)

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a, b, n = c[A], c[B], 4
            await a.store.put(items(range(2 * n)))
            await until(lambda: b.t.locator.directory.count(A) == 2 * n, "announcements")
            await get_exact(b, range(n))
            keys = a.t.lane_keys
            assert keys is not None and len(keys) == 1 and b.t.counters.lane_pulls >= 1
            client = b.t.links[A].client
            assert client is not None
            first = await client.lane_key()
            assert keys.get(first[0]) == (B, first[1])
            client.close()                                   # the session ends
            assert not client.usable                         # no new request goes out on a closing session
            await until(lambda: keys.get(first[0]) is None, "A to revoke the key")
            pulls = b.t.counters.lane_pulls
            await c.connected()
            await get_exact(b, range(n, 2 * n))             # not held by B yet: pulled again
            assert b.t.counters.lane_pulls == pulls + 1 and b.t.counters.lane_fallbacks == 0
            client = b.t.links[A].client
            assert client is not None and (await client.lane_key())[0] != first[0]
    asyncio.run(body())


def test_a_mac_lane_that_stops_reading_is_given_up_and_unpins(tmp_path: Path, mode: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified client asks for 7 MiB and reads nothing: the server, whose transport still
    holds payload bytes (views of pinned slots) past what the kernel buffers, gives up after
    STALL_S, closes the lane, counts it and releases every pin."""
    mac_only(mode)
    monkeypatch.setattr(lane_module, "STALL_S", 0.5)
    monkeypatch.setattr(peer_tier_module, "SLAB", 1 << 20)       # 1 MiB blocks, a 16 MiB arena

    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            a = c[A]
            big = [PutItem(address(1000 + i), payload(1000 + i, (1 << 20) - 64), model="m") for i in range(7)]
            await a.store.put(big)
            assert a.store.max_pinned_bytes >= 7 << 20
            server, keys = a.t.lane_server, a.t.lane_keys
            assert server is not None and keys is not None
            handshake = m.ClientHandshake(*keys.grant(B, object()))
            loop = asyncio.get_running_loop()
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the bytes stay with A
                sock.setblocking(False)
                await loop.sock_connect(sock, c.addr(A))
                await loop.sock_sendall(sock, handshake.hello)
                challenge = b""
                while len(challenge) < m.CHALLENGE.size:
                    challenge += await asyncio.wait_for(loop.sock_recv(sock, m.CHALLENGE.size - len(challenge)), 5)
                proof, secrets = handshake.challenge(challenge)
                pull = p.encode(p.Pull([(it.address.digest, it.address.layer) for it in big], 1 << 20), 1)
                await loop.sock_sendall(sock, proof + m.Sealer(secrets.connection_key, m.CLIENT_TO_SERVER).seal(pull)
                                        + pull)
                await until(lambda: a.store.pinned_bytes > 0, "A to pin what it sends")
                await until(lambda: server.counters.stalled == 1, "A to give the answer up")
                await until(lambda: a.store.pinned_bytes == 0, "A to release every pin")
            assert a.t.server_stats()["lane_stalled"] == 1
    asyncio.run(body())


def test_a_striped_pull_goes_over_several_connections_bit_exact(tmp_path: Path, mode: str) -> None:
    """lane_stripes 4: a pull of 32 blocks is split in 4 Pulls of 8 on 4 connections at once; all
    arrive whole, and the 4 connections are kept for the next pulls."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(32)))
            lane, key = lane_client(c, B, A, mode, stripes=4), grant(c, A, B, mode)
            wanted = [(it.address.digest, it.address.layer) for it in items(range(32))]
            sink = Collect()
            await lane.pull(wanted, sink, key)
            assert sorted(sink.arrived_) == sorted(w[0] for w in wanted) and not sink.missed_
            assert all(bytes(sink.buffers[w[0]]) == payload(n, SIZE) for n, w in enumerate(wanted))
            assert len(lane._idle) == 4
            server = c[A].t.lane_server
            assert server is not None and server.counters.served_pulls == 4
            await lane.close()
    asyncio.run(body())


def test_a_lane_of_the_other_mode_cannot_be_had_and_a_tls_daemon_grants_no_key(tmp_path: Path, mode: str) -> None:
    """Both ends must run the same mode. A client of the other mode gets an error the peer tier
    falls back to QUIC on (tls against mac: the server reads the TLS hello as a bad mac hello,
    refuses and counts it; mac against tls: the TLS server drops the bytes). A tls daemon asked
    for a mac key over QUIC answers Error UNAVAILABLE. The server serves on afterwards."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B)) as c:
            await c[A].store.put(items(range(1)))
            wanted = [(items(range(1))[0].address.digest, 0)]
            server = c[A].t.lane_server
            assert server is not None
            other = "mac" if mode == "tls" else "tls"
            wrong = lane_client(c, B, A, other)
            key = (b"\x01" * 16, b"\x02" * 32) if other == "mac" else None
            with pytest.raises((OSError, ssl.SSLError, PeerRefused, PeerGone)):
                await wrong.pull(wanted, Collect(), key)
            if mode == "mac":
                await until(lambda: server.counters.refused == 1, "A to refuse the TLS hello")
            else:
                await c.connected()
                client = c[B].t.links[A].client
                assert client is not None
                with pytest.raises(p.ProtocolError, match="no mac lane") as err:
                    await client.lane_key()
                assert err.value.code == p.ErrorCode.UNAVAILABLE
            sink = Collect()
            await lane_client(c, B, A, mode).pull(wanted, sink, grant(c, A, B, mode))
            assert sink.arrived_ == [wanted[0][0]]
    asyncio.run(body())
