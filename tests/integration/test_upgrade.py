"""Upgrades: ``kvcached upgrade`` hands the RAM arena and the listening sockets to a successor
(kvcached.lifecycle.handover), with clients in other processes working the whole time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress

from .agent_worker import payload
from .conftest import KVCACHED, DaemonProcess, run_cli, wait_for
from .test_arena_survival import memfd_inodes, ram_status, summary

HERE = Path(__file__).parent
KIB = 1024
UPGRADES = int(os.environ.get("KVCACHED_TEST_UPGRADES", "20"))


class Service:
    """A daemon whose serving process changes at each upgrade (the successor is a child of the
    process it replaced, not of the test)."""

    def __init__(self, d: DaemonProcess) -> None:
        self.d = d
        assert d.proc is not None
        self.pid = d.proc.pid

    def upgrade(self) -> dict[str, Any]:
        before = self.pid
        r = run_cli(["upgrade", "--json", *self.d.args()], timeout=120)
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{self.d.log()}"
        answer = json.loads(r.stdout)
        assert answer["op"] == "upgraded" and answer["ok"], answer
        self.pid = answer["pid"]
        wait_for(lambda: not alive(before), text=f"the previous daemon {before} exiting")
        return answer

    def stop(self) -> None:
        if alive(self.pid):
            os.kill(self.pid, signal.SIGTERM)
            wait_for(lambda: not alive(self.pid), timeout=30, text="the daemon stopping")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    d = DaemonProcess(tmp_path, ["kv.ram_gib=0.25"]).start()
    s = Service(d)
    yield s
    s.stop()
    if d.proc is not None and d.proc.poll() is None:
        d.proc.kill()


def load(mode: str, where: str, seed: str, cwd: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "upgrade_load.py"), mode, where, seed], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=open(cwd / f"load-{seed}.err", "w"), text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"started": True}, (cwd / f"load-{seed}.err").read_text()
    return proc


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def ram_keys(d: DaemonProcess) -> set[bytes]:
    with d.client() as c:
        return {r.address.digest for r in c.list_blocks(tier=pb.TIER_RAM, page_size=1000)}


def test_upgrade_keeps_the_ram_tier_and_the_same_memory(service: Service) -> None:
    d = service.d
    blocks = {BlockAddress(f"up-{i}".encode().ljust(32, b".")): payload(f"up-{i}".encode().ljust(32, b"."), 0, 64 * KIB)
              for i in range(50)}
    with d.client() as c:
        c.put(blocks.items())
    inode = memfd_inodes(service.pid, "kvcached-arena")
    answer = service.upgrade()
    assert d.proc is not None and d.proc.wait(10) == 0          # the old one exits cleanly
    assert memfd_inodes(service.pid, "kvcached-arena") == inode
    got = summary(d)
    assert (got["adopted"], got["trusted"], got["mismatched"]) == ("50", "True", "0")
    with d.client() as c:
        fetched, _ = c.get(list(blocks))
        assert all(f.payload == blocks[f.address] for f in fetched) and len(fetched) == 50
    log = d.log()
    assert "handed over; exiting" in log and "took over from the previous daemon" in log
    assert answer["elapsed_s"] < 30


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_twenty_upgrades_under_load(service: Service, tmp_path: Path) -> None:
    """Agents save and load and gRPC clients put and get, each in a process of its own, while
    the daemon is upgraded 20 times: no call fails, no byte is wrong, nothing stored goes
    missing, every block in RAM before an upgrade is in RAM after, and the arena is the same
    memory throughout."""
    d = service.d
    loads = [load("grpc", d.target, f"g{i}", tmp_path) for i in range(2)]
    loads += [load("agent", str(d.state / "agent.sock"), f"a{i}", tmp_path) for i in range(2)]
    inode = memfd_inodes(service.pid, "kvcached-arena")
    time.sleep(1.0)
    handovers = []
    for _ in range(UPGRADES):
        before = ram_keys(d)
        handovers.append(service.upgrade()["elapsed_s"])
        assert memfd_inodes(service.pid, "kvcached-arena") == inode
        missing = before - ram_keys(d)
        assert not missing, f"{len(missing)} RAM blocks lost at an upgrade"
    time.sleep(0.5)
    results = [finish(p) for p in loads]
    for r in results:
        assert r["failed"] == 0 and r["wrong"] == 0 and r["missing"] == 0, json.dumps(results)
        assert r["calls"] > 40, results
    assert ram_status(d).ram_taken_over


def test_a_predecessor_that_dies_during_the_handover(tmp_path: Path) -> None:
    """SIGKILL the old daemon at points of the handover: the successor serves, either with the
    RAM tier (checked block by block unless the old one released it cleanly) or starting clean;
    every byte it serves is right."""
    for attempt, pause in enumerate((None, 0.0, 0.02)):
        state = tmp_path / f"run{attempt}"
        state.mkdir()
        d = DaemonProcess(state, ["kv.ssd_gib=0"]).start()
        old = d.proc
        assert old is not None
        blocks = {BlockAddress(f"die-{i}".encode().ljust(32, b".")): payload(f"die-{i}".encode().ljust(32, b"."),
                                                                                0, 32 * KIB) for i in range(30)}
        with d.client() as c:
            c.put(blocks.items())
        wait_for(lambda: (state / "index" / "handover.sock").exists(), text="the handover socket")
        if pause is None:                 # frozen before it can answer: dies before passing anything
            old.send_signal(signal.SIGSTOP)
        successor = subprocess.Popen(KVCACHED + ["serve", *d.args(), "--takeover"], cwd=state,
                                     stdout=open(state / "successor.log", "wb"), stderr=subprocess.STDOUT)
        try:
            if pause is None:             # once it asked (the old one, frozen, cannot answer)
                wait_for(lambda: b"asking the running daemon to hand over" in (state / "successor.log").read_bytes(),
                         timeout=30, text="the successor asking")
                time.sleep(0.3)
            else:                         # dies once the successor has the files
                wait_for(lambda: b"taking over from the running daemon" in (state / "successor.log").read_bytes(),
                         timeout=30, text="the successor receiving the files")
                time.sleep(pause)
            old.kill()
            old.wait()
            d.proc = successor
            d.log_path = state / "successor.log"
            d.wait_ready(30)
            status = ram_status(d)
            with d.client() as c:
                fetched, _ = c.get(list(blocks), allow_partial=True)
            assert all(f.payload == blocks[f.address] for f in fetched)
            if pause is None:
                assert not status.ram_taken_over and fetched == []      # started clean
                assert "went away before it passed anything" in d.log()
            else:
                got = summary(d)
                assert got["mismatched"] == "0" and got["adopted"] == "30", got
                assert len(fetched) == 30
                if got["trusted"] == "False":
                    assert "its RAM tier is checked before use" in d.log()
        finally:
            successor.kill()
            successor.wait()


def test_takeover_without_a_running_daemon_is_refused(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, [])
    r = subprocess.run(KVCACHED + ["serve", *d.args(), "--takeover"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "--takeover: no daemon to take over from" in r.stderr + r.stdout
    r = run_cli(["upgrade", *d.args()])
    assert r.returncode == 1 and "upgrade: no daemon answers" in r.stderr


def test_a_second_daemon_on_the_same_tcp_port_is_refused(tmp_path: Path) -> None:
    """gRPC listens with SO_REUSEPORT so that a successor can listen beside its predecessor; a
    daemon that is not taking over still refuses a port another process holds."""
    from .test_operations import free_tcp_port

    port = free_tcp_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listen = f'grpc.listen=["unix:{{}}", "127.0.0.1:{port}"]'
    first = DaemonProcess(tmp_path / "a", [listen.format(tmp_path / "a" / "kvcached.sock")]).start()
    try:
        second = subprocess.run(KVCACHED + ["serve", *DaemonProcess(tmp_path / "b", [
            listen.format(tmp_path / "b" / "kvcached.sock")]).args()], cwd=tmp_path / "b", capture_output=True,
            text=True, timeout=60)
        assert second.returncode == 1 and "another process holds the port" in second.stderr + second.stdout
    finally:
        first.stop()


def test_garbage_on_the_handover_socket_changes_nothing(service: Service) -> None:
    """Malformed requests, an unknown op, a request cut short: each is refused in the log and
    the daemon serves on."""
    import socket as sk

    d = service.d
    path = str(d.state / "index" / "handover.sock")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    for data in (b"not json", b'{"op": "format-disk"}', b"[1, 2]", b""):
        with sk.socket(sk.AF_UNIX, sk.SOCK_SEQPACKET) as s:
            s.connect(path)
            if data:
                s.send(data)
            else:
                s.shutdown(sk.SHUT_WR)
            s.settimeout(10)
            assert s.recv(1024) == b""              # closed without an answer
    with d.client() as c:
        assert c.stats().version
    wait_for(lambda: d.log().count("handover failed; serving on") >= 3, text="refusals logged")
    assert "unknown request 'format-disk'" in d.log()
    assert alive(service.pid)


def test_a_successor_that_fails_during_the_handover(tmp_path: Path) -> None:
    """A successor that cannot listen: the old daemon serves on. A successor killed after the old
    one released the index: the old process starts again (the same pid) and takes the RAM tier
    up, every block checked. Either way every block is served, bit-exact."""
    import socket as sk

    from .test_operations import free_tcp_port

    d = DaemonProcess(tmp_path, ["kv.ssd_gib=0"]).start()
    assert d.proc is not None
    blocks = {BlockAddress(f"fail-{i}".encode().ljust(32, b".")): payload(f"fail-{i}".encode().ljust(32, b"."),
                                                                           0, 32 * KIB) for i in range(30)}
    with d.client() as c:
        c.put(blocks.items())

    def all_served() -> None:
        with d.client() as c:
            fetched, _ = c.get(list(blocks))
        assert len(fetched) == 30 and all(f.payload == blocks[f.address] for f in fetched)

    def successor(*extra: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"successor-{time.monotonic_ns()}.log"
        return subprocess.Popen(KVCACHED + ["serve", *d.args(), *extra, "--takeover"], cwd=tmp_path,
                                stdout=open(log, "wb"), stderr=subprocess.STDOUT)

    # 1. it cannot listen (its TCP port is held): nothing changed
    port = free_tcp_port()
    with sk.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        s = successor("--set", f'grpc.listen=["unix:{d.socket}", "127.0.0.1:{port}"]')
        assert s.wait(60) == 1
    wait_for(lambda: "handover failed; serving on" in d.log(), text="the old daemon serving on")
    assert d.proc.poll() is None
    all_served()

    # 2. killed after the old one released the index (a race with its start: tried until won)
    for _ in range(5):
        released = d.log().count("released the index to the successor")
        s = successor()
        deadline = time.monotonic() + 60
        while d.log().count("released the index to the successor") == released and time.monotonic() < deadline:
            time.sleep(0.002)
        s.kill()
        s.wait()
        if d.proc.poll() is None:           # the old process started again in place
            break
        # the successor served before it was killed: start over from a daemon of our own
        d.start()
        with d.client() as c:
            c.put(blocks.items())
    else:
        pytest.skip("the successor always served before it could be killed")
    wait_for(lambda: "starting again in this process" in d.log(), text="the old process starting again")
    d.wait_ready(30)
    got = summary(d)
    assert (got["trusted"], got["adopted"], got["mismatched"]) == ("False", "30", "0"), got
    all_served()
    d.stop()
