"""kvcached agent benchmark: the engine-side library against a real daemon, every figure next to
a baseline measured in the same run.

    python bench/bench_agent.py [--json PATH] [--quick]

A real ``kvcached serve`` subprocess (bench_core.start_kvcached: all state in a temp dir) with a
RAM arena of ``kv.ram_gib`` (1 GiB; --quick 0.5) and the SSD tier off (``kv.ssd_gib=0``,
``kv.write_policy="write_back"``: with no SSD a Commit is answered once the blocks are visible,
and the daemon checksums them and writes their index records in a background thread afterwards,
which is what write_back does for RAM too). One agent (kvcached_agent.Agent, CPU tensors:
``use_cuda=False``) in this process, one request in flight.

1. Save and load of 1 MiB blocks in batches of 64 (one 64 MiB tensor viewed as 64 block
   tensors, as an engine's KV cache), against a plain torch copy of the same bytes: 64
   ``copy_`` calls of 1 MiB into a preallocated 64 MiB tensor (save: engine tensor -> buffer;
   load: buffer -> engine tensor). Before timing, the whole arena is written once through the
   agent (its GB/s, into never-touched shared memory, is printed as a note), so the rounds run in
   a long-lived cache's steady state: pages already mapped, each save evicting older blocks.
   Each repetition saves 64 fresh blocks (new random digests) and loads 64 blocks saved once at
   the start (checked byte for byte before and after); the baseline copies run in the same
   repetition, the order alternating. After each timed save the benchmark waits, off the clock,
   until the daemon has checksummed and recorded that batch (a one-block Load waits for it), so a
   save is timed with the daemon idle. Shown: each side's p50 batch time as GB/s; the ratio is the
   median over repetitions of the two sides' ratio within the repetition. Target >= 0.5x. This
   process runs torch with one intra-op thread (both sides copy with torch): the second core is
   the daemon's, and a two-thread copy_ is an OpenMP region that stalls whenever anything else
   holds that core.
   "Sustained save": ``sustained`` batches of fresh blocks back to back, stored bytes / total
   time, against the baseline copy run as many times back to back; no target. Its note gives
   the bound no save can pass here with CPU tensors: each byte copied once (the baseline's rate)
   and hashed once (BLAKE3 on one thread, measured in the run), on the cores this process may
   use: cores / (1/copy + 1/hash). There the
   daemon's background checksumming (BLAKE3 on two threads) competes with the copies for the
   machine's cores, and blocks not yet checksummed cannot be evicted, so saves may be refused
   (``full``); the note counts them, and the time to drain the last checksum.
2. Lookup round trip of a 32-block chain that RAM holds entirely (answer checked), p50 over
   blocking calls, against a bare echo: bench/_echo_server.py, an asyncio + uvloop server in its
   own process on a Unix socket that answers every frame with a 32-byte frame (the size of the
   daemon's LookupResult), with a blocking socket client (sendall, recv; a timeout set, like the
   agent's client) sending the very bytes of the agent's Lookup frame (1,044 bytes for 32
   digests). Also a 1-digest lookup (52-byte request). Interleaved rounds (agent, echo, then the
   reverse), warm-up calls first; the ratio is the median over rounds of the p50 ratio within a
   round. Target: 32-digest lookup <= 3x the echo.
3. (bench/agent_sustained.py) Sustained saves at 4 KiB, 64 KiB and 1 MiB blocks, with the SSD
   tier off, written back and written through, each against the same copies back to back.

Also printed as notes: where a save's and a load's time goes (the same requests as Agent.save
and Agent.load, issued step by step with a clock around each: the Allocate round trip, the copy,
the Commit round trip; the Load round trip, the copy, the Release, which is sent without
waiting), and the daemon's CPU time per batch (from /proc/PID/stat).

--quick: 0.5 GiB arena, 20 repetitions, 16 sustained batches, 4 lookup rounds, 0.5 s a figure 3 case: a smoke test
(under a minute). Progress goes to stderr, the table to stdout. bench/gpu_copy.py runs figure 1 with
GPU tensors where CUDA exists, with the functions of this module.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)   # torch's CPU build; numpy is not used
import torch  # noqa: E402
from agent_sustained import FIGURE as SUSTAINED_FIGURE  # noqa: E402
from agent_sustained import TITLE as SUSTAINED_TITLE  # noqa: E402
from agent_sustained import connect, sustained_rows  # noqa: E402
from bench_core import (  # noqa: E402
    BENCH_DIR,
    MiB,
    Proc,
    Row,
    percentile,
    print_table,
    proc_times,
    progress,
    size_name,
    start_kvcached,
)

from kvcached_agent import protocol as p  # noqa: E402
from kvcached_agent.address import CROSS_LAYER, BlockAddress  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402
from kvcached_agent.integrity import payload_checksum  # noqa: E402

BLOCK = 1 * MiB
BATCH = 64
COPY_TARGET = 0.5            # agent save/load GB/s / torch copy GB/s
LOOKUP_TARGET = 3.0          # lookup p50 / bare echo p50
LOOKUP_CHAIN = 32
MODEL = "bench/agent"


@dataclass(frozen=True)
class Settings:
    ram_gib: float
    reps: int               # paired repetitions per copy case
    sustained: int          # batches saved back to back
    phase_reps: int         # step-by-step repetitions for the time breakdown
    lookup_rounds: int
    lookup_calls: int       # per side and round
    sustained_case_s: float  # figure 3: seconds of saves per block size and SSD setting


FULL = Settings(ram_gib=1.0, reps=150, sustained=48, phase_reps=20, lookup_rounds=10, lookup_calls=400, sustained_case_s=2.0)
QUICK = Settings(ram_gib=0.5, reps=20, sustained=16, phase_reps=8, lookup_rounds=4, lookup_calls=200, sustained_case_s=0.5)


# =============================================================================================
# the daemon and the agent


def start_agent(stack: contextlib.ExitStack, tmp: Path, ram_gib: float, block_bytes: int, *,
                use_cuda: bool, timeout: float = 30.0) -> tuple[Proc, Agent]:
    """A ``kvcached serve`` subprocess (SSD off) and an agent connected to it."""
    proc, _ = start_kvcached(stack, tmp, ram_gib, ["kv.ssd_gib=0", 'kv.write_policy="write_back"'])
    agent = connect(tmp, block_bytes, proc, agent_id="bench", model=MODEL, use_cuda=use_cuda, timeout=timeout)
    stack.callback(agent.close)
    return proc, agent


def fresh(n: int) -> list[BlockAddress]:
    return Agent.addresses([os.urandom(32) for _ in range(n)])


def block_views(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    """A flat uint8 tensor as a list of ``size``-byte block tensors (views, no copy)."""
    return list(flat.view(-1, size))


def save_all(agent: Agent, addresses: Sequence[BlockAddress], tensors: Sequence[torch.Tensor]) -> None:
    result = agent.save(addresses, tensors)
    if result.stored + result.present != len(addresses):
        raise RuntimeError(f"agent save stored {result.stored} of {len(addresses)} blocks (skipped {result.skipped})")


def wait_recorded(agent: Agent, address: BlockAddress, scratch: torch.Tensor) -> None:
    """Return once the daemon has checksummed and recorded the batch ``address`` was saved in
    (a Load waits for that) and check it is there."""
    if agent.load([address], [scratch]).loaded != 1:
        raise RuntimeError(f"block {address} just saved cannot be loaded")


def fill(agent: Agent, blocks: Sequence[torch.Tensor], total: int, scratch: torch.Tensor) -> float:
    """Save fresh blocks until ``total`` bytes went through (the whole arena once: every page
    touched and mapped in both processes); GB/s."""
    size = blocks[0].numel() * blocks[0].element_size()
    t0 = time.perf_counter()
    last = None
    for _ in range(0, total, size * len(blocks)):
        last = fresh(len(blocks))
        save_all(agent, last, blocks)
    elapsed = time.perf_counter() - t0
    if last is not None:
        wait_recorded(agent, last[-1], scratch)
    return total / elapsed / 1e9


# =============================================================================================
# figure 1: save and load against a plain copy of the same bytes


@dataclass
class CopyCase:
    """Blocks to save (``src``, the engine's tensors), tensors loads land in (``dst``), and the
    baseline: the same bytes copied out of ``src`` (``base_save``) and into ``dst``
    (``base_load``) without the daemon. ``settle`` runs before every timed call (GPU: sync)."""

    label: str
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    scratch: torch.Tensor
    base_save: Callable[[], None]
    base_load: Callable[[], None]
    settle: Callable[[], None] = lambda: None
    one_copy: tuple[Callable[[], None], Callable[[], None]] | None = None   # save, load: the batch in one copy_

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.src)


def clock(case: CopyCase, call: Callable[[], Any]) -> tuple[float, Any]:
    case.settle()
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def run_copy_case(agent: Agent, case: CopyCase, reps: int) -> dict[str, Any]:
    """``reps`` paired repetitions: baseline save copy, agent save of fresh blocks, (wait for the
    checksum, unclocked), baseline load copy, agent load of the blocks saved first."""
    n = len(case.src)
    kept = fresh(n)
    save_all(agent, kept, case.src)
    wait_recorded(agent, kept[-1], case.scratch)
    for d in case.dst:
        d.zero_()
    loaded = agent.load(kept, case.dst).loaded
    case.settle()
    if loaded != n or not all(torch.equal(s, d) for s, d in zip(case.src, case.dst)):
        raise RuntimeError(f"{case.label}: blocks saved through the agent did not load back intact")
    times: dict[str, list[float]] = {k: [] for k in ("save", "base_save", "load", "base_load", "one_save", "one_load")}
    resaved = 0
    for r in range(reps + 2):     # two warm-up repetitions, dropped
        addresses = fresh(n)
        sides = [("base_save", case.base_save), ("save", lambda: agent.save(addresses, case.src))]
        for name, call in (sides if r % 2 else reversed(sides)):
            dt, out = clock(case, call)
            if name == "save":
                if out.stored != n:
                    raise RuntimeError(f"{case.label}: save stored {out.stored} of {n} fresh blocks (skipped {out.skipped})")
                wait_recorded(agent, addresses[-1], case.scratch)    # the daemon's checksum overlaps nothing timed
            times[name].append(dt)
        sides = [("base_load", case.base_load), ("load", lambda: agent.load(kept, case.dst))]
        for name, call in (sides if r % 2 else reversed(sides)):
            dt, out = clock(case, call)
            if name == "load" and out.loaded != n:     # evicted by the saves: save them again, time again
                resaved += 1
                save_all(agent, kept, case.src)
                wait_recorded(agent, kept[-1], case.scratch)
                dt, out = clock(case, call)
                if out.loaded != n:
                    raise RuntimeError(f"{case.label}: loaded {out.loaded} of {n} blocks just saved")
            times[name].append(dt)
        if case.one_copy is not None:
            times["one_save"].append(clock(case, case.one_copy[0])[0])
            times["one_load"].append(clock(case, case.one_copy[1])[0])
    case.settle()
    if not all(torch.equal(s, d) for s, d in zip(case.src, case.dst)):
        raise RuntimeError(f"{case.label}: the last load did not bring back the bytes saved")
    out = {k: v[2:] for k, v in times.items() if v}
    out["resaved"] = resaved
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def copy_rows(figure: int, case: CopyCase, t: dict[str, Any], baseline_name: str, target: float) -> list[Row]:
    """The save and load rows of a case: p50 GB/s each side, paired ratio, target."""
    rows = []
    for op in ("save", "load"):
        kv, base = t[op], t["base_" + op]
        detail = {"kvcached": {"p50_ms": statistics.median(kv) * 1e3, "p90_ms": percentile(kv, 0.9) * 1e3,
                               "mean_ms": statistics.fmean(kv) * 1e3, "reps": len(kv)},
                  "baseline": {"p50_ms": statistics.median(base) * 1e3, "p90_ms": percentile(base, 0.9) * 1e3,
                               "mean_ms": statistics.fmean(base) * 1e3, "reps": len(base)}}
        if op == "load":
            detail["kvcached"]["resaved_between_reps"] = t["resaved"]
        row = Row(figure, f"{op} {case.label}", "GB/s", gbps(case.nbytes, statistics.median(kv)), baseline_name,
                  gbps(case.nbytes, statistics.median(base)), True, f">= {target:.2f}x", details=detail,
                  paired_ratio=statistics.median(b / k for k, b in zip(kv, base)))
        row.passed = row.ratio >= target
        rows.append(row)
    return rows


def one_copy_note(case: CopyCase, t: dict[str, Any], rows: Sequence[Row]) -> str:
    """The save and load rows against the baseline done as one copy_ of the whole batch."""
    parts = []
    for row in rows:
        op = row.case.split()[0]
        one = gbps(case.nbytes, statistics.median(t["one_" + op]))
        parts.append(f"{op} {one:.2f} GB/s (agent {row.kvcached / one:.2f}x of it)")
    return f"{case.label}: the baseline as one copy_ of the whole batch instead of one per block: " + ", ".join(parts)


def sustained(agent: Agent, case: CopyCase, batches: int, pid: int) -> tuple[Row, str]:
    """``batches`` saves of fresh blocks back to back against the baseline copy as many times."""
    n = len(case.src)
    addresses = [fresh(n) for _ in range(batches)]
    case.settle()
    t0 = time.perf_counter()
    for _ in range(batches):
        case.base_save()
    case.settle()
    base_s = time.perf_counter() - t0
    cpu0 = proc_times(pid)
    stored = skipped = 0
    last: BlockAddress | None = None        # the last block stored
    t0 = time.perf_counter()
    for batch in addresses:
        result = agent.save(batch, case.src)
        stored += result.stored
        skipped += len(result.skipped)
        refused = set(result.skipped)
        last = next((batch[i] for i in reversed(range(n)) if i not in refused), last)
    save_s = time.perf_counter() - t0
    drained = None
    if last is not None:      # batches are checksummed in order: when the last is recorded, all are
        wait_recorded(agent, last, case.scratch)
        drained = time.perf_counter() - t0
    cpu1 = proc_times(pid)
    size = case.src[0].numel() * case.src[0].element_size()
    kv, base = gbps(stored * size, save_s), gbps(batches * case.nbytes, base_s)
    cpu = (cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) / batches
    row = Row(1, f"sustained save {case.label}", "GB/s", kv, f"the same copy x{batches}", base, True,
              details={"kvcached": {"seconds": save_s, "batches": batches, "stored": stored, "skipped": skipped,
                                    "drained_s": drained, "daemon_cpu_s_per_batch": cpu},
                       "baseline": {"seconds": base_s}})
    hashed = hash_rate(case)
    cores = len(os.sched_getaffinity(0))
    bound = cores / (1 / base + 1 / hashed)
    note = (f"sustained save: {batches} batches of {case.label} in {save_s:.2f} s, {stored} blocks stored, {skipped} "
            f"refused (Allocate answered FULL: RAM held by blocks not yet checksummed)"
            + (f"; last checksum recorded {drained:.2f} s after the first save" if drained is not None else "")
            + f"; daemon CPU {cpu * 1e3:.1f} ms per batch (user+sys, all its threads). "
            f"The most any save can sustain here with CPU tensors: every byte is copied once (the baseline, "
            f"{base:.2f} GB/s on one core) and hashed once (BLAKE3, {hashed:.2f} GB/s on one core, this run), on "
            f"{cores} cores: {cores} / (1/{base:.2f} + 1/{hashed:.2f}) = {bound:.2f} GB/s, {bound / base:.2f}x of the "
            f"baseline (kvcached {kv / bound:.2f}x of that bound)")
    row.details["bound"] = {"hash_gbps": hashed, "cores": cores, "gbps": bound}
    return row, note


def hash_rate(case: CopyCase, rounds: int = 3) -> float:
    """GB/s of the daemon's checksum of a saved block (kvcached_agent.integrity.payload_checksum,
    BLAKE3 on one thread) over the case's blocks, best of ``rounds``: with CPU tensors, what a
    saved byte costs beside its copy. CPU blocks only (GPU blocks reach the daemon by DMA)."""
    views = [memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")
             for t in case.src if t.device.type == "cpu"]
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for view in views:
            payload_checksum(view)
        best = min(best, time.perf_counter() - t0)
    return gbps(sum(len(v) for v in views), best)


# =============================================================================================
# where the time goes: Agent.save / Agent.load step by step


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process ``pid`` so far: (its main thread, where the event
    loop runs; all its other threads: checksums, RocksDB, gRPC). Threads that ended are missed."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if int(tid) == pid:
            main += cpu
        else:
            other += cpu
    return main, other


def phases(agent: Agent, case: CopyCase, reps: int, pid: int) -> str:
    """The requests of Agent.save and Agent.load (one batch each), a clock around each step, and
    the daemon's CPU time per batch by thread."""
    n = len(case.src)
    size = case.src[0].numel() * case.src[0].element_size()
    kept = fresh(n)
    save_all(agent, kept, case.src)
    wait_recorded(agent, kept[-1], case.scratch)
    steps: dict[str, list[float]] = {k: [] for k in
                                     ("allocate", "copy in", "commit", "recorded", "load", "copy out", "release")}
    copies = [0, 0]
    cpu = [0.0] * 4      # save: loop thread, other threads; load: the same

    def step(name: str, call: Callable[[], Any]) -> Any:
        dt, out = clock(case, call)
        steps[name].append(dt)
        return out

    for _ in range(reps):
        addresses = fresh(n)
        c0 = thread_cpu(pid)
        slots = step("allocate", lambda: agent.client.call(p.Allocate([(a.digest, a.layer, size) for a in addresses])))
        if not (isinstance(slots, p.Slots) and all(s == p.Status.OK for s, _, _ in slots.entries)):
            raise RuntimeError(f"Allocate of {n} fresh blocks refused: {slots}")
        copies[0] = step("copy in", lambda: agent.copier.save(case.src, [o for _, _, o in slots.entries]))
        step("commit", lambda: agent.client.call(p.Commit([h for _, h, _ in slots.entries])))
        step("recorded", lambda: wait_recorded(agent, addresses[-1], case.scratch))
        c1 = thread_cpu(pid)
        if agent.lookup([a.digest for a in kept]).ram < n:      # evicted by the saves: save them again
            save_all(agent, kept, case.src)
            wait_recorded(agent, kept[-1], case.scratch)
            c1 = thread_cpu(pid)
        loaded = step("load", lambda: agent.client.call(p.Load([(a.digest, a.layer) for a in kept])))
        if not (isinstance(loaded, p.Loaded) and all(e[0] == p.Status.OK for e in loaded.entries)):
            raise RuntimeError(f"Load of {n} blocks just saved missed: {loaded}")
        copies[1] = step("copy out", lambda: agent.copier.load(case.dst, [e[2] for e in loaded.entries]))
        step("release", lambda: agent.client.send(p.Release([e[1] for e in loaded.entries])))
        agent.lookup([kept[0].digest])      # a round trip: the Release is handled before the next one
        c2 = thread_cpu(pid)
        for i, (a, b) in enumerate(((c0, c1), (c1, c2))):
            cpu[2 * i] += (b[0] - a[0]) / reps
            cpu[2 * i + 1] += (b[1] - a[1]) / reps
    ms = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
    cpu_ms = [c * 1e3 for c in cpu]
    return (f"where the time goes, {case.label}, p50 of {reps} (ms): save = Allocate round trip {ms['allocate']:.2f} "
            f"+ copy {ms['copy in']:.2f} ({copies[0]} copy_ call(s)) + Commit round trip {ms['commit']:.2f}; then, in "
            f"the daemon's background, checksum + index record until a Load may see them {ms['recorded']:.2f}. "
            f"load = Load round trip {ms['load']:.2f} + copy {ms['copy out']:.2f} ({copies[1]} copy_ call(s)) + Release "
            f"(sent, not awaited) {ms['release']:.3f}. Daemon CPU per batch, mean (/proc, 10 ms ticks over {reps} "
            f"batches: +-{10 / reps:.1f} ms): save + "
            f"checksum {cpu_ms[0]:.1f} ms in the event-loop thread + {cpu_ms[1]:.1f} ms in other threads; load "
            f"{cpu_ms[2]:.1f} + {cpu_ms[3]:.1f} ms")


