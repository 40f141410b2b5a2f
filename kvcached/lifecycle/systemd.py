"""sd_notify(3) for a Type=notify service: READY, STATUS, WATCHDOG, STOPPING and FDSTORE
datagrams; sd_listen_fds(3) for the file descriptors systemd hands back at a start.

The protocol is one datagram of ``KEY=value`` lines to the Unix socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Outside systemd the variable
is unset and every call is a no-op, so the daemon calls these unconditionally. A failed send is
ignored: the service manager going away must never take the daemon down with it.

The file descriptor store: ``FDSTORE=1`` with ``FDNAME=name`` and the descriptors attached
(SCM_RIGHTS) asks systemd to keep them while the service restarts (FileDescriptorStoreMax= in
the unit); at the next start they arrive from fd 3 on, with ``$LISTEN_FDS``, ``$LISTEN_PID``
and ``$LISTEN_FDNAMES`` (colon-separated names), which :func:`listen_fds` reads. The daemon keeps
its RAM arena there, so a crash does not lose it (docs/operations.md).
"""

from __future__ import annotations

import array
import os
import socket
from typing import Mapping, MutableMapping

__all__ = ["Notifier", "listen_fds", "LISTEN_FDS_START"]

LISTEN_FDS_START = 3


class Notifier:
    """Tells the service manager about this process. ``watchdog_s``: how often to send
    WATCHDOG=1 (half of systemd's WatchdogSec, from $WATCHDOG_USEC), or None without a watchdog
    (or when $WATCHDOG_PID names another process)."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        path = environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_s: float | None = None
        usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 2e6
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased); True if the datagram went out. Safe to
        call from any thread."""
        if self._sock is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(message, self.address)
        except OSError:
            return False
        return True

    def store_fd(self, name: str, fd: int) -> bool:
        """Ask systemd to keep ``fd`` under ``name`` across restarts (FDSTORE=1; FDPOLL=0: a
        memfd never hangs up, and systemd must not drop it for any poll result). True if the
        datagram went out."""
        if self._sock is None:
            return False
        message = f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0".encode()
        try:
            self._sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                               0, self.address)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status, mainpid=os.getpid())

    def status(self, text: str, *, extend_timeout_s: float | None = None) -> bool:
        """A STATUS line (``systemctl status`` shows it); during a long start, also ask for more
        time than TimeoutStartSec, as EXTEND_TIMEOUT_USEC does, and ping the watchdog."""
        fields: dict[str, str | int] = {"status": text}
        if extend_timeout_s is not None:
            fields["extend_timeout_usec"] = int(extend_timeout_s * 1e6)
        if self.watchdog_s is not None:
            fields["watchdog"] = 1
        return self.notify(**fields)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(stopping=1, status=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listen_fds(environ: MutableMapping[str, str] = os.environ) -> dict[str, int]:
    """The file descriptors systemd passed this process, by name (sd_listen_fds_with_names):
    empty unless ``$LISTEN_PID`` is this process. The variables are removed (a child must not
    take them for its own) and the descriptors made close-on-exec. An fd without a name is
    named "unknown", as systemd does."""
    pid, count = environ.get("LISTEN_PID", ""), environ.get("LISTEN_FDS", "")
    names = environ.get("LISTEN_FDNAMES", "")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(key, None)
    if pid != str(os.getpid()) or not count.isdigit():
        return {}
    listed = names.split(":") if names else []
    fds: dict[str, int] = {}
    for i in range(int(count)):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue
        name = listed[i] if i < len(listed) and listed[i] else "unknown"
        if name in fds:         # the same name twice: keep the first, close the rest
            os.close(fd)
            continue
        fds[name] = fd
    return fds
