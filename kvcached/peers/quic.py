"""The peer protocol over QUIC (aioquic): a thin asyncio layer under the sans-I/O codec.

One connection per peer and direction: a daemon dials each configured peer (its
:class:`PeerClient`: the pulls it makes and the announcements it sends) and answers every
peer that dials it (:class:`PeerServer`: the pulls it serves and the announcements it hears).
Each request is one bidirectional stream, so many pulls are in flight at once and a slow one
holds up no other; the announcements of one connection share one long-lived stream, in order.

Mutual TLS is checked here, at the handshake (tls.py says why aioquic needs help): the server
asks for a client certificate, checks its chain and name when the handshake completes and
closes the connection otherwise; a client checks the server it dialled the same way. Data that
arrives before the handshake completes is 0-RTT early data of a resumed connection: only Pull
and Exists are acted on (protocol.EARLY_DATA_TYPES); anything else is answered Error EARLY_DATA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.lane_mac import LaneKeys
from kvcached.peers.nixl_holder import NixlHolder
from kvcached.peers.session import REQUEST_BODY, PeerGone, PeerHandler, PullAnswers, PullSink, RequestIds, SendRoom, take_request
from kvcached.peers.tls import PeerAuth, PeerRefused, ServerTickets

__all__ = ["PeerServerProtocol", "PeerClientProtocol", "REFUSED", "REQUEST_BODY", "PeerGone", "PeerHandler",
           "PullAnswers", "PullSink"]

# A coded pull goes over a lane only (its codec work is the lane server's): QUIC carries the rest.
_QUIC_REQUESTS = p.REQUESTS - {p.CodedPull.TYPE}

log = logging.getLogger("kvcached.peers")

REFUSED = 0x101          # application close code: mutual TLS failed (the reason phrase says why)
SEND_QUEUE_BYTES = 8 << 20   # per connection: answer bytes handed to aioquic and not yet sent
SEND_STALL_S = 30.0          # an answer whose queue has not moved this long is given up (stream reset)
STALLED = 0x102              # stream reset code: the peer stopped reading an answer


def _close(quic: QuicConnection, reason: str) -> None:
    quic.close(error_code=REFUSED, reason_phrase=reason[:200])


class PeerServerProtocol(QuicConnectionProtocol):
    """One connection a peer dialled. Knows the peer only once it is verified (or resumed a
    ticket bound to a verified peer): until then nothing it sends is read."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *, auth: PeerAuth,
                 tickets: ServerTickets, handler: PeerHandler, lane_keys: LaneKeys | None = None,
                 nixl: NixlHolder | None = None) -> None:
        super().__init__(quic, stream_handler)
        self.auth, self.tickets, self.handler, self.lane_keys, self.nixl = auth, tickets, handler, lane_keys, nixl
        self.peer: str | None = None
        self.verified = False
        self._issued: SessionTicket | None = None
        self._decoders: dict[int, st.FrameDecoder] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.room = SendRoom(SEND_QUEUE_BYTES, SEND_STALL_S, time.monotonic)
        self.stalled = 0                       # answers given up because the peer stopped reading
        self._written: dict[int, int] = {}     # stream being answered -> bytes handed to aioquic
        self._room = asyncio.Event()           # set when queued bytes may have gone down
        self._stopped: set[int] = set()        # answers the peer asked us to stop sending
        self._gone = False
        self.on_verified: Callable[[], None] = lambda: None   # the server's handshake table listens
        initialize = quic._initialize  # noqa: SLF001 (aioquic: no public API)

        def ask_for_certificate(peer_cid: bytes) -> None:   # aioquic asks only with this flag
            initialize(peer_cid)
            quic.tls._request_client_certificate = True  # noqa: SLF001 (aioquic: no public API)

        quic._initialize = ask_for_certificate  # type: ignore[method-assign]  # noqa: SLF001 (aioquic: no public API)
        quic._session_ticket_fetcher = self._fetch_ticket  # noqa: SLF001 (aioquic: no public API)
        quic._session_ticket_handler = self._ticket_issued  # noqa: SLF001 (aioquic: no public API)

    def _fetch_ticket(self, label: bytes) -> SessionTicket | None:
        entry = self.tickets.take(label)
        if entry is None or entry[1] not in self.auth.peer_names:   # a peer no longer listed: a full handshake
            return None
        self.peer = entry[1]
        # A resumed handshake carries no certificate: aioquic would wait for one it never asked
        # for and kill the connection. The ticket stands for the verified peer instead.
        self._quic.tls._request_client_certificate = False  # noqa: SLF001 (aioquic: no public API)
        return entry[0]

    def _ticket_issued(self, ticket: SessionTicket) -> None:
        self._issued = ticket           # bound once this connection's peer is verified

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self._data(event)
        elif isinstance(event, events.HandshakeCompleted):
            self._handshake(event)
        elif isinstance(event, events.StreamReset):
            self._decoders.pop(event.stream_id, None)
        elif isinstance(event, events.StopSendingReceived):
            if event.stream_id in self._written:
                self._stopped.add(event.stream_id)
                self._room.set()
        elif isinstance(event, events.ConnectionTerminated):
            self._gone = True          # pulls being answered stop and unpin what they hold
            self._room.set()
            if self.lane_keys is not None:
                self.lane_keys.revoke(self)     # lane keys live as long as the session that granted them
            if self.nixl is not None:
                self.nixl.session_ended(self)   # so do the NIXL leases granted over it

    def transmit(self) -> None:
        super().transmit()
        if self._written:                # what was queued may have gone out: answers waiting for room go on
            self._room.set()

    def _queued(self) -> int:
        """Answer bytes handed to aioquic and not yet sent, over every stream being answered.
        Reads the streams' highest sent offset (aioquic has no public call for it); a sent byte
        waits in aioquic's buffer only until it is acknowledged, which the congestion window bounds."""
        streams = self._quic._streams  # noqa: SLF001 (aioquic: no public API)
        return sum(written - (streams[sid].sender.highest_offset if sid in streams else written)
                   for sid, written in self._written.items())

    @property
    def peak_queued(self) -> int:
        """The most answer bytes ever queued and not yet sent on this connection."""
        return self.room.peak

    async def _wait_for_room(self, sid: int, need: int) -> bool:
        """Wait until ``need`` more bytes fit in the send queue (session.SendRoom decides).
        False if the answer is to stop: the connection ended, the peer sent STOP_SENDING, or
        the queue did not go down for SEND_STALL_S (the stream is then reset, so a peer that
        stops reading cannot keep blocks pinned)."""
        room = self.room
        while not (self._gone or sid in self._stopped):
            if room.fits(self._queued(), need):
                return True
            self.transmit()              # send what the queue holds before waiting for it to go out
            if room.moved(self._queued()):
                continue
            if room.stalled():
                log.warning("peer stopped reading an answer; giving it up",
                            extra={"fields": {"peer": self.peer, "stream": sid, "queued": self._queued()}})
                self.stalled += 1
                self._quic.reset_stream(sid, STALLED)
                self.transmit()
                return False
            self._room.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._room.wait(), room.wait_s())
        return False

    def _handshake(self, event: events.HandshakeCompleted) -> None:
        if not event.session_resumed:
            tls = self._quic.tls
            try:
                self.peer = self.auth.check_client(tls._peer_certificate, tls._peer_certificate_chain)  # noqa: SLF001 (aioquic: no public API)
            except PeerRefused as exc:
                log.warning("peer refused", extra={"fields": {"side": "server", "reason": str(exc),
                                                              "address": str(self._quic._network_paths[0].addr)  # noqa: SLF001 (aioquic: no public API)
                                                              if self._quic._network_paths else ""}})  # noqa: SLF001 (aioquic: no public API)
                self.peer = None
                _close(self._quic, str(exc))
                return
        if self.peer is None:            # resumed without a ticket we bound: cannot happen, refuse all the same
            _close(self._quic, "resumed session of an unknown peer")
            return
        self.verified = True
        self.on_verified()
        if self._issued is not None:
            self.tickets.bind(self._issued, self.peer)
            self._issued = None
        self.handler.connected(self.peer)

    def _data(self, event: events.StreamDataReceived) -> None:
        peer = self.peer
        if peer is None:
            return
        sid = event.stream_id
        decoder = self._decoders.get(sid)
        if decoder is None:
            decoder = self._decoders[sid] = st.FrameDecoder(max_body=REQUEST_BODY, max_payload=1)
        decoder.feed(event.data)
        try:
            for item in decoder:
                if isinstance(item, p.Frame):
                    self._request(peer, sid, item)
                else:          # a Block or Blocks frame is an answer, never a request
                    raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Block or Blocks frame sent as a request", fatal=True,
                                          request_id=getattr(item, "request_id", 0))
        except p.ProtocolError as exc:
            self._error(sid, exc.request_id or 0, exc.code, str(exc), end=True)
            self._decoders.pop(sid, None)
            return
        if event.end_stream:
            self._decoders.pop(sid, None)

    def _request(self, peer: str, sid: int, frame: p.Frame) -> None:
        try:
            message = take_request(frame, early=not self.verified, carries=_QUIC_REQUESTS, where="QUIC")
        except p.ProtocolError as exc:
            self._error(sid, frame.request_id, exc.code, str(exc))
            return
        if isinstance(message, (p.Pull, p.TenantPull)):
            task = asyncio.ensure_future(self._serve_pull(peer, sid, frame.request_id, message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, p.Exists):
            try:
                answer: p.Message = p.ExistsResult(self.handler.exists(peer, message))
            except Exception as exc:     # a bad layer, an index error: this request fails, not the connection
                answer = p.Error(p.ErrorCode.INVALID_ARGUMENT, str(exc))
            self._send(sid, p.encode(answer, frame.request_id), end=True)
        elif isinstance(message, p.Locate):
            try:
                answer = self.handler.answer_locate(peer, message)
            except Exception as exc:
                log.exception("answering a Locate failed", extra={"fields": {"peer": peer}})
                answer = p.Error(p.ErrorCode.INTERNAL, f"answering the Locate failed: {exc}")
            self._send(sid, p.encode(answer, frame.request_id), end=True)
        elif isinstance(message, (p.Announce, p.Drop, p.Snapshot)):
            self.handler.event(peer, message, frame.request_id)
        elif isinstance(message, (p.NixlOpen, p.NixlPull)) and self.nixl is None:
            self._error(sid, frame.request_id, p.ErrorCode.UNAVAILABLE, "this daemon runs no NIXL lane")
        elif isinstance(message, p.NixlOpen):
            assert self.nixl is not None
            self._send(sid, p.encode(self.nixl.agent(), frame.request_id), end=True)
        elif isinstance(message, p.NixlPull):
            task = asyncio.ensure_future(self._serve_nixl_pull(peer, sid, frame.request_id, message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, p.NixlDone):
            if self.nixl is not None:
                self.nixl.done(peer, message.lease)
        elif isinstance(message, p.LaneOpen):
            if self.lane_keys is None:
                self._error(sid, frame.request_id, p.ErrorCode.UNAVAILABLE, "this daemon runs no mac lane")
            else:
                key_id, key = self.lane_keys.grant(peer, self)
                self._send(sid, p.encode(p.LaneKey(key_id, key), frame.request_id), end=True)

    async def _serve_nixl_pull(self, peer: str, sid: int, request_id: int, request: p.NixlPull) -> None:
        """Answer a NixlPull: the blocks pinned under a lease, where they lie (nixl_holder)."""
        assert self.nixl is not None
        try:
            spans = await self.nixl.pull(peer, self, request)
        except Exception as exc:
            log.exception("serving a NIXL pull failed", extra={"fields": {"peer": peer}})
            self._error(sid, request_id, p.ErrorCode.INTERNAL, f"serving the NIXL pull failed: {exc}", end=True)
            return
        if self._gone:                   # the session ended while the blocks were pinned: so did the lease
            self.nixl.session_ended(self)
            return
        self._send(sid, p.encode(spans, request_id), end=True)

    async def _serve_pull(self, peer: str, sid: int, request_id: int, request: p.AnyPull) -> None:
        """Answer a Pull in order. Payloads are copied into aioquic only as the send queue has
        room (a slow peer cannot make this daemon buffer a whole batch), and every pinned block
        is released whatever happens: sent, the stream reset by the peer, the connection gone."""
        try:
            answers = await self.handler.pull(peer, request)
        except Exception as exc:
            log.exception("serving a pull failed", extra={"fields": {"peer": peer}})
            self._error(sid, request_id, p.ErrorCode.INTERNAL, f"serving the pull failed: {exc}", end=True)
            return
        pending = iter(answers)
        self._written[sid] = 0
        try:
            for answer in pending:
                if isinstance(answer, p.Miss):
                    data: bytes | memoryview = p.encode(answer, request_id)
                    if not await self._wait_for_room(sid, len(data)):
                        return
                    self._quic.send_stream_data(sid, data)  # type: ignore[arg-type]   # aioquic takes any buffer; its hint says bytes
                    self._written[sid] += len(data)
                    continue
                head, payload, release = answer
                try:
                    data = p.encode(head, request_id)
                    if not await self._wait_for_room(sid, len(data) + len(payload)):
                        return
                    self._quic.send_stream_data(sid, data)
                    self._quic.send_stream_data(sid, payload)  # type: ignore[arg-type]   # copied into the stream's buffer (any buffer works)
                    self._written[sid] += len(data) + len(payload)
                finally:
                    release()
            self._quic.send_stream_data(sid, b"", end_stream=True)
        except RuntimeError:             # the peer reset the stream (gave up on this pull)
            return
        finally:
            for rest in pending:         # not sent: unpin
                if not isinstance(rest, p.Miss):
                    rest[2]()
            del self._written[sid]
            self._stopped.discard(sid)
            if not self._gone:
                self.transmit()

    def _error(self, sid: int, request_id: int, code: int, message: str, end: bool = False) -> None:
        self._send(sid, p.encode(p.Error(code, message), request_id), end=end)

    def _send(self, sid: int, data: bytes, end: bool) -> None:
        try:
            self._quic.send_stream_data(sid, data, end_stream=end)
        except Exception:        # the stream was reset or already ended by the peer
            return
        self._transmit_soon()


@dataclass
class _Request:
    sid: int
    answers: PullAnswers
    done: asyncio.Future[Any]
    early: bool = False           # sent as 0-RTT data: may have to go again (_send_early_again)
    data: bytes = b""             # the request's frame, kept while it may have to go again


class PeerClientProtocol(QuicConnectionProtocol):
    """The connection this daemon dialled to one peer: it makes pulls and exists queries, and
    sends this daemon's announcements on one events stream."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *, auth: PeerAuth, peer: str,
                 max_payload: int) -> None:
        super().__init__(quic, stream_handler)
        self.auth, self.peer, self.max_payload = auth, peer, max_payload
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.verified = False
        self.early = False            # resuming with a session ticket: Pull and Exists may go as 0-RTT data
        self.refused: str | None = None
        self._requests: dict[int, _Request] = {}
        self._ids = RequestIds()
        self._events_stream: int | None = None
        self._lane_key: tuple[bytes, bytes] | None = None
        self._closing = False         # close() was called: no new request goes out on it

    # -- handshake and lifetime --

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        """Close the connection; from now on it is not ``usable``, though aioquic reports it
        closed only once the peer answers the close or the drain time passes: a request made in
        between would wait on a connection that can no longer answer."""
        self._closing = True
        super().close(error_code=error_code, reason_phrase=reason_phrase)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self._data(event)
        elif isinstance(event, events.HandshakeCompleted):
            if not event.session_resumed:    # a resumed session has no certificate; the ticket stands for it
                tls = self._quic.tls
                try:
                    self.auth.check_server(tls._peer_certificate, tls._peer_certificate_chain, self.peer)  # noqa: SLF001 (aioquic: no public API)
                except PeerRefused as exc:
                    self.refused = str(exc)
                    log.warning("peer refused", extra={"fields": {"side": "client", "peer": self.peer,
                                                                  "reason": str(exc)}})
                    _close(self._quic, str(exc))
                    self._fail_all(PeerGone(str(exc)))
                    return
            self.verified = True
            if not event.early_data_accepted or self._quic._retry_count:  # noqa: SLF001 (aioquic: no public API)
                self._send_early_again()
            if not self.ready.done():
                self.ready.set_result(None)
        elif isinstance(event, events.StreamReset):
            request = self._requests.pop(event.stream_id, None)
            if request is not None and not request.done.done():
                request.done.set_exception(PeerGone(f"{self.peer} reset the stream (code {event.error_code})"))
        elif isinstance(event, events.ConnectionTerminated):
            reason = event.reason_phrase or f"error code {event.error_code}"
            if event.error_code == REFUSED or (not self.verified and 0x100 <= event.error_code <= 0x1FF):
                self.refused = reason       # the server refused us, or the TLS handshake refused it (an alert)
            self._fail_all(PeerGone(f"connection to {self.peer} ended: {reason}"))

    def _send_early_again(self) -> None:
        """Requests sent as 0-RTT data that the server never took (it refused early data, or a
        Retry restarted the handshake and aioquic forgets what it sent before) go again on new
        streams, now that the handshake is complete."""
        for sid, request in list(self._requests.items()):
            if request.early and not request.done.done():
                del self._requests[sid]
                request.sid, request.early = self._quic.get_next_available_stream_id(), False
                self._requests[request.sid] = request
                self._quic.send_stream_data(request.sid, request.data, end_stream=True)
        self._transmit_soon()

    def _fail_all(self, exc: Exception) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()       # retrieved: nobody may be waiting
        for request in self._requests.values():
            if not request.done.done():
                request.done.set_exception(exc)
        self._requests.clear()

    def forget_pings(self) -> None:
        """Cancel the pings nobody waits for any more (a keep-alive that timed out or was
        cancelled), so the connection's close sets no error that no one retrieves."""
        for waiter in self._ping_waiters.values():
            waiter.cancel()
        self._ping_waiters.clear()

    @property
    def usable(self) -> bool:
        return not (self._closing or self._closed.is_set()) and self.refused is None

    # -- requests --

    def _start(self, message: p.Message, sink: PullSink | None = None) -> _Request:
        if not self.verified and not p.allowed_as_early_data(message.TYPE):
            raise RuntimeError(f"{type(message).__name__} may not be sent before the handshake completes")
        request_id = self._ids.next()
        sid = self._quic.get_next_available_stream_id()
        data = p.encode(message, request_id)
        expected = len(message.addresses) if isinstance(message, (p.Pull, p.TenantPull)) else None
        answers = PullAnswers(self.peer, st.FrameDecoder(max_payload=self.max_payload), sink, request_id=request_id,
                              expected=expected)
        request = _Request(sid, answers,
                           asyncio.get_running_loop().create_future(), early=not self.verified,
                           data=data if not self.verified else b"")
        self._requests[sid] = request
        self._quic.send_stream_data(sid, data, end_stream=True)
        self.transmit()
        return request

    async def exists(self, layer: int, digests: Sequence[bytes]) -> int:
        request = self._start(p.Exists(layer, digests))
        try:
            return int(await request.done)
        finally:
            self._abandon(request)

    async def locate(self, addresses: Sequence[tuple[bytes, int]]) -> list[tuple[str, ...]]:
        """Ask this peer, a home of these blocks, who holds them: per address, in order, the
        members its records name. PeerGone or ProtocolError as for a pull."""
        request = self._start(p.Locate(addresses))
        try:
            located: p.Located = await request.done
        finally:
            self._abandon(request)
        if len(located.holders) != len(addresses):
            raise p.ProtocolError(p.ErrorCode.MALFORMED, f"Located answers {len(located.holders)} of "
                                  f"{len(addresses)} addresses")
        return [tuple(h) for h in located.holders]

    async def lane_key(self) -> tuple[bytes, bytes]:
        """A key for ``mac`` lanes to this peer (kvcached.peers.lane_mac), granted over this
        session and valid while it lasts; asked for once, then kept. ProtocolError if the peer
        runs no mac lane, PeerGone if the connection ends first."""
        if self._lane_key is None:
            request = self._start(p.LaneOpen())
            try:
                key = await request.done
            finally:
                self._abandon(request)
            self._lane_key = (key.key_id, key.key)
        return self._lane_key

    async def nixl_open(self) -> p.NixlAgent:
        """How to read this peer's arena over NIXL (its agent metadata, the arena's base and
        size), asked over this verified session. ProtocolError UNAVAILABLE where the peer runs
        no NIXL lane, PeerGone if the connection ends first."""
        agent: p.NixlAgent = await self._ask(p.NixlOpen(), p.NixlAgent)
        return agent

    async def nixl_pull(self, addresses: Sequence[tuple[bytes, int]], tenant: str = "") -> p.NixlSpans:
        """Where ``tenant``'s blocks at ``addresses`` lie in this peer's arena, pinned there under
        the answer's lease until :meth:`nixl_done` or ``hold_ms``. Errors as for :meth:`nixl_open`."""
        spans: p.NixlSpans = await self._ask(p.NixlPull(addresses, self.max_payload, tenant), p.NixlSpans)
        if len(spans.spans) != len(addresses):
            raise p.ProtocolError(p.ErrorCode.MALFORMED, f"NixlSpans answers {len(spans.spans)} of "
                                  f"{len(addresses)} blocks")
        return spans

    def nixl_done(self, lease: int) -> None:
        """Tell this peer the blocks of ``lease`` are read: it unpins them (no answer)."""
        if lease and self.usable and self.verified:
            sid = self._quic.get_next_available_stream_id()
            self._quic.send_stream_data(sid, p.encode(p.NixlDone(lease)), end_stream=True)
            self._transmit_soon()

    async def _ask(self, message: p.Message, answer: type) -> Any:
        """Send ``message`` and wait for its one answer, which must be an ``answer``."""
        request = self._start(message)
        try:
            got = await request.done
        finally:
            self._abandon(request)
        if not isinstance(got, answer):
            raise p.ProtocolError(p.ErrorCode.MALFORMED, f"{self.peer} ended the stream without a {answer.__name__}")
        return got

    async def pull(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink, tenant: str = "") -> None:
        """Pull ``addresses``, ``tenant``'s blocks; answers go to ``sink`` as they arrive. Returns
        once every entry is answered; PeerGone if the connection or stream ends first,
        ProtocolError if the peer answers with an Error or bytes that do not parse."""
        request = self._start(p.pull_of(addresses, self.max_payload, tenant), sink)
        try:
            await request.done
        finally:
            self._abandon(request)

    def _abandon(self, request: _Request) -> None:
        """Take no more answers for ``request`` (given up: its deadline passed, or it failed):
        from now on nothing is written into the buffers its sink gave, and the peer is asked
        to stop sending."""
        if self._requests.get(request.sid) is request:
            del self._requests[request.sid]
            try:
                self._quic.stop_stream(request.sid, 0)
                self._transmit_soon()
            except Exception:
                pass

    def send_event(self, message: p.Announce | p.Drop | p.Snapshot, request_id: int = 0) -> None:
        """Queue an announcement or snapshot part on the events stream (after the handshake)."""
        if not self.verified:
            raise RuntimeError("announcements wait for the handshake: they change state")
        if self._events_stream is None:
            self._events_stream = self._quic.get_next_available_stream_id()
        self._quic.send_stream_data(self._events_stream, p.encode(message, request_id))
        self._transmit_soon()

    # -- answers --

    def _data(self, event: events.StreamDataReceived) -> None:
        request = self._requests.get(event.stream_id)
        if request is None:
            return
        decoder = request.answers.decoder
        decoder.feed(event.data)
        try:
            for item in decoder:
                self._answer(request, item)
        except Exception as exc:       # a protocol error or a sink that failed: this request fails
            self._requests.pop(event.stream_id, None)
            if not request.done.done():
                request.done.set_exception(exc)
            return
        if event.end_stream:
            self._requests.pop(event.stream_id, None)
            if not request.done.done():
                if decoder.buffered or decoder.payload_remaining:
                    request.done.set_exception(PeerGone(f"{self.peer} ended the answer in the middle of a frame"))
                else:
                    request.done.set_result(None)

    def _answer(self, request: _Request, item: st.Event) -> None:
        message = request.answers.take(item)
        if isinstance(message, p.ExistsResult):
            if not request.done.done():
                request.done.set_result(message.count)
        elif isinstance(message, (p.LaneKey, p.Located, p.NixlAgent, p.NixlSpans)):
            if not request.done.done():
                request.done.set_result(message)
        elif message is not None:
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer this request")
