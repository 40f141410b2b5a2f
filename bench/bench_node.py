"""kvcached node benchmark (issue 63): N engine agents, each in a process of its own, against one
daemon, every figure next to a baseline measured in the same run.

    python bench/bench_node.py [--json PATH] [--quick] [--agents 1,2,4] [--block-kib 64,1024]

Per block size (64 KiB and 1 MiB; ``--block-kib``) one ``kvcached serve`` subprocess, all its
state in a temp dir, RAM tier ``kv.ram_gib`` (2 GiB; --quick 1), SSD tier off (``kv.ssd_gib=0``,
``kv.write_policy="write_back"``: a Commit is answered once the blocks are visible, the daemon
checksums them with BLAKE3 and records them in a background thread), hash threads as deployed
(``kv.hash_threads=0``: one per CPU). The daemon runs under a shim (``--daemon``) that only gives
each Python thread its name at the OS level too (prctl PR_SET_NAME, as Python 3.14 does by
itself), so /proc/PID/task/TID/comm tells the store's hashing threads (``kvcached-hash``, the
hand-off thread of kvcached.store.write_path, and ``blake3_N``, kvcached_agent.integrity's
Hasher pool) from the rest. Before the cases the whole arena is written once through an agent
(fresh 64-block batches), so every page exists and the daemon's mapping of it is faulted in;
each agent process then maps the whole arena in with MADV_POPULATE_WRITE (an engine's agent in
a long-lived node has touched it all). The runs are a long-lived cache's steady state: **the
arena is full, so every saved block evicts an older one** (eviction is part of what a save
costs here, as in bench_agent.py).

For N in ``--agents`` (1, 2, 4; 8 too where os.cpu_count() >= 8), N agent processes
(``--child``: this file, torch with one intra-op thread, kvcached_agent.Agent with CPU tensors)
run each phase together: every child prepares, prints ``ready``, waits for ``go`` on stdin, runs
the phase for ``seconds`` and prints one JSON line. The phases, in pairs, the order within a
pair alternating by round:

- save: batches of 64 fresh blocks (new random digests) from one 64-block tensor, back to back;
  the phase ends for a child when the daemon has checksummed and recorded its last batch (a
  one-block Load waits for that), so the background hashing is inside the time and the CPU.
  Baseline: the same processes, no daemon: the same 64 ``copy_`` calls from the same tensor into
  a ring buffer (256 MiB a process; --quick 64 MiB: far beyond any cache, as the arena is),
  then BLAKE3 of the 64 blocks just written with kvcached_agent.integrity.Hasher on as many
  threads as the daemon's (its Stats' hash_threads): the daemon's own checksum code.
- load: ``Agent.load`` of 64 blocks the child saved (saved again and read back, checked, before
  the phase), back to back; the last load is checked byte for byte. Baseline: the same 64
  ``copy_`` calls from a 64-block buffer into the destination tensor (no hashing: the daemon
  hashes nothing on a RAM load).
- lookup: ``Agent.lookup`` of 32 digests of those blocks (all in RAM, answer checked), back to
  back. Baseline: bench/_echo_server.py (a bare uvloop server that answers every frame with a
  frame of a LookupResult's size), the same processes sending the very bytes of that Lookup
  frame with a blocking socket client.

Figure 1: aggregate save and load GB/s (and blocks/s) of the N processes: bytes stored or loaded
by all / (the last child's end - the first child's start); the same for the baseline; each
side's median round, ratio = median over rounds of the ratio within a round. Target (issue 63):
with 2 and 4 agents, save and load >= 0.8x. Lookups a second and echo round trips a second: no
target.

Figure 2: the daemon's CPU time per block: user + system of every thread of the daemon from
/proc/PID/task/TID/stat before and after each phase, split into the event loop's thread (tid ==
pid), the hashing threads (by name, above) and the others (RocksDB, gRPC, asyncio's executor),
summed over every N and round of a block size, divided by the blocks saved or loaded (lookup:
digests looked up). Target (issue 63): at most 5 us per block saved and per block loaded, at
most 0.5 us per digest looked up, hashing apart (event loop + other threads). Baselines: for the
event loop, the echo server's CPU per frame (from the lookup baseline) times the frames the
agents sent per block (counted in each child: Allocate, Commit, Load, Release, ...): what a
server doing nothing but answering those frames would spend; for hashing, BLAKE3 of a block on
one thread in this process (CPU time, best of 3). Then what one core of the daemon sustains at
those costs: blocks/s = 1e6 / (us per block), GB/s = blocks/s x block bytes.

/proc counts in 10 ms ticks; each figure-2 value sums several seconds of phases, hundreds of
ticks. --quick: 1 GiB arena, 0.5 s phases, one round, 64 MiB rings: a smoke test. Progress goes
to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_core import CONFIG, KiB, MiB, Proc, Row, log_tail, print_fitted, proc_times, progress, size_name, wait_grpc  # noqa: E402

BATCH = 64
LOOKUP_DIGESTS = 32
THROUGHPUT_TARGET = 0.8       # agents' aggregate save/load GB/s / the same processes copying (and hashing)
TARGET_N = (2, 4)             # the agent counts the throughput target applies to
BLOCK_US_TARGET = 5.0         # daemon CPU per block saved or loaded, hashing apart
DIGEST_US_TARGET = 0.5        # daemon CPU per digest looked up
HASH_THREADS = ("kvcached-hash", "blake3")     # comm prefixes of the daemon's hashing threads
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MODEL = "bench/node"
THIS = Path(__file__).resolve()


@dataclass(frozen=True)
class Settings:
    ram_gib: float
    seconds: float          # per phase
    rounds: int
    ring_mib: int           # baseline save destination per process


FULL = Settings(ram_gib=2.0, seconds=3.0, rounds=2, ring_mib=256)
QUICK = Settings(ram_gib=1.0, seconds=0.5, rounds=1, ring_mib=64)

PAIRS = (("base_save", "save"), ("base_load", "load"), ("echo", "lookup"))


def import_torch() -> Any:
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)   # torch's CPU build
    import torch

    torch.set_num_threads(1)      # before any op: 2 cores, N processes; a 2-thread copy_ stalls on a busy core
    return torch


# =============================================================================================
# the daemon, with its Python threads named at the OS level


def daemon_main(argv: Sequence[str]) -> int:
    """``kvcached`` (kvcached.cli.main) with every Python thread's name given to the OS thread
    as it starts, so /proc/PID/task/TID/comm shows it. Nothing else changes."""
    import threading as th

    libc = ctypes.CDLL(None, use_errno=True)
    inner = th.Thread._bootstrap_inner        # type: ignore[attr-defined]

    def named(self: th.Thread) -> None:
        libc.prctl(15, self.name.encode()[:15], 0, 0, 0)      # PR_SET_NAME
        inner(self)

    th.Thread._bootstrap_inner = named        # type: ignore[attr-defined]
    from kvcached.cli import main

    return main(list(argv))


def start_daemon(stack: contextlib.ExitStack, tmp: Path, ram_gib: float) -> tuple[Proc, Any]:
    """bench_core.start_kvcached's daemon (all state in ``tmp``, SSD off), run by daemon_main."""
    sets = [f"kv.ram_gib={ram_gib}", f'grpc.listen=["unix:{tmp}/kvcached.sock"]', 'metrics.listen=""',
            f'kv.index_dir="{tmp}/index"', f'kv.ssd_dir="{tmp}/ssd"', f'agent.socket="{tmp}/agent.sock"',
            "kv.ssd_gib=0", 'kv.write_policy="write_back"']
    argv = [sys.executable, str(THIS), "--daemon", "serve", "--config", str(CONFIG)] + [a for s in sets for a in ("--set", s)]
    proc = Proc("kvcached", argv, cwd=tmp, log=tmp / "kvcached.log")
    stack.callback(proc.stop)
    channel = wait_grpc(proc, f"unix:{tmp}/kvcached.sock")
    stack.callback(channel.close)
    return proc, channel


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """tid -> (comm, user + system CPU seconds, system seconds) of every thread of process ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue        # a thread that just ended
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick)
    return out


def cpu_split(pid: int, before: dict[int, tuple[str, float, float]],
              after: dict[int, tuple[str, float, float]]) -> dict[str, Any]:
    """CPU seconds between two thread_cpu snapshots: event loop (tid == pid; also its system
    time apart), hashing threads, other threads (and per thread name). Threads that ended in
    between are missed."""
    out: dict[str, Any] = {"loop": 0.0, "loop_sys": 0.0, "hash": 0.0, "other": 0.0, "by_name": {}}
    for tid, (comm, cpu, sys_s) in after.items():
        was = before.get(tid, (comm, 0.0, 0.0))
        d = cpu - was[1]
        kind = "loop" if tid == pid else "hash" if comm.startswith(HASH_THREADS) else "other"
        out[kind] += d
        if kind == "loop":
            out["loop_sys"] += sys_s - was[2]
        out["by_name"][comm] = out["by_name"].get(comm, 0.0) + d
    return out


# =============================================================================================
# agent processes (--child)


def child_main(args: argparse.Namespace) -> int:
    """One engine's agent: set up, print ``up``, then per command line on stdin: prepare, print
    ``ready``, wait for ``go``, run the phase, print a JSON line. Stdout carries nothing else."""
    torch = import_torch()
    from bench_agent import EchoClient

    from kvcached_agent import protocol as p
    from kvcached_agent.address import CROSS_LAYER, BlockAddress
    from kvcached_agent.agent import Agent
    from kvcached_agent.integrity import Hasher

    size, n = args.block, BATCH
    agent = Agent.connect(args.sock, agent_id=f"bench-node-{args.index}", model=MODEL, dtype="bfloat16",
                          block_tokens=16, num_layers=1, layer_block_bytes=size, use_cuda=False)
    populated = True
    try:      # map the whole (already written) arena in, as a long-lived engine's agent has it
        agent._map.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        populated = False
    frames = [0]
    client = agent.client
    assert client is not None
    send_locked = client._send_locked

    def counted(message: Any) -> int:       # every frame the agent sends the daemon
        frames[0] += 1
        return send_locked(message)

    client._send_locked = counted           # type: ignore[method-assign]

    def fresh() -> list[BlockAddress]:
        raw = os.urandom(32 * n)
        return [BlockAddress(raw[i * 32:i * 32 + 32], CROSS_LAYER) for i in range(n)]

    def block_views(flat: Any) -> list[Any]:
        return list(flat.view(-1, size))

    src_flat = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
    src = block_views(src_flat)
    dst = block_views(torch.empty(n * size, dtype=torch.uint8).fill_(0))
    hold = block_views(src_flat.clone())               # baseline load source
    ring_flat = torch.empty(max(args.ring_mib * MiB // (n * size), 1) * n * size, dtype=torch.uint8).fill_(1)
    ring = block_views(ring_flat)
    ring_views = [memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B") for t in ring]
    hasher = Hasher(args.hash_threads)
    scratch = torch.empty(size, dtype=torch.uint8)
    kept = fresh()
    digests = [a.digest for a in kept[:LOOKUP_DIGESTS]]
    echo = EchoClient(args.echo)
    echo_frame = p.encode(p.Lookup(CROSS_LAYER, digests), 1)

    def ensure_kept() -> None:
        """The 64 blocks to load saved (again, if evicted), recorded and read back intact."""
        result = agent.save(kept, src)
        if result.stored + result.present != n:
            raise RuntimeError(f"saving the blocks to load: stored {result.stored} + present {result.present} of {n}")
        for d in dst:
            d.zero_()
        if agent.load(kept, dst).loaded != n or not all(torch.equal(s, d) for s, d in zip(src, dst)):
            raise RuntimeError("blocks just saved did not load back intact")

    def run_save(deadline: float) -> dict[str, Any]:
        stored = refused = batches = 0
        last = None
        while time.monotonic() < deadline:
            addresses = fresh()
            result = agent.save(addresses, src)
            stored += result.stored
            refused += len(result.skipped)
            batches += 1
            skipped = set(result.skipped)
            last = next((addresses[i] for i in reversed(range(n)) if i not in skipped), last)
        if last is not None and agent.load([last], [scratch]).loaded != 1:     # waits for its checksum
            raise RuntimeError("a block just saved cannot be loaded")
        return {"blocks": stored, "refused": refused, "batches": batches}

    def run_base_save(deadline: float) -> dict[str, Any]:
        batches = 0
        slots = len(ring) // n
        while time.monotonic() < deadline:
            at = (batches % slots) * n
            for b, x in zip(ring[at:at + n], src):
                b.copy_(x)
            hasher.checksums(ring_views[at:at + n])
            batches += 1
        return {"blocks": batches * n, "batches": batches}

    def run_load(deadline: float) -> dict[str, Any]:
        loaded = batches = 0
        while time.monotonic() < deadline:
            loaded += agent.load(kept, dst).loaded
            batches += 1
        if loaded != batches * n:
            raise RuntimeError(f"loaded {loaded} of {batches * n} blocks saved just before")
        if not all(torch.equal(s, d) for s, d in zip(src, dst)):
            raise RuntimeError("the last load did not bring back the bytes saved")
        return {"blocks": loaded, "batches": batches}

    def run_base_load(deadline: float) -> dict[str, Any]:
        batches = 0
        while time.monotonic() < deadline:
            for d, b in zip(dst, hold):
                d.copy_(b)
            batches += 1
        return {"blocks": batches * n, "batches": batches}

    def run_lookup(deadline: float) -> dict[str, Any]:
        calls = misses = 0
        while time.monotonic() < deadline:
            misses += agent.lookup(digests).ram != LOOKUP_DIGESTS
            calls += 1
        if misses:
            raise RuntimeError(f"{misses} of {calls} lookups did not find all {LOOKUP_DIGESTS} blocks in RAM")
        return {"calls": calls, "digests": calls * LOOKUP_DIGESTS}

    def run_echo(deadline: float) -> dict[str, Any]:
        calls = 0
        while time.monotonic() < deadline:
            echo.call(echo_frame)
            calls += 1
        return {"calls": calls}

    runs: dict[str, Callable[[float], dict[str, Any]]] = {
        "save": run_save, "base_save": run_base_save, "load": run_load, "base_load": run_base_load,
        "lookup": run_lookup, "echo": run_echo}
    ensure_kept()

    def say(obj: Any) -> None:
        sys.stdout.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        sys.stdout.flush()

    say({"up": True, "populated": populated, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                break
            if op in ("load", "lookup"):
                ensure_kept()
            say("ready")
            if sys.stdin.readline().strip() != "go":
                break
            cpu0, frames0 = sum(os.times()[:2]), frames[0]
            start = time.monotonic()
            out = runs[op](start + cmd["seconds"])
            end = time.monotonic()
            say({"op": op, "start": start, "end": end, "cpu_s": sum(os.times()[:2]) - cpu0,
                 "frames": frames[0] - frames0, **out})
    finally:
        echo.close()
        agent.close()
    return 0


class Child:
    """An agent process (child_main) and its stdout lines, read by a thread into a queue."""

    def __init__(self, argv: Sequence[str], log: Path) -> None:
        self.log = log
        prefix = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([*prefix, *argv], cwd=THIS.parents[1], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=f, text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.proc.stdin.flush()

    def expect(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"agent process {self.proc.pid}: nothing after {timeout:.0f} s:\n{self.tail()}") from None
        if line is None:
            self.proc.wait(5)
            raise RuntimeError(f"agent process {self.proc.pid} exited with {self.proc.returncode}:\n{self.tail()}")
        return line

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send({"op": "quit"})
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_children(stack: contextlib.ExitStack, tmp: Path, count: int, block: int, hash_threads: int,
                   ring_mib: int, echo_path: Path) -> list[Child]:
    children = []
    for i in range(count):
        argv = [sys.executable, str(THIS), "--child", "--sock", str(tmp / "agent.sock"), "--block", str(block),
                "--index", str(i), "--hash-threads", str(hash_threads), "--ring-mib", str(ring_mib),
                "--echo", str(echo_path)]
        child = Child(argv, tmp / f"agent-{block}-{count}-{i}.log")
        stack.callback(child.stop)
        children.append(child)
    for child in children:
        up = json.loads(child.expect(180))
        if not up.get("populated"):
            progress(f"agent {up['pid']}: MADV_POPULATE_WRITE refused; its first touches of arena pages fault")
    return children


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def run_phase(children: Sequence[Child], op: str, seconds: float, daemon_pid: int, echo_pid: int) -> dict[str, Any]:
    """One phase, all children together (start barrier); aggregate figures and the daemon's
    (for ``echo``: the echo server's) CPU over it."""
    for c in children:
        c.send({"op": op, "seconds": seconds})
    for c in children:
        if (line := c.expect(120)) != "ready":
            raise RuntimeError(f"agent process said {line!r} instead of ready")
    pids = [daemon_pid, echo_pid, *(c.proc.pid for c in children)]
    busy0, mine0 = busy_cpu_s(), sum(os.times()[:2]) + sum(sum(proc_times(p)[:2]) for p in pids)
    d0, e0 = thread_cpu(daemon_pid), proc_times(echo_pid)
    t0 = time.monotonic()
    for c in children:
        c.send("go")
    results = [json.loads(c.expect(seconds + 180)) for c in children]
    d1, e1 = thread_cpu(daemon_pid), proc_times(echo_pid)
    took = time.monotonic() - t0
    others = busy_cpu_s() - busy0 - (sum(os.times()[:2]) + sum(sum(proc_times(p)[:2]) for p in pids) - mine0)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    out: dict[str, Any] = {"op": op, "wall_s": wall, "children": results,
                           "daemon_cpu": cpu_split(daemon_pid, d0, d1),
                           "echo_cpu_s": e1[0] + e1[1] - e0[0] - e0[1],
                           "others_cpu_s": max(0.0, others), "clocked_s": took}
    for key in ("blocks", "calls", "digests", "frames", "refused"):
        if key in results[0]:
            out[key] = sum(r[key] for r in results)
    return out


# =============================================================================================
# one block size: a daemon, an echo server, every N


def fill_arena(sock: Path, block: int, ram_gib: float) -> float:
    """Write the whole arena once (and a batch more) through an agent in this process; GB/s."""
    torch = import_torch()
    from kvcached_agent.address import BlockAddress
    from kvcached_agent.agent import Agent

    agent = Agent.connect(str(sock), agent_id="bench-node-fill", model=MODEL, dtype="bfloat16", block_tokens=16,
                          num_layers=1, layer_block_bytes=block, use_cuda=False)
    try:
        src = list(torch.randint(0, 256, (BATCH * block,), dtype=torch.uint8).view(BATCH, block))
        total = int(ram_gib * 1024) * MiB + BATCH * block
        t0 = time.perf_counter()
        last = None
        for _ in range(0, total, BATCH * block):
            last = [BlockAddress(os.urandom(32)) for _ in range(BATCH)]
            agent.save(last, src)
        if last is not None:
            agent.load(last[-1:], src[:1])       # waits for the last batch's checksums
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        agent.close()


def hash_us(block: int, threads: int = 1) -> float:
    """CPU us of BLAKE3 (kvcached_agent.integrity's) per block of ``block`` bytes, one thread, best of 3."""
    from kvcached_agent.integrity import Hasher

    payloads = [os.urandom(block) for _ in range(BATCH)]
    hasher = Hasher(threads)
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        hasher.checksums(payloads)
        best = min(best, time.thread_time() - t0)
    return best / BATCH * 1e6


def index_write_us(directory: Path, records: int = 64 * 400) -> float:
    """CPU us of the calling thread per key an index write costs here: the daemon's own
    BlockIndex (RocksDB, its options), 64 records a write, then the 64 tombstones that patch
    them, as a saved block and its eviction write; best of 3 passes over ``records`` keys."""
    from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier
    from kvcached.index.format import tombstone_of

    index = BlockIndex(directory / "index-cost")
    try:
        best = float("inf")
        for _ in range(3):
            keys = [os.urandom(32) for _ in range(records)]
            batches = [[(k, BlockRecord(k, 0, MODEL, 65536, k, 1.0, 1.0, Tier.RAM).encode()) for k in keys[i:i + BATCH]]
                       for i in range(0, records, BATCH)]
            tombstones = [[(k, tombstone_of(raw, int(GoneReason.EVICTED), 2.0)) for k, raw in batch] for batch in batches]
            t0 = time.thread_time()
            for batch in batches:
                index.write(batch, watch=False)
            for batch in tombstones:
                index.write(batch, watch=False)
            best = min(best, time.thread_time() - t0)
        return best / (2 * records) * 1e6
    finally:
        index.close()


def index_keys_us(requests: int = 2_000) -> tuple[float, float]:
    """CPU us per block a request's index keys cost here (kvcached.host.short_hash: 64 digests
    at one layer), (compiled in one call, one BlockAddress each as before it): best of 3 each,
    interleaved. The compiled side is the blake3 package's where the extension is not built."""
    from kvcached.host import short_hash
    from kvcached_agent.address import CROSS_LAYER, BlockAddress

    digests = [os.urandom(32) for _ in range(BATCH)]
    layers = [CROSS_LAYER] * BATCH
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for side in (0, 1):
            t0 = time.thread_time()
            for _ in range(requests):
                if side == 0:
                    short_hash.addresses(digests, layers)
                else:
                    [BlockAddress(d, layer) for d, layer in zip(digests, layers)]
            best[side] = min(best[side], time.thread_time() - t0)
    return best[0] / requests / BATCH * 1e6, best[1] / requests / BATCH * 1e6


def codec_us_per_digest(calls: int = 20_000) -> float:
    """CPU us per digest the agent protocol's own Python costs a 32-digest Lookup here: the
    frame read (FrameDecoder), decoded, and its LookupResult encoded; best of 3."""
    from kvcached_agent import protocol as p
    from kvcached_agent.address import CROSS_LAYER

    frame = p.encode(p.Lookup(CROSS_LAYER, [os.urandom(32) for _ in range(LOOKUP_DIGESTS)]), 7)
    decoder = p.FrameDecoder()
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(calls):
            decoder.feed(frame)
            got = decoder.next_frame()
            assert got is not None
            p.decode(got)
            p.encode(p.LookupResult(LOOKUP_DIGESTS, 0, LOOKUP_DIGESTS, 0, 0), got.request_id)
        best = min(best, time.thread_time() - t0)
    return best / calls / LOOKUP_DIGESTS * 1e6


def bench_size(block: int, counts: Sequence[int], s: Settings) -> dict[str, Any]:
    from bench_agent import start_echo
    from bench_core import GrpcBackend

    from kvcached_agent import protocol as p

    with tempfile.TemporaryDirectory(prefix="kvcbench-node-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        progress(f"{size_name(block)}: starting kvcached (RAM {s.ram_gib:g} GiB, SSD off) and the echo server")
        proc, channel = start_daemon(stack, tmp, s.ram_gib)
        pid = proc.proc.pid
        try:
            backend = GrpcBackend("kvcached", channel, pid)
            hash_threads = backend.stub.Stats(backend.pb.StatsRequest(), timeout=10).hash_threads
            _, echo_pid = start_echo(stack, tmp, len(p.encode(p.LookupResult(0, 0, 0, 0, 0))) - p.HEADER.size)
            progress(f"{size_name(block)}: writing the whole arena once ({s.ram_gib:g} GiB)")
            fill = fill_arena(tmp / "agent.sock", block, s.ram_gib)
            names = sorted({t[0] for t in thread_cpu(pid).values()})
            out: dict[str, Any] = {"block": block, "hash_threads": hash_threads, "fill_gbps": fill,
                                   "daemon_threads": names, "hash_us_1thread": hash_us(block),
                                   "index_us_per_key": index_write_us(tmp), "codec_us_per_digest": codec_us_per_digest(),
                                   "index_keys_us": index_keys_us(),
                                   "groups": {}}
            if not any(n.startswith(HASH_THREADS) for n in names):
                progress(f"warning: no hashing thread named {HASH_THREADS} in the daemon: {names}")
            for count in counts:
                with contextlib.ExitStack() as group:
                    progress(f"{size_name(block)}, {count} agent(s): starting the agent processes")
                    children = start_children(group, tmp, count, block, hash_threads, s.ring_mib, tmp / "echo.sock")
                    rounds = []
                    for r in range(s.rounds):
                        phases = {}
                        for pair in PAIRS:
                            for op in (pair if r % 2 == 0 else reversed(pair)):
                                phases[op] = ph = run_phase(children, op, s.seconds, pid, echo_pid)
                                rate = (f"{ph['blocks'] * block / ph['wall_s'] / 1e9:.3f} GB/s" if "blocks" in ph
                                        else f"{ph['calls'] / ph['wall_s']:.0f} calls/s")
                                progress(f"{size_name(block)}, {count} agent(s), round {r + 1}: {op} {rate}")
                        rounds.append(phases)
                    out["groups"][count] = rounds
            return out
        except BaseException:
            progress(f"kvcached log, last lines:\n{proc.tail(20)}")
            raise


# =============================================================================================
# figures


TITLES = {
    1: f"1. Aggregate save/load of N agent processes (CPU tensors, batches of {BATCH}) against one daemon, vs the same N "
       "processes copying (save: and BLAKE3-hashing) the same bytes with no daemon; each side's median round",
    2: "2. The daemon's CPU per block saved or loaded and per digest looked up (/proc, all N and rounds together); "
       "lower is better",
}


def fmt(value: float, unit: str) -> str:
    if unit.startswith("GB/s@"):
        block = int(unit[5:])
        return f"{value:.3f} GB/s ({value * 1e9 / block / 1e3:.1f}k blk/s)"
    if unit == "calls/s":
        return f"{value / 1e3:.1f}k calls/s"
    if unit == "us":
        return f"{value:.2f} us"
    return f"{value:.3g} {unit}"


def throughput_rows(res: dict[str, Any]) -> list[Row]:
    block = res["block"]
    rows = []
    for count, rounds in res["groups"].items():
        for op, base, name in (("save", "base_save", "copy_ + BLAKE3"), ("load", "base_load", "copy_"),
                               ("lookup", "echo", "echo, same frame")):
            unit = "calls/s" if op == "lookup" else f"GB/s@{block}"
            key = "calls" if op == "lookup" else "blocks"
            scale = 1.0 if op == "lookup" else block / 1e9

            def rate(ph: dict[str, Any], key: str = key, scale: float = scale) -> float:
                return ph[key] * scale / ph["wall_s"]

            kv = [rate(r[op]) for r in rounds]
            bs = [rate(r[base]) for r in rounds]
            label = f"{op} {size_name(block)}" + (f" ({LOOKUP_DIGESTS} digests)" if op == "lookup" else "")
            row = Row(1, f"{label}, {count} agent{'s' if count > 1 else ''}", unit, statistics.median(kv),
                      f"{name}, {count} proc{'s' if count > 1 else ''}", statistics.median(bs), True,
                      details={"kvcached": kv, "baseline": bs, "refused": [r[op].get("refused", 0) for r in rounds]},
                      paired_ratio=statistics.median(k / b for k, b in zip(kv, bs)))
            if op != "lookup" and count in TARGET_N:
                row.target = f">= {THROUGHPUT_TARGET:.1f}x"
                row.passed = row.ratio >= THROUGHPUT_TARGET
            rows.append(row)
    return rows


def cpu_costs(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per operation: daemon CPU us per block (digest) by kind, all groups and rounds together,
    and the frames the agents sent per block; also per N (event loop + other)."""
    out: dict[str, dict[str, Any]] = {}
    echo_cpu = echo_calls = 0.0
    for rounds in res["groups"].values():
        for r in rounds:
            echo_cpu += r["echo"]["echo_cpu_s"]
            echo_calls += r["echo"]["calls"]
    for op, per in (("save", "blocks"), ("load", "blocks"), ("lookup", "digests")):
        tot = {"loop": 0.0, "hash": 0.0, "other": 0.0}
        loop_sys = 0.0
        units = frames = 0
        by_n = {}
        idle = 0.0
        idle_s = 0.0
        for count, rounds in res["groups"].items():
            n_cpu = n_units = 0.0
            for r in rounds:
                ph = r[op]
                for k in tot:
                    tot[k] += ph["daemon_cpu"][k]
                loop_sys += ph["daemon_cpu"]["loop_sys"]
                units += ph[per]
                frames += ph["frames"]
                n_cpu += ph["daemon_cpu"]["loop"] + ph["daemon_cpu"]["other"]
                n_units += ph[per]
                base = r["base_save" if op == "save" else "base_load" if op == "load" else "echo"]
                idle += sum(base["daemon_cpu"][k] for k in tot)
                idle_s += base["wall_s"]
            by_n[count] = n_cpu / n_units * 1e6 if n_units else float("nan")
        us = {k: v / units * 1e6 for k, v in tot.items()}
        us["loop_sys"] = loop_sys / units * 1e6
        us["no_hash"] = us["loop"] + us["other"]
        us["total"] = us["no_hash"] + us["hash"]
        out[op] = {**us, "units": units, "frames_per_unit": frames / units, "by_n": by_n,
                   "echo_us_per_frame": echo_cpu / echo_calls * 1e6,
                   "daemon_idle_cpu_per_s": idle / idle_s if idle_s else 0.0}
    return out


def cpu_rows(res: dict[str, Any], costs: dict[str, dict[str, Any]]) -> list[Row]:
    block = size_name(res["block"])
    rows = []
    for op, target in (("save", BLOCK_US_TARGET), ("load", BLOCK_US_TARGET), ("lookup", DIGEST_US_TARGET)):
        c = costs[op]
        what = "digest" if op == "lookup" else "block"
        echo = c["echo_us_per_frame"] * c["frames_per_unit"]
        echo_name = f"echo x {c['frames_per_unit']:.3g} frames/{what}"
        main = Row(2, f"{op} {block}: loop + other (hashing apart)", "us", c["no_hash"], echo_name, echo, False,
                   f"<= {target:g} us", c["no_hash"] <= target, details=c)
        rows.append(main)
        rows.append(Row(2, f"{op} {block}: event loop only", "us", c["loop"], echo_name, echo, False))
        if op == "save":
            rows.append(Row(2, f"{op} {block}: hashing threads", "us", c["hash"], "BLAKE3, 1 thread, here",
                            res["hash_us_1thread"], False))
    return rows


def core_lines(results: Sequence[dict[str, Any]], costs: Sequence[dict[str, dict[str, Any]]]) -> list[str]:
    """What one core of the daemon sustains at the measured costs."""
    lines = ["What one core of the daemon sustains at these costs (blocks/s = 1e6 / us per block; GB/s = blocks/s x "
             "block bytes; lookup: digests/s):"]
    head = ["op", "loop us", "of it sys", "other us", "hash us", "loop+other: /s", "GB/s", "hashing: GB/s", "all: /s", "GB/s",
            "loop+other us by N"]
    table = []
    for res, cost in zip(results, costs):
        block = res["block"]
        for op in ("save", "load", "lookup"):
            c = cost[op]
            nb = 1e6 / c["no_hash"] if c["no_hash"] else float("inf")
            al = 1e6 / c["total"] if c["total"] else float("inf")
            hs = block / c["hash"] / 1e3 if c["hash"] > 0.05 else float("nan")
            table.append([f"{op} {size_name(block)}", f"{c['loop']:.2f}", f"{c['loop_sys']:.2f}", f"{c['other']:.2f}", f"{c['hash']:.2f}",
                          f"{nb / 1e3:.1f}k", "-" if op == "lookup" else f"{nb * block / 1e9:.2f}",
                          "-" if hs != hs else f"{hs:.2f}", f"{al / 1e3:.1f}k",
                          "-" if op == "lookup" else f"{al * block / 1e9:.2f}",
                          " ".join(f"{n}:{v:.2f}" for n, v in c["by_n"].items())])
    widths = [max(len(x) for x in col) + 2 for col in zip(head, *table)]
    lines.append("  " + "".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  " + "".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in table]
    return lines


def notes_for(res: dict[str, Any], cost: dict[str, dict[str, Any]]) -> list[str]:
    block = size_name(res["block"])
    refused = sum(r["save"].get("refused", 0) for rounds in res["groups"].values() for r in rounds)
    others: dict[str, float] = {}
    units = cost["save"]["units"]
    for rounds in res["groups"].values():
        for r in rounds:
            for name, cpu in r["save"]["daemon_cpu"]["by_name"].items():
                others[name] = others.get(name, 0.0) + cpu
    phases = [ph for rounds in res["groups"].values() for r in rounds for ph in r.values()]
    other_s, clocked = sum(ph["others_cpu_s"] for ph in phases), sum(ph["clocked_s"] for ph in phases)
    split = ", ".join(f"{k} {v / units * 1e6:.2f}" for k, v in sorted(others.items(), key=lambda kv: -kv[1]) if v > 0)
    return [f"{block}: first write of the arena {res['fill_gbps']:.2f} GB/s (cold pages); daemon hash threads "
            f"{res['hash_threads']}; blocks refused by Allocate in the save phases: {refused}; daemon CPU while the "
            f"baselines ran (no agent traffic): {cost['save']['daemon_idle_cpu_per_s'] * 1e3:.0f} ms/s",
            f"{block}: daemon CPU per block saved by thread name (us): {split}",
            f"{block}: an index write costs {res['index_us_per_key']:.2f} us of the writer's thread a key here (RocksDB, "
            f"the daemon's options, 64 keys a write); a saved block writes 2 keys (its record, its victim's tombstone): "
            f"{2 * res['index_us_per_key']:.2f} us of the save's event loop figure",
            f"{block}: the agent protocol's own Python (frame read, Lookup decoded, answer encoded) costs "
            f"{res['codec_us_per_digest']:.3f} us a digest of a {LOOKUP_DIGESTS}-digest Lookup here; with the echo "
            f"server's {cost['lookup']['echo_us_per_frame'] * cost['lookup']['frames_per_unit']:.3f} us that is "
            f"{res['codec_us_per_digest'] + cost['lookup']['echo_us_per_frame'] * cost['lookup']['frames_per_unit']:.3f}"
            " us a digest before any lookup work",
            f"{block}: a request's addresses (64 index keys) cost {res['index_keys_us'][0]:.2f} us a block hashed in one "
            f"compiled call (kvcached.host.short_hash), {res['index_keys_us'][1]:.2f} us one BlockAddress each: "
            f"{res['index_keys_us'][0] / res['index_keys_us'][1]:.2f}x",
            f"{block}: other processes used {other_s:.1f} CPU-s during the {clocked:.0f} s of phases "
            f"({other_s / clocked:.0%} of one core)" + ("; the figures are disturbed by them" if other_s / clocked > 0.1 else "")]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached node benchmark: N agent processes against one daemon")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 GiB arena, 0.5 s phases, one round")
    default_agents = "1,2,4" + (",8" if (os.cpu_count() or 1) >= 8 else "")
    parser.add_argument("--agents", default=default_agents, help=f"agent process counts (default {default_agents})")
    parser.add_argument("--block-kib", default="64,1024", help="block sizes, KiB (default 64,1024)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for arg in ("--sock", "--echo"):
        parser.add_argument(arg, help=argparse.SUPPRESS)
    for arg in ("--block", "--index", "--hash-threads", "--ring-mib"):
        parser.add_argument(arg, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)

    signal.signal(signal.SIGTERM, _interrupt)
    s = QUICK if args.quick else FULL
    counts = [int(x) for x in args.agents.split(",") if x]
    blocks = [int(x) * KiB for x in args.block_kib.split(",") if x]
    load = os.getloadavg()[0]
    started = time.time()
    results = [bench_size(block, counts, s) for block in blocks]
    costs = [cpu_costs(res) for res in results]
    rows: list[Row] = []
    for res, cost in zip(results, costs):
        rows += throughput_rows(res)
    for res, cost in zip(results, costs):
        rows += cpu_rows(res, cost)
    notes = [n for res, cost in zip(results, costs) for n in notes_for(res, cost)]
    header = (f"kvcached node benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s, load "
              f"average {load:.2f} at the start\nsettings: arena {s.ram_gib:g} GiB (full: every save evicts), SSD off, "
              f"{s.rounds} round(s) x {s.seconds:g} s a phase, agents {','.join(map(str, counts))}, baseline ring "
              f"{s.ring_mib} MiB a process")
    footer = ["ratio = kvcached / baseline; figure 1: median over rounds of the ratio within a round.",
              "figure 2 baselines: echo = the bare uvloop echo server's CPU per frame (lookup baseline phases) x the "
              "frames the agents sent per block or digest; BLAKE3 = CPU per block on one thread in this process.",
              "", *core_lines(results, costs), "", *(f"note: {n}" for n in notes)]
    print_fitted(rows, header, TITLES, fmt, footer)
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                        "settings": asdict(s), "agents": counts, "blocks": blocks},
               "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "costs": {str(res["block"]): cost for res, cost in zip(results, costs)},
               "runs": results, "notes": notes}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--daemon"]:
        sys.exit(daemon_main(sys.argv[2:]))
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); daemons and agent processes stopped, temp dirs removed")
        sys.exit(130)
