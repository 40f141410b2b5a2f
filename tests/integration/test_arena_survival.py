"""The RAM tier survives a crash through systemd's file descriptor store (docs/operations.md).

A :class:`tests.fdstore.ServiceManager` speaks systemd's side of the protocol: the daemon stores
its arena and slot directory with FDSTORE=1, is SIGKILLed, and starts again with them from
fd 3 on (LISTEN_FDS, LISTEN_FDNAMES), as systemd restarts a service that crashed.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pbg
from kvcached_agent.address import BlockAddress

from ..fdstore import ServiceManager
from .agent_worker import payload
from .conftest import DaemonProcess, wait_for
from .test_agent import Worker

KIB = 1024
NO_SSD = "kv.ssd_gib=0"


def block(i: int, seed: str, size: int = 64 * KIB) -> tuple[BlockAddress, bytes]:
    digest = f"{seed}-{i}".encode().ljust(32, b".")[:32]
    return BlockAddress(digest), payload(digest, 0, size)


@pytest.fixture
def manager(tmp_path: Path):  # type: ignore[no-untyped-def]
    m = ServiceManager(tmp_path / "notify")
    yield m
    m.close()


def start(d: DaemonProcess, manager: ServiceManager) -> DaemonProcess:
    d.prefix, d.env, d.pass_fds = manager.start_prefix()
    try:
        d.start()
    finally:
        manager.started()
    return d


def ram_status(d: DaemonProcess) -> pb.ReconcileStatusResponse:
    with grpc.insecure_channel(d.target) as channel:
        return pbg.AdminStub(channel).ReconcileStatus(pb.ReconcileStatusRequest(), timeout=10)


def summary(d: DaemonProcess) -> dict[str, str]:
    wait_for(lambda: ram_status(d).ram_done, text="the RAM tier taken over")
    return dict(item.split("=") for item in ram_status(d).ram_summary.split())


def memfd_inodes(pid: int, name: str) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name}"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def test_a_crash_keeps_every_block_in_ram(tmp_path: Path, manager: ServiceManager) -> None:
    d = start(DaemonProcess(tmp_path, [NO_SSD]), manager)
    manager.wait_for("READY", "1")
    assert set(manager.stored) == {"kvcached-arena", "kvcached-slots"}
    inode = os.fstat(manager.stored["kvcached-arena"]).st_ino
    blocks = dict(block(i, "crash") for i in range(40))
    with d.client() as c:
        c.put(blocks.items())
    assert not ram_status(d).ram_taken_over
    d.stop(signal.SIGKILL)

    start(d, manager)
    assert memfd_inodes(d.proc.pid, "kvcached-arena") == {inode}       # the same memory
    got = summary(d)
    assert (got["listed"], got["adopted"], got["mismatched"], got["trusted"]) == ("40", "40", "0", "False")
    with d.client() as c:
        fetched, _ = c.get(list(blocks))
        assert [f.payload for f in fetched] == list(blocks.values())        # bit-exact
        assert c.stats().tiers[0].blocks == 40
    assert "RAM arenas taken over from the previous process" in d.log()
    # a clean stop and a start: the same again (the fd store outlives both)
    assert d.stop() == 0
    start(d, manager)
    assert summary(d)["adopted"] == "40"
    d.stop()
    assert not any("ERROR" in m for m in manager.messages)


def test_flipped_bytes_and_half_written_saves_are_never_served(tmp_path: Path, manager: ServiceManager) -> None:
    from .test_operations import free_tcp_port

    port = free_tcp_port()
    d = start(DaemonProcess(tmp_path, [NO_SSD, f'metrics.listen="127.0.0.1:{port}"']), manager)
    blocks = dict(block(i, "flip") for i in range(8))
    with d.client() as c:
        c.put(blocks.items())
    # An agent's save stopped halfway (reserved, half copied, never committed), and one written
    # whole but not committed: neither may ever be served.
    worker = Worker(d, "w0", "--layer-block-bytes", str(64 * KIB)).ready()
    half = [b"half".ljust(32, b"."), 0, 64 * KIB]
    whole = [b"whole".ljust(32, b"."), 0, 64 * KIB]
    worker.call("allocate", blocks=[[half[0].hex(), 0, half[2]]], write="half")
    worker.call("allocate", blocks=[[whole[0].hex(), 0, whole[2]]], write="whole")
    d.stop(signal.SIGKILL)
    worker.proc.kill()
    # flip one byte of one block in the arena while no daemon runs
    victim_address, victim = next(iter(blocks.items()))
    arena = mmap.mmap(manager.stored["kvcached-arena"], 0, mmap.MAP_SHARED)
    at = arena.find(victim[:4096])
    assert at >= 0
    arena[at + 1000] ^= 0xFF
    arena.close()

    start(d, manager)
    got = summary(d)
    assert (got["listed"], got["adopted"], got["mismatched"]) == ("8", "7", "1")
    with d.client() as c:
        fetched, misses = c.get(list(blocks), allow_partial=True)
        assert {f.address for f in fetched} == set(blocks) - {victim_address}
        assert all(f.payload == blocks[f.address] for f in fetched)
        assert len(misses) == 1 and "lost at restart" in misses[0].reason
        stray, _ = c.get([BlockAddress(half[0]), BlockAddress(whole[0])], allow_partial=True)
        assert stray == []
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvcached_integrity_failures_total{tier="ram"} 1.0' in text
    assert 'kvcached_ram_takeover_blocks{outcome="mismatched"} 1.0' in text
    assert 'kvcached_ram_takeover_blocks{outcome="adopted"} 7.0' in text
    d.stop()


def test_kill_during_saves_serves_every_acknowledged_block(tmp_path: Path, manager: ServiceManager) -> None:
    """Puts run in a loop while the daemon is SIGKILLed: after the restart every block whose Put
    was acknowledged is served bit-exact, and nothing else is served wrong."""
    d = start(DaemonProcess(tmp_path, [NO_SSD]), manager)
    acked: dict[BlockAddress, bytes] = {}
    tried: dict[BlockAddress, bytes] = {}
    stop = threading.Event()

    def writer() -> None:
        i = 0
        with d.client(timeout=5) as c:
            while not stop.is_set():
                batch = dict(block(i + j, "load", 32 * KIB) for j in range(4))
                tried.update(batch)
                i += 4
                try:
                    c.put(batch.items())
                except grpc.RpcError:
                    return
                acked.update(batch)

    thread = threading.Thread(target=writer)
    thread.start()
    wait_for(lambda: len(acked) >= 200, text="puts acknowledged")
    d.stop(signal.SIGKILL)
    stop.set()
    thread.join()
    start(d, manager)
    got = summary(d)
    assert int(got["adopted"]) >= len(acked) and got["mismatched"] == "0"
    with d.client() as c:
        addresses = list(tried)
        for i in range(0, len(addresses), 64):
            fetched, _ = c.get(addresses[i:i + 64], allow_partial=True)
            assert all(f.payload == tried[f.address] for f in fetched)
            served = {f.address for f in fetched}
            assert {a for a in addresses[i:i + 64] if a in acked} <= served
    d.stop()


def test_another_arena_size_starts_clean(tmp_path: Path, manager: ServiceManager) -> None:
    d = start(DaemonProcess(tmp_path, [NO_SSD]), manager)
    with d.client() as c:
        c.put([block(0, "size")])
    d.stop(signal.SIGKILL)
    old = os.fstat(manager.stored["kvcached-arena"]).st_ino
    d.overrides.append("kv.ram_gib=0.25")
    start(d, manager)
    assert not ram_status(d).ram_taken_over
    assert "does not fit this configuration" in d.log()
    # the old arena left the store, the new one is in it
    wait_for(lambda: os.fstat(manager.stored["kvcached-arena"]).st_ino != old, text="new arena stored")
    with d.client() as c:
        assert c.get([block(0, "size")[0]], allow_partial=True)[0] == []
    d.stop()
    time.sleep(0.1)
    assert not any("ERROR" in m for m in manager.messages)


def test_an_unknown_file_or_half_of_the_pair_passed_at_start_is_not_used(tmp_path: Path,
                                                                        manager: ServiceManager) -> None:
    """A start given a file it does not know, and the arena without its slot directory: both are
    closed with a warning, the RAM tier starts empty (nothing unchecked is served), the store
    ends up holding a new, whole pair."""
    d = start(DaemonProcess(tmp_path, [NO_SSD]), manager)
    address, data = block(0, "half")
    with d.client() as c:
        c.put([(address, data)])
    d.stop(signal.SIGKILL)
    old_arena = os.fstat(manager.stored["kvcached-arena"]).st_ino
    os.close(manager.stored.pop("kvcached-slots"))
    manager.stored["something-else"] = os.memfd_create("something-else")
    start(d, manager)
    log = d.log()
    assert "file descriptor passed at start not used" in log and "name=something-else" in log
    assert "passed at start without their slot directory" in log
    assert not ram_status(d).ram_taken_over
    with d.client() as c:
        assert c.get([address], allow_partial=True)[0] == []
        c.put([(address, data)])                     # and it serves: a new arena
        assert c.get([address])[0][0].payload == data
    wait_for(lambda: "kvcached-slots" in manager.stored
             and os.fstat(manager.stored["kvcached-arena"]).st_ino != old_arena, text="a new pair stored")
    d.stop()
