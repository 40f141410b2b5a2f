"""systemd's side of sd_notify and the file descriptor store, for tests on machines without it.

:class:`ServiceManager` binds the datagram socket a Type=notify service writes to
(``$NOTIFY_SOCKET``), reads its messages as systemd does (``KEY=value`` lines; descriptors passed
with SCM_RIGHTS), keeps the descriptors sent with ``FDSTORE=1`` under their ``FDNAME`` (one copy
per file, as systemd dedups them; ``FDSTOREREMOVE=1`` drops a name), and starts the next process
of the service with them from fd 3 on and ``$LISTEN_FDS``, ``$LISTEN_PID`` and
``$LISTEN_FDNAMES`` set, as systemd does at a restart (sd_listen_fds(3)).
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import threading
from pathlib import Path

__all__ = ["ServiceManager"]

HIGH_FD = 200        # stored descriptors are passed from here, then moved to 3.. by the shell


class ServiceManager:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.stored: dict[str, int] = {}          # FDNAME -> our copy
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(16 * 4) + socket.CMSG_SPACE(12))
            except OSError:
                return
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[:len(payload) - len(payload) % 4])
                    fds += list(got)
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.messages.append(fields)
                if fields.get("FDSTOREREMOVE") == "1":
                    old = self.stored.pop(fields.get("FDNAME", "stored"), None)
                    if old is not None:
                        os.close(old)
                if fields.get("FDSTORE") == "1":
                    name = fields.get("FDNAME", "stored")
                    for fd in fds:
                        if name in self.stored and _same_file(self.stored[name], fd):
                            os.close(fd)      # systemd keeps one copy of a file
                        elif name in self.stored:
                            os.close(fd)      # a second file under one name: the test wants to know
                            self.messages.append({"ERROR": f"two files stored as {name}"})
                        else:
                            self.stored[name] = fd
                else:
                    for fd in fds:
                        os.close(fd)
                self._ready.notify_all()

    def wait_for(self, key: str, value: str | None = None, timeout: float = 20.0, after: int = 0) -> dict[str, str]:
        """The first message from index ``after`` on that has ``key`` (= ``value``)."""
        with self._lock:
            def found() -> dict[str, str] | None:
                for m in self.messages[after:]:
                    if key in m and (value is None or m[key] == value):
                        return m
                return None
            if not self._ready.wait_for(lambda: found() is not None, timeout):
                raise AssertionError(f"no {key}={value} from the service within {timeout} s: {self.messages}")
            result = found()
            assert result is not None
            return result

    def start_prefix(self) -> tuple[list[str], dict[str, str], tuple[int, ...]]:
        """(command prefix, environment additions, descriptors to pass) that start a process the
        way systemd starts the service with its fd store: the stored descriptors at 3, 4, ...
        and LISTEN_* naming them. The prefix is a shell that moves them and execs the command."""
        with self._lock:
            names = sorted(self.stored)
            high = []
            for i, name in enumerate(names):
                high.append(fcntl.fcntl(self.stored[name], fcntl.F_DUPFD_CLOEXEC, HIGH_FD + i))
        moves = " ".join(f"{3 + i}<&{fd} {fd}<&-" for i, fd in enumerate(high))
        script = (f"exec {moves}; " if moves else "") + \
            f'LISTEN_PID=$$ LISTEN_FDS={len(names)} LISTEN_FDNAMES={":".join(names)} exec "$@"'
        env = {"NOTIFY_SOCKET": self.path}
        self._passed = high
        return ["bash", "-c", script, "bash"], env, tuple(high)

    def started(self) -> None:
        """Close this side's copies made by :meth:`start_prefix` (call once the process runs)."""
        for fd in getattr(self, "_passed", []):
            os.close(fd)
        self._passed = []

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for fd in self.stored.values():
                os.close(fd)
            self.stored.clear()


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
