"""The agent endpoint: a Unix socket that engine-side agents connect to (thin asyncio layer).

Frames are cut and parsed by kvcached_agent.protocol and answered by an AgentSession; this
module only moves bytes, hands over (SCM_RIGHTS) in the Welcome the file descriptor of the
agent's tenant's arena and no other (kvcached.tiers.arenas), and ends connections: on EOF, on
a frame that breaks the framing, and when an agent has sent nothing for three heartbeat
intervals (a hung or stopped engine must not keep its slots). Every ending releases what the
agent held (AgentSession.close).

Besides the agent socket, where the kernel's word on the process (uid, gid) names its tenant,
a tenant may have agent sockets of its own (tenants.agent_sockets): whoever connects through one
is that tenant. Each socket is created with the configured mode and group before it listens, so
there is no moment when anyone else may connect. Requests that never wait (lookups, events, releases) are
answered inline, in order; allocations (write-back back-pressure), commits and loads (checksums,
the SSD, promotions), and lookups of many digests (done a slice at a time,
kvcached.api.slices) run as tasks and answer when done (each reply carries its request id).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from enum import IntEnum
from itertools import count
from typing import Any, Callable, cast

from kvcached import __version__
from kvcached.api.agent_session import AgentSession, PeerCredentials, Waiting, check_hello
from kvcached.host.logs import fields
from kvcached.store import Store
from kvcached.tenants import TenantMap
from kvcached.tiers.ram import RamFull
from kvcached_agent import protocol as p

__all__ = ["AgentServer", "listener_name"]

log = logging.getLogger("kvcached.agent")

HELLO_TIMEOUT_S = 5.0
_PEERCRED = struct.Struct("3i")
_HIGH_WATER = 4 << 20      # reply bytes buffered for an agent that does not read: stop reading its requests
MAX_IN_FLIGHT = 64         # waiting requests (Allocate, Commit, Load) of one agent: stop reading past it


def listener_name(tenant: str | None) -> str:
    """The name of an agent socket in an upgrade's handover: "agent" for the agent socket,
    "agent:NAME" for tenant NAME's own (tenants.agent_sockets)."""
    return "agent" if tenant is None else f"agent:{tenant}"


