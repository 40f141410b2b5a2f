"""sd_notify(3) for a Type=notify service: READY, STATUS, WATCHDOG and STOPPING datagrams.

The protocol is one datagram of ``KEY=value`` lines to the Unix socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Outside systemd the variable
is unset and every call is a no-op, so the daemon calls these unconditionally. A failed send is
ignored: the service manager going away must never take the daemon down with it.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

__all__ = ["Notifier"]


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
