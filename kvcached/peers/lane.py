"""The bulk lane: pull payloads over TCP beside QUIC, in ``tls`` or ``mac`` mode.

QUIC (kvcached.peers.quic) stays the control connection: mutual TLS, 0-RTT, announcements,
Exists. A lane carries Pulls, and a cluster's Locates (a TCP round trip costs a home and its
asker a third of what aioquic's does: bench_cluster_daemons). A pull's payloads are bytes in
bulk, and aioquic's pure-Python packet handling is most of a pull's time (bench_peers figure
3), so pulls go over a lane when the peer offers one: TCP connections to the same port number
as the peer's QUIC port, in one of two modes (``[quic] lane``; docs/peers.md says what each
protects against):

- ``tls``: TLS 1.3 with the cluster certificates, both sides checking chain, dates and name
  exactly as the QUIC side does (:class:`~kvcached.peers.tls.PeerAuth`);
- ``mac``: plain TCP, each connection proving a key granted over the QUIC session and every
  frame sealed with keyed BLAKE3 (kvcached.peers.lane_mac): integrity and authenticity, no
  confidentiality.

The bytes on a lane are the peer protocol's frames (kvcached.peers.protocol): the client sends
one Pull, the server answers every entry in order with a Miss or a block, each run of blocks as
one Blocks frame (their heads) and then their payloads back to back (one frame to decode and,
on ``mac``, one seal to check per run, not per block), or the whole request with an Error.
One pull is in flight per connection; a client may stripe a large pull over several
connections (``[quic] lane_stripes``), keeps a few open for the next pulls, and closes one
whose pull it gives up (a deadline, a hedge that lost), which is the lane's STOP_SENDING.

Receive side: :class:`LaneConnection` is a buffered protocol. While a Block's payload is coming,
the buffer it hands the event loop is the arena slot the store reserved for it (the decoder's
:meth:`~kvcached.peers.protocol.FrameDecoder.payload_target`), so the kernel (``mac``) or
OpenSSL (``tls``) writes the payload straight into the slot: no intermediate bytes object, no
copy. The store checks the BLAKE3 checksum and only then commits. Send side: heads and payloads
are written as memoryviews of the pinned slot; a pinned block is released only once the
transport holds no reference to it (``tls``: encrypted at once; ``mac``: the kernel took it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cryptography import x509

from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers.session import REQUEST_BODY, PeerGone, PeerHandler, PullAnswers, PullSink, RequestIds, take_request
from kvcached.peers.tls import PeerAuth, PeerRefused

__all__ = ["LANE_ALPN", "LANE_MODES", "LaneClient", "LaneConnection", "LaneCounters", "LaneServer",
           "client_context", "server_context"]

log = logging.getLogger("kvcached.peers")

LANE_ALPN = "kvcached-lane/1"
LANE_MODES = ("tls", "mac")
SCRATCH_BYTES = 4 << 10        # one read outside payloads: heads, Misses, requests (payload bytes read here are copied)
WRITE_HIGH = 4 << 20           # a server's send buffer above this waits for the kernel
WRITE_BATCH = 1 << 20          # a server hands answers to the transport in batches of about this
STALL_S = 30.0                 # an answer whose send buffer has not drained this long is given up
IDLE_S = 300.0                 # a server closes a lane that sent no request this long
STRIPE_MIN = 8                 # entries per stripe at least: smaller pulls go on one connection
MAX_QUEUED_REQUESTS = 4        # a server stops reading a lane with this many requests unanswered
RAW_HIGH = 64 << 10            # bytes gathered before framing starts (the handshake) past which reading pauses
_LANE_REQUESTS = frozenset({p.Pull.TYPE, p.Locate.TYPE})   # a lane carries pulls and Locates; the rest goes over QUIC


def _context(auth: PeerAuth, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(auth.cert_path, auth.key_path)
    ctx.load_verify_locations(cadata=auth.ca_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False            # the name is checked by PeerAuth, as on the QUIC side
    ctx.set_alpn_protocols([LANE_ALPN])
    return ctx


def server_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane server's TLS: TLS 1.3 only, this node's certificate, client certificates required."""
    return _context(auth, server=True)


