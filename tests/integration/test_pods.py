"""The topology of the Helm chart (deploy/helm/kvcached, docs/kubernetes.md), run with Linux
namespaces: daemon "pods" and engine "pods" (tests/pods.py), each in its own mount, PID, UTS,
IPC and network namespaces, seeing only the image and the hostPath directories the chart mounts.

- The node's directories: the state (index, handover socket), the sockets (one directory per
  tenant), and the arena's, on a tmpfs (/dev/shm), with ``kv.arena = "file"``.
- Two engine pods run as the same uid, each with its own tenant's socket directory alone: the
  daemon names the tenant by the socket (tenants.agent_sockets), not by the uid.
- A rolling update: a second daemon pod (``serve --rolling``) started beside the first takes
  over through the handover socket in the shared state directory, while both engines save and
  load; then the same with the old pod SIGKILLed halfway through the handover.
- A daemon pod SIGKILLed and replaced: its RAM blocks are served again from the arena files,
  each checked; a byte flipped in them while no daemon ran is never served.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from kvcached.client import KvCacheClient
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pbg
from kvcached_agent.address import CROSS_LAYER

from ..pods import PodSpec, kill_pod, pod_command, pod_pid
from .agent_worker import payload
from .conftest import DaemonProcess, wait_for
from .test_agent import Worker

HERE = Path(__file__).parent
BLOCK = 64 * 1024
ENGINE_UID = 1000          # both teams' engines: one uid, as pods of different teams often are
TENANTS = ("alice", "bob")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="pods need root and unshare (util-linux)")


class Node:
    """The node's directories the chart mounts (hostPath), and the daemon's configuration."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "n" / "state"          # short: the sockets' paths must fit AF_UNIX's 108 bytes
        self.run = tmp / "n" / "run"
        self.config = tmp / "n" / "config"
        self.arena = Path(tempfile.mkdtemp(prefix="kvt-arena-", dir="/dev/shm"))    # a tmpfs, as the chart's
        for d in (self.state, self.run, self.config):
            d.mkdir(parents=True)
        sockets = ", ".join(f'{t} = "/run/kvcached/tenants/{t}/agent.sock"' for t in TENANTS)
        (self.config / "kvcached.toml").write_text(f"""
[kv]
ram_gib = 0.0625
max_block_mib = 1
arena = "file"
arena_dir = "/var/lib/kvcached-arena"
index_dir = "/var/lib/kvcached/index"
ssd_dir = "/var/lib/kvcached/ssd"
ssd_gib = 0
[grpc]
listen = ["unix:/run/kvcached/admin/kvcached.sock"]
health_listen = "0.0.0.0:8470"
grace_s = 2
[agent]
socket = ""
mode = "0666"
heartbeat_s = 1
[metrics]
listen = "127.0.0.1:9464"
[tenants]
default = ""
agent_sockets = {{ {sockets} }}
""")

    @property
    def admin(self) -> str:
        return f"unix:{self.run / 'admin' / 'kvcached.sock'}"

    def socket_dir(self, tenant: str) -> Path:
        return self.run / "tenants" / tenant

    def close(self) -> None:
        shutil.rmtree(self.arena, ignore_errors=True)


