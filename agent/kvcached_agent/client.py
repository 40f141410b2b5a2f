"""Blocking client of the daemon's agent socket: connect, Hello, requests, events, heartbeats.

Engines call their KV connectors from ordinary worker threads, so this client is synchronous:
one request at a time per client (a lock), each answered by the frame carrying its request id.
Events (pinned, evicted, heartbeat) and releases are sent without waiting; their rare Error
answers are read with the next reply, logged and kept in :attr:`AgentClient.event_errors`.
A background thread sends a heartbeat whenever nothing was sent for one interval, so an idle
engine stays connected and a stopped one is dropped by the daemon.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from typing import Deque

from kvcached_agent import protocol as p

__all__ = ["AgentClient", "AgentError", "ConnectionClosed", "unreachable_reason"]

log = logging.getLogger("kvcached_agent")

_RECV = 1 << 16


class AgentError(Exception):
    """The daemon answered an Error frame (``code`` is a protocol.ErrorCode)."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = p.ErrorCode(code).name
        except ValueError:
            name = str(code)
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message


class ConnectionClosed(AgentError):
    """The daemon closed the connection (or it broke)."""

    def __init__(self, message: str) -> None:
        super().__init__(p.ErrorCode.UNAVAILABLE, message)


def unreachable_reason(path: str, exc: OSError) -> str:
    """Why the agent socket at ``path`` could not be opened, in words an operator can act on: a
    typo in the path reads otherwise as a daemon that is down forever."""
    if isinstance(exc, FileNotFoundError):
        return (f"no socket at {path}: is the daemon running, and is this the path it listens on "
                "(agent.socket in its config)?")
    if isinstance(exc, PermissionError):
        return (f"permission denied opening {path} (this process runs as uid {os.getuid()}, gid {os.getgid()}): "
                "the socket's group and mode decide who may connect (agent.group, agent.mode in the daemon's config)")
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing accepts connections at {path}: the daemon is down or restarting"
    if exc.errno == errno.ENOTSOCK:
        return f"{path} is not a socket"
    return f"{path}: {exc}"


def _what_answered(data: bytes) -> str:
    """A guess at what answered a Hello, from its first bytes (for the error that says the socket
    is not an agent socket)."""
    if data.startswith(b"HTTP/"):
        return "an HTTP server"
    if len(data) >= 9 and data[3] == 0x04 and data[5:9] == bytes(4):     # an HTTP/2 SETTINGS frame on stream 0
        return "an HTTP/2 server, such as the daemon's gRPC socket (grpc.listen)"
    return f"something else: it answered {data[:16].hex()}"


