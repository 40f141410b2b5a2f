"""The reliability suite: hostile input, full disks and crashes against real daemon processes.

`make test` runs the short versions (bounded: each test a few seconds); `make soak` runs the long
ones, marked ``soak`` (the flood at full size, crash loops, soaks), which print their counts:
datagrams sent, kills, acknowledged blocks, lost, wrong, RSS and open fds before and after.
The daemon fixtures are the integration suite's (real processes on Unix sockets in tmp_path).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.integration.conftest import daemon, make_daemon  # noqa: F401  (fixtures)
from tests.integration.users import socket_dir, users  # noqa: F401  (fixtures)

__all__ = ["rss_kib", "open_fds", "report"]


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int, but_under: Path | None = None) -> int:
    """How many file descriptors ``pid`` holds open, leaving out files under ``but_under``.

    The index's directory is the one to leave out where a test watches for leaks: RocksDB keeps
    its table files open, and how many there are follows compaction (bounded by the data, not by
    time); sockets, pipes, eventfds and block files are what a leak would be made of."""
    fds = f"/proc/{pid}/fd"
    count = 0
    for name in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{name}")
        except FileNotFoundError:            # closed while we looked
            continue
        if but_under is None or not target.startswith(f"{but_under}/"):
            count += 1
    return count


def report(name: str, **counts: object) -> None:
    """Print a test's counts on one line (visible with -s, as `make soak` runs)."""
    print(f"\n[{name}] " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
