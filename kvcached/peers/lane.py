"""The bulk lane, ``tls`` mode: pull payloads over TLS 1.3 on TCP, beside QUIC.

QUIC (kvcached.peers.quic) stays the control connection: mutual TLS, 0-RTT, announcements,
Exists, small pulls. A pull's payloads are bytes in bulk, and aioquic's pure-Python packet
handling is most of a pull's time (bench_peers figure 3), so pulls go over a lane when the peer
offers one: a TCP connection to the same port number as the peer's QUIC port, TLS 1.3 with the
cluster certificates, both sides checking chain, dates and name exactly as the QUIC side does
(:class:`~kvcached.peers.tls.PeerAuth`). The bytes on a lane are the peer protocol's frames
(kvcached.peers.protocol, docs/peer-protocol.md): the client sends one Pull, the server answers
every entry in order with a Block (head, then payload) or a Miss, or the whole request with an
Error. One pull is in flight per connection; a client keeps a few connections per peer open for
the next pulls, and closes one whose pull it gives up (a deadline, a hedge that lost), which is
the lane's STOP_SENDING: nothing more is written into the slots that pull was given.

Both ends run on the event loop (asyncio's TLS: OpenSSL does the cipher work). Payloads are
decoded straight into the arena slot the store reserved (FrameDecoder.receive_into); a server
releases a pinned block only once its bytes are handed to the kernel (write buffer low-water
mark 0, then drain).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Sequence

from cryptography import x509

from kvcached.peers import protocol as p
from kvcached.peers.quic import REQUEST_BODY, PeerGone, PeerHandler, PullAnswers, PullSink
from kvcached.peers.tls import PeerAuth, PeerRefused

__all__ = ["LANE_ALPN", "LaneClient", "LaneCounters", "LaneServer", "client_context", "server_context"]

log = logging.getLogger("kvcached.peers")

LANE_ALPN = "kvcached-lane/1"
READ_BYTES = 1 << 20           # one read off the TLS stream at most
WRITE_HIGH = 4 << 20           # a server's send buffer above this waits for the kernel
STALL_S = 30.0                 # an answer whose send buffer has not drained this long is given up
IDLE_S = 300.0                 # a server closes a lane that sent no request this long


def _context(auth: PeerAuth, purpose: ssl.Purpose) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(auth.cert_path, auth.key_path)
    ctx.load_verify_locations(cadata=auth.ca_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False            # the name is checked by PeerAuth, as on the QUIC side
    ctx.set_alpn_protocols([LANE_ALPN])
    return ctx


def server_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane server's TLS: TLS 1.3 only, this node's certificate, client certificates required."""
    return _context(auth, ssl.Purpose.CLIENT_AUTH)


def client_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane client's TLS: TLS 1.3 only, this node's certificate presented, the server's required."""
    return _context(auth, ssl.Purpose.SERVER_AUTH)


def _peer_certificate(writer: asyncio.StreamWriter) -> x509.Certificate | None:
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return x509.load_der_x509_certificate(der) if der else None


@dataclass
class LaneCounters:
    refused: int = 0           # lane connections refused (certificate, name, TLS)
    served_pulls: int = 0      # pulls answered over lanes


