"""Kubernetes pods on one machine, made of Linux namespaces (tests/integration/test_pods.py).

A :class:`PodSpec` says what a pod of the Helm chart (deploy/helm/kvcached) sees: its own mount,
PID, UTS, IPC and network namespaces, a root file system with the image alone in it (the Python
install and this project, read-only), and the hostPath volumes the chart mounts, bound in from
directories of the test that stand for the node's. :func:`pod_command` is the command line that
starts a program in such a pod (tests/pod_launch.py does the inside work); the process the test
starts is ``unshare``, and :func:`pod_pid` finds the pod's first process (pid 1 inside) from it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = Path(__file__).resolve().parent / "pod_launch.py"
# The image: the Python install, this project (its venv and sources), and the system's own files.
IMAGE = sorted({sys.base_prefix, str(ROOT), "/usr", "/etc", *[p for p in ("/bin", "/lib", "/lib64", "/sbin")
                                                               if os.path.exists(p)]})


@dataclass
class PodSpec:
    name: str
    root: Path                                         # where the pod's root file system is mounted
    volumes: list[tuple[str, str, bool]] = field(default_factory=list)   # (node path, pod path, read-only)
    uid: int = 0
    gid: int = 0
    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> str:
        return json.dumps({"root": str(self.root), "hostname": self.name, "image": IMAGE,
                           "volumes": [list(v) for v in self.volumes], "uid": self.uid, "gid": self.gid,
                           "cwd": self.cwd, "env": {"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp",
                                                    "OMP_NUM_THREADS": "1", **self.env}})


def pod_command(spec: PodSpec, cmd: list[str]) -> list[str]:
    """``cmd`` run in a new pod of ``spec``; killing the returned process kills the whole pod."""
    return ["unshare", "--mount", "--pid", "--uts", "--net", "--ipc", "--fork", "--kill-child",
            sys.executable, str(LAUNCH), spec.as_json(), "--", *cmd]


def kill_pod(unshare_pid: int) -> None:
    """SIGKILL the pod's first process, which ends every process of its PID namespace, then its
    ``unshare``."""
    try:
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    except FileNotFoundError:
        children = []
    for pid in [*map(int, children), unshare_pid]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def pod_pid(unshare_pid: int, timeout: float = 10.0) -> int:
    """The host pid of the pod's first process (the child ``unshare`` forked)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        except FileNotFoundError:
            raise AssertionError(f"the pod's unshare {unshare_pid} exited") from None
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError(f"the pod's unshare {unshare_pid} started no process")
