"""An arena per tenant (issue 61, docs/security.md "The arena"): an agent of one tenant maps no
memory that holds another tenant's bytes, as users run it and as an attacker would look.

Alice's agent is also handed her arena's slab generations, which it cannot write, and which
moved when her slabs were recycled (an agent that page-locks arena memory for DMA locks such a
slab again: kvcached_agent.slab_pins).

Two tenants are two real users (alice and bob, made for the test), their agents forked children
that drop to those ids. Alice saves blocks whose every 32-byte run starts with a random 16-byte
marker, so that any 64-byte run of her payloads holds a whole marker. Bob's agent then scans
every byte of every memory object the daemon ever handed it (each file descriptor received,
every memfd it holds) and every shared mapping of its own process (/proc/self/maps: what else it
maps), and tries the daemon's own descriptors through /proc: no marker anywhere, and /proc
refuses. Alice loads her blocks bit-exact each time. The same holds:

1. at first, both tenants' blocks in RAM;
2. after bob filled the node four times over, so that alice's blocks went to SSD and the slabs that
   held them were punched out of her arena and given to bob's (recycled memory: the kernel
   counts what each arena holds);
3. after ``kvcached upgrade`` (the successor took every arena over);
4. after a crash (SIGKILL), the arenas taken back from the file descriptor store.

The daemon runs under a ServiceManager (systemd's side of the fd store), at a RAM tier of 8 MiB
with 256 KiB slabs, so 2 MiB of alice's and 32 MiB of bob's saves move slabs between arenas.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvcached_agent.agent import Agent
from kvcached_agent.slab_pins import SlabGenerationsView

from ..fdstore import ServiceManager
from .conftest import DaemonProcess, wait_for
from .test_arena_survival import start, summary
from .test_upgrade import Service
from .users import as_user, needs_users

pytestmark = [needs_users, pytest.mark.timeout(600)]

KIB = 1024
BLOCK = 64 * KIB
TOKENS = 16                     # per block
RAM = ["kv.ram_gib=0.0078125", "kv.max_block_mib=0.25", "kv.ssd_gib=0.125", 'kv.write_policy="write_through"']


def marked_payload(marker: bytes, n: int) -> bytes:
    """``n`` bytes: each 32-byte run the 16-byte ``marker``, then 16 random bytes."""
    out = bytearray(os.urandom(n))
    for at in range(0, n, 32):
        out[at:at + 16] = marker
    return bytes(out)


def connect(sock: Path, agent_id: str) -> Agent:
    return Agent.connect(str(sock), agent_id=agent_id, model="m", dtype="bf16", block_tokens=TOKENS, num_layers=1,
                         layer_block_bytes=BLOCK, timeout=20)


def tokens_of(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * TOKENS))


def saver(sock: Path, first: int, payloads: list[bytes]) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        torch.set_num_threads(1)        # a forked child: OpenMP's pool of the parent is not there
        with connect(sock, f"saver-{first}") as agent:
            addresses = agent.addresses(agent.hash_tokens(tokens_of(first, len(payloads))))
            stored = 0
            for at in range(0, len(payloads), 16):
                tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads[at:at + 16]]
                stored += agent.save(addresses[at:at + 16], tensors).stored
            return {"stored": stored}
    return work


def loader(sock: Path, first: int, payloads: list[bytes]) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        torch.set_num_threads(1)
        with connect(sock, f"loader-{first}") as agent:
            addresses = agent.addresses(agent.hash_tokens(tokens_of(first, len(payloads))))
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in payloads]
            loaded = agent.load(addresses, out).loaded
            exact = sum(bytes(t.numpy()) == p for t, p in zip(out, payloads))
            # the slab generations beside the arena (kvcached_agent.slab_pins): read-only here
            fd = agent.client.generations_fd
            view = SlabGenerationsView(fd)
            generations = sum(view.generation)
            view.close()
            refused = 0
            for attempt in (lambda: mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                            lambda: os.pwrite(fd, b"x", 64)):
                try:
                    attempt()
                except OSError:
                    refused += 1
            return {"loaded": loaded, "exact": exact, "generations": generations, "writes_refused": refused}
    return work


def scanner(sock: Path, inverted: list[bytes], daemon_pid: int, fill: int) -> Callable[[], dict[str, Any]]:
    """Bob's agent: saves ``fill`` blocks of his own, then scans what it can reach. The markers
    come inverted, so the plain ones exist in this process's private heap only (which is
    never scanned: it holds nothing the daemon handed over)."""
    def work() -> dict[str, Any]:
        torch.set_num_threads(1)
        needles = [bytes(b ^ 0xFF for b in m) for m in inverted]
        # The fork inherited the test's own descriptors (the ServiceManager's fd store holds the
        # daemon's memfds, as systemd does): an engine never has those, so they go first, and
        # every memfd held after this came from the daemon.
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                    os.close(int(fd))
            except OSError:
                pass
        with connect(sock, "scanner") as agent:
            addresses = agent.addresses(agent.hash_tokens(tokens_of(10_000_000, max(fill, 1))))
            stored = 0
            for at in range(0, fill, 16):
                part = addresses[at:at + 16]
                stored += agent.save(part, [torch.frombuffer(bytearray(os.urandom(BLOCK)), dtype=torch.uint8)
                                            for _ in part]).stored
            found, scanned, objects, inodes = 0, 0, [], set()
            # every memfd this process holds: the arena the Welcome handed over, and any other
            for fd in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/memfd:") or target.startswith("/dev/shm"):
                    objects.append(target)
                    inodes.add(os.fstat(int(fd)).st_ino)
                    size = os.fstat(int(fd)).st_size
                    for at in range(0, size, 4 << 20):
                        chunk = os.pread(int(fd), (4 << 20) + 15, at)
                        found += sum(chunk.count(n) for n in needles)
                        scanned += len(chunk)
            # every shared mapping of this process (what else it maps), read in place (a process
            # that dropped from root to a user may not open its own /proc/self/mem)
            with open("/proc/self/maps") as maps:
                lines = maps.read().splitlines()
            for line in lines:
                fields = line.split()
                if "r" not in fields[1] or "s" not in fields[1]:
                    continue
                if int(fields[4]) in inodes:    # a memfd read whole above (reading its holes here would fill them)
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                objects.append(fields[5] if len(fields) > 5 else "anonymous shared")
                for at in range(lo, hi, 4 << 20):
                    chunk = ctypes.string_at(at, min(4 << 20, hi - at))
                    found += sum(chunk.count(n) for n in needles)
                    scanned += len(chunk)
            refused = 0                     # the daemon's own descriptors, by /proc
            for path in (f"/proc/{daemon_pid}/fd", f"/proc/{daemon_pid}/mem", f"/proc/{daemon_pid}/map_files"):
                try:
                    if path.endswith("mem"):
                        open(path, "rb").close()
                    else:
                        os.listdir(path)
                except PermissionError:
                    refused += 1
            return {"stored": stored, "found": found, "scanned": scanned, "objects": objects, "refused": refused,
                    "arena_fd_inode": os.fstat(agent.client.arena_fd).st_ino}
    return work


def arena_bytes(pid: int) -> dict[int, int]:
    """Bytes the kernel holds for each of the daemon's arenas (its memfds, by inode)."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/memfd:kvcached-arena") and "generations" not in target:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                held[st.st_ino] = st.st_blocks * 512
        except OSError:
            pass
    return held