class AgentClient:
    """A connection to the daemon. :attr:`arena_fd` is the RAM arena, :attr:`generations_fd` its
    slab generations where the daemon recycles slabs between tenants, else -1 (both owned by
    this client)."""

    def __init__(self, path: str, hello: p.Hello, *, timeout: float = 60.0, heartbeat: bool = True) -> None:
        self.path = path
        self.timeout = timeout
        self.event_errors: Deque[AgentError] = collections.deque(maxlen=100)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._decoder = p.FrameDecoder()
        self._inbox = bytearray(_RECV)
        self._inview = memoryview(self._inbox)
        self._send_lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._next_id = 1
        self._ignore: set[int] = set()     # request ids whose replies nobody waits for
        self._submitted: set[int] = set()  # request ids sent by submit whose answers answer() will take
        self._answers: dict[int, p.Frame] = {}     # ... those read already (by a reader waiting for another)
        self._last_send = time.monotonic()
        self._closed = False
        self.arena_fd = -1
        self.generations_fd = -1      # the arena's slab generations, where its slabs change tenant (slab_pins)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            self.welcome = self._handshake(hello)
        except BaseException:
            self.close()
            raise
        self.heartbeat_s = self.welcome.heartbeat_ms / 1000
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if heartbeat and self.heartbeat_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, name="kvcached-agent-heartbeat", daemon=True)
            self._heartbeat.start()

    # -- handshake ------------------------------------------------------------------------------

    def _handshake(self, hello: p.Hello) -> p.Welcome:
        self._sock.sendall(p.encode(hello, 0))
        first = b""                 # the answer's first bytes: what answered, if not a daemon
        while True:
            data, fds, _, _ = socket.recv_fds(self._sock, _RECV, 2)
            for fd in fds:
                if self.arena_fd < 0:
                    self.arena_fd = fd
                elif self.generations_fd < 0:
                    self.generations_fd = fd
                else:      # pragma: no cover - the daemon sends two at most
                    os.close(fd)
            if not data:
                raise ConnectionClosed(f"the daemon at {self.path} closed the connection during the handshake")
            first = first or bytes(data[:16])
            self._decoder.feed(data)
            try:
                frame = self._decoder.next_frame()
            except p.ProtocolError as exc:
                # Version 0 was never spoken; a frame of a later version is a real version mismatch.
                if exc.code != p.ErrorCode.UNSUPPORTED_VERSION or first[4] == 0:
                    raise AgentError(p.ErrorCode.HANDSHAKE, f"{self.path} is not a kvcached agent socket (it looks "
                                     f"like {_what_answered(first)}); the agent socket is agent.socket in the "
                                     "daemon's config") from exc
                raise
            if frame is None:
                continue
            message = p.decode(frame)
            if isinstance(message, p.Error):
                raise AgentError(message.code, message.message)
            if not isinstance(message, p.Welcome):
                raise AgentError(p.ErrorCode.HANDSHAKE, f"expected Welcome, got {type(message).__name__}")
            if self.arena_fd < 0:
                raise AgentError(p.ErrorCode.HANDSHAKE, "the Welcome came without the arena's file descriptor")
            return message

    # -- requests -------------------------------------------------------------------------------

    def call(self, message: p.Message) -> p.Message:
        """Send a request and return its answer; an Error answer raises AgentError."""
        with self._call_lock:
            return self._await(self._send(message))

    def submit(self, message: p.Message) -> int:
        """Send a request and return its id, whose answer :meth:`answer` takes later: requests in
        flight together (kvcached_agent.transfer asks for the next chunk's slots while it copies
        this one's). Each id submitted must be answered once, in any order."""
        with self._send_lock:
            request_id = self._next_id
            self._submitted.add(request_id)     # before it is sent: a reader in another thread keeps its answer
            try:
                sent = self._send_locked(message)
            except BaseException:
                self._submitted.discard(request_id)
                raise
        assert sent == request_id
        return request_id

    def answer(self, request_id: int) -> p.Message:
        """The answer to a request :meth:`submit` sent (waiting for it if not read yet); an Error
        answer raises AgentError."""
        with self._call_lock:
            return self._await(request_id)

    def _await(self, request_id: int) -> p.Message:
        """Read frames until ``request_id``'s answer (one read before is taken from those kept);
        answers to other submitted requests are kept, the rest are strays. Under the call lock."""
        frame = self._answers.pop(request_id, None)
        try:
            while frame is None:
                read = self._read_frame()
                if read.request_id == request_id:
                    frame = read
                elif read.request_id in self._submitted:
                    self._answers[read.request_id] = read
                else:
                    self._stray(read)
        finally:
            self._submitted.discard(request_id)
        answer = p.decode(frame)
        if isinstance(answer, p.Error):
            raise AgentError(answer.code, answer.message)
        return answer

    def send(self, message: p.Message) -> None:
        """Send a request without waiting: an event, or a request whose answer does not matter
        (its Error, if any, is logged when read)."""
        with self._send_lock:     # registered before any reader can see the answer
            request_id = self._send_locked(message)
            if message.TYPE not in p.EVENTS:
                self._ignore.add(request_id)

    def _send(self, message: p.Message) -> int:
        with self._send_lock:
            return self._send_locked(message)

    def _send_locked(self, message: p.Message) -> int:
        if self._closed:
            raise ConnectionClosed("the connection to the daemon is closed")
        request_id = self._next_id
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF or 1
        frame = p.encode(message, request_id)
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._closed = True
            raise ConnectionClosed(f"cannot send to the daemon: {exc}") from exc
        self._last_send = time.monotonic()
        return request_id

    def _read_frame(self) -> p.Frame:
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                return frame
            try:
                n = self._sock.recv_into(self._inbox)    # into one buffer: recv(64 KiB) would allocate 64 KiB a call
            except socket.timeout:
                # The late answer may hand out slots or pins that nobody would release: end the
                # connection, and the daemon gives back everything this agent held.
                self._disconnect()
                raise ConnectionClosed(f"no answer from the daemon within {self.timeout:g} s; "
                                       "the connection was closed (connect again)") from None
            except OSError as exc:
                self._disconnect()
                raise ConnectionClosed(f"connection to the daemon broke: {exc}") from exc
            if not n:
                self._disconnect()
                reason = next((f" ({e})" for e in reversed(self.event_errors)), "")
                raise ConnectionClosed(f"the daemon closed the connection{reason}")
            self._decoder.feed(self._inview[:n])

    def _stray(self, frame: p.Frame) -> None:
        """A frame that answers no waiting call: the reply to a request sent without waiting,
        or an Error about an event or about the connection."""
        ignored = frame.request_id in self._ignore
        self._ignore.discard(frame.request_id)
        if frame.type != p.Error.TYPE:
            return
        message = p.decode(frame)
        assert isinstance(message, p.Error)
        error = AgentError(message.code, message.message)
        self.event_errors.append(error)
        log.warning("daemon refused a request sent without waiting: %s", error,
                    extra={"request_id": frame.request_id, "ignored": ignored})

    # -- heartbeat and close --------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_send >= self.heartbeat_s / 2:
                try:
                    self.send(p.Heartbeat())
                except AgentError:
                    return

    def _disconnect(self) -> None:
        """Mark the connection dead: later calls fail at once with ConnectionClosed."""
        with self._send_lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)     # wakes a recv blocked in another thread
        except OSError:
            pass

    def close(self) -> None:
        self._disconnect()
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        try:
            self._sock.close()
        finally:
            if self.arena_fd >= 0:
                os.close(self.arena_fd)
                self.arena_fd = -1
            if self.generations_fd >= 0:
                os.close(self.generations_fd)
                self.generations_fd = -1