class DaemonPod:
    """A pod of the chart's DaemonSet: the daemon with ``serve --rolling``."""

    def __init__(self, node: Node, name: str) -> None:
        self.node, self.name = node, name
        self.spec = PodSpec(name, node.tmp / "pods" / name, [
            (str(node.state), "/var/lib/kvcached", False), (str(node.run), "/run/kvcached", False),
            (str(node.arena), "/var/lib/kvcached-arena", False), (str(node.config), "/config", True)])
        self.log_path = node.tmp / f"{name}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(pod_command(self.spec, [sys.executable, "-m", "kvcached.cli", "serve", "--config",
                                                             "/config/kvcached.toml", "--rolling"]),
                                     stdout=log, stderr=log)
        log.close()
        self.pid = pod_pid(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        wait_for(lambda: text in self.log() or self.proc.poll() is not None, timeout=timeout, text=text)
        assert text in self.log(), self.log()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def health(self, service: str = "") -> str:
        """What Kubernetes' gRPC probe would get on the pod's address (run in its network
        namespace): the readiness probe's answer, or with ``service`` the liveness probe's."""
        probe = ("import grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; "
                 "ch = grpc.insecure_channel('127.0.0.1:8470'); "
                 "print(h.HealthCheckResponse.ServingStatus.Name(g.HealthStub(ch).Check(h.HealthCheckRequest("
                 f"service={service!r}), timeout=5).status))")
        r = subprocess.run(["nsenter", f"--net=/proc/{self.pid}/ns/net", sys.executable, "-c", probe],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else "UNREACHABLE"

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_pod(self.proc.pid)
            self.proc.wait(10)


def engine_spec(node: Node, tenant: str, name: str) -> PodSpec:
    """An engine pod of ``tenant``: its own tenant's socket directory, read-only, and nothing else."""
    return PodSpec(name, node.tmp / "pods" / name, [(str(node.socket_dir(tenant)), f"/run/kvcached/tenants/{tenant}",
                                                     True)], uid=ENGINE_UID, gid=ENGINE_UID)


def engine_worker(node: Node, tenant: str, name: str) -> Worker:
    prefix = pod_command(engine_spec(node, tenant, name), [])
    return Worker(DaemonProcess(node.tmp), name, "--torch", "--num-layers", "1", "--layer-block-bytes", str(BLOCK),
                  "--dtype", "uint8", socket_path=f"/run/kvcached/tenants/{tenant}/agent.sock", prefix=prefix).ready()


def engine_load(node: Node, tenant: str, seed: str) -> subprocess.Popen[str]:
    """tests/integration/upgrade_load.py's agent loop in an engine pod of ``tenant``."""
    spec = engine_spec(node, tenant, f"load-{seed}")
    spec.cwd = str(HERE)
    err = open(node.tmp / f"load-{seed}.err", "w")
    proc = subprocess.Popen(pod_command(spec, [sys.executable, "upgrade_load.py", "agent",
                                               f"/run/kvcached/tenants/{tenant}/agent.sock", seed]),
                            stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"started": True}, (node.tmp / f"load-{seed}.err").read_text()
    return proc


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Stop a load (SIGTERM to its pod's process) and read what it counted."""
    os.kill(pod_pid(proc.pid), signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def blocks(seed: str, n: int) -> list[list[Any]]:
    return [[f"{seed}-{i}".encode().ljust(32, b".").hex(), CROSS_LAYER] for i in range(n)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


@pytest.fixture
def pods() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for pod in started:           # the whole pod: its first process ends its PID namespace
        proc = pod.proc if isinstance(pod, (DaemonPod, Worker)) else pod
        if proc.poll() is None:
            kill_pod(proc.pid)
            proc.wait(10)


def ram_summary(node: Node) -> dict[str, str]:
    """What the take-up of the RAM tier found, once done (Admin ReconcileStatus)."""
    def status() -> pb.ReconcileStatusResponse:
        with grpc.insecure_channel(node.admin) as channel:
            return pbg.AdminStub(channel).ReconcileStatus(pb.ReconcileStatusRequest(), timeout=10)
    wait_for(lambda: status().ram_done, text="the RAM tier taken up")
    return dict(item.split("=") for item in status().ram_summary.split())


def ram_blocks(node: Node) -> int:
    with KvCacheClient(node.admin, timeout=10) as c:
        return sum(t.blocks for t in c.stats().tiers if t.tier == pb.TIER_RAM)


@pytest.mark.timeout(180)
def test_two_teams_on_one_uid_each_see_their_own_blocks_alone(node: Node, pods: list[Any]) -> None:
    daemon = DaemonPod(node, "kvcached-a")
    pods.append(daemon)
    daemon.wait_log("ready")
    assert daemon.health() == "SERVING"
    # What an engine pod sees of the node: its own tenant's socket directory, nothing else.
    look = ("import os; print(os.listdir('/run/kvcached'), os.listdir('/run/kvcached/tenants'), "
            "os.path.exists('/run/kvcached/tenants/alice/agent.sock'), os.path.exists('/var/lib/kvcached'), "
            "os.path.exists('/var/lib/kvcached-arena'), os.getuid())")
    r = subprocess.run(pod_command(engine_spec(node, "alice", "look"), [sys.executable, "-c", look]),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "['tenants'] ['alice'] True False False 1000", r.stderr
    alice, bob = engine_worker(node, "alice", "alice-engine"), engine_worker(node, "bob", "bob-engine")
    pods += [alice, bob]
    shape = {"dtype": "uint8", "shape": [BLOCK]}
    mine, same = blocks("alice-own", 8), blocks("shared-prompt", 8)
    assert alice.call("save", blocks=mine + same, **shape)["stored"] == 16
    got = alice.call("load", blocks=mine + same, **shape)
    assert (got["loaded"], got["missing"], got["bad"]) == (16, [], [])
    # Bob, the same uid, names the same digests: none is his to find or load.
    found = bob.call("lookup", digests=[d for d, _ in mine + same])["result"]
    assert found[0] == 0, found
    got = bob.call("load", blocks=mine + same, **shape)
    assert got["loaded"] == 0 and len(got["missing"]) == 16 and got["bad"] == []
    # His own save of the shared prompt is a block of his own, which alice's does not answer.
    assert bob.call("save", blocks=same, **shape)["stored"] == 8
    assert bob.call("load", blocks=same, **shape)["loaded"] == 8
    assert ram_blocks(node) == 24
    assert "tenant=alice" in daemon.log() and "tenant=bob" in daemon.log()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("old_pod", ["exits", "killed_halfway"])
def test_a_rolling_update_keeps_the_ram_tier_under_load(node: Node, pods: list[Any], old_pod: str) -> None:
    """maxSurge 1, maxUnavailable 0: the new pod starts beside the old one and takes over while
    both engines save and load; no call fails and no RAM block is lost. ``killed_halfway``: the
    old pod is SIGKILLed once it has passed its files, and the new one takes up the arena files
    with every block checked."""
    old = DaemonPod(node, "kvcached-old")
    pods.append(old)
    old.wait_log("ready")
    loads = [engine_load(node, "alice", "a"), engine_load(node, "bob", "b")]
    pods.extend(loads)
    wait_for(lambda: ram_blocks(node) >= 64, timeout=60, text="both engines saving")
    time.sleep(0.5)
    new = DaemonPod(node, "kvcached-new")
    pods.append(new)
    if old_pod == "killed_halfway":
        old.wait_log("handing over to a successor")
        old.signal(signal.SIGKILL)
        assert old.wait() != 0
    new.wait_log("took over from the previous daemon")
    if old_pod == "exits":
        old.wait_log("waiting for SIGTERM")       # the pod lingers, holding nothing, until it is deleted
        assert old.proc.poll() is None
        # Not ready (the DaemonSet controller deletes it) but alive: the kubelet must not start it again.
        assert (old.health(), old.health("kvcached.liveness")) == ("NOT_SERVING", "SERVING")
    assert (new.health(), new.health("kvcached.liveness")) == ("SERVING", "SERVING")
    time.sleep(1.0)                                  # the engines work on against the new pod
    counts = [finish(p) for p in loads]
    for c in counts:
        assert c["failed"] == 0 and c["wrong"] == 0 and c["missing"] == 0, counts
        assert c["reconnects"] >= 1, counts
    if old_pod == "exits":
        old.signal(signal.SIGTERM)                   # the pod's deletion
        assert old.wait() == 0
        assert "took over" in new.log() and "trusted=True" in new.log()
    else:
        assert "trusted=False" in new.log()
    summary = ram_summary(node)
    assert summary["mismatched"] == "0" and int(summary["adopted"]) >= 64, summary


@pytest.mark.timeout(180)
def test_a_killed_daemon_pod_is_replaced_and_its_ram_tier_checked(node: Node, pods: list[Any]) -> None:
    first = DaemonPod(node, "kvcached-1")
    pods.append(first)
    first.wait_log("ready")
    alice = engine_worker(node, "alice", "alice-1")
    pods.append(alice)
    shape = {"dtype": "uint8", "shape": [BLOCK]}
    saved = blocks("kept", 12)
    assert alice.call("save", blocks=saved, **shape)["stored"] == 12
    with KvCacheClient(node.admin, timeout=10) as c:      # recorded once checksummed, just after the save
        wait_for(lambda: len(list(c.list_blocks(tier=pb.TIER_RAM))) == 12, text="the saves recorded")
    first.signal(signal.SIGKILL)
    alice.proc.kill()
    first.wait()
    # While no daemon runs, a byte of one block flips in the arena file on the node's tmpfs.
    victim = payload(bytes.fromhex(saved[3][0]), CROSS_LAYER, BLOCK)
    arenas = [p for p in node.arena.iterdir() if p.name.startswith("kvcached-arena")]
    flipped = 0
    for path in arenas:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            at = m.find(victim[:4096])
            if at >= 0:
                m[at + 100] ^= 0xFF
                flipped += 1
    assert flipped == 1
    second = DaemonPod(node, "kvcached-2")           # a fresh pod: new namespaces, the same node directories
    pods.append(second)
    second.wait_log("ready")
    summary = ram_summary(node)
    assert (summary["adopted"], summary["mismatched"], summary["trusted"]) == ("11", "1", "False"), (summary, second.log())
    alice = engine_worker(node, "alice", "alice-2")
    pods.append(alice)
    got = alice.call("load", blocks=saved, **shape)
    assert got["loaded"] == 11 and got["missing"] == [3] and got["bad"] == [], got


def test_an_arena_directory_that_cannot_hold_the_tier_stops_the_start(make_daemon: Any, tmp_path: Path,
                                                                      node: Node) -> None:
    """kv.arena = "file" on a disk (the pages would be written to it) and on another user's
    directory: the daemon does not start, says why in one line, and leaves what is there alone."""
    disk = tmp_path / "on-disk"
    d = make_daemon('kv.arena="file"', f'kv.arena_dir="{disk}"', "kv.ssd_gib=0", start=False)
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(20) != 0
    assert "kv.arena_dir" in d.log() and "not tmpfs or hugetlbfs" in d.log() and "Traceback" not in d.log()
    theirs = node.arena / "theirs"
    theirs.mkdir()
    (theirs / "kvcached-arena").write_bytes(b"someone else's")
    os.chown(theirs, 1000, 1000)
    (tmp_path / "b").mkdir()
    d = make_daemon('kv.arena="file"', f'kv.arena_dir="{theirs}"', "kv.ssd_gib=0", state=tmp_path / "b", start=False)
    d.start(wait=False)
    assert d.proc is not None and d.proc.wait(20) != 0
    assert "belongs to uid 1000" in d.log() and "Traceback" not in d.log()
    assert (theirs / "kvcached-arena").read_bytes() == b"someone else's"