def client_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane client's TLS: TLS 1.3 only, this node's certificate presented, the server's required."""
    return _context(auth, server=False)


class LaneConnection(asyncio.BufferedProtocol):
    """One lane connection's bytes, either side.

    Before framing starts (``mac``: the handshake) bytes are gathered raw for :meth:`read_raw`.
    Then they go through :attr:`decoder`, and every event it hands out goes, synchronously, to
    :attr:`on_event` (so a Block head's slot is the very next read's buffer). An exception from
    ``on_event`` ends the connection and becomes :attr:`error`. :meth:`abandon` cuts the
    connection off from every buffer a pull gave it, at once, before closing it."""

    def __init__(self, decoder: p.FrameDecoder, *, framed: bool,
                 on_made: Callable[[LaneConnection], None] | None = None) -> None:
        self.decoder = decoder
        self.framed = framed
        self.on_made = on_made
        self.on_event: Callable[[p.Event], None] = self._unexpected
        self.sealer: m.Sealer | None = None
        self.opener: m.Opener | None = None
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.stalled = False                  # a write waited STALL_S for the peer to read
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._into_payload = False
        self._raw = bytearray()
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._wake: asyncio.Future[None] | None = None
        self._until: Callable[[], bool] = bool      # what the waiting task waits for (see wait)
        self._writable: asyncio.Future[None] | None = None

    # -- asyncio.BufferedProtocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]   # a stream transport (uvloop's are not asyncio.Transport subclasses)
        if self.on_made is not None:
            self.on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self.decoder.payload_target() if self.framed else None
        self._into_payload = bool(target)
        return target if target else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_payload:
            self._take(self.decoder.payload_written, nbytes)
        elif self.framed:
            self._take(self.decoder.feed, bytes(self._scratch[:nbytes]))
        else:
            self._raw += self._scratch[:nbytes]
            if len(self._raw) >= RAW_HIGH and self.transport is not None:
                self.transport.pause_reading()     # nobody reads past the handshake yet
            self._notify()

    def eof_received(self) -> bool | None:
        return None                        # close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None and exc is not None:
            self.error = exc
        if not self.closed.done():
            self.closed.set_result(None)
        self._notify()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- for the client and server --

    def _take(self, give: Callable[[Any], None], data: Any) -> None:
        """Give the decoder new input (``give(data)``), then hand out every event it makes whole."""
        try:
            give(data)
            decoder, opener = self.decoder, self.opener
            while (item := decoder.next_event()) is not None:
                if opener is not None and opener.take(item):
                    continue               # a seal, kept for the frame it precedes
                self.on_event(item)
            self._notify()
        except Exception as exc:           # a protocol error, a bad seal, a sink that failed
            self.fail(exc)

    def _unexpected(self, item: p.Event) -> None:
        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(item).__name__} when no answer was due")

    def _notify(self) -> None:
        """Wake the waiting task if what it waits for now holds, or the connection failed: not
        on every read (a pull's task would step once per block for nothing)."""
        wake = self._wake
        if wake is not None and not wake.done() and (
                self._until() or self.error is not None or self.closed.done()):
            wake.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Stop taking input, with ``exc`` as the connection's error (the first one is kept): no
        buffer a pull gave is written into any more. The owner then answers or closes."""
        if self.error is None:
            self.error = exc
        self._detach()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._notify()

    def abandon(self) -> None:
        """Write nothing more into any buffer a pull gave, and close now (unsent bytes dropped)."""
        self._detach()
        if self.transport is not None:
            self.transport.abort()

    def _detach(self) -> None:
        self.on_event = lambda item: None
        self.decoder = p.FrameDecoder(max_body=0, max_payload=1)   # holds no slot; reads go to scratch
        self.framed = True

    @property
    def gone(self) -> bool:
        return (self.error is not None or self.closed.done() or self.transport is None
                or self.transport.is_closing())

    def failure(self) -> BaseException:
        return self.error if self.error is not None else PeerGone("the peer closed the lane")

    async def wait(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds after some input; the connection's failure if it ends first."""
        while not condition():
            if self.error is not None or self.closed.done():
                raise self.failure()
            self._until = condition
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake

    async def read_raw(self, n: int) -> bytes:
        """The next ``n`` bytes before framing (a handshake message)."""
        await self.wait(lambda: len(self._raw) >= n)
        data = bytes(self._raw[:n])
        del self._raw[:n]
        self._resume_raw()
        return data

    def _resume_raw(self) -> None:
        if len(self._raw) < RAW_HIGH and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def start_framing(self) -> None:
        """From now on bytes are frames (what came after the handshake is decoded first)."""
        self.framed = True
        rest, self._raw = bytes(self._raw), bytearray()
        self._resume_raw()
        if rest:
            self._take(self.decoder.feed, rest)

    def sealed(self, frame: bytes) -> bytes:
        """``frame`` as it goes on this lane: after its Seal where the lane is ``mac``."""
        return self.sealer.seal(frame) + frame if self.sealer is not None else frame

    def write_frame(self, frame: bytes) -> None:
        """Write one frame (sealed where the lane is ``mac``)."""
        assert self.transport is not None
        self.transport.write(self.sealed(frame))

    @property
    def buffered(self) -> int:
        """Bytes the transport holds, not yet taken by the kernel."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    async def flushed(self) -> None:
        """Until the transport holds nothing (the kernel took every byte written)."""
        if self.buffered and self.transport is not None and not self.gone:
            self.transport.set_write_buffer_limits(high=0, low=0)      # pauses writing: resumed at empty
            try:
                await self.drain()
            finally:
                if not self.transport.is_closing():
                    self.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
        if self.closed.done():
            raise self.failure()

    async def drain(self) -> None:
        """Until the transport is under its high-water mark again; asyncio.TimeoutError when it
        has not moved for STALL_S (the peer stopped reading)."""
        writable = self._writable
        if writable is not None and not writable.done():
            try:
                await asyncio.wait_for(asyncio.shield(writable), STALL_S)
            except asyncio.TimeoutError:
                self.stalled = True
                raise
        if self.closed.done():
            raise self.failure()


def _peer_certificate(transport: asyncio.BaseTransport | None) -> x509.Certificate | None:
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return x509.load_der_x509_certificate(der) if der else None


@dataclass
class LaneCounters:
    refused: int = 0           # lane connections refused (certificate, name, TLS, mac handshake)
    bad_seals: int = 0         # mac lanes ended for a frame whose seal was missing or wrong
    stalled: int = 0           # answers given up: the client stopped reading for STALL_S
    served_pulls: int = 0      # pulls answered over lanes


class LaneServer:
    """Accepts lanes from peers and answers their pulls through ``handler`` (the peer tier).
    ``mac`` mode needs ``keys``: the grants the QUIC side made (kvcached.peers.lane_mac)."""

    def __init__(self, auth: PeerAuth, handler: PeerHandler, *, mode: str = "tls", keys: m.LaneKeys | None = None,
                 handshake_timeout_s: float = 5.0, max_connections: int = 256) -> None:
        if mode not in LANE_MODES or (mode == "mac") != (keys is not None):
            raise ValueError(f"a lane server runs mode tls, or mac with keys; not {mode!r}")
        self.auth, self.handler, self.mode, self.keys = auth, handler, mode, keys
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.counters = LaneCounters()
        self._server: asyncio.Server | None = None
        self._connections: set[LaneConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, fd: int | None = None) -> None:
        """Listen on TCP ``host``:``port`` (the QUIC port's number). OSError if it is taken.
        With ``fd``: accept on that listening socket (a predecessor's, kvcached.handover)."""
        loop = asyncio.get_running_loop()
        tls = self.mode == "tls"
        where: dict[str, Any] = {"sock": socket.socket(fileno=fd)} if fd is not None else {"host": host, "port": port}
        self._server = await loop.create_server(
            lambda: LaneConnection(p.FrameDecoder(max_body=REQUEST_BODY, max_payload=1), framed=False,
                                   on_made=self._accepted),
            ssl=server_context(self.auth) if tls else None,
            ssl_handshake_timeout=self.handshake_timeout_s if tls else None, **where)

    @property
    def listening_fd(self) -> int:
        assert self._server is not None and self._server.sockets
        return self._server.sockets[0].fileno()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.abandon()
            for task in list(self._tasks):
                task.cancel()
            await self._server.wait_closed()
            self._server = None

    def _accepted(self, conn: LaneConnection) -> None:
        if len(self._connections) >= self.max_connections:
            conn.abandon()
            return
        self._connections.add(conn)
        task = asyncio.ensure_future(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, conn: LaneConnection, reason: str) -> None:
        self.counters.refused += 1
        log.warning("lane refused", extra={"fields": {"side": "server", "mode": self.mode, "reason": reason}})
        conn.abandon()

    async def _authenticate(self, conn: LaneConnection) -> tuple[str, bytes] | None:
        """The peer of a new lane and its key id (``mac``), or None (refused, counted)."""
        if self.mode == "tls":
            try:
                return self.auth.check_client(_peer_certificate(conn.transport), []), b""
            except (PeerRefused, ValueError) as exc:
                self._refuse(conn, str(exc))
                return None
        assert self.keys is not None
        handshake = m.ServerHandshake(self.keys)
        try:
            hello = await asyncio.wait_for(conn.read_raw(m.HELLO.size), self.handshake_timeout_s)
            conn.transport.write(handshake.hello(hello))            # type: ignore[union-attr]
            proof = await asyncio.wait_for(conn.read_raw(m.PROOF.size), self.handshake_timeout_s)
            peer, secrets = handshake.proof(proof)
        except m.MacRefused as exc:
            self._refuse(conn, str(exc))
            return None
        except (asyncio.TimeoutError, ConnectionError, OSError, PeerGone):
            conn.abandon()             # gone or silent before proving anything: not served, not counted
            return None
        conn.opener = m.Opener(secrets.connection_key, m.CLIENT_TO_SERVER)
        conn.sealer = m.Sealer(secrets.connection_key, m.SERVER_TO_CLIENT)
        return peer, handshake.key_id

    async def _serve(self, conn: LaneConnection) -> None:
        requests: deque[p.Frame] = deque()

        def on_event(item: p.Event) -> None:
            if not isinstance(item, p.Frame):
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Block or Blocks frame sent as a request", fatal=True)
            requests.append(item)
            if len(requests) >= MAX_QUEUED_REQUESTS and conn.transport is not None:
                conn.transport.pause_reading()

        try:
            who = await self._authenticate(conn)
            if who is None:
                return
            peer, key_id = who
            assert conn.transport is not None
            conn.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
            conn.on_event = on_event
            conn.start_framing()
            while True:
                if not requests:
                    async with asyncio.timeout(IDLE_S):       # no task per request, unlike wait_for
                        await conn.wait(lambda: bool(requests))
                frame = requests.popleft()
                if not conn.gone:
                    conn.transport.resume_reading()
                if self.keys is not None and self.keys.get(key_id) is None:
                    return                 # the QUIC session that granted the key ended
                await self._request(peer, conn, frame)
        except p.ProtocolError:
            pass                           # the connection's error: answered below
        except asyncio.TimeoutError:
            if conn.stalled:
                self.counters.stalled += 1     # not reading its answers (STALL_S); idle lanes end quietly
        except (ConnectionError, ssl.SSLError, OSError, PeerGone):
            pass                           # gone
        finally:
            if isinstance(conn.error, m.MacRefused):
                self.counters.bad_seals += 1
                log.warning("lane frame refused", extra={"fields": {"side": "server", "reason": str(conn.error)}})
            elif isinstance(conn.error, p.ProtocolError) and not conn.closed.done() and conn.transport is not None:
                conn.write_frame(p.encode(p.Error(conn.error.code, str(conn.error)), conn.error.request_id or 0))
            self._connections.discard(conn)
            if conn.transport is not None:
                conn.transport.close()     # what was written (an Error) goes out first

    async def _request(self, peer: str, conn: LaneConnection, frame: p.Frame) -> None:
        try:
            message = take_request(frame, carries=_LANE_REQUESTS, where="a lane")
        except p.ProtocolError as exc:
            conn.write_frame(p.encode(p.Error(exc.code, str(exc)), frame.request_id))
            return
        if isinstance(message, p.Locate):
            conn.write_frame(p.encode(self.handler.answer_locate(peer, message), frame.request_id))
            return
        assert isinstance(message, p.Pull)
        self.counters.served_pulls += 1
        # Pinned and sent a part at a time: the first payloads are on their way (the puller
        # reading and checking them) while the next part is pinned.
        sender = _Sender(conn)
        try:
            rows = message.addresses
            for at in range(0, len(rows), SERVE_PART):
                answers = await self.handler.pull(peer, p.Pull(rows[at:at + SERVE_PART], message.max_payload))
                try:
                    pieces = _answer_pieces(answers, frame.request_id, conn.sealed)
                except BaseException:            # a head that cannot be encoded: unpin the part, end the lane
                    for answer in answers:
                        if not isinstance(answer, p.Miss):
                            answer[2]()
                    raise
                await sender.send(pieces)
            await sender.finish()
        finally:
            sender.close()


class _Sender:
    """Writes a pull's answers to a lane in batches of about WRITE_BATCH bytes, one writelines
    (one writev where the kernel takes it) each. Payloads the transport may still hold a
    reference to (``mac``: plain TCP transports keep what the kernel did not take as views, not
    copies) are released in order once the bytes up to their end have left it; ``tls``
    encrypts on write, so its payloads are released once their batch is written."""

    def __init__(self, conn: LaneConnection) -> None:
        self.conn = conn
        self.holds = conn.sealer is not None
        self.held: deque[tuple[int, Callable[[], None]]] = deque()   # (end offset, release), in order
        self.batch: list[bytes | memoryview] = []
        self.batched = self.written = 0
        self.pieces: list[tuple[bytes | memoryview, Callable[[], None] | None]] = []   # the part being sent
        self.taken = 0                          # of them, handed to a batch

    async def send(self, pieces: list[tuple[bytes | memoryview, Callable[[], None] | None]]) -> None:
        """Hand ``pieces`` to the transport (the last batch too: the next part is pinned while
        these go out)."""
        self.pieces, self.taken = pieces, 0
        for data, release in pieces:
            self.taken += 1
            self.batch.append(data)
            self.batched += len(data)
            if release is not None:
                self.held.append((self.written + self.batched, release))
            if self.batched >= WRITE_BATCH:
                await self._flush()
        if self.batch:
            await self._flush()

    async def _flush(self) -> None:
        conn = self.conn
        assert conn.transport is not None
        conn.transport.writelines(self.batch)
        self.batch.clear()
        self.written, self.batched = self.written + self.batched, 0
        if not self.holds:
            _release_sent(self.held, self.written)
        await conn.drain()                       # above the high-water mark: wait for the kernel
        _release_sent(self.held, self.written - conn.buffered)

    async def finish(self) -> None:
        """Until every payload held has left the transport, each released as it does."""
        while self.held:
            await self.conn.flushed()
            _release_sent(self.held, self.written - self.conn.buffered)

    def close(self) -> None:
        """Release what is still pinned: queued when the connection failed, or never sent."""
        for _, queued in self.held:
            queued()
        self.held.clear()
        for _, release in self.pieces[self.taken:]:
            if release is not None:
                release()
        self.pieces, self.taken = [], 0


SERVE_PART = 16                # entries of a Pull pinned at a time: sent before the next are pinned


def _answer_pieces(answers: Sequence[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss],
                   request_id: int, sealed: Callable[[bytes], bytes]
                   ) -> list[tuple[bytes | memoryview, Callable[[], None] | None]]:
    """A part of a Pull's answers (SERVE_PART entries at most, so a Blocks frame's body stays
    small) as the bytes that go on the lane, in order: each run of blocks served as one Blocks
    frame (``sealed``: after its Seal on a ``mac`` lane) and then their payloads, each with the
    release that unpins it; each Miss as its own frame."""
    pieces: list[tuple[bytes | memoryview, Callable[[], None] | None]] = []
    run: list[tuple[p.Block, memoryview, Callable[[], None]]] = []

    def end_run() -> None:
        if run:
            pieces.append((sealed(p.encode(p.Blocks([head for head, _, _ in run]), request_id)), None))
            pieces.extend((payload, release) for _, payload, release in run)
            run.clear()

    for answer in answers:
        if isinstance(answer, tuple):
            run.append(answer)
        else:
            end_run()
            pieces.append((sealed(p.encode(answer, request_id)), None))
    end_run()
    return pieces


def _release_sent(held: deque[tuple[int, Callable[[], None]]], sent: int) -> None:
    while held and held[0][0] <= sent:
        held.popleft()[1]()


class LaneClient:
    """Pulls from one peer over lanes: a connection per pull (or stripe) in flight, up to
    ``keep`` kept open for the next ones. A pull of ``2 * STRIPE_MIN`` entries or more is split
    over up to ``stripes`` connections at once. ``mac`` mode: each pull names the key the QUIC
    session granted; connections opened with another key are closed."""

    def __init__(self, auth: PeerAuth, peer: str, address: tuple[str, int], max_payload: int, *,
                 mode: str = "tls", keep: int = 4, stripes: int = 1, connect_timeout_s: float = 5.0) -> None:
        if mode not in LANE_MODES:
            raise ValueError(f"lane mode {mode!r}: one of {', '.join(LANE_MODES)}")
        self.auth, self.peer, self.address, self.max_payload = auth, peer, address, max_payload
        self.mode, self.keep, self.stripes, self.connect_timeout_s = mode, keep, max(stripes, 1), connect_timeout_s
        self._context = client_context(auth) if mode == "tls" else None
        self._idle: list[tuple[LaneConnection, bytes]] = []      # (connection, key id it proved)
        self._ids = RequestIds()
        self.refused = 0           # servers that did not prove the key, frames whose seal failed

    async def _connect(self, key: tuple[bytes, bytes] | None) -> LaneConnection:
        loop = asyncio.get_running_loop()
        host, port = self.address
        framed = self.mode == "tls"

        def factory() -> LaneConnection:
            return LaneConnection(p.FrameDecoder(max_payload=self.max_payload), framed=framed)

        if framed:
            _, conn = await asyncio.wait_for(loop.create_connection(
                factory, host, port, ssl=self._context, server_hostname=self.peer,
                ssl_handshake_timeout=self.connect_timeout_s), self.connect_timeout_s)
            try:
                self.auth.check_server(_peer_certificate(conn.transport), [], self.peer)
            except (PeerRefused, ValueError):
                conn.abandon()
                raise
            return conn
        if key is None:
            raise PeerRefused(f"no lane key from {self.peer} (its QUIC session grants one)")
        _, conn = await asyncio.wait_for(loop.create_connection(factory, host, port), self.connect_timeout_s)
        handshake = m.ClientHandshake(*key)
        try:
            assert conn.transport is not None
            conn.transport.write(handshake.hello)
            challenge = await asyncio.wait_for(conn.read_raw(m.CHALLENGE.size), self.connect_timeout_s)
            proof, secrets = handshake.challenge(challenge)
        except m.MacRefused as exc:
            self.refused += 1
            conn.abandon()
            raise PeerRefused(f"{self.peer}: {exc}") from None
        except BaseException:
            conn.abandon()
            raise
        conn.transport.write(proof)
        conn.sealer = m.Sealer(secrets.connection_key, m.CLIENT_TO_SERVER)
        conn.opener = m.Opener(secrets.connection_key, m.SERVER_TO_CLIENT)
        conn.start_framing()
        return conn

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.abandon()

    async def pull(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink,
                   key: tuple[bytes, bytes] | None = None) -> None:
        """As :meth:`PeerClientProtocol.pull`: answers go to ``sink`` as they arrive; returns once
        every entry is answered. ``key``: the (key id, key) granted over QUIC (``mac`` mode).
        OSError, ssl.SSLError or PeerRefused where the lane cannot be had (the caller pulls over
        QUIC instead); PeerGone or ProtocolError as on QUIC."""
        n = min(self.stripes, len(addresses) // STRIPE_MIN) if len(addresses) >= 2 * STRIPE_MIN else 1
        if n <= 1:
            await self._pull_one(addresses, sink, key)
            return
        size = -(-len(addresses) // n)
        parts = [asyncio.ensure_future(self._pull_one(addresses[i:i + size], sink, key))
                 for i in range(0, len(addresses), size)]
        try:
            done, pending = await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for part in parts:
                part.cancel()          # on a failure or a cancel: the other stripes give up too
            await asyncio.gather(*parts, return_exceptions=True)
        for part in parts:
            if part.done() and not part.cancelled() and part.exception() is not None:
                raise part.exception()  # type: ignore[misc]

    async def _pull_one(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink,
                        key: tuple[bytes, bytes] | None) -> None:
        conn = await self._take(key)
        done = False
        try:
            await self._pull_on(conn, addresses, sink)
            done = True
        except m.MacRefused:
            self.refused += 1
            raise
        finally:
            self._give_back(conn, key, done)

    async def locate(self, addresses: Sequence[tuple[bytes, int]],
                     key: tuple[bytes, bytes] | None = None) -> list[tuple[str, ...]]:
        """As :meth:`PeerClientProtocol.locate`, over the lane (a home's answer costs a TCP round
        trip, not aioquic's packet handling); the same failures as :meth:`pull`."""
        conn = await self._take(key)
        done = False
        try:
            holders = await self._locate_on(conn, addresses)
            done = True
            return holders
        except m.MacRefused:
            self.refused += 1
            raise
        finally:
            self._give_back(conn, key, done)

    async def _take(self, key: tuple[bytes, bytes] | None) -> LaneConnection:
        """An idle connection proved with ``key``'s id, or a new one."""
        key_id = key[0] if key is not None else b""
        while self._idle:
            candidate, proved = self._idle.pop()
            if candidate.gone or proved != key_id:
                candidate.abandon()    # closed by the server meanwhile (idle), or an older session's key
            else:
                return candidate
        return await self._connect(key)

    def _give_back(self, conn: LaneConnection, key: tuple[bytes, bytes] | None, done: bool) -> None:
        if done and not conn.gone and len(self._idle) < self.keep:
            conn.on_event = conn._unexpected
            self._idle.append((conn, key[0] if key is not None else b""))
        else:
            conn.abandon()             # given up or failed: nothing more reaches the slots

    async def _locate_on(self, conn: LaneConnection, addresses: Sequence[tuple[bytes, int]]) -> list[tuple[str, ...]]:
        request_id = self._ids.next()
        answers = PullAnswers(self.peer, conn.decoder, None, request_id=request_id)
        got: list[p.Located] = []

        def on_event(item: p.Event) -> None:
            message = answers.take(item)
            if not isinstance(message, p.Located) or got:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer a Locate")
            got.append(message)

        conn.on_event = on_event
        conn.write_frame(p.encode(p.Locate(addresses), request_id))
        await conn.wait(lambda: bool(got))
        if len(got[0].holders) != len(addresses):
            raise p.ProtocolError(p.ErrorCode.MALFORMED, f"Located answers {len(got[0].holders)} of "
                                  f"{len(addresses)} addresses")
        return [tuple(h) for h in got[0].holders]

    async def _pull_on(self, conn: LaneConnection, addresses: Sequence[tuple[bytes, int]], sink: PullSink) -> None:
        request_id = self._ids.next()
        answers = PullAnswers(self.peer, conn.decoder, sink, request_id=request_id, expected=len(addresses))

        def on_event(item: p.Event) -> None:
            message = answers.take(item)
            if message is not None:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer a Pull")

        conn.on_event = on_event
        conn.write_frame(p.encode(p.Pull(addresses, self.max_payload), request_id))
        try:
            await conn.wait(lambda: answers.complete)
        except PeerGone:
            raise PeerGone(f"{self.peer} closed the lane with {len(addresses) - answers.answered} of "
                           f"{len(addresses)} entries unanswered") from None
        if conn.decoder.buffered or conn.decoder.payload_remaining:
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent more than the answer")
