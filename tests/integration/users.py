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

__all__ = ["as_user", "made_users", "needs_users", "socket_dir", "start_as_user", "together", "users"]

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
    return together([(uid, gid, work)])[0]


def together(works: list[tuple[int, int, Callable[[], Any]]]) -> list[Any]:
    """Each ``work()`` in a forked child of its own running as its user, all at once; their
    results in order, as :func:`as_user` gives them."""
    def child(work: Callable[[], Any], write: int) -> None:
        try:
            result = {"ok": work()}
        except BaseException as exc:               # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())

    children = [_fork_as(uid, gid, lambda write, work=work: child(work, write)) for uid, gid, work in works]
    results = []
    for pid, read in children:
        chunks = []
        while chunk := os.read(read, 1 << 16):
            chunks.append(chunk)
        os.close(read)
        os.waitpid(pid, 0)
        data = b"".join(chunks)
        results.append(json.loads(data) if data else {"error": "the child could not become its user"})
    return results


def start_as_user(uid: int, gid: int, work: Callable[[Callable[[], None]], Any]) -> int:
    """``work(ready)`` in a forked child running as ``uid``/``gid`` that goes on until killed;
    returns its pid once the child called ``ready()`` (or exited)."""
    pid, read = _fork_as(uid, gid, lambda write: work(lambda: os.write(write, b"r")))
    os.read(read, 1)
    os.close(read)
    return pid


def _fork_as(uid: int, gid: int, child: Callable[[int], Any]) -> tuple[int, int]:
    """``child(write end of a pipe)`` in a forked child running as ``uid``/``gid``, which then
    exits (it never returns into pytest); the child's pid and the pipe's read end."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _become(uid, gid)
            child(write)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _become(uid: int, gid: int) -> None:
    """This (forked) process runs as ``uid``/``gid`` from now on, with no supplementary groups."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
