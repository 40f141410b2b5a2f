"""sd_notify (kvcached.lifecycle.systemd.Notifier) against a real datagram socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvcached.lifecycle.systemd import Notifier


def listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_messages_reach_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with listener(path) as sock:
        n = Notifier({"NOTIFY_SOCKET": path})
        assert n.enabled and n.watchdog_s is None
        assert n.ready("serving")
        assert sock.recv(4096).decode().split("\n") == ["READY=1", "STATUS=serving", f"MAINPID={os.getpid()}"]
        n.status("reconciling the index: 10 of about 100 records", extend_timeout_s=60)
        assert sock.recv(4096) == b"STATUS=reconciling the index: 10 of about 100 records\nEXTEND_TIMEOUT_USEC=60000000"
        n.stopping()
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping"
        n.close()


def test_abstract_socket_and_watchdog() -> None:
    name = f"kvcached-test-{os.getpid()}"
    with listener("\0" + name) as sock:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000"})
        assert n.watchdog_s == 1.5
        assert n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        n.status("busy")                          # with a watchdog, a status line pings it too
        assert sock.recv(4096) == b"STATUS=busy\nWATCHDOG=1"


def test_outside_systemd_everything_is_a_no_op(tmp_path: Path) -> None:
    n = Notifier({})
    assert not n.enabled and not n.ready("serving") and not n.watchdog() and not n.stopping()
    # a watchdog meant for another process is not ours to ping
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "x"), "WATCHDOG_USEC": "1000000",
                     "WATCHDOG_PID": "1"}).watchdog_s is None
    # the manager gone (socket missing): a send fails quietly
    assert not Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).watchdog()


def test_the_fd_store_receives_the_descriptor_and_forgets_it_on_request(tmp_path: Path) -> None:
    from ..fdstore import ServiceManager

    manager = ServiceManager(tmp_path / "notify")
    n = Notifier({"NOTIFY_SOCKET": manager.path})
    fd = os.memfd_create("kept")
    try:
        assert n.store_fd("kvcached-arena", fd)
        message = manager.wait_for("FDSTORE", "1")
        assert message["FDNAME"] == "kvcached-arena" and message["FDPOLL"] == "0"
        assert os.fstat(manager.stored["kvcached-arena"]).st_ino == os.fstat(fd).st_ino
        n.notify(fdstoreremove=1, fdname="kvcached-arena")
        manager.wait_for("FDSTOREREMOVE", "1")
        assert manager.stored == {}
        assert not Notifier({}).store_fd("x", fd)        # outside systemd: nothing to do
    finally:
        os.close(fd)
        n.close()
        manager.close()
