"""What the daemon does to its process and its sockets before it serves: glibc malloc settings,
the interpreter's thread switch interval, the threads it may keep busy, claiming a Unix socket
path (a stale one is removed, a live one refused), group ids from names.
"""

from __future__ import annotations

import os
import socket
import sys

from kvcached.host.fsmodes import make_dirs, socket_dir_mode

__all__ = ["StartupError", "claim_unix_socket", "cpu_threads", "group_id", "shmem_huge_pages", "tune_malloc",
           "tune_switch_interval"]


# glibc malloc settings (mallopt(3)): keep freed memory in the heap instead of handing it back
# to the kernel after every call. Request and response buffers of a few MiB are allocated and
# freed on each call; by default glibc serves them with mmap and unmaps them at free, so every
# call page-faults its buffers in again (measured: ~15k minor faults and ~50-80 ms of system time
# per 16 MiB Put; ~500 faults with these settings). The cost is up to _TRIM bytes of heap kept.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_TRIM = 256 << 20
_TOP_PAD = 64 << 20
_MMAP = 32 << 20          # glibc's maximum on 64-bit


def tune_malloc() -> bool:
    """Apply the settings above; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, _MMAP), (_M_TRIM_THRESHOLD, _TRIM), (_M_TOP_PAD, _TOP_PAD)))


# How long a thread running Python keeps the GIL while another waits for it (sys.setswitchinterval;
# CPython's default is 5 ms). The event loop gives the GIL up around every poll and takes it again
# for each callback, so while a worker thread runs Python (the index's tombstone scan, the SSD
# reconcile, a checksum thread) every callback can wait a whole interval: measured with a scan
# of a million index records in a thread, a round trip through a uvloop loop took 5.2 ms at the
# median, 11.4 ms at p99, 29 ms at most (0.02 / 0.23 / 1 ms without the scan); with 0.5 ms, 0.66
# / 1.5 / 5.3 ms. The cost is more switches between threads that both run Python.
_SWITCH_INTERVAL_S = 0.0005


def tune_switch_interval() -> None:
    """Apply the switch interval above."""
    sys.setswitchinterval(_SWITCH_INTERVAL_S)


AUTO_THREADS_MOST = 16      # kv.hash_threads = 0: one a CPU, up to this many (a GPU host's engines need theirs)


def shmem_huge_pages(path: str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled") -> str | None:
    """The kernel's huge page setting for shared memory (``never``, ``advise``, ...; None where
    it cannot be read): whether the arenas' ``MADV_HUGEPAGE`` is granted (kvcached.tiers.arena)."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


def cpu_threads(configured: int, most: int = AUTO_THREADS_MOST) -> int:
    """``configured`` threads; 0: one per CPU this process may run on (its affinity, which
    systemd's CPUAffinity= and a cgroup's cpuset set), ``most`` at most."""
    if configured > 0:
        return configured
    return max(1, min(most, len(os.sched_getaffinity(0))))


class StartupError(Exception):
    """The daemon cannot start; the message says why in one line."""


def claim_unix_socket(path: str, mode: int = 0o660, gid: int = -1) -> None:
    """Make ``path`` free for a new listener of permission bits ``mode`` and group ``gid`` (-1:
    the daemon's): refuse if a live server answers on it, remove a stale socket file left by a
    crash, refuse to clobber anything that is not a socket. Missing directories are created
    with :func:`kvcached.host.fsmodes.socket_dir_mode` (search only for whom ``mode`` admits)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        make_dirs(directory, socket_dir_mode(mode), gid)
    except OSError as exc:
        raise StartupError(f"cannot create the directory of socket {path}: {exc.strerror or exc}") from None
    if not os.path.lexists(path):
        return
    import stat

    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)     # stale: nobody listens
    else:
        raise StartupError(f"{path} is in use by a running process (another kvcached?); refusing to start")
    finally:
        probe.close()


def check_tcp_port_free(host: str, port: int, key: str) -> None:
    """StartupError if another process listens on TCP ``host``:``port`` (port 0: nothing to
    check). gRPC binds with SO_REUSEPORT, so that an upgrade's successor can listen beside its
    predecessor; without this check a second daemon would share the port silently."""
    if not port:
        return
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StartupError(f"{key}: cannot listen ({exc.strerror}: another process holds the port)") from None


def group_id(group: str, key: str) -> int:
    """The gid of ``group`` (a name or a number; config key ``key``); -1 for "" (keep the daemon's own)."""
    if not group:
        return -1
    if group.isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartupError(f"{key}: no such group {group!r}") from None
