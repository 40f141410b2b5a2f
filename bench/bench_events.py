"""What KV events cost (kvcached.events, [events]): agent puts with events on against off in the
same run, a slow and an absent subscriber, and the delay from a block's commit to its event.

    python bench/bench_events.py [--quick] [--json PATH] [--ssd-gib G]

Setup: ``kvcached serve`` subprocesses (bench_core.start_kvcached: all state in a temp dir,
``kv.ram_gib`` 1, SSD off unless --ssd-gib, write_policy as configured, metrics on a free
loopback port for every daemon, so only [events] differs between them):

- "off": ``events.endpoint = ""`` (no publisher; its agent is not asked for route keys);
- "on": ``events.endpoint = "ipc://<tmp>/on/events"``, ``events.batch_ms`` 50 (the default),
  ``events.hwm`` 100 (so a stalled subscriber fills its queue within seconds) and
  ``events.replay_mib`` 8 (so the replay log, which every publisher keeps, is bounded early in
  the run and RSS growth past it is the subscribers' doing);
- "on, 10 ms" (figure 3 only): the same with ``events.batch_ms`` 10.

One agent (kvcached_agent.Agent, CPU tensors) per daemon in this process, one request in flight,
torch on one intra-op thread. Saves are 64 blocks a call of 64 KiB or 1 MiB, fresh addresses every
call. Where the agent is asked for them (``agent.wants_routes``: the "on" daemons), each block
carries one route key as a vLLM engine would give it: one int page hash, the previous block's hash
as parent, 16 token ids, block_size 16 (kvcached_agent.route.RouteKey); the keys are built off the
clock and encoded with ``encode_routes`` on it, so the clock holds everything the feature adds on
both sides: encoding, the Route frame, the daemon's check and storing of the keys, and the
publisher's work (tier feed, a multi-get of the keys, msgpack, ZMQ) on the daemon's cores.
Subscribers are subprocesses (this file with ``--subscriber``): a zmq SUB socket on the endpoint,
subscribed to every topic, that reads every batch [topic, seq, payload], checks the sequence
numbers for gaps, decodes the payload (kvcached.events.schema.decode_batch) and stamps the arrival
of marked block hashes with CLOCK_MONOTONIC (shared with this process).

Before timing, each daemon's arena is filled once with 1 MiB saves (with route keys where
asked), so every timed put evicts older blocks and the publisher sends a BlockRemoved for each
(the steady state of a long-lived cache), and each size gets a few unclocked warm-up saves.

1. Puts, events on with a subscriber reading, against events off: interleaved rounds (off, on,
   then on, off, ...), each side saving back to back until its clocked time (around
   ``Agent.save`` and the route keys' encoding only) reaches the round length. After each side's
   round, off the clock, the benchmark waits until the daemon has checksummed and recorded the
   round's blocks (a one-block load waits for that) and for the publisher to send them (2.5 batch
   intervals), so no round pays for the one before. GB/s = bytes stored / clocked time; a side's
   figure is its median round, the ratio the median over rounds of on / off within the round.
   Target (issue 40): >= 0.95x. A third side in the same rounds saves to the "on" daemon without
   route keys (its events name the blocks by digest): what the keys add apart from publishing.
   Also, no target: the daemon's CPU seconds (all its threads, /proc/PID/stat) per GB stored,
   from the start of a side's round to the end of its wait: what the puts cost the daemon,
   which the other sessions on a shared machine disturb less than they disturb throughput.
   And the floor of this design: the time to parse one block's Route entry and decode its keys
   three times (on arrival, for its BlockStored, for its BlockRemoved), timed in this process,
   against the "off" daemon's event-loop CPU per block in the same rounds (its main thread,
   /proc/PID/task/PID/stat): the share of a put's loop time spent before one event is built.
2. The same rounds with the "on" daemon's subscriber replaced by one that connects and never
   reads (its own receive queue capped at ``events.hwm`` batches, so the daemon's queue to it
   fills in seconds, not minutes), after unclocked saves until kvcached_events_dropped_hwm_total
   rises (the daemon is then dropping batches for it on every tick; as many unclocked saves go to
   the "off" daemon, so both indexes hold as much), then with no subscriber at all. Targets: puts
   >= 0.95x of off; the "on" daemon's VmRSS growth over each phase (read from /proc/PID/status
   before it and after every round) at most the "off" daemon's over the same puts plus the
   publisher's bound: its queue to the stalled subscriber (hwm x the largest batch the reader
   saw) and the replay log (replay_mib). kvcached_events_dropped_hwm_total is
   reported from /metrics next to what the stalled subscriber really missed: once stopped, it
   reads what was queued for it, and the batches published while it was connected
   (kvcached_events_batches_total) that it never got are the batches it missed.
3. Commit to event: blocks saved one at a time (64 KiB, ``confirm=True``), a random pause of up
   to one batch interval between them (so commits fall at every phase of the publisher's tick);
   the clock starts when ``Agent.save`` returns and stops when the subscriber receives the batch
   naming the block. p50 and p99 as a ratio to ``events.batch_ms``. Target (issue 40): p99 < 2
   batch intervals. Also, no target: the same delay under load, for the first block of every
   save in figure 1's rounds (a save's return to the arrival of its first block's event).

--quick: 3 rounds of 0.3 s, 120 and 200 latency samples (about a minute in all). Full: 5
rounds of 1 s, 600 and 1000 samples (about 2 minutes). Progress goes to stderr, the table to
stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
import timeit
import urllib.request
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)   # torch's CPU build; numpy is not used
import torch  # noqa: E402
from bench_agent import busy_cpu_s, fresh, run_script, wait_recorded  # noqa: E402
from bench_core import KiB, MiB, Proc, Row, percentile, print_fitted, proc_times, progress, size_name, start_kvcached  # noqa: E402

from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402
from kvcached_agent.route import RouteKey, encode_routes  # noqa: E402

SIZES = (64 * KiB, 1 * MiB)
BATCH = 64                  # blocks a save
TOKENS = 16                 # tokens per block, one engine page of 16
MARK = 1 << 62              # block hashes whose arrival the subscriber stamps
MODEL = "bench/events"
PUT_TARGET = 0.95           # puts with events on / off
LATENCY_TARGET = 2.0        # p99 commit -> event, in batch intervals
HWM = 100
REPLAY_MIB = 8


@dataclass(frozen=True)
class Settings:
    ram_gib: float
    rounds: int
    seconds: float          # clocked save time per side and round
    samples_50: int         # latency samples at batch_ms 50
    samples_10: int         # ... and at 10
    prefill_s: float        # longest unclocked wait for the first drop in figure 2


FULL = Settings(ram_gib=1.0, rounds=5, seconds=1.0, samples_50=600, samples_10=1000, prefill_s=30.0)
QUICK = Settings(ram_gib=1.0, rounds=3, seconds=0.3, samples_50=120, samples_10=200, prefill_s=15.0)


# =============================================================================================
# the subscriber (its own process)


def subscriber_main(args: argparse.Namespace) -> int:
    """Read the batches published on ``args.subscriber`` (with --stall: read none until SIGTERM,
    then what was queued for it); at SIGTERM write what was seen to ``args.out`` as JSON."""
    import zmq

    from kvcached.events.schema import BlockRemoved, BlockStored, decode_batch

    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if args.stall:
        sub.setsockopt(zmq.RCVHWM, args.hwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(args.subscriber)
    seen: dict[str, Any] = {"batches": 0, "events": 0, "bytes": 0, "max_batch_bytes": 0, "gaps": 0, "stored": 0,
                            "stored_with_tokens": 0, "removed": 0, "stored_events": 0, "removed_events": 0, "other": 0,
                            "malformed": 0}
    arrivals: dict[int, float] = {}
    last: int | None = None
    while args.stall and not stop:       # connected, never reading
        time.sleep(0.05)
    while True:
        if stop and not args.stall:
            break
        if not sub.poll(100 if not args.stall else 500):
            if args.stall:               # stopped: what was queued for it is read, then it ends
                break
            continue
        while True:
            try:
                frames = sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            now = time.monotonic()
            if len(frames) != 3 or len(frames[1]) != 8:
                seen["malformed"] += 1
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if last is not None and seq > last + 1:
                seen["gaps"] += seq - last - 1
            last = seq
            seen["batches"] += 1
            seen["bytes"] += len(payload)
            seen["max_batch_bytes"] = max(seen["max_batch_bytes"], len(payload))
            batch = decode_batch(payload)
            seen["events"] += len(batch.events)
            for event in batch.events:
                if isinstance(event, BlockStored):        # a chain of blocks saved together is one event
                    seen["stored_events"] += 1
                    seen["stored"] += len(event.block_hashes)
                    if event.token_ids and len(event.token_ids) == TOKENS * len(event.block_hashes):
                        seen["stored_with_tokens"] += len(event.block_hashes)
                    h = event.block_hashes[0]
                    if isinstance(h, int) and h & MARK and h not in arrivals:
                        arrivals[h] = now
                elif isinstance(event, BlockRemoved):
                    seen["removed_events"] += 1
                    seen["removed"] += len(event.block_hashes)
                else:
                    seen["other"] += 1
    sub.close(linger=0)
    ctx.term()
    user, system = os.times()[:2]
    seen.update(cpu_s=user + system, arrivals=[[h, t] for h, t in arrivals.items()])
    Path(args.out).write_text(json.dumps(seen))
    return 0


class Subscriber:
    """A subscriber subprocess; :meth:`finish` stops it and returns what it saw."""

    def __init__(self, tmp: Path, name: str, endpoint: str, *, stall: bool = False) -> None:
        self.out = tmp / f"{name}.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--subscriber", endpoint, "--out", str(self.out),
                "--hwm", str(HWM)] + (["--stall"] if stall else [])
        self.proc = Proc(name, argv, cwd=tmp, log=tmp / f"{name}.log")

    def finish(self) -> dict[str, Any]:
        self.proc.stop()
        if not self.out.exists():
            raise RuntimeError(f"{self.proc.name} wrote nothing:\n{self.proc.tail()}")
        seen: dict[str, Any] = json.loads(self.out.read_text())
        seen["arrivals"] = {int(h): t for h, t in seen["arrivals"]}
        return seen


# =============================================================================================
# the daemons


@dataclass
class Daemon:
    name: str
    proc: Proc
    agent: Agent
    metrics_port: int
    endpoint: str            # "": events off
    batch_ms: float
    last: dict[int, BlockAddress] = field(default_factory=dict)     # per size: the last block stored

    @property
    def pid(self) -> int:
        return self.proc.proc.pid

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def rss(self) -> dict[str, int]:
        """VmRSS and RssAnon of the daemon, bytes."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def wait_subscriptions(self, n: int, timeout: float = 20.0) -> None:
        """Until the publisher counts ``n`` subscriptions (it reads them once a batch interval)."""
        deadline = time.monotonic() + timeout
        while self.metrics().get("kvcached_events_subscriptions") != n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {n} subscription(s) not seen in {timeout:.0f} s:\n{self.proc.tail()}")
            time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(stack: contextlib.ExitStack, tmp: Path, name: str, ram_gib: float, ssd_gib: float,
                 batch_ms: float | None) -> Daemon:
    """A ``kvcached serve`` subprocess in ``tmp/name`` and an agent connected to it; events on
    with ``batch_ms`` (None: off)."""
    home = tmp / name
    home.mkdir()
    port = free_port()
    endpoint = f"ipc://{home}/events" if batch_ms is not None else ""
    extra = [f"kv.ssd_gib={ssd_gib}", f'metrics.listen="127.0.0.1:{port}"', f'events.endpoint="{endpoint}"']
    if batch_ms is not None:
        extra += [f"events.batch_ms={batch_ms}", f"events.hwm={HWM}", f"events.replay_mib={REPLAY_MIB}"]
    proc, _ = start_kvcached(stack, home, ram_gib, extra)
    deadline = time.monotonic() + 30
    while True:     # the agent socket listens right after gRPC does
        try:
            agent = Agent.connect(str(home / "agent.sock"), agent_id=f"bench-{name}", model=MODEL, dtype="bfloat16",
                                  block_tokens=TOKENS, num_layers=1, layer_block_bytes=max(SIZES), use_cuda=False)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"no agent socket from kvcached {name}:\n{proc.tail()}") from None
            time.sleep(0.05)
    stack.callback(agent.close)
    if agent.wants_routes != bool(endpoint):
        raise RuntimeError(f"{name}: the agent's wants_routes is {agent.wants_routes} with events.endpoint {endpoint!r}")
    return Daemon(name, proc, agent, port, endpoint, batch_ms or 0.0)