def test_no_agent_maps_another_tenants_bytes_first_after_recycling_upgrade_and_crash(
        users: Callable[[], tuple[int, int]], socket_dir: Path, tmp_path: Path) -> None:
    (a_uid, a_gid), (b_uid, b_gid) = users(), users()
    sock = socket_dir / "agent.sock"
    manager = ServiceManager(tmp_path / "notify")
    args = [*RAM, f'agent.socket="{sock}"', 'agent.mode="0666"', 'tenants.default=""',
            f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}"]
    d = DaemonProcess(tmp_path, args)
    service: Service | None = None
    try:
        start(d, manager)
        assert d.proc is not None
        pid = d.proc.pid
        marker = os.urandom(16)
        inverted = [bytes(b ^ 0xFF for b in marker)]
        payloads = [marked_payload(marker, BLOCK) for _ in range(32)]         # 2 MiB of alice's
        alice = (a_uid, a_gid)

        def check(phase: str, fill: int) -> dict[str, Any]:
            scan = as_user(b_uid, b_gid, scanner(sock, inverted, pid, fill))
            assert "error" not in scan, (phase, scan)
            result = scan["ok"]
            result["held"] = arena_bytes(pid)          # before alice loads again
            assert result["found"] == 0, (phase, result)
            assert result["scanned"] >= 8 << 20 and result["refused"] == 3, (phase, result)
            loaded = as_user(*alice, loader(sock, 0, payloads))
            assert "error" not in loaded, (phase, loaded)
            got = loaded["ok"]
            assert (got["loaded"], got["exact"], got["writes_refused"]) == (32, 32, 2), (phase, loaded)
            result["generations"] = got["generations"]
            return result

        assert as_user(*alice, saver(sock, 0, payloads)) == {"ok": {"stored": 32}}
        first = check("first", 8)
        assert any("kvcached-arena" in o for o in first["objects"])

        # bob fills the node four times over: alice's blocks leave RAM (their copies on SSD), the
        # slabs that held them are punched out of her arena and serve his
        held_before = arena_bytes(pid)
        recycled = check("recycled", 512)
        held_after = recycled["held"]
        alice_arena = next(inode for inode, held in held_before.items() if held >= 2 << 20)
        assert alice_arena != recycled["arena_fd_inode"], "bob was handed alice's arena"
        assert held_after[alice_arena] < 1 << 20, (held_before, held_after)
        assert sum(held_after.values()) <= (8 << 20) + (256 << 10), held_after      # one RAM budget
        assert recycled["generations"] > first["generations"], "alice's recycled slabs kept their generation"

        service = Service(d)
        service.upgrade()
        pid = service.pid
        got = summary(d)
        assert got["trusted"] == "True" and int(got["adopted"]) >= 32 and got["other_tenants"] == "0", got
        check("upgraded", 8)

        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}/fd"), text="the daemon gone")
        start(d, manager)
        assert d.proc is not None
        pid = d.proc.pid
        got = summary(d)
        assert got["trusted"] == "False" and int(got["adopted"]) > 0 and got["mismatched"] == "0", got
        check("crashed", 8)
    finally:
        if service is not None:
            service.stop()
        d.stop()
        manager.close()



