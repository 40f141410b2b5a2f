"""The bulk lane's server: accepts lanes, proves who calls, answers their pulls and Locates.

Anyone who reaches the port can open TCP connections to it, so what a sender without a
certificate can make this server hold is bounded before any handshake work is done, with the
QUIC side's rules and table (kvcached.peers.handshakes, docs/security.md):

1. A connection is accepted raw (no TLS yet) and admitted by a :class:`HandshakeTable`: at most
   ``max_handshakes`` connections in handshake in all and ``max_handshakes_per_source`` from one
   source (an IPv4 address, an IPv6 /64). One over its source's share is reset at once; when the
   table is full the oldest handshake is reset to make room (a real peer's handshake lasts a
   round trip or two, so keeping one out takes refilling the whole table faster than that).
2. Only then does the handshake run: TLS 1.3 over the accepted connection (``start_tls``, client
   certificates required, checked by :class:`~kvcached.peers.tls.PeerAuth` as on QUIC) or the
   ``mac`` hello/challenge/proof. A connection that has not proved itself within
   ``handshake_timeout_s`` of its accept is reset.
3. Only a verified lane takes one of the ``max_lanes`` places: strangers holding connections
   open cannot push peers' lanes to QUIC.
4. Every connection is disposed of when it ends (:meth:`LaneConnection.dispose`), so its memory
   goes back when it does, not at the next full garbage collection.

Then each verified lane is served one request at a time (Pulls and Locates: the module
docstring of kvcached.peers.lane), its answers written by :class:`_Sender`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

from kvcached.codecs import Codec, CodecError, codec_coded
from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.handshakes import DISPLACED, FULL, TIMEOUT, HandshakeLimits, HandshakeTable, source_of
from kvcached.peers.lane import LANE_MODES, WRITE_HIGH, LaneConnection, peer_certificate, server_context
from kvcached.peers.session import REQUEST_BODY, PeerGone, PeerHandler, take_request
from kvcached.peers.tls import PeerAuth, PeerRefused

__all__ = ["LaneCounters", "LaneServer", "MAX_LANES"]

log = logging.getLogger("kvcached.peers")

MAX_LANES = 256                # verified lanes at once, by default ([quic] lane_max_connections)
WRITE_BATCH = 1 << 20          # answers are handed to the transport in batches of about this
IDLE_S = 300.0                 # a lane that sent no request this long is closed
MAX_QUEUED_REQUESTS = 4        # a lane with this many requests unanswered is not read from
BACKLOG = 1024                 # the listen queue: a flood of connects must not crowd peers' out of it
ACCEPT_PAUSE_S = 1.0           # accepting pauses this long after an error (out of file descriptors)
REFUSAL_LOG_S = 10.0           # refused handshakes are logged at most once this often (a flood would flood the log)
# A lane carries pulls (any tenant's) and Locates; the rest goes over QUIC.
_LANE_REQUESTS = frozenset({p.Pull.TYPE, p.TenantPull.TYPE, p.CodedPull.TYPE, p.Locate.TYPE})


@dataclass
class LaneCounters:
    refused: int = 0           # handshakes that failed their proof (certificate, name, TLS, mac key)
    bad_seals: int = 0         # mac lanes ended for a frame whose seal was missing or wrong
    stalled: int = 0           # answers given up: the client stopped reading for STALL_S
    served_pulls: int = 0      # pulls answered over lanes
    coded_blocks: int = 0      # blocks sent coded (answering CodedPulls)
    coded_saved_bytes: int = 0 # bytes that coding kept off the wire


class LaneServer:
    """Accepts lanes from peers and answers their pulls through ``handler`` (the peer tier).
    ``mac`` mode needs ``keys``: the grants the QUIC side made (kvcached.peers.lane_mac).
    ``limits``: the handshake bounds (the [quic] keys, applied to this server's own table);
    ``max_lanes``: verified lanes at once. ``table.refused`` counts connections refused and
    handshakes dropped by reason; ``counters.refused`` the handshakes whose proof failed."""

    def __init__(self, auth: PeerAuth, handler: PeerHandler, *, mode: str = "tls", keys: m.LaneKeys | None = None,
                 limits: HandshakeLimits = HandshakeLimits(), max_lanes: int = MAX_LANES) -> None:
        if mode not in LANE_MODES or (mode == "mac") != (keys is not None):
            raise ValueError(f"a lane server runs mode tls, or mac with keys; not {mode!r}")
        self.auth, self.handler, self.mode, self.keys = auth, handler, mode, keys
        self.limits, self.max_lanes = limits, max_lanes
        # Every lane connection is validated (TCP proved the address); verified lanes are capped
        # apart (max_lanes), so the table's own cap on all connections never binds before them.
        self.table = HandshakeTable(dataclasses.replace(limits, max_connections=limits.max_handshakes + max_lanes))
        self.counters = LaneCounters()
        self._context = server_context(auth) if mode == "tls" else None
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._lanes: set[LaneConnection] = set()       # verified
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusals = _RefusalLog()

    @property
    def handshakes(self) -> int:
        """Connections in handshake now."""
        return self.table.handshaking

    @property
    def lanes(self) -> int:
        """Verified lanes now."""
        return len(self._lanes)

    async def start(self, host: str, port: int, fd: int | None = None) -> None:
        """Listen on TCP ``host``:``port`` (the QUIC port's number). OSError if it is taken.
        With ``fd``: accept on that listening socket (a predecessor's, kvcached.lifecycle.handover)."""
        if fd is not None:
            listener = socket.socket(fileno=fd)
        else:
            family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            listener = socket.socket(family, kind, proto)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(address)
                listener.listen(BACKLOG)
            except OSError:
                listener.close()
                raise
        listener.setblocking(False)
        self._listener = listener
        self._acceptor = asyncio.ensure_future(self._accept())

    @property
    def listening_fd(self) -> int:
        assert self._listener is not None
        return self._listener.fileno()

    async def stop(self) -> None:
        if self._listener is None:
            return
        if self._acceptor is not None:
            self._acceptor.cancel()
            await asyncio.gather(self._acceptor, return_exceptions=True)
        self._listener.close()
        self._listener = None
        for conn in list(self._lanes):
            conn.abandon()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self) -> None:
        """Accept connections until stopped. Running out of file descriptors (or another accept
        error) pauses accepting for a second, as asyncio's own servers do, and is logged."""
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, address = await loop.sock_accept(self._listener)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                self._refusals.note("server", self.mode, f"accept failed: {exc}")
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            self._admit(sock, address, loop.time())

    def _admit(self, sock: socket.socket, address: Any, now: float) -> None:
        """A TCP connection came in: admitted to the handshake table (its handshake then runs in
        a task of its own), or reset at once. Handshakes the table gives up for it are
        cancelled, each freeing what it held."""
        source = source_of(address) if isinstance(address, tuple) else "unknown"
        refused, victims = self.table.admit(source, validated=True)
        if refused is not None:
            _reset(sock)
            return
        for victim in victims:              # the table's keys are this server's handshake tasks
            self.table.drop(victim, DISPLACED)
            cast("asyncio.Task[None]", victim).cancel()
        task = asyncio.ensure_future(self._serve(sock))
        self.table.add(task, source, True, now)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        conn = LaneConnection(st.FrameDecoder(max_body=REQUEST_BODY, max_payload=1), framed=False)
        try:
            who = await self._authenticate(sock, conn, task)
            if who is None:
                return
            if len(self._lanes) >= self.max_lanes:
                self.table.drop(task, FULL)
                self._refusals.note("server", self.mode, f"{self.max_lanes} lanes open already")
                return
            self.table.verified(task)
            self._lanes.add(conn)
            await self._serve_requests(conn, *who)
        except asyncio.CancelledError:
            if self._listener is not None:       # displaced by a newer handshake: this task's end, quietly
                return
            raise                                # the server stops
        finally:
            self._lanes.discard(conn)
            self.table.closed(task)
            self._close(conn)                    # the socket is the transport's from its handshake's start

    async def _authenticate(self, sock: socket.socket, conn: LaneConnection,
                            key: Any) -> tuple[str, bytes] | None:
        """The peer of a new lane and its key id (``mac``), or None: refused (counted, logged
        within REFUSAL_LOG_S), timed out (counted by the table) or gone (neither)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.handshake_timeout_s):
                if self._context is None:
                    await loop.connect_accepted_socket(lambda: conn, sock)
                    return await self._mac_handshake(conn)
                # The TLS handshake runs before the connection is handed to ``conn``.
                await loop.connect_accepted_socket(lambda: conn, sock, ssl=self._context,
                                                   ssl_handshake_timeout=2 * self.limits.handshake_timeout_s)
                return self.auth.check_client(peer_certificate(conn.transport), []), b""
        except TimeoutError:
            self.table.drop(key, TIMEOUT)
        except (PeerRefused, m.MacRefused, ssl.SSLError, ValueError) as exc:
            self.counters.refused += 1
            self._refusals.note("server", self.mode, str(exc))
        except (ConnectionError, OSError, PeerGone):
            pass                   # gone before proving anything: not served, not counted
        conn.abandon()
        return None

    async def _mac_handshake(self, conn: LaneConnection) -> tuple[str, bytes]:
        assert self.keys is not None
        handshake = m.ServerHandshake(self.keys)
        hello = await conn.read_raw(m.HELLO.size)
        conn.send(handshake.hello(hello))
        peer, secrets = handshake.proof(await conn.read_raw(m.PROOF.size))
        conn.opener = m.Opener(secrets.connection_key, m.CLIENT_TO_SERVER)
        conn.sealer = m.Sealer(secrets.connection_key, m.SERVER_TO_CLIENT)
        return peer, handshake.key_id

    async def _serve_requests(self, conn: LaneConnection, peer: str, key_id: bytes) -> None:
        """A verified lane's requests, one at a time, until it closes, breaks, idles IDLE_S or
        (``mac``) the QUIC session that granted its key ends."""
        requests: deque[p.Frame] = deque()

        def on_event(item: st.Event) -> None:
            if not isinstance(item, p.Frame):
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Block or Blocks frame sent as a request", fatal=True)
            requests.append(item)
            if len(requests) >= MAX_QUEUED_REQUESTS and conn.transport is not None:
                conn.transport.pause_reading()

        assert conn.transport is not None
        conn.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
        conn.on_event = on_event
        conn.start_framing()           # what came after the handshake is the first request
        try:
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
        except (p.ProtocolError, m.MacRefused):
            pass                           # the connection's error: answered or counted when it is closed
        except asyncio.TimeoutError:
            if conn.stalled:
                self.counters.stalled += 1     # not reading its answers (STALL_S); idle lanes end quietly
        except (ConnectionError, OSError, PeerGone):
            pass                           # gone (ssl.SSLError is an OSError)

    def _close(self, conn: LaneConnection) -> None:
        """End ``conn``: a protocol error is answered first (an Error frame), a bad seal counted;
        then it is closed and disposed of."""
        error, transport = conn.error, conn.transport
        if isinstance(error, m.MacRefused):
            self.counters.bad_seals += 1
            log.warning("lane frame refused", extra={"fields": {"side": "server", "reason": str(error)}})
        elif (isinstance(error, p.ProtocolError) and not conn.closed.done() and transport is not None
              and not transport.is_closing()):
            transport.write(conn.sealed(p.encode(p.Error(error.code, str(error)), error.request_id or 0)))
        if transport is not None:
            transport.close()      # what was written (an Error) goes out first
        conn.dispose()

    async def _request(self, peer: str, conn: LaneConnection, frame: p.Frame) -> None:
        try:
            message = take_request(frame, carries=_LANE_REQUESTS, where="a lane")
        except p.ProtocolError as exc:
            conn.write_frame(p.encode(p.Error(exc.code, str(exc)), frame.request_id))
            return
        if isinstance(message, p.Locate):
            conn.write_frame(p.encode(self.handler.answer_locate(peer, message), frame.request_id))
            return
        assert isinstance(message, (p.Pull, p.TenantPull, p.CodedPull))
        self.counters.served_pulls += 1
        codec = _link_codec(message.codec) if isinstance(message, p.CodedPull) else None
        # Pinned and sent a part at a time: the first payloads are on their way (the puller
        # reading and checking them) while the next part is pinned (and coded).
        sender = _Sender(conn)
        try:
            rows = message.addresses
            for at in range(0, len(rows), SERVE_PART):
                answers = await self.handler.pull(peer, message.part(rows[at:at + SERVE_PART]))
                await self._send_part(sender, answers, codec, frame.request_id)
            await sender.finish()
        finally:
            sender.close()

    async def _send_part(self, sender: "_Sender", answers: Sequence[Answer], codec: Codec | None,
                         request_id: int) -> None:
        """A part's answers handed to ``sender``. Coded, a run of CODE_RUN at a time: the next
        run is coded while the last one goes out. Whatever fails, every block of the part not
        handed to the sender is unpinned (what it holds, :meth:`_Sender.close` unpins)."""
        runs = [list(answers)] if codec is None else [list(answers[i:i + CODE_RUN])
                                                      for i in range(0, len(answers), CODE_RUN)]
        sent = 0
        try:
            for k in range(len(runs)):
                if codec is not None:
                    runs[k] = await _coded(runs[k], codec, self.counters)
                pieces = _answer_pieces(runs[k], request_id, sender.conn.sealed, coded=codec is not None)
                sent = k + 1                     # the sender holds this run's pins from here
                await sender.send(pieces)
        except BaseException:                    # a head that cannot be encoded, the lane gone: unpin the rest
            for run in runs[sent:]:
                for answer in run:
                    if not isinstance(answer, p.Miss):
                        answer[2]()
            raise


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
        if conn.gone:
            raise conn.failure()
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
LINK_MARGIN = 0.05             # a block coding shrinks by less than this goes raw: not worth the puller's decode
CODE_RUN = 4                   # blocks of a coded pull coded at once (on worker threads), sent as the next are coded

Answer = tuple[p.Block, "memoryview | bytes", Callable[[], None]] | p.Miss


def _link_codec(code: int) -> Codec | None:
    """The codec a CodedPull asks for; None where this daemon does not know it: the pull is then
    answered as a Pull is (Blocks frames, every block raw), which the puller takes as well."""
    try:
        return codec_coded(code)
    except CodecError:
        return None


def _encoded(codec: Codec, payload: memoryview | bytes) -> bytes | None:
    """A worker thread's part of a coded answer: the payload's coded form, or None to send it raw."""
    try:
        return codec.encode(memoryview(payload), LINK_MARGIN)
    except Exception:            # a codec that cannot take this payload: it goes raw, as one that does not pay
        return None


async def _coded(answers: Sequence[Answer], codec: Codec, counters: LaneCounters) -> list[Answer]:
    """A run of a CodedPull's answers (CODE_RUN at most), each block coded on a worker thread
    (the whole run at once) where that shrinks it, and unpinned as soon as its coded copy is made (a raw one stays
    pinned until sent). The threads read pinned blocks: a cancel waits for them before the
    caller unpins anything."""
    loop = asyncio.get_running_loop()
    blocks = [answer for answer in answers if not isinstance(answer, p.Miss)]
    jobs = asyncio.gather(*(loop.run_in_executor(None, _encoded, codec, payload) for _, payload, _ in blocks))
    try:
        coded = iter(await asyncio.shield(jobs))
    except asyncio.CancelledError:
        await asyncio.gather(jobs, return_exceptions=True)
        raise
    out: list[Answer] = []
    for answer in answers:
        if isinstance(answer, p.Miss):
            out.append(answer)
            continue
        form = next(coded)
        head, payload, release = answer
        if form is None:
            out.append(answer)
            continue
        release()
        counters.coded_blocks += 1
        counters.coded_saved_bytes += head.payload_length - len(form)
        out.append((dataclasses.replace(head, codec=codec.code, wire_length=len(form)), form, _nothing))
    return out


def _nothing() -> None:
    pass


def _answer_pieces(answers: Sequence[Answer], request_id: int, sealed: Callable[[bytes], bytes], *,
                   coded: bool = False) -> list[tuple[bytes | memoryview, Callable[[], None] | None]]:
    """A part of a Pull's answers (SERVE_PART entries at most, so a Blocks frame's body stays
    small) as the bytes that go on the lane, in order: each run of blocks served as one Blocks
    frame (``coded``: a CodedBlocks frame; ``sealed``: after its Seal on a ``mac`` lane) and then
    their payloads, each with the release that unpins it; each Miss as its own frame."""
    pieces: list[tuple[bytes | memoryview, Callable[[], None] | None]] = []
    run: list[tuple[p.Block, memoryview | bytes, Callable[[], None]]] = []
    frame = p.CodedBlocks if coded else p.Blocks

    def end_run() -> None:
        if run:
            pieces.append((sealed(p.encode(frame([head for head, _, _ in run]), request_id)), None))
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




def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0): nothing lingers, on either side, in TIME_WAIT."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _RefusalLog:
    """Refused handshakes, logged the first time and then at most once every REFUSAL_LOG_S with
    how many went unlogged meanwhile: a stranger's flood must not flood the log (the counters
    have every one)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        self.next_at = 0.0
        self.unlogged = 0

    def note(self, side: str, mode: str, reason: str) -> None:
        now = self.clock() if self.clock is not None else asyncio.get_running_loop().time()
        if now < self.next_at:
            self.unlogged += 1
            return
        log.warning("lane refused", extra={"fields": {"side": side, "mode": mode, "reason": reason,
                                                      "not_logged_since": self.unlogged}})
        self.next_at, self.unlogged = now + REFUSAL_LOG_S, 0