class LaneServer:
    """Accepts lanes from peers and answers their pulls through ``handler`` (the peer tier)."""

    def __init__(self, auth: PeerAuth, handler: PeerHandler, *, handshake_timeout_s: float = 5.0,
                 max_connections: int = 256) -> None:
        self.auth, self.handler = auth, handler
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.counters = LaneCounters()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> None:
        """Listen on TCP ``host``:``port`` (the QUIC port's number). OSError if it is taken."""
        self._server = await asyncio.start_server(self._serve, host, port, ssl=server_context(self.auth),
                                                  ssl_handshake_timeout=self.handshake_timeout_s)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = self.auth.check_client(_peer_certificate(writer), [])
        except (PeerRefused, ValueError) as exc:
            self.counters.refused += 1
            log.warning("lane refused", extra={"fields": {"side": "server", "reason": str(exc)}})
            writer.close()
            return
        if len(self._writers) >= self.max_connections:
            writer.close()
            return
        self._writers.add(writer)
        writer.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
        decoder = p.FrameDecoder(max_body=REQUEST_BODY, max_payload=1)
        try:
            while data := await asyncio.wait_for(reader.read(READ_BYTES), IDLE_S):
                decoder.feed(data)
                for item in decoder:
                    if not isinstance(item, p.Frame):
                        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Block frame sent as a request", fatal=True)
                    await self._request(peer, writer, item)
        except p.ProtocolError as exc:
            writer.write(p.encode(p.Error(exc.code, str(exc)), exc.request_id or 0))
        except (ConnectionError, ssl.SSLError, OSError, asyncio.TimeoutError):
            pass                          # gone, idle, or not reading its answers (STALL_S)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _request(self, peer: str, writer: asyncio.StreamWriter, frame: p.Frame) -> None:
        try:
            message = p.decode(frame)
        except p.ProtocolError as exc:
            writer.write(p.encode(p.Error(exc.code, str(exc)), frame.request_id))
            return
        if not isinstance(message, p.Pull):
            writer.write(p.encode(p.Error(p.ErrorCode.UNEXPECTED, f"a lane carries pulls, not {type(message).__name__}"),
                                  frame.request_id))
            return
        answers = await self.handler.pull(peer, message)
        self.counters.served_pulls += 1
        pending = iter(answers)
        try:
            for answer in pending:
                if isinstance(answer, p.Miss):
                    writer.write(p.encode(answer, frame.request_id))
                    continue
                head, payload, release = answer
                try:
                    writer.write(p.encode(head, frame.request_id))
                    writer.write(payload)
                    await asyncio.wait_for(writer.drain(), STALL_S)   # low-water mark 0: the payload is with the kernel
                finally:
                    release()
            await asyncio.wait_for(writer.drain(), STALL_S)
        finally:
            for rest in pending:                # not sent (the client went away): unpin
                if not isinstance(rest, p.Miss):
                    rest[2]()


class LaneClient:
    """Pulls from one peer over lanes: a connection per pull in flight, up to ``keep`` kept open
    for the next ones."""

    def __init__(self, auth: PeerAuth, peer: str, address: tuple[str, int], max_payload: int, *,
                 keep: int = 4, connect_timeout_s: float = 5.0) -> None:
        self.auth, self.peer, self.address, self.max_payload = auth, peer, address, max_payload
        self.keep, self.connect_timeout_s = keep, connect_timeout_s
        self._context = client_context(auth)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._next_id = 1

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self.address
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self._context, server_hostname=self.peer,
                                    ssl_handshake_timeout=self.connect_timeout_s), self.connect_timeout_s)
        try:
            self.auth.check_server(_peer_certificate(writer), [], self.peer)
        except (PeerRefused, ValueError):
            writer.close()
            raise
        return reader, writer

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def pull(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink) -> None:
        """As :meth:`PeerClientProtocol.pull`: answers go to ``sink`` as they arrive; returns
        once every entry is answered. OSError, ssl.SSLError or PeerRefused where the lane cannot
        be had (the caller pulls over QUIC instead); PeerGone or ProtocolError as on QUIC."""
        while self._idle and (self._idle[-1][1].is_closing() or self._idle[-1][0].at_eof()):
            self._idle.pop()[1].close()  # closed by the server meanwhile (idle)
        conn = self._idle.pop() if self._idle else await self._connect()
        done = False
        try:
            await self._pull_on(conn, addresses, sink)
            done = True
        finally:
            if done and len(self._idle) < self.keep:
                self._idle.append(conn)
            else:
                conn[1].close()            # given up or failed: nothing more reaches the slots

    async def _pull_on(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                       addresses: Sequence[tuple[bytes, int]], sink: PullSink) -> None:
        reader, writer = conn
        request_id = self._next_id
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF or 1
        writer.write(p.encode(p.Pull(addresses, self.max_payload), request_id))
        decoder = p.FrameDecoder(max_payload=self.max_payload)
        answers = PullAnswers(self.peer, decoder, sink)
        while answers.answered < len(addresses):
            data = await reader.read(READ_BYTES)
            if not data:
                raise PeerGone(f"{self.peer} closed the lane with {len(addresses) - answers.answered} of "
                               f"{len(addresses)} entries unanswered")
            decoder.feed(data)
            for item in decoder:
                if getattr(item, "request_id", request_id) != request_id:
                    raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer}: an answer to another request")
                message = answers.take(item)
                if message is not None:
                    raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer a Pull")
        if decoder.buffered or decoder.payload_remaining:
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent more than the answer")