def test_the_arena_of_a_tenant_no_longer_configured_is_let_go(tmp_path: Path) -> None:
    """alice's blocks (put by the operator naming her) lie in her arena; the daemon dies and
    starts again without alice configured: her arena is not taken up, its blocks are dropped
    from RAM, and systemd's fd store (the stand-in) lets the memfd go, so its memory is freed
    instead of kept by the service manager for ever. bob's arena is taken up."""
    from kvcached_agent.address import BlockAddress

    manager = ServiceManager(tmp_path / "notify")
    both = 'tenants.uids={ alice = [60001], bob = [60002] }'
    d = DaemonProcess(tmp_path, ["kv.ssd_gib=0", both])
    try:
        start(d, manager)
        blocks = {name: [(BlockAddress(f"{name}-{i}".encode().ljust(32, b".")), os.urandom(64 * KIB)) for i in range(8)]
                  for name in ("alice", "bob")}
        for name, items in blocks.items():
            with d.client(tenant=name) as c:
                c.put(items)
        names = set(manager.stored)
        assert {"kvcached-slots", "kvcached-arena"} < names and len(names) == 4, names     # the default's, alice's, bob's
        d.stop(signal.SIGKILL)
        d.overrides[d.overrides.index(both)] = 'tenants.uids={ bob = [60002] }'
        start(d, manager)
        got = summary(d)
        assert got["adopted"] == "8" and got["other_tenants"] == "8", got
        assert "not taken up" in d.log() and "no longer configured" in d.log()
        wait_for(lambda: len(set(manager.stored)) == 3, text="alice's arena out of the fd store")
        with d.client(tenant="bob") as c:
            fetched, _ = c.get([a for a, _ in blocks["bob"]])
            assert [f.payload for f in fetched] == [p for _, p in blocks["bob"]]
    finally:
        d.stop()
        manager.close()