# =============================================================================================
# saves


class Hashes:
    """Engine block hashes, unique over the run; marked ones (MARK set) are stamped on arrival."""

    def __init__(self) -> None:
        self.next = 1

    def keys(self, n: int, *, mark_first: bool = False) -> tuple[list[RouteKey], int]:
        """Route keys of ``n`` chained blocks (16 tokens each) and the first block's hash."""
        keys = []
        parent: int | None = None
        first = 0
        for i in range(n):
            h = self.next | (MARK if mark_first and i == 0 else 0)
            self.next += 1
            base = (h * TOKENS) & 0xFFFF
            keys.append(RouteKey([h], parent, list(range(base, base + TOKENS)), TOKENS))
            parent = h
            first = first or h
        return keys, first


class Blocks:
    """Per size, BATCH block tensors (views of one random tensor) and a scratch tensor for loads."""

    def __init__(self) -> None:
        self.src = {size: list(torch.randint(0, 256, (BATCH * size,), dtype=torch.uint8).view(-1, size))
                    for size in SIZES}
        self.scratch = {size: torch.empty(size, dtype=torch.uint8) for size in SIZES}


def save(d: Daemon, blocks: Blocks, size: int, hashes: Hashes, n: int = BATCH,
         commits: dict[int, float] | None = None, with_routes: bool = True) -> tuple[float, int, int]:
    """One save of ``n`` fresh blocks, with route keys where the agent is asked for them (and
    ``with_routes``); (clocked seconds, stored, skipped). With ``commits``, the first block's
    hash is marked and the time the save returned kept for it."""
    routes = d.agent.wants_routes and with_routes
    if not routes:
        commits = None
    addresses = fresh(n)
    keys, first = hashes.keys(n, mark_first=commits is not None)
    t0 = time.perf_counter()
    blobs = [encode_routes([k]) for k in keys] if routes else None
    result = d.agent.save(addresses, blocks.src[size][:n], routes=blobs)
    t1 = time.perf_counter()
    if commits is not None and 0 not in result.skipped:
        commits[first] = time.monotonic()
    refused = set(result.skipped)
    last = next((addresses[i] for i in reversed(range(n)) if i not in refused), None)
    if last is not None:
        d.last[size] = last
    return t1 - t0, result.stored, len(refused)


