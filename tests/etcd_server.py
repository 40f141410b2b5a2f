"""A real etcd server (Debian's etcd-server, installed by `make system-deps`) for tests: its own
data directory and ports, started, stopped, killed and started again on the same data."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EtcdServer", "etcd_binary"]


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    """One etcd member on ``host`` (default 127.0.0.1). With ``tls`` (ca, cert, key PEM paths), clients must show
    a certificate signed by ``ca`` (mutual TLS)."""

    data: Path
    tls: tuple[Path, Path, Path] | None = None
    host: str = "127.0.0.1"                    # where clients reach it (peers: always 127.0.0.1)
    port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or _free_tcp_port()
        self.peer_port = self.peer_port or _free_tcp_port()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        binary = etcd_binary()
        assert binary, "etcd not installed (make system-deps installs etcd-server)"
        scheme = "https" if self.tls else "http"
        argv = [binary, "--name", "test", "--data-dir", str(self.data),
                "--listen-client-urls", f"{scheme}://{self.host}:{self.port}",
                "--advertise-client-urls", f"{scheme}://{self.host}:{self.port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
                "--log-level", "warn", "--logger", "zap"]
        if self.tls:
            ca, cert, key = self.tls
            argv += ["--client-cert-auth", "--trusted-ca-file", str(ca), "--cert-file", str(cert), "--key-file", str(key)]
        log = open(self.data.parent / f"{self.data.name}.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not listen within {timeout} s: {self.tail()}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: etcd gone at once, its data kept for :meth:`start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def tail(self, lines: int = 20) -> str:
        path = self.data.parent / f"{self.data.name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