class AgentServer:
    def __init__(self, store: Store, path: str, *, arena_for: Callable[[str], list[int]], arena_bytes: int,
                 mode: int = 0o660, gid: int = -1, heartbeat_s: float = 5.0, max_agents: int = 256,
                 tenants: TenantMap | None = None, tenant_sockets: dict[str, str] | None = None) -> None:
        """``path``: the agent socket ("": none); ``tenant_sockets``: tenants' own agent
        sockets, by tenant name. ``arena_for``: the files a tenant's agents are handed (by
        Tenant.tag): its arena and its slab generations, the only memory they get
        (kvcached.tiers.arenas)."""
        self.store = store
        #: Who each connecting process is (kvcached.tenants); None: everyone the default tenant.
        self.tenants = tenants
        self.refused_no_tenant = 0         # Hellos refused: their process maps to no tenant
        self.path = path
        #: Socket path by the tenant it is bound to (None: the tenant is named by uid and gid).
        self.paths: dict[str | None, str] = {None: path} if path else {}
        self.paths.update((tenant, p) for tenant, p in (tenant_sockets or {}).items())
        self.arena_for = arena_for
        self.arena_bytes = arena_bytes
        self.mode = mode
        self.gid = gid
        self.heartbeat_s = heartbeat_s
        self.max_agents = max_agents
        self.connections: set[AgentConnection] = set()
        self._sessions = count(1)
        self._servers: dict[str | None, asyncio.base_events.Server] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def next_session(self) -> int:
        """A new agent session's number (unique while this daemon runs)."""
        return next(self._sessions)

    async def start(self, passed: Callable[[str], int | None] | None = None) -> None:
        """Bind each socket (mode and group set before listen), listen, start the heartbeat
        watchdog. A socket ``passed`` names (by :func:`listener_name`) is accepted on as it is
        instead: a predecessor's, passed at an upgrade (kvcached.lifecycle.handover), which this
        server then owns. OSError names the path that failed."""
        for tenant, path in self.paths.items():
            fd = passed(listener_name(tenant)) if passed is not None else None
            try:
                self._servers[tenant] = await self._listen(path, fd, tenant)
            except OSError as exc:
                raise OSError(exc.errno, f"{path}: {exc.strerror or exc}") from None
        self._watchdog = asyncio.create_task(self._watch(), name="agent-watchdog")

    async def _listen(self, path: str, fd: int | None, tenant: str | None) -> asyncio.base_events.Server:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) if fd is None else socket.socket(fileno=fd)
        try:
            if fd is None:
                sock.bind(path)
                os.chmod(path, self.mode)
                if self.gid >= 0:
                    os.chown(path, -1, self.gid)
                sock.listen(128)
            sock.setblocking(False)
            return await asyncio.get_running_loop().create_unix_server(lambda: AgentConnection(self, tenant), sock=sock)
        except BaseException:
            sock.close()
            raise

    @property
    def listening_fds(self) -> dict[str, int]:
        """The listening sockets by :func:`listener_name` (what an upgrade passes to the successor)."""
        return {listener_name(tenant): server.sockets[0].fileno() for tenant, server in self._servers.items()}

    async def stop(self) -> None:
        """Stop accepting, end every connection (releasing what each agent held). A listening
        socket passed to a successor stays open in it: connections waiting in its queue are the
        successor's to accept."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for server in self._servers.values():
            server.close()
        tasks = [t for conn in self.connections for t in conn.tasks]
        for conn in list(self.connections):
            conn.end("daemon stopping", p.ErrorCode.UNAVAILABLE)
        if tasks:       # commits and loads under way finish (and release) before the tiers close
            await asyncio.wait(tasks, timeout=10.0)
        for server in self._servers.values():
            await server.wait_closed()

    async def _watch(self) -> None:
        """End connections that have been silent for three heartbeat intervals."""
        loop = asyncio.get_running_loop()
        limit = 3 * self.heartbeat_s
        while True:
            await asyncio.sleep(self.heartbeat_s / 2)
            now = loop.time()
            for conn in list(self.connections):
                if len(conn.tasks) >= MAX_IN_FLIGHT or conn.holding:   # we stopped reading it: its heartbeats wait
                    conn.last_seen = now
                elif now - conn.last_seen > limit:     # (one that does not read its answers is not exempt)
                    try:
                        conn.end(f"no heartbeat for {now - conn.last_seen:.1f} s (agent.heartbeat_s = "
                                 f"{self.heartbeat_s:g}; the limit is three intervals)", p.ErrorCode.UNAVAILABLE)
                    except Exception:
                        log.exception("ending a silent agent connection failed")


class AgentConnection(asyncio.Protocol):
    """One agent's connection: Hello first, then requests and events until it ends."""

    def __init__(self, server: AgentServer, bound: str | None = None) -> None:
        self.server = server
        self.bound = bound          # the tenant whose own socket this came through (None: by uid and gid)
        self.decoder = p.FrameDecoder()
        self.session: AgentSession | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = PeerCredentials(0, -1, -1)
        self._loop = asyncio.get_event_loop()
        self.last_seen = self._loop.time()
        self.tasks: set[asyncio.Task[None]] = set()
        self._ended = False
        self._write_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._holding: asyncio.Task[None] | None = None     # a long Route the connection's next frames wait for

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)     # uvloop's transports are not asyncio.Transport subclasses
        self.transport = stream
        stream.set_write_buffer_limits(high=_HIGH_WATER)
        self.peer = _peer_credentials(stream)
        self._hello_timer = self._loop.call_later(
            HELLO_TIMEOUT_S, self.end, f"no Hello within {HELLO_TIMEOUT_S:g} s", p.ErrorCode.HANDSHAKE)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_seen = self._loop.time()
        self.decoder.feed(data)
        self._frames()

    def _frames(self) -> None:
        """Answer the frames received, in order, until one holds the connection (a long Route:
        the frames after it may name its blocks)."""
        while not self._ended and self._holding is None:
            try:
                frame = self.decoder.next_frame()
            except p.ProtocolError as exc:
                self.end(str(exc), exc.code, getattr(exc, "request_id", 0))
                return
            if frame is None:
                return
            self._frame(frame)

    @property
    def holding(self) -> bool:
        """A long Route is being checked: the connection's next frames wait for it."""
        return self._holding is not None

    @property
    def held_back(self) -> bool:
        """The daemon stops reading this agent: its answers go unread, or too many in flight."""
        return self._write_paused or len(self.tasks) >= MAX_IN_FLIGHT or self._holding is not None

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._resume()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task is self._holding:
            self._holding = None
            self._frames()            # those that came after it
        self._resume()

    def _resume(self) -> None:
        if self.transport is not None and not self._ended and not self.held_back:
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        self.end("agent closed the connection")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None or isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            self.end("agent closed the connection")     # e.g. it left without reading a last answer
        else:
            self.end(f"connection lost ({exc})")

    # -- frames ---------------------------------------------------------------------------------

    def _frame(self, frame: p.Frame) -> None:
        try:
            message = p.decode(frame)
        except p.ProtocolError as exc:
            self._send(p.Error(exc.code, str(exc)), frame.request_id)
            if self.session is None:
                self.end("a broken first frame", exc.code, frame.request_id, answered=True)
            return
        if self.session is None:
            self._hello(message, frame.request_id)
            return
        if self.session.waits(message, self.server.store.asks_homes):
            task = asyncio.ensure_future(self._answer_later(message, frame.request_id))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
            if isinstance(message, p.Route):      # the frames after it may name its blocks
                self._holding = task
            if self.held_back and self.transport is not None:
                self.transport.pause_reading()     # resumed as the tasks finish
            return
        try:
            answer = self.session.handle(message)
        except Exception as exc:      # a bug must cost one request, not the daemon
            log.exception("agent request failed", extra=fields(session=self.session.session))
            answer = p.Error(p.ErrorCode.INTERNAL, f"internal error: {exc}")
        if answer is not None:
            self._send(answer, frame.request_id)

    async def _answer_later(self, message: Waiting, request_id: int) -> None:
        assert self.session is not None
        try:
            answer = await self.session.handle_waiting(message)
        except Exception as exc:
            log.exception("agent request failed", extra=fields(session=self.session.session))
            answer = p.Error(p.ErrorCode.INTERNAL, f"internal error: {exc}")
        if not self._ended and answer is not None:
            self._send(answer, request_id)

    def _hello(self, message: p.Message, request_id: int) -> None:
        server = self.server
        if not isinstance(message, p.Hello):
            self.end(f"the first frame must be Hello, got {type(message).__name__}", p.ErrorCode.HANDSHAKE, request_id)
            return
        problem = check_hello(message, server.store.max_block_bytes)
        if problem is not None:
            code = p.ErrorCode.UNSUPPORTED_VERSION if message.version != p.VERSION else p.ErrorCode.INVALID_ARGUMENT
            self.end(f"Hello refused: {problem}", code, request_id)
            return
        if len(server.store.gpu) >= server.max_agents:
            self.end(f"{server.max_agents} agents are connected already (agent.max_agents)",
                     p.ErrorCode.RESOURCE_EXHAUSTED, request_id)
            return
        if self.bound is not None and server.tenants is not None:
            tenant = server.tenants.through_socket(self.bound, self.peer.uid, self.peer.gid)
            if tenant is None:
                server.refused_no_tenant += 1
                self.end(f"Hello refused: uid {self.peer.uid} or gid {self.peer.gid} names another tenant than "
                         f"{self.bound}, whose socket this is (tenants.agent_sockets)", p.ErrorCode.HANDSHAKE, request_id)
                return
        else:
            tenant = server.tenants.resolve(self.peer.uid, self.peer.gid) if server.tenants is not None else None
        if server.tenants is not None and tenant is None:
            server.refused_no_tenant += 1
            self.end(f"Hello refused: uid {self.peer.uid} and gid {self.peer.gid} name no tenant (tenants.uids, "
                     "tenants.gids) and tenants.default is empty", p.ErrorCode.HANDSHAKE, request_id)
            return
        session = AgentSession(server.store, server.next_session(), message, self.peer, tenant)
        welcome = p.encode(p.Welcome(session.session, server.arena_bytes, server.store.max_block_bytes,
                                     int(server.heartbeat_s * 1000), __version__), request_id)
        try:
            _send_with_fds(self.transport, welcome, server.arena_for(tenant.tag if tenant is not None else ""))
        except (BrokenPipeError, ConnectionResetError):
            session.close()
            self.end("agent left during the handshake")
            return
        except (OSError, RamFull) as exc:
            session.close()
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            self.end(f"cannot hand over the arena ({reason or exc})", p.ErrorCode.INTERNAL, request_id)
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.session = session
        log.info("agent connected", extra=fields(session=session.session, agent_id=message.agent_id,
                                                 model=message.model, dtype=message.dtype, pid=self.peer.pid,
                                                 uid=self.peer.uid, gid=self.peer.gid,
                                                 tenant=tenant.name if tenant is not None else None))

    def _send(self, message: p.Message, request_id: int) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(p.encode(message, request_id))

    def end(self, reason: str, code: IntEnum | None = None, request_id: int = 0, *, answered: bool = False) -> None:
        """End the connection once: answer an Error first if ``code``, release what the agent held."""
        if self._ended:
            return
        self._ended = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.server.connections.discard(self)
        if self.transport is not None:
            if code is not None and not answered:
                self._send(p.Error(code, reason), request_id)
            self.transport.close()       # flushes the Error first
        ctx: dict[str, Any] = {"pid": self.peer.pid, "reason": reason}
        if self.session is not None:
            slots, pins, gpu = self.session.close()
            ctx |= {"session": self.session.session, "agent_id": self.session.hello.agent_id,
                    "released_slots": slots, "released_pins": pins, "gpu_blocks_dropped": gpu}
            log.info("agent disconnected", extra=fields(**ctx))
        elif code is not None:
            log.warning("agent connection refused", extra=fields(**ctx))


def _peer_credentials(transport: asyncio.Transport) -> PeerCredentials:
    sock = transport.get_extra_info("socket")
    try:
        pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, AttributeError, TypeError):
        return PeerCredentials(0, -1, -1)
    return PeerCredentials(pid, uid, gid)


def _send_with_fds(transport: asyncio.Transport | None, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached (SCM_RIGHTS) on the transport's socket. Only valid
    while nothing is buffered in the transport (the Welcome is the first frame sent), so the
    bytes stay in order. uvloop's transport socket cannot sendmsg, a duplicate of it can."""
    assert transport is not None and transport.get_write_buffer_size() == 0
    raw = transport.get_extra_info("socket")
    dup = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(raw.fileno()))
    try:
        sent = socket.send_fds(dup, [data], fds)
    finally:
        dup.close()
    if sent != len(data):      # a fresh socket's buffer holds a Welcome many times over
        raise OSError(f"short send of the Welcome ({sent} of {len(data)} bytes)")
