"""Start a process as a Kubernetes pod would run it, with Linux namespaces (tests/pods.py).

    unshare --mount --pid --uts --net --ipc --fork --kill-child python pod_launch.py SPEC -- CMD...

Run as root in the new namespaces (this process is pid 1 of the new PID namespace), it makes the
pod's root file system, a tmpfs, and binds into it only what ``SPEC`` (JSON) names: the image
(``image``: host paths bound read-only at the same path: the Python install, the project), the
hostPath volumes (``volumes``: [host, path in the pod, read_only]), a /dev with the usual device
nodes, /proc of the new PID namespace, a /tmp of its own; it brings up loopback in the new
network namespace, sets the host name, changes root, drops to ``uid``/``gid`` and runs CMD.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

DEVICES = ("null", "zero", "full", "random", "urandom")
PR_SET_PDEATHSIG = 1


def run(*argv: str) -> None:
    subprocess.run(argv, check=True)


def bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    run("mount", "--rbind", source, target)
    if read_only:
        run("mount", "-o", "remount,bind,ro", target)


def main() -> int:
    spec = json.loads(sys.argv[1])
    cmd = sys.argv[sys.argv.index("--") + 1:]
    root = spec["root"]
    run("mount", "--make-rprivate", "/")
    os.makedirs(root, exist_ok=True)
    run("mount", "-t", "tmpfs", "-o", "mode=0755", "pod-root", root)
    os.makedirs(root + "/dev", exist_ok=True)
    run("mount", "-t", "tmpfs", "-o", "mode=0755", "pod-dev", root + "/dev")
    for path in ("/dev/shm", "/tmp"):          # first: the image may lie under /tmp (a checkout there)
        os.makedirs(root + path, exist_ok=True)
        run("mount", "-t", "tmpfs", "-o", "mode=1777", "pod-tmp", root + path)
    for name in DEVICES:
        bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    for path in spec["image"]:
        bind(path, root + path, read_only=True)
    os.makedirs(root + "/proc", exist_ok=True)
    run("mount", "-t", "proc", "proc", root + "/proc")
    for host, inside, read_only in spec["volumes"]:
        bind(host, root + inside, read_only)
    run("ip", "link", "set", "lo", "up")
    socket.sethostname(spec["hostname"])
    os.chroot(root)
    os.chdir(spec.get("cwd", "/"))
    os.setgroups([])
    os.setgid(spec.get("gid", 0))
    os.setuid(spec.get("uid", 0))
    # unshare --kill-child asked the kernel to kill this process when unshare dies; a change of
    # credentials clears that request, so it is made again (the pod dies with its unshare).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.execvpe(cmd[0], cmd, {**spec.get("env", {}), "PATH": "/usr/local/bin:/usr/bin:/bin"})
    return 1


if __name__ == "__main__":
    sys.exit(main())