# =============================================================================================
# figure 2: lookup against a bare uvloop echo


class EchoClient:
    """A blocking Unix-socket client as the agent's: sendall a frame, recv until the whole reply."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)      # as AgentClient: recv waits in poll()
        self.sock.connect(path)
        self.buf = bytearray()

    def call(self, frame: bytes) -> bytes:
        self.sock.sendall(frame)
        buf = self.buf
        while True:
            if len(buf) >= p.HEADER.size:
                end = p.HEADER.size + p.HEADER.unpack_from(buf)[0]
                if len(buf) >= end:
                    reply = bytes(buf[:end])
                    del buf[:end]
                    return reply
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the echo server closed the connection")
            buf += data

    def close(self) -> None:
        self.sock.close()


def start_echo(stack: contextlib.ExitStack, tmp: Path, reply_body: int) -> tuple[EchoClient, int]:
    path = tmp / "echo.sock"
    proc = Proc("echo server", [sys.executable, str(BENCH_DIR / "_echo_server.py"), str(path), str(reply_body)],
                cwd=tmp, log=tmp / "echo.log")
    stack.callback(proc.stop)
    deadline = time.monotonic() + 20
    while True:
        try:
            client = EchoClient(str(path))
            stack.callback(client.close)
            return client, proc.proc.pid
        except (FileNotFoundError, ConnectionRefusedError):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"echo server not up:\n{proc.tail()}") from None
            time.sleep(0.05)


def set_affinity(pids: Sequence[int], cpus: set[int]) -> None:
    """Every thread of each process in ``pids`` (0: this thread) runs on ``cpus`` only."""
    for pid in pids:
        if pid == 0:
            os.sched_setaffinity(0, cpus)
            continue
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):      # a thread that just ended
                os.sched_setaffinity(int(tid), cpus)


def placements() -> dict[str, tuple[set[int], set[int]]]:
    """(client CPUs, server CPUs) per placement: both on one core, and on two different cores."""
    cpus = sorted(os.sched_getaffinity(0))
    out = {"same core": ({cpus[0]}, {cpus[0]})}
    if len(cpus) > 1:
        out["two cores"] = ({cpus[0]}, {cpus[1]})
    return out


def bench_lookup(agent: Agent, echo: EchoClient, server_pids: Sequence[int], s: Settings) -> list[Row]:
    """Lookups and echoes, interleaved by round, with the client and both servers pinned: first
    all on one core, then the client on one and the servers on another. Unpinned, this 2-vCPU VM
    gives bimodal round trips (~20 us when client and server share a core, ~100 us when a wakeup
    crosses cores), so which core each server happened to land on would decide the ratio."""
    chain = agent.hash_tokens(list(range(LOOKUP_CHAIN * 16)))
    tensors = block_views(torch.randint(0, 256, (LOOKUP_CHAIN * 4096,), dtype=torch.uint8), 4096)
    save_all(agent, agent.addresses(chain), tensors)
    answer = agent.lookup(chain)
    if answer.longest != LOOKUP_CHAIN or answer.ram != LOOKUP_CHAIN:
        raise RuntimeError(f"lookup of the {LOOKUP_CHAIN} blocks just saved says longest={answer.longest} ram={answer.ram}")
    reply = len(p.encode(p.LookupResult(0, 0, 0, 0, 0)))
    frames = {k: p.encode(p.Lookup(CROSS_LAYER, chain[:k]), 1) for k in (LOOKUP_CHAIN, 1)}
    if len(echo.call(frames[1])) != reply:
        raise RuntimeError("the echo server's reply is not the size of a LookupResult frame")
    sides: list[tuple[str, Callable[[], Any]]] = []
    for k in (LOOKUP_CHAIN, 1):
        sides += [(f"agent {k}", lambda d=chain[:k]: agent.lookup(d)), (f"echo {k}", lambda f=frames[k]: echo.call(f))]
    everyone = sorted(os.sched_getaffinity(0))
    rows: list[Row] = []
    for place, (client_cpus, server_cpus) in placements().items():
        set_affinity([0], client_cpus)
        set_affinity(server_pids, server_cpus)
        try:
            lat: dict[str, list[float]] = {name: [] for name, _ in sides}
            rounds: dict[str, list[float]] = {name: [] for name, _ in sides}     # p50 of each round
            for r in range(s.lookup_rounds):
                for name, call in (sides if r % 2 == 0 else list(reversed(sides))):
                    for _ in range(20):
                        call()
                    xs = []
                    for _ in range(s.lookup_calls):
                        t0 = time.perf_counter()
                        call()
                        xs.append(time.perf_counter() - t0)
                    lat[name] += xs
                    rounds[name].append(statistics.median(xs))
        finally:
            set_affinity([0, *server_pids], set(everyone))
        stats = {n: {"p50_us": percentile(x, 0.5) * 1e6, "p99_us": percentile(x, 0.99) * 1e6,
                     "mean_us": statistics.fmean(x) * 1e6, "calls": len(x)} for n, x in lat.items()}
        progress(f"lookup, {place}: " + ", ".join(f"{n} p50 {v['p50_us']:.0f} us" for n, v in stats.items()))
        for k in (LOOKUP_CHAIN, 1):
            kv, base = stats[f"agent {k}"], stats[f"echo {k}"]
            row = Row(2, f"{k} digest{'s' if k > 1 else ''}, {place}", "us", kv["p50_us"],
                      f"echo {len(frames[k])} B -> {reply} B", base["p50_us"], False,
                      details={"kvcached": kv, "baseline": base, "placement": place},
                      paired_ratio=statistics.median(a / b for a, b in zip(rounds[f"agent {k}"], rounds[f"echo {k}"])))
            if k == LOOKUP_CHAIN:
                row.target = f"<= {LOOKUP_TARGET:.1f}x"
                row.passed = row.ratio <= LOOKUP_TARGET
            rows.append(row)
    return rows


# =============================================================================================
# output and main


TITLES = {
    1: f"1. Agent save/load, {size_name(BLOCK)} blocks x{BATCH}, CPU tensors <-> RAM arena (SSD off), vs torch copy_ "
       "of the same bytes; GB/s of the p50 batch",
    2: "2. Agent lookup round trip, p50 (blocking client, Unix socket), pinned as said, vs a bare uvloop echo of "
       "the same frame sizes; lower is better",
    SUSTAINED_FIGURE: SUSTAINED_TITLE,
}


def report(rows: Sequence[Row], header: str, titles: dict[int, str], notes: Sequence[str], json_path: str | None,
           started: float, meta: dict[str, Any]) -> None:
    """The table and notes on stdout; with ``json_path``, the same figures as JSON (bench_core's shape)."""
    print_table(list(rows), header, titles)
    for note in notes:
        print(f"note: {note}")
    if json_path:
        meta = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started, **meta}
        doc = {"meta": meta, "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "notes": list(notes)}
        Path(json_path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {json_path}")


def run_script(main: Callable[[], int]) -> None:
    """Exit with main()'s status; SIGTERM and Ctrl-C end it as 130 once every finally has run."""
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); servers stopped, temp dir removed")
        sys.exit(130)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def others_cpu_note(busy0: float, mine0: float, pids: Sequence[int], wall_s: float) -> str:
    """How much CPU processes other than this one (``mine0``: its CPU seconds when ``busy0`` was
    read) and ``pids`` (started after that) took during the run: on a shared 2-core machine, the
    first thing to look at when a figure is off."""
    mine = sum(os.times()[:2]) - mine0 + sum(sum(proc_times(pid)[:2]) for pid in pids)
    other = max(0.0, busy_cpu_s() - busy0 - mine)
    return (f"other processes used {other:.1f} CPU-s during the {wall_s:.0f} s run ({other / wall_s:.0%} of one core)"
            + ("; the figures are disturbed by them" if other / wall_s > 0.1 else ""))


def on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cpu_case() -> CopyCase:
    src = torch.randint(0, 256, (BATCH * BLOCK,), dtype=torch.uint8)
    buf = torch.zeros_like(src)
    dst = torch.zeros_like(src)
    src_b, buf_b, dst_b = (block_views(t, BLOCK) for t in (src, buf, dst))

    def base_save() -> None:
        for b, x in zip(buf_b, src_b):
            b.copy_(x)

    def base_load() -> None:
        for d, b in zip(dst_b, buf_b):
            d.copy_(b)

    return CopyCase(f"{size_name(BLOCK)} x{BATCH}", src_b, dst_b, torch.empty(BLOCK, dtype=torch.uint8),
                    base_save, base_load, one_copy=(lambda: buf.copy_(src), lambda: dst.copy_(buf)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached agent benchmark (figures with same-run baselines)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (under a minute): 0.5 GiB arena, fewer repetitions")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    # One intra-op thread: the other core is the daemon's. With two, every copy_ is an OpenMP region
    # that waits for both cores, and while anything else runs the 64-copy baseline was seen at 0.13 GB/s.
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    busy0, mine0 = busy_cpu_s(), sum(os.times()[:2])
    rows: list[Row] = []
    notes: list[str] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcbench-agent-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        progress(f"starting kvcached (RAM {s.ram_gib:g} GiB, SSD off) and the echo server")
        proc, agent = start_agent(stack, tmp, s.ram_gib, BLOCK, use_cuda=False)
        pid = proc.proc.pid
        try:
            echo, echo_pid = start_echo(stack, tmp, len(p.encode(p.LookupResult(0, 0, 0, 0, 0))) - p.HEADER.size)
            rows += bench_lookup(agent, echo, [pid, echo_pid], s)
            case = cpu_case()
            progress(f"writing the whole arena once through the agent ({s.ram_gib:g} GiB)")
            first = fill(agent, case.src, int(s.ram_gib * 1024) * MiB + case.nbytes, case.scratch)
            progress(f"{s.reps} paired repetitions of save and load, {case.label}")
            t = run_copy_case(agent, case, s.reps)
            copy = copy_rows(1, case, t, f"torch copy_, {BATCH} x {size_name(BLOCK)}", COPY_TARGET)
            progress(", ".join(f"{r.case} {r.kvcached:.2f} GB/s ({r.ratio:.2f}x)" for r in copy)
                     + f"; loaded blocks saved again {t['resaved']} time(s)")
            progress(f"sustained save, {s.sustained} batches")
            row, note = sustained(agent, case, s.sustained, pid)
            rows += copy + [row]
            notes += [f"first write of the arena (1 MiB x64 saves into shared memory never touched before): "
                      f"{first:.2f} GB/s", one_copy_note(case, t, copy), note]
            if t["resaved"]:
                notes.append(f"the loaded blocks were evicted and saved again {t['resaved']} time(s) between repetitions")
            progress("time breakdown of save and load")
            notes.append(phases(agent, case, s.phase_reps, pid))
            notes.append(others_cpu_note(busy0, mine0, [pid, echo_pid], time.time() - started))
        except BaseException:
            progress(f"kvcached log, last lines:\n{proc.tail(20)}")
            raise
    more, more_notes = sustained_rows(s.sustained_case_s)      # figure 3: daemons of their own
    rows += more
    notes += more_notes

    header = (f"kvcached agent benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
              f"{time.time() - started:.0f} s, load average {load:.2f} at the start\nsettings: arena {s.ram_gib:g} GiB, "
              f"SSD off, {s.reps} repetitions, {s.lookup_rounds} lookup rounds x {s.lookup_calls} calls per side, "
              f"torch intra-op threads {torch.get_num_threads()}")
    report(rows, header, TITLES, notes, args.json, started, {"quick": args.quick, "settings": asdict(s)})
    return 0


if __name__ == "__main__":
    run_script(main)