def settle(d: Daemon, blocks: Blocks, size: int) -> None:
    """Off the clock: until the daemon has recorded the blocks saved so far (and, with events, the
    publisher has sent them)."""
    if size in d.last:
        wait_recorded(d.agent, d.last[size], blocks.scratch[size])
    if d.endpoint:
        time.sleep(2.5 * d.batch_ms / 1000)


def fill(d: Daemon, blocks: Blocks, hashes: Hashes, ram_gib: float) -> float:
    """Save 1 MiB blocks until the arena was written once, and a batch more; GB/s."""
    total = int(ram_gib * 1024) * MiB + BATCH * MiB
    spent = 0.0
    for _ in range(0, total, BATCH * MiB):
        spent += save(d, blocks, MiB, hashes)[0]
    settle(d, blocks, MiB)
    return total / spent / 1e9


@dataclass
class Sides:
    """Per side, every round's GB/s, the daemon's CPU seconds per GB stored (all its threads,
    and its event loop's thread alone); stored and refused blocks in all."""

    gbps: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    loop_cpu: dict[str, list[float]] = field(default_factory=dict)
    stored: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


def rounds(sides: dict[str, tuple[Daemon, bool]], blocks: Blocks, hashes: Hashes, size: int, s: Settings,
           commits: dict[int, float] | None = None, after_round: Any = None) -> Sides:
    """Interleaved rounds of back-to-back saves, a side being a daemon and whether route keys
    go with the saves (the order reversed every round); with ``commits``, the first block of
    every save with route keys is marked."""
    names = list(sides)
    out = Sides({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}, dict.fromkeys(names, 0),
                dict.fromkeys(names, 0))
    for d, with_routes in sides.values():   # warm-up, unclocked: this size's slots in use on every side
        for _ in range(4 if size >= MiB else 16):
            save(d, blocks, size, hashes, with_routes=with_routes)
        settle(d, blocks, size)
    for r in range(s.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            d, with_routes = sides[name]
            spent = 0.0
            stored = 0
            cpu0, loop0 = proc_times(d.pid), loop_times(d.pid)
            while spent < s.seconds:
                dt, ok, refused = save(d, blocks, size, hashes, commits=commits, with_routes=with_routes)
                spent += dt
                stored += ok
                out.skipped[name] += refused
            settle(d, blocks, size)         # the daemon's work for these saves ends here
            cpu1, loop1 = proc_times(d.pid), loop_times(d.pid)
            out.gbps[name].append(stored * size / spent / 1e9)
            out.cpu[name].append((cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) / max(1e-9, stored * size / 1e9))
            out.loop_cpu[name].append((loop1 - loop0) / max(1e-9, stored * size / 1e9))
            out.stored[name] += stored
        if after_round is not None:
            after_round()
    return out


def loop_times(pid: int) -> float:
    """CPU seconds of the daemon's main thread (its event loop, where every put's bookkeeping
    and the publisher run; the checksums run in other threads)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def floor_row(sides: Sides, size: int) -> Row:
    """What this design spends per block at the least on route keys, against the event loop's
    CPU per block with events off (measured in the rounds just run): a block's keys are decoded
    three times (checked when their Route frame arrives, read for its BlockStored, read again for
    its BlockRemoved: every put evicts) and its Route entry parsed once. Timed here, in this
    process, on the keys figure 1 sends. The ratio is the share of a put's event-loop time that
    is gone before one event is built, encoded or sent; the 0.95x target leaves 5%."""
    from kvcached_agent.codes import LIMITS
    from kvcached_agent.framing import BodyReader
    from kvcached_agent.protocol import Route
    from kvcached_agent.route import decode_routes
    keys, _ = Hashes().keys(BATCH)
    blobs = [encode_routes([k]) for k in keys]
    body = Route([(bytes(32), 0, b) for b in blobs]).encode_body()

    def work() -> None:
        Route.decode_body(BodyReader(body, "Route", LIMITS))
        for _ in range(3):
            for blob in blobs:
                decode_routes(blob)

    floor_us = min(timeit.repeat(work, number=20, repeat=5)) / 20 / BATCH * 1e6
    loop_us = statistics.median(sides.loop_cpu["off"]) * size / 1e9 * 1e6
    return Row(1, f"floor: route keys decoded 3x a block, {size_name(size)}", "us/block", floor_us,
               "event loop CPU a block, off", loop_us, False, details={"loop_cpu_s_per_gb": sides.loop_cpu})


def put_row(figure: int, case: str, sides: Sides, on: str, off: str, size: int, target: bool = True) -> Row:
    ratio = statistics.median(a / b for a, b in zip(sides.gbps[on], sides.gbps[off]))
    row = Row(figure, f"{case}, {size_name(size)} x{BATCH}", "GB/s", statistics.median(sides.gbps[on]), "events off",
              statistics.median(sides.gbps[off]), True,
              details={"rounds": sides.gbps, "daemon_cpu_s_per_gb": sides.cpu, "stored": sides.stored,
                       "refused": sides.skipped}, paired_ratio=ratio)
    if target:
        row.target, row.passed = f">= {PUT_TARGET:.2f}x", ratio >= PUT_TARGET
    return row


def cpu_row(figure: int, case: str, sides: Sides, on: str, off: str, size: int) -> Row:
    """The daemon's CPU seconds (all its threads) per GB stored, from the start of a side's
    round to the end of its settle: what the puts cost it, whoever else ran."""
    ratio = statistics.median(a / b for a, b in zip(sides.cpu[on], sides.cpu[off]))
    return Row(figure, f"{case}, {size_name(size)} x{BATCH}", "CPU-s/GB", statistics.median(sides.cpu[on]),
               "events off", statistics.median(sides.cpu[off]), False, details={"rounds": sides.cpu},
               paired_ratio=ratio)


# =============================================================================================
# figure 3: commit to event


def latency_samples(d: Daemon, blocks: Blocks, hashes: Hashes, n: int) -> dict[int, float]:
    """``n`` single 64 KiB saves, a random pause of up to one batch interval apart; the commit
    time of each marked hash."""
    commits: dict[int, float] = {}
    rng = random.Random(40)
    interval = d.batch_ms / 1000
    for _ in range(n):
        save(d, blocks, SIZES[0], hashes, n=1, commits=commits)
        time.sleep(rng.uniform(0.0, interval))
    settle(d, blocks, SIZES[0])
    time.sleep(2 * interval)
    return commits


def delays_ms(commits: dict[int, float], arrivals: dict[int, float]) -> tuple[list[float], int]:
    """Commit-to-arrival delays, ms, and how many committed blocks never arrived."""
    out = [(arrivals[h] - t) * 1e3 for h, t in commits.items() if h in arrivals]
    return out, len(commits) - len(out)


def latency_rows(case: str, delays: list[float], missing: int, batch_ms: float, target: bool) -> list[Row]:
    if not delays:
        raise RuntimeError(f"{case}: no event arrived for the {missing} blocks committed")
    rows = []
    details = {"samples": len(delays), "missing": missing, "max_ms": max(delays), "min_ms": min(delays)}
    for q in (0.5, 0.99):
        value = percentile(delays, q)
        row = Row(3, f"{case}, p{q * 100:.0f}", "ms", value, "events.batch_ms", batch_ms, False, details=details)
        if target and q == 0.99:
            row.target, row.passed = f"< {LATENCY_TARGET:g}x", value / batch_ms < LATENCY_TARGET and not missing
        rows.append(row)
    return rows


# =============================================================================================
# the run


def mib(n: float) -> float:
    return n / MiB


def run(s: Settings, ssd_gib: float, tmp: Path, stack: contextlib.ExitStack, notes: list[str]) -> list[Row]:
    rows: list[Row] = []
    blocks, hashes = Blocks(), Hashes()
    progress(f"starting kvcached: events off, events on (batch_ms 50, hwm {HWM}); RAM {s.ram_gib:g} GiB each, "
             f"SSD {f'{ssd_gib:g} GiB' if ssd_gib else 'off'}")
    off = start_daemon(stack, tmp, "off", s.ram_gib, ssd_gib, None)
    on = start_daemon(stack, tmp, "on", s.ram_gib, ssd_gib, 50.0)
    pair = {"off": off, "on": on}
    both = {"off": (off, True), "on": (on, True)}
    reader = Subscriber(tmp, "reader", on.endpoint)
    stack.callback(reader.proc.stop)
    on.wait_subscriptions(1)
    for d in pair.values():
        progress(f"filling {d.name}'s arena once with 1 MiB saves ({s.ram_gib:g} GiB)")
        gbps = fill(d, blocks, hashes, s.ram_gib)
        notes.append(f"first write of {d.name}'s arena (1 MiB x{BATCH} saves into memory never touched): {gbps:.2f} GB/s")

    # -- 1: a subscriber reading -----------------------------------------------------------------
    loaded: dict[int, dict[int, float]] = {}
    t_fig1 = time.monotonic()
    cpu0 = proc_times(reader.proc.proc.pid)
    for size in SIZES:
        progress(f"1. puts of {size_name(size)} x{BATCH}, events on (a subscriber reading) vs off: "
                 f"{s.rounds} rounds of {s.seconds:g} s per side")
        loaded[size] = {}
        sides = rounds({**both, "on, no keys": (on, False)}, blocks, hashes, size, s, commits=loaded[size])
        rows.append(put_row(1, "events on, subscriber reading", sides, "on", "off", size))
        progress(f"   on {rows[-1].kvcached:.3f} GB/s, off {rows[-1].baseline:.3f} GB/s: {rows[-1].ratio:.2f}x")
        rows.append(put_row(1, "the same, no route keys", sides, "on, no keys", "off", size, target=False))
        rows.append(cpu_row(1, "daemon CPU, subscriber reading", sides, "on", "off", size))
        rows.append(cpu_row(1, "daemon CPU, no route keys", sides, "on, no keys", "off", size))
        rows.append(floor_row(sides, size))
    fig1_wall = time.monotonic() - t_fig1
    cpu1 = proc_times(reader.proc.proc.pid)
    dropped_fig1 = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0)

    # -- 3 at batch_ms 50, with the same reader ---------------------------------------------------
    progress(f"3. commit -> event: {s.samples_50} single 64 KiB saves, batch_ms 50")
    commits_50 = latency_samples(on, blocks, hashes, s.samples_50)
    seen = reader.finish()
    if seen["gaps"] or seen["malformed"] or not seen["stored"]:
        raise RuntimeError(f"the reader saw {seen['gaps']} missing batches, {seen['malformed']} malformed ones and "
                           f"{seen['stored']} blocks in BlockStored events")
    if not seen["stored_with_tokens"]:
        raise RuntimeError(f"none of {seen['stored']} blocks in BlockStored events carries the route keys' tokens: the "
                           "route keys did not reach the events")
    reader_cpu = cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]
    notes.append(f"figure 1's reader: {seen['batches']:,} batches, {seen['events']:,} events ({seen['stored_events']:,} "
                 f"BlockStored naming {seen['stored']:,} blocks, {seen['stored_with_tokens']:,} of them with the route keys' "
                 f"tokens, the others by digest; {seen['removed_events']:,} BlockRemoved naming {seen['removed']:,}), "
                 f"{seen['bytes'] / 1e6:.1f} MB, largest batch "
                 f"{seen['max_batch_bytes'] / 1e3:.0f} kB, no gap in the sequence numbers; its CPU during figure 1: "
                 f"{reader_cpu:.2f} s over {fig1_wall:.0f} s ({reader_cpu / fig1_wall:.0%} of a core, taken from the cores the daemons and "
                 f"this client share); kvcached_events_dropped_hwm_total {dropped_fig1:.0f}")
    delays, missing = delays_ms(commits_50, seen["arrivals"])
    rows += latency_rows("idle, batch_ms 50", delays, missing, 50.0, True)
    for size in SIZES:
        delays, missing = delays_ms(loaded[size], seen["arrivals"])
        rows += latency_rows(f"puts of {size_name(size)} x{BATCH}, batch_ms 50", delays, missing, 50.0, False)

    # -- 2: a stalled subscriber, then none ------------------------------------------------------
    bound = mib(HWM * seen["max_batch_bytes"]) + REPLAY_MIB
    stall = Subscriber(tmp, "stalled", on.endpoint, stall=True)
    stack.callback(stall.proc.stop)
    on.wait_subscriptions(1)
    published0 = on.metrics().get("kvcached_events_batches_total", 0.0)
    progress("2. a subscriber that never reads: unclocked 64 KiB saves until the daemon drops batches for it")
    dropped0 = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0)
    deadline = time.monotonic() + s.prefill_s
    dropped = dropped0
    prefill_saves = 0
    while dropped <= dropped0 and time.monotonic() < deadline:
        for _ in range(8):
            save(on, blocks, SIZES[0], hashes)
        prefill_saves += 8
        dropped = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0)
    settle(on, blocks, SIZES[0])
    progress(f"   the same {prefill_saves} saves to the off daemon, so both indexes hold as much")
    for _ in range(prefill_saves):     # else only "on"'s index grows, and its compactions land in the rounds
        save(off, blocks, SIZES[0], hashes)
    settle(off, blocks, SIZES[0])
    if dropped <= dropped0:
        notes.append(f"the stalled subscriber caused no drop within {s.prefill_s:g} s of saves: figure 2's slow case "
                     "ran before its queue was full")
    for case, subscriber in (("stalled subscriber", stall), ("no subscriber", None)):
        if subscriber is None:
            published = on.metrics().get("kvcached_events_batches_total", 0.0) - published0
            got = stall.finish()
            on.wait_subscriptions(0)
            counted = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0) - dropped0
            notes.append(f"the stalled subscriber, once stopped, read the {got['batches']:,} batches queued for it of "
                         f"the {published:,.0f} published while it was connected: it missed "
                         f"{published - got['batches']:,.0f} ({got['gaps']:,} in gaps between the sequence numbers it "
                         f"got); kvcached_events_dropped_hwm_total rose by {counted:.0f} meanwhile")
        rss0 = {n: d.rss() for n, d in pair.items()}
        trace = [mib(rss0["on"]["VmRSS"])]
        before = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0)
        for size in SIZES:
            progress(f"2. puts of {size_name(size)} x{BATCH}, events on with {case} vs off")
            sides = rounds(both, blocks, hashes, size, s, after_round=lambda: trace.append(mib(on.rss()["VmRSS"])))
            rows.append(put_row(2, f"events on, {case}", sides, "on", "off", size))
            progress(f"   on {rows[-1].kvcached:.3f} GB/s, off {rows[-1].baseline:.3f} GB/s: {rows[-1].ratio:.2f}x")
            rows.append(cpu_row(2, f"daemon CPU, {case}", sides, "on", "off", size))
        after = on.metrics().get("kvcached_events_dropped_hwm_total", 0.0)
        rss1 = {n: d.rss() for n, d in pair.items()}
        grown = {n: mib(rss1[n]["VmRSS"] - rss0[n]["VmRSS"]) for n in pair}
        anon = {n: mib(rss1[n]["RssAnon"] - rss0[n]["RssAnon"]) for n in pair}
        limit = max(0.0, grown["off"]) + bound
        rows.append(Row(2, f"VmRSS growth, {case}", "MiB", grown["on"], f"off's growth + {bound:.0f} MiB bound", limit,
                        False, "<= 1.00x", grown["on"] <= limit,
                        {"vmrss_mib": {n: [mib(rss0[n]["VmRSS"]), mib(rss1[n]["VmRSS"])] for n in pair},
                         "rss_anon_growth_mib": anon, "on_vmrss_after_each_round_mib": trace}))
        notes.append(f"{case}: kvcached_events_dropped_hwm_total {before:.0f} -> {after:.0f} over the phase's rounds"
                     + (f" ({dropped - dropped0:.0f} during the unclocked saves before them)" if subscriber else "")
                     + f"; the on daemon's VmRSS {trace[0]:.0f} MiB at the start, after each round "
                     + ", ".join(f"{x:.0f}" for x in trace[1:]) + f" MiB; RssAnon growth on {anon['on']:+.1f} MiB, "
                     f"off {anon['off']:+.1f} MiB. Bound: hwm {HWM} x largest batch {seen['max_batch_bytes'] / 1e3:.0f} "
                     f"kB + replay_mib {REPLAY_MIB}")

    # -- 3 at batch_ms 10 ------------------------------------------------------------------------
    for d in pair.values():
        d.agent.close()
        d.proc.stop()
    progress("starting kvcached with events.batch_ms 10")
    fast = start_daemon(stack, tmp, "on10", s.ram_gib, ssd_gib, 10.0)
    reader10 = Subscriber(tmp, "reader10", fast.endpoint)
    stack.callback(reader10.proc.stop)
    fast.wait_subscriptions(1)
    progress(f"3. commit -> event: {s.samples_10} single 64 KiB saves, batch_ms 10")
    commits_10 = latency_samples(fast, blocks, hashes, s.samples_10)
    seen10 = reader10.finish()
    delays, missing = delays_ms(commits_10, seen10["arrivals"])
    rows += latency_rows("idle, batch_ms 10", delays, missing, 10.0, True)
    return rows


TITLES = {1: f"1. Agent puts ({BATCH} blocks a save, fresh addresses, arena full), events on with a subscriber "
             "reading vs events off; GB/s of the median round, and the daemon's CPU per GB stored (lower is better)",
          2: f"2. The same puts with a subscriber that never reads, then with none (hwm {HWM}), vs events off; and the "
             "daemon's VmRSS growth over each phase",
          3: "3. A block's commit (Agent.save returned) to its event on a subscriber socket; ratio = delay / batch_ms"}


def others_note(busy0: float, mine0: float, wall_s: float) -> str:
    """How much CPU processes other than this one and its children (reaped by now) took during
    the run (as bench_agent.others_cpu_note): on a shared 2-core machine, the first thing to look
    at when a figure is off."""
    other = max(0.0, busy_cpu_s() - busy0 - (sum(os.times()[:4]) - mine0))
    return (f"other processes used {other:.1f} CPU-s during the {wall_s:.0f} s run ({other / wall_s:.0%} of one core)"
            + ("; the figures are disturbed by them" if other / wall_s > 0.1 else ""))


def fmt(value: float, unit: str) -> str:
    if unit == "GB/s":
        return f"{value:.3f} GB/s"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "MiB":
        return f"{value:+.1f} MiB"
    if unit == "CPU-s/GB":
        return f"{value:.2f} CPU-s/GB"
    if unit == "us/block":
        return f"{value:.1f} us/block"
    return f"{value:.0f} {unit}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (about a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--ssd-gib", type=float, default=0.0, help="each daemon's SSD tier, GiB (default 0: off)")
    parser.add_argument("--subscriber", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hwm", type=int, default=HWM, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.subscriber:
        return subscriber_main(args)
    s = QUICK if args.quick else FULL
    torch.set_num_threads(1)          # the other core is the daemons' (as bench_agent.py)
    load = os.getloadavg()[0]
    busy0, mine0 = busy_cpu_s(), sum(os.times()[:4])
    started = time.time()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-events-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        try:
            rows = run(s, args.ssd_gib, tmp, stack, notes)
        except BaseException:
            for log in sorted(tmp.glob("*/kvcached.log")) + sorted(tmp.glob("*.log")):
                progress(f"{log.relative_to(tmp)}, last lines:\n" + "\n".join(log.read_text(errors="replace")
                                                                            .splitlines()[-15:]))
            raise
    notes.append(others_note(busy0, mine0, time.time() - started))
    header = (f"kvcached KV events benchmark ({'quick' if args.quick else 'full'}): {platform.node()}, "
              f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
              f"{time.time() - started:.0f} s, load average {load:.2f} at the start\nsettings: RAM {s.ram_gib:g} GiB per "
              f"daemon, SSD {f'{args.ssd_gib:g} GiB' if args.ssd_gib else 'off'}, {s.rounds} interleaved rounds of "
              f"{s.seconds:g} s per side, events.hwm {HWM}, events.replay_mib {REPLAY_MIB}, route keys: 1 per block "
              f"({TOKENS} tokens, int hashes)")
    footer = ["ratio = events on / events off, median over rounds of the ratio within a round (throughput: higher is "
              "better; CPU-s/GB: lower is better); floor: the share of a put's event-loop time (events off) that "
              "parsing and decoding a block's route keys takes, before one event is built (the best ratio left is "
              "about 1 / (1 + floor)); VmRSS: growth / (off's growth + bound); latency: delay / events.batch_ms (lower "
              "is better)."]
    print_fitted(rows, header, TITLES, fmt, footer)
    for note in notes:
        print(f"note: {note}")
    if args.json:
        doc = {"meta": {"quick": args.quick, "settings": asdict(s), "ssd_gib": args.ssd_gib, "cpus": os.cpu_count(),
                        "started": started, "elapsed_s": time.time() - started},
               "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows], "notes": notes}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_script(main)
