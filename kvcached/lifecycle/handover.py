"""Handover: a running daemon gives its RAM arena and listening sockets to its successor.

``kvcached serve --takeover`` (or ``kvcached upgrade``, which asks the running daemon to start
one) replaces a daemon without losing its RAM tier and without a moment in which a client's
connect fails (docs/operations.md). The two processes talk over a Unix seqpacket socket in the
index directory (0700, so only the daemon's user reaches it; the peer's uid is checked too),
one JSON message per packet, file descriptors attached with SCM_RIGHTS:

1. successor -> ``{"op": "takeover", "pid", "version"}``
2. predecessor -> ``{"op": "files", "names": [...], "info": {...}, "more": bool}`` with the
   descriptors named: every tenant's arena memfd and the slot directory's, and the listening
   sockets it can pass (agent, QUIC, lane, metrics). ``info`` gives their addresses and the
   gRPC TCP ports in use. At most :data:`FDS_PER_MESSAGE` descriptors a message (the kernel
   passes 253 at most): ``more`` says another such message follows.
3. The successor binds gRPC beside the predecessor (TCP with SO_REUSEPORT on the same ports,
   Unix sockets renamed over the old paths), its calls held at a gate, then ->
   ``{"op": "listening"}``. New connections now reach the successor; the passed sockets are
   shared, so what waits in their queues is accepted by whoever reads them next.
4. The predecessor stops its gRPC servers (calls in flight finish), its agent connections (the
   agents reconnect at once) and peer links, finishes its writes, saves its policies and closes
   the index -> ``{"op": "released"}``.
5. The successor opens the index, takes up the RAM tier as passed (no checksum pass: the
   predecessor stopped every write first), starts, opens the gate -> ``{"op": "serving"}``; the
   predecessor exits.

If the predecessor goes away before ``released`` (it crashed), the successor still has what it
was sent: it waits for the index lock (freed when that process died) and takes up the arena as
after a crash, every block checked against its checksum first; with nothing sent it starts
clean. If the successor goes away before ``listening``, the predecessor serves on; after
``released``, the predecessor starts again in place with the arena (kvcached.lifecycle.daemon.serve).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

__all__ = ["HandoverBroken", "HandoverServer", "Takeover", "handover_path", "network_namespace", "request_upgrade",
           "tcp_migrate_req", "wait_gone", "MAX_FDS"]

log = logging.getLogger("kvcached.handover")

SOCKET_NAME = "handover.sock"
MAX_MESSAGE = 1 << 16
MAX_FDS = 253                  # the most SCM_RIGHTS carries in one message (the kernel's SCM_MAX_FD)
FDS_PER_MESSAGE = 64
STEP_TIMEOUT_S = 120.0     # each step of the other side (a big index's close, a big RAM tier's take-up)


class HandoverBroken(Exception):
    """The other process went away, refused, or said something out of turn."""


def handover_path(index_dir: str | os.PathLike[str]) -> Path:
    return Path(index_dir) / SOCKET_NAME


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return int(pid), int(uid)


def network_namespace() -> str:
    """This process's network namespace, as an identity two processes can compare: a successor
    in another one (a Kubernetes pod's, at a rolling update) binds network listeners of its own."""
    try:
        info = os.stat("/proc/self/ns/net")
    except OSError:
        return ""
    return f"{info.st_dev}:{info.st_ino}"


def tcp_migrate_req() -> bool:
    """net.ipv4.tcp_migrate_req: a closing SO_REUSEPORT listener's queued connections move to
    another listener of the port (Linux 5.14) instead of being reset (deploy/99-kvcached.conf)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _exited(pid: int) -> bool:
    """Every thread of process ``pid`` has exited (its files are closed): a zombie leader with
    threads still running is not gone yet, their exit closes the files. A process reaped while
    /proc is read answers ESRCH (ProcessLookupError), not ENOENT: gone as well."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
        except (FileNotFoundError, ProcessLookupError):
            pass
    return True


async def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Wait until process ``pid`` has exited, every thread (its sockets closed); True if it did."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if _exited(pid):
            return True
        await asyncio.sleep(0.02)
    return False


async def _ready(sock: socket.socket, writable: bool) -> None:
    """Wait until ``sock`` (non-blocking) can be written to, or read from."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    def wake() -> None:
        if not done.done():
            done.set_result(None)

    add(sock.fileno(), wake)
    try:
        await done
    finally:
        remove(sock.fileno())


async def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise HandoverBroken(f"handover message of {len(data)} bytes is over {MAX_MESSAGE}")
    while True:
        try:
            socket.send_fds(sock, [data], list(fds))
            return
        except BlockingIOError:
            await _ready(sock, writable=True)
        except OSError as exc:
            raise HandoverBroken(f"the other process went away ({exc.strerror})") from None


async def _recv(sock: socket.socket, expect: str | None,
                timeout: float = STEP_TIMEOUT_S) -> tuple[dict[str, Any], list[int]]:
    """The next message, which must be ``op == expect`` (None: any op); its descriptors are the
    caller's."""
    async def read() -> tuple[bytes, list[int], int]:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
                return data, fds, flags
            except BlockingIOError:
                await _ready(sock, writable=False)
            except OSError as exc:
                raise HandoverBroken(f"the other process went away ({exc.strerror})") from None

    try:
        data, fds, flags = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise HandoverBroken(f"no {expect!r} from the other process within {timeout:.0f} s") from None
    if not data:
        raise HandoverBroken(f"the other process went away before {expect!r}")
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise HandoverBroken("a handover message came truncated")
        try:
            message = json.loads(data)
        except ValueError:
            raise HandoverBroken(f"a handover message that is not JSON: {data[:60]!r}") from None
        if not isinstance(message, dict) or (expect is not None and message.get("op") != expect):
            raise HandoverBroken(f"expected {expect or 'a request'!r}, got {str(message)[:200]}")
    except HandoverBroken:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


@dataclass
class Takeover:
    """The successor's side (see the module): :meth:`begin`, then :meth:`listening`, then
    :meth:`serving` once it serves."""

    path: Path
    sock: socket.socket | None = None
    files: dict[str, int] = field(default_factory=dict)     # name -> descriptor (ours to close or use)
    info: dict[str, Any] = field(default_factory=dict)
    predecessor_pid: int = 0

    async def begin(self, version: str) -> None:
        """Ask the running daemon to hand over; receive its files. HandoverBroken if none
        answers at :attr:`path` or it refuses."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise HandoverBroken(f"no daemon to take over from at {self.path} ({exc.strerror})") from None
        self.predecessor_pid, uid = _peer(sock)
        if uid != os.geteuid():
            sock.close()
            raise HandoverBroken("the process at the handover socket runs as another user")
        sock.setblocking(False)
        self.sock = sock        # connected: a failure from here on is the predecessor going away
        await _send(sock, {"op": "takeover", "pid": os.getpid(), "version": version})
        more = True
        while more:
            message, fds = await _recv(sock, "files")
            names = message.get("names", [])
            if not isinstance(names, list) or len(names) != len(fds):
                for fd in [*fds, *self.files.values()]:
                    os.close(fd)
                self.files = {}
                raise HandoverBroken(f"{len(fds)} files came named {names!r}")
            self.files.update(zip(names, fds))
            self.info = message.get("info", {})
            more = message.get("more") is True

    async def listening(self) -> bool:
        """Tell the predecessor our listeners accept; wait until it released the index. True if
        it did; False if it went away first (a crash: what it sent must be checked)."""
        assert self.sock is not None
        try:
            await _send(self.sock, {"op": "listening"})
            await _recv(self.sock, "released")
        except HandoverBroken as exc:
            log.warning("the previous daemon went away during the handover: its RAM tier is checked before use",
                        extra={"fields": {"reason": str(exc)}})
            return False
        return True

    async def serving(self) -> None:
        if self.sock is None:
            return
        try:
            await _send(self.sock, {"op": "serving", "pid": os.getpid()})
        except HandoverBroken:
            pass
        self.close()

    def take(self, name: str) -> int | None:
        return self.files.pop(name, None)

    def keep(self, wanted: dict[str, bool]) -> None:
        """Close the listening sockets whose names ``wanted`` says no to (this configuration
        listens elsewhere): the successor binds its own there."""
        for name, use in wanted.items():
            fd = self.files.pop(name, None) if not use else None
            if fd is not None:
                log.info("a listening socket of the previous daemon not used: this configuration listens elsewhere",
                         extra={"fields": {"socket": name}})
                os.close(fd)

    def close_files(self) -> None:
        """Close the files not taken."""
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()

    def close(self) -> None:
        self.close_files()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class HandoverServer:
    """The running daemon's side: listens at ``path``. A successor's ``takeover`` request runs
    ``hand_over(conn, request)``, which carries out the steps over ``conn`` (see the module)
    with :func:`send_files`, :func:`wait_listening`, :func:`send_released` and
    :func:`wait_serving`; one handover at a time. An ``upgrade`` request (``kvcached upgrade``)
    runs ``upgrade()``, which starts a successor and returns the outcome, sent back as the
    answer."""

    def __init__(self, path: Path, hand_over: Callable[[socket.socket, dict[str, Any]], Awaitable[None]],
                 upgrade: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.path = path
        self.hand_over = hand_over
        self.upgrade = upgrade
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._busy = False
        self._ino = 0

    def start(self) -> None:
        """Listen at :attr:`path`: bound under a temporary name and renamed over whatever is
        there (a stale socket, or the predecessor's while it waits to exit), so the name never
        goes missing."""
        temporary = f"{self.path}.{os.getpid()}.new"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        sock.bind(temporary)
        os.chmod(temporary, 0o600)
        sock.listen(4)
        os.rename(temporary, self.path)
        sock.setblocking(False)
        self._sock = sock
        self._ino = os.stat(self.path).st_ino
        self._task = asyncio.ensure_future(self._accept())

    async def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            if _peer(conn)[1] != os.geteuid():
                log.warning("handover refused: the caller runs as another user")
                return
            request, fds = await _recv(conn, None, timeout=10)
            for fd in fds:
                os.close(fd)
            op = request.get("op")
            if op == "upgrade":
                answer = ({"op": "failed", "reason": "a handover is under way"} if self._busy
                          else await self.upgrade())
                await _send(conn, answer)
                return
            if op != "takeover":
                raise HandoverBroken(f"unknown request {str(op)[:40]!r}")
            if self._busy:
                raise HandoverBroken("a handover is under way already")
            self._busy = True
            try:
                log.warning("handing over to a successor", extra={"fields": {
                    "successor_pid": request.get("pid"), "successor_version": request.get("version")}})
                await self.hand_over(conn, request)
            finally:
                self._busy = False
        except HandoverBroken as exc:
            log.error("handover failed; serving on", extra={"fields": {"reason": str(exc)}})
        except Exception:
            log.exception("handover failed")
        finally:
            conn.close()

    async def stop(self, unlink: bool = True) -> None:
        """Stop listening; requests under way get a moment to answer (an upgrade's caller
        learns how it went), then are cancelled."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        others = [t for t in self._conns if t is not asyncio.current_task()]
        if others:
            _, pending = await asyncio.wait(others, timeout=2.0)
            for task in pending:
                task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                if unlink and os.stat(self.path).st_ino == self._ino:
                    self.path.unlink()
            except FileNotFoundError:
                pass


async def send_files(conn: socket.socket, files: dict[str, int], info: dict[str, Any]) -> None:
    items = list(files.items())
    for at in range(0, max(1, len(items)), FDS_PER_MESSAGE):
        part = items[at:at + FDS_PER_MESSAGE]
        await _send(conn, {"op": "files", "names": [n for n, _ in part], "info": info,
                           "more": at + FDS_PER_MESSAGE < len(items)}, [fd for _, fd in part])


async def wait_listening(conn: socket.socket) -> None:
    await _recv(conn, "listening")


async def send_released(conn: socket.socket, info: dict[str, Any]) -> None:
    await _send(conn, {"op": "released", **info})


async def wait_serving(conn: socket.socket) -> dict[str, Any]:
    return (await _recv(conn, "serving"))[0]


def request_upgrade(path: Path, timeout: float = STEP_TIMEOUT_S * 3) -> dict[str, Any]:
    """``kvcached upgrade``: ask the daemon at ``path`` to start its successor; its answer
    (``op`` "upgraded" with ``pid`` and times, or "failed" with ``reason``). Blocking."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise HandoverBroken(f"no daemon answers at {path} ({exc.strerror})") from None
        sock.settimeout(timeout)
        sock.send(json.dumps({"op": "upgrade", "pid": os.getpid()}).encode())
        try:
            data = sock.recv(MAX_MESSAGE)
        except socket.timeout:
            raise HandoverBroken(f"no answer within {timeout:.0f} s") from None
        if not data:
            raise HandoverBroken("the daemon went away before answering")
        answer = json.loads(data)
        return answer if isinstance(answer, dict) else {"op": "failed", "reason": str(answer)[:200]}
