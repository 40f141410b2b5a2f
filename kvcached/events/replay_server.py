"""The replay endpoint: a ZMQ ROUTER that answers replay requests from the event log (a thin
layer over kvcached.events.replay, which decides everything).

:meth:`ReplayServer.pump` runs on the event loop, often while answers are under way: it counts
connections and whose they are (the socket's monitor; the kernel's credentials of an ipc peer),
admits or refuses each new one at its handshake (ZAP, the ZeroMQ authentication protocol, with
the NULL mechanism: no secret, a decision per connection), takes new requests, and goes on with
each answer as far as its client's queue allows. Every send is non-blocking and shares the log's bytes (zero-copy).
When what clients may hold passes the budget, the endpoint is reset: the socket is closed,
which frees every message libzmq kept for any client, gone or not, and bound again at once (an
ipc path is renamed into place; a TCP port is retried at each pump until the kernel gives it
back). Clients then connect again by themselves and ask again.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcached.events.endpoints import Bound, bind, unbind
from kvcached.events.replay import CLIENT_HWM, COPY_BELOW, ReplayAnswers
from kvcached.events.stream import EventLog
from kvcached.host.logs import fields

__all__ = ["REQUEST_BYTES", "ReplayServer"]

log = logging.getLogger("kvcached.events")

REQUEST_BYTES = 64          # larger request frames are refused by ZMQ itself (that client is dropped)
REQUESTS_PER_PUMP = 256     # requests taken per pump; more wait in ZMQ's queue (a few per client)
MESSAGES_PER_PUMP = 4096    # messages sent per pump, all answers together
RESET_EVERY_S = 1.0         # at most one reset a second
ZAP_ENDPOINT = "inproc://zeromq.zap.01"     # where libzmq asks about each handshake (RFC 27)
ZAP_DOMAIN = b"kvcached-replay"
_PEERCRED = struct.Struct("3i")


class ReplayServer:
    """The replay endpoint of one stream over ``log``: ``budget`` bytes at most held for its
    clients (kvcached.events.replay.ReplayAnswers.held_bytes)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, key: str, log_: EventLog, *,
                 budget: int, admit: tuple[list[int], list[int]] | None = None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.key = key
        self.admit = admit
        self.budget = budget
        self.answers = ReplayAnswers(log_, budget=budget)
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._zap: zmq.Socket[bytes] | None = None
        self._bound: Bound = None
        self._last_reset = 0.0
        self.down_since: float | None = None      # a reset's bind not done yet (a TCP port not given back)

    def open(self) -> None:
        """Bind (OSError saying why it cannot be)."""
        if self._zap is None:
            zap = self.ctx.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
            self._zap = zap
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)       # with NULL security: a ZAP request per handshake
        sock.copy_threshold = COPY_BELOW              # zero-copy sends share the log's batches
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)
        sock.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        sock.setsockopt(zmq.RCVHWM, 4)                # requests queued per client
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a full client raises EAGAIN, a gone one EHOSTUNREACH
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            self._bound = bind(sock, self.endpoint, self.key, self.admit)
        except BaseException:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self._sock, self._monitor = sock, monitor
        self.down_since = None

    def close(self, *, unbind_path: bool = True) -> None:
        """Close the socket (what libzmq held for clients is freed); ``unbind_path``: remove an
        ipc path too (a reset leaves it: the next bind renames a new socket over it)."""
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sock = self._monitor = None
        if unbind_path and self._zap is not None:
            self._zap.close(linger=0)
            self._zap = None
        if unbind_path:
            unbind(self._bound)
        self._bound = None

    @property
    def busy(self) -> bool:
        """Answers are under way: pump often."""
        return self.answers.under_way > 0

    def pump(self, now: float | None = None) -> None:
        """Count connections, take requests, go on with the answers; reset past the budget."""
        now = time.monotonic() if now is None else now
        if self._sock is None:
            if self.down_since is not None:
                self._reopen(now)
            return
        self._count_connections()
        self._admit()
        self._take_requests(now)
        self._answer(now)
        if self.answers.over_budget and now - self._last_reset >= RESET_EVERY_S:
            self._reset(now)

    def _count_connections(self) -> None:
        monitor, answers = self._monitor, self.answers
        assert monitor is not None
        for _ in range(10_000):
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                answers.accepted(int(event["value"]), _peer_of(int(event["value"])))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                answers.disconnected(int(event["value"]))

    def _admit(self) -> None:
        """Answer libzmq's ZAP requests: each new connection stays or is refused (RFC 27)."""
        zap = self._zap
        assert zap is not None
        for _ in range(10_000):
            try:
                request = zap.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) < 4:
                continue
            version, request_id, address = request[0], request[1], request[3].decode("ascii", "replace")
            ok = self.answers.admits(_zap_peer(address))
            zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                b"OK" if ok else b"too many replay connections", b"", b""])

    def _take_requests(self, now: float) -> None:
        sock, answers = self._sock, self.answers
        assert sock is not None
        for _ in range(REQUESTS_PER_PUMP):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:     # cheaper than a recv that raises
                return
            try:
                request = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) < 2:
                continue
            identity, rest = request[0], request[1:]
            if rest and rest[0] == b"":          # a REQ or DEALER client's empty delimiter
                rest = rest[1:]
            refusal = answers.ask(identity, rest, now)
            if refusal is not None and self._send(identity, refusal):
                answers.queued(identity, -1)

    def _answer(self, now: float) -> None:
        answers = self.answers
        budget = MESSAGES_PER_PUMP
        for answer in answers.due(now):
            while budget > 0:
                seq, frames = answers.next_message(answer)
                try:
                    self._send_shared(answer.identity, frames)
                except zmq.Again:                    # its queue is full: later, or cut once stalled
                    answers.blocked(answer, now)
                    break
                except zmq.ZMQError:                 # it left (EHOSTUNREACH)
                    answers.end(answer.identity)
                    break
                budget -= 1
                answers.sent(answer, seq, now)
                if seq < 0:
                    break
            if budget <= 0:
                return

    def _send_shared(self, identity: bytes, frames: tuple[bytes, bytes, bytes]) -> None:
        """One answer message: the identity and small frames copied (libzmq keeps frames of up
        to 33 bytes inline), the payload shared with the log. Zmq.Again (the client's queue is
        full) or ZMQError (it left) come from the identity frame, before anything is queued."""
        sock = self._sock
        assert sock is not None
        topic, seq, payload = frames
        sock.send(identity, zmq.SNDMORE | zmq.NOBLOCK)
        sock.send(b"", zmq.SNDMORE)
        sock.send(topic, zmq.SNDMORE)
        sock.send(seq, zmq.SNDMORE)
        sock.send(payload, copy=False)

    def _send(self, identity: bytes, frames: tuple[bytes, ...]) -> bool:
        try:
            assert self._sock is not None
            self._sock.send_multipart((identity, b"", *frames), flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:      # full or gone: a refusal is not worth waiting for
            return False

    def _reset(self, now: float) -> None:
        held = self.answers.held_bytes
        self._last_reset = now
        self.close(unbind_path=False)
        self.answers.reset()
        log.warning("KV events: the replay endpoint was reset to free what its clients held", extra=fields(
            endpoint=self.endpoint, held_bytes=held, budget_bytes=self.budget))
        self.down_since = now
        self._reopen(now)

    def _reopen(self, now: float) -> None:
        try:
            self.open()
        except OSError as exc:        # a TCP port not given back yet: the next pump tries again
            if now - (self.down_since or now) > 10.0:
                log.warning("KV events: the replay endpoint cannot be bound again", extra=fields(
                    endpoint=self.endpoint, error=str(exc)))
                self.down_since = now


def _peer_of(fd: int) -> str:
    """Whose the connection on ``fd`` is: ``uid:N`` on a Unix socket (the kernel's word), else
    the peer's address. Read as its ACCEPTED event is handled: should the descriptor be another
    connection's by then, :meth:`ReplayAnswers.accepted` of that one sets it right."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return "?"
    try:
        if sock.family == socket.AF_UNIX:
            return f"uid:{_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]}"
        return str(sock.getpeername()[0])
    except OSError:
        return "?"
    finally:
        sock.detach()


def _zap_peer(address: str) -> str:
    """The peer a ZAP request names: libzmq writes ``localhost:UID:GID:PID`` for an ipc peer,
    the address for TCP (the same keys as :func:`_peer_of`)."""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost":
        return f"uid:{parts[1]}"
    return address
