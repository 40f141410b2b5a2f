"""Real users for tests of tenants: made for a test and deleted after it, and work run as them.

Work runs in a forked child that drops to the user's ids (the interpreter lives under /root,
which other users cannot reach, so a fresh process could not start as them); the child imports
nothing new, so everything it uses must be imported before."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

__all__ = ["as_user", "made_users", "needs_users", "socket_dir", "start_as_user", "users"]

needs_users = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                 reason="needs root and useradd: the test creates the users it runs as")


@contextlib.contextmanager
def made_users() -> Iterator[Callable[[], tuple[int, int]]]:
    """Creates system users on demand ((uid, gid) each) and deletes them at the end."""
    made: list[str] = []

    def make() -> tuple[int, int]:
        name = f"kvct{uuid.uuid4().hex[:8]}"
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        made.append(name)
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def users() -> Iterator[Callable[[], tuple[int, int]]]:
    with made_users() as make:
        yield make


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory other users can reach the agent socket in (pytest's own is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="kvct-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, gid: int, work: Callable[[], Any]) -> Any:
    """``work()`` in a forked child running as ``uid``/``gid`` (no supplementary groups); its
    JSON-able result, or {"error": text} if it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns into pytest
        os.close(read)
        try:
            _become(uid, gid)
            result = {"ok": work()}
        except BaseException as exc:               # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def start_as_user(uid: int, gid: int, work: Callable[[Callable[[], None]], Any]) -> int:
    """``work(ready)`` in a forked child running as ``uid``/``gid`` that goes on until killed;
    returns its pid once the child called ``ready()`` (or exited)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns into pytest
        os.close(read)
        try:
            _become(uid, gid)
            work(lambda: os.write(write, b"r"))
        finally:
            os._exit(0)
    os.close(write)
    os.read(read, 1)
    os.close(read)
    return pid


def _become(uid: int, gid: int) -> None:
    """This (forked) process runs as ``uid``/``gid`` from now on, with no supplementary groups."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
