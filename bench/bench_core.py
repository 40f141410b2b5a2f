"""kvcached core benchmark: every figure next to a baseline measured in the same run.

    python bench/bench_core.py [--json PATH] [--quick] [--figures 1234]

Machines here are shared and noisy (see /work/shared/BASELINES.md): absolute figures move from
run to run, the ratio to a baseline timed seconds apart on the same machine much less. Every
throughput case runs in interleaved rounds (kvcached, bare, redis, then the reverse order, ...);
each side reports its median round, and the ratio is the median over rounds of kvcached /
baseline within a round (the machine's speed drifts; a round's sides ran seconds apart).

1. gRPC Get/Put, 64 KiB and 1 MiB blocks, 1 and 16 blocks a call: a real ``kvcached serve``
   subprocess (2 GiB arena, all state in a temp dir) against a bare grpc.aio servicer of the
   same kvcached.v1.KvCache proto that keeps bytes in a dict (bench/_baseline_server.py: own
   subprocess, same server options, uvloop). Both on Unix sockets; one blocking grpcio client
   (this process, one call in flight) sends the same request messages to both. Time is summed
   around the RPC only (building a Put request with fresh addresses is off the clock). Gets
   cycle over a resident working set. Before the Put cases every server is filled once to its
   memory budget (kvcached's arena; the bare servicer's FIFO cap, half of it; redis' maxmemory),
   so Puts run in a long-lived cache's steady state: memory touched before, each put evicting.
   The GB/s of that first fill (cold memory) is printed as a note. Target: >= 0.8x bare.
2. The same cases against redis-server (own subprocess, Unix socket, ``--save "" --appendonly
   no``, maxmemory = the arena size, allkeys-lru) through redis-py: GET/SET for one block,
   MGET/MSET for 16. Target: kvcached Get >= 2x redis-py (Put: reported, no target).
3. Lookup of a 64-block prefix (digests from kvcached_agent.address.chain_digests, all 64 put
   first so the whole prefix hits): p50/p99 over N blocking calls, against an empty-message
   round trip (Stats -> empty StatsResponse) to the bare servicer; also against the bare
   servicer's Lookup with the same 64-digest request (empty answer), which separates the
   daemon's own work from the message size. No target.
4. Metadata memory per block, each probe in a fresh subprocess, VmRSS growth read from
   /proc/self/status: kvcached.index.BlockIndex (RocksDB) in a temp dir, 1M BlockRecords
   written in batches of 10k through BlockIndex.write, and its size on disk after close;
   kvcached.tiers.ram.RamTier over a SharedArena of 1M x 4 KiB (memfd: reserve + commit only,
   no payload written, so no arena page is touched and only metadata grows). Baseline: a plain
   dict of 1M 32-byte keys -> 32-byte bytes, same method; for disk, the raw key + record bytes.
   Target: <= 256 bytes per block.

The client process keeps freed memory in its heap (mallopt; see tune_client_malloc) so that its
own page faults do not dilute the ratios; servers run untuned, as deployed. The JSON also holds,
per case and side, every round, p50 call latency, and the server's CPU time and minor page
faults per call.

--quick: 0.5 GiB arena (so the fill is short), 3 rounds of 0.1 s, 600 lookups, 250k blocks for
the memory figure; noisier, for a smoke test. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
CONFIG = ROOT / "config" / "kvcached.toml"
KiB, MiB = 1 << 10, 1 << 20
MAX_MESSAGE = 64 * MiB
SIZES = (64 * KiB, 1 * MiB)
BATCHES = (1, 16)
MEMORY_TARGET = 256          # bytes of metadata per block
GRPC_TARGET = 0.8            # kvcached / bare servicer
REDIS_GET_TARGET = 2.0       # kvcached Get / redis-py GET
MODEL = "meta-llama/Llama-3.1-8B-Instruct"   # model label of the index records (32 characters)

_T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    seconds: float          # clocked RPC time per side per round
    rounds: int
    lookup_calls: int       # per side, over all rounds
    mem_blocks: int
    working_set: int        # bytes of blocks that Gets cycle over, per size
    ram_gib: float          # kvcached arena and redis maxmemory; the bare servicer keeps half


FULL = Settings(seconds=0.5, rounds=5, lookup_calls=2000, mem_blocks=1_000_000, working_set=64 * MiB, ram_gib=2.0)
QUICK = Settings(seconds=0.1, rounds=3, lookup_calls=600, mem_blocks=250_000, working_set=16 * MiB, ram_gib=0.5)


@dataclass
class Row:
    """One printed figure: kvcached against its baseline."""

    figure: int
    case: str
    unit: str
    kvcached: float
    baseline_name: str
    baseline: float
    higher_is_better: bool
    target: str = ""        # printed as is; "" when the figure has no target
    passed: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)
    paired_ratio: float | None = None   # median over rounds of kvcached / baseline in the same round

    @property
    def ratio(self) -> float:
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.kvcached / self.baseline if self.baseline else float("nan")

    @property
    def verdict(self) -> str:
        return "-" if self.passed is None else ("PASS" if self.passed else "BELOW TARGET")


def size_name(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


def read_status() -> dict[str, int]:
    """VmRSS and friends of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def log_tail(log: Path, lines: int = 15) -> str:
    """The last ``lines`` of a process's log ("" if it cannot be read)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def proc_times(pid: int) -> tuple[float, float, int]:
    """(user s, system s, minor page faults) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])


# =============================================================================================
# subprocesses


class Proc:
    """A server subprocess with its log in a file; stop() always leaves it dead."""

    def __init__(self, name: str, argv: Sequence[str], *, cwd: Path, log: Path) -> None:
        self.name = name
        self.log = log
        # setpriv --pdeathsig: the server gets SIGTERM even if this process is SIGKILLed.
        prefix = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([*prefix, *argv], cwd=cwd, stdin=subprocess.DEVNULL, stdout=f, stderr=f)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_grpc(proc: Proc, target: str, timeout: float = 60.0, max_message: int = MAX_MESSAGE) -> Any:
    """A ready grpc channel to ``target`` taking messages up to ``max_message`` bytes either way;
    raises with the server's log if it died or hung."""
    import grpc

    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)])
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            channel.close()
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return channel
        except grpc.FutureTimeoutError:
            if time.monotonic() > deadline:
                channel.close()
                raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s:\n{proc.tail()}") from None


def start_kvcached(stack: contextlib.ExitStack, tmp: Path, ram_gib: float, extra: Sequence[str] = (),
                   max_message: int = MAX_MESSAGE, code: Path | None = None) -> tuple[Proc, Any]:
    """A ``kvcached serve`` subprocess with all its state in ``tmp`` (gRPC on ``tmp/kvcached.sock``,
    agent socket ``tmp/agent.sock``) and a ready gRPC channel to it; ``extra``: more --set values.
    ``max_message``: the channel's message limit, bytes (raise the daemon's own with
    ``grpc.max_message_mib`` in ``extra``). ``code``: a source tree of kvcached to run the daemon
    from (another version, checked out beside this one) instead of the installed one."""
    exe = Path(sys.executable).with_name("kvcached")
    base = [str(exe)] if exe.exists() and code is None else [sys.executable, "-m", "kvcached.cli"]
    if code is not None:
        base = ["env", f"PYTHONPATH={code}:{code / 'agent'}", *base]
    sets = [f"kv.ram_gib={ram_gib}", f'grpc.listen=["unix:{tmp}/kvcached.sock"]', 'metrics.listen=""',
            f'kv.index_dir="{tmp}/index"', f'kv.ssd_dir="{tmp}/ssd"', f'agent.socket="{tmp}/agent.sock"', *extra]
    argv = [*base, "serve", "--config", str(CONFIG)] + [a for s in sets for a in ("--set", s)]
    proc = Proc("kvcached", argv, cwd=tmp, log=tmp / "kvcached.log")
    stack.callback(proc.stop)
    channel = wait_grpc(proc, f"unix:{tmp}/kvcached.sock", max_message=max_message)
    stack.callback(channel.close)
    return proc, channel


def start_bare(stack: contextlib.ExitStack, tmp: Path, ram_gib: float) -> tuple[Proc, Any]:
    argv = [sys.executable, str(BENCH_DIR / "_baseline_server.py"), f"unix:{tmp}/bare.sock",
            "--cap-mib", str(int(ram_gib * 1024) // 2), "--max-message-mib", str(MAX_MESSAGE >> 20)]
    proc = Proc("bare servicer", argv, cwd=tmp, log=tmp / "bare.log")
    stack.callback(proc.stop)
    channel = wait_grpc(proc, f"unix:{tmp}/bare.sock")
    stack.callback(channel.close)
    return proc, channel


def start_redis(stack: contextlib.ExitStack, tmp: Path, ram_gib: float,
                tcp_port: int | None = None) -> tuple[Proc, Any] | None:
    """A fresh redis-server and a redis-py client of it; None if either is not installed. On a
    Unix socket in ``tmp``, or with ``tcp_port`` on 127.0.0.1 (a network path, as a peer pull's)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    try:
        import redis
    except ImportError:
        return None
    sock = tmp / "redis.sock"
    where = (["--port", str(tcp_port), "--bind", "127.0.0.1"] if tcp_port is not None
             else ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"])
    argv = [exe, *where, "--save", "", "--appendonly", "no", "--dir", str(tmp), "--maxmemory",
            f"{int(ram_gib * 1024)}mb", "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]
    proc = Proc("redis-server", argv, cwd=tmp, log=tmp / "redis.log")
    stack.callback(proc.stop)
    client = (redis.Redis(host="127.0.0.1", port=tcp_port) if tcp_port is not None
              else redis.Redis(unix_socket_path=str(sock)))
    stack.callback(client.close)
    deadline = time.monotonic() + 20
    while True:
        if not proc.alive():
            raise RuntimeError(f"redis-server exited with {proc.proc.returncode}:\n{proc.tail()}")
        try:
            client.ping()
            return proc, client
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready:\n{proc.tail()}") from None
            time.sleep(0.05)


# =============================================================================================
# backends: one way to put and get blocks, with request building kept off the clock


class Backend(ABC):
    """A server under test. Requests are built first (unclocked), then sent (clocked)."""

    name: str
    pid: int          # the server process, for its CPU time and page faults

    @abstractmethod
    def put_request(self, keys: Sequence[bytes], payload: bytes) -> Any: ...

    @abstractmethod
    def put(self, request: Any) -> int:
        """Send a put; returns how many blocks the server newly stored."""

    @abstractmethod
    def get_request(self, keys: Sequence[bytes]) -> Any: ...

    @abstractmethod
    def get(self, request: Any) -> list[bytes]:
        """Send a get; returns the payloads."""


class GrpcBackend(Backend):
    """kvcached or the bare servicer, through the generated blocking stub."""

    def __init__(self, name: str, channel: Any, pid: int) -> None:
        from kvcached.v1 import kvcache_pb2 as pb
        from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

        self.name = name
        self.pid = pid
        self.pb = pb
        self.stub = pb_grpc.KvCacheStub(channel)

    def put_request(self, keys: Sequence[bytes], payload: bytes) -> Any:
        pb = self.pb
        return pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=k), payload=payload) for k in keys])

    def put(self, request: Any) -> int:
        return self.stub.Put(request, timeout=60).stored

    def get_request(self, keys: Sequence[bytes]) -> Any:
        pb = self.pb
        return pb.GetRequest(addresses=[pb.BlockAddress(digest=k) for k in keys])

    def get(self, request: Any) -> list[bytes]:
        return [b.payload for b in self.stub.Get(request, timeout=60).blocks]


def drained(backend: GrpcBackend, timeout: float = 300.0) -> None:
    """Wait until ``backend``'s RAM tier holds no block still to be written back to SSD (a daemon
    without an SSD tier has none)."""
    deadline = time.monotonic() + timeout
    while backend.stub.Stats(backend.pb.StatsRequest(), timeout=10).ram_dirty_bytes and time.monotonic() < deadline:
        time.sleep(0.2)


class RedisBackend(Backend):
    """redis-py: SET/GET for one block, MSET/MGET for a batch."""

    def __init__(self, client: Any, pid: int) -> None:
        self.name = "redis"
        self.pid = pid
        self.r = client

    def put_request(self, keys: Sequence[bytes], payload: bytes) -> Any:
        return {k: payload for k in keys}

    def put(self, request: dict[bytes, bytes]) -> int:
        if len(request) == 1:
            (key, value), = request.items()
            self.r.set(key, value)
        else:
            self.r.mset(request)
        return len(request)

    def get_request(self, keys: Sequence[bytes]) -> Any:
        return list(keys)

    def get(self, request: list[bytes]) -> list[bytes]:
        if len(request) == 1:
            return [self.r.get(request[0])]
        return self.r.mget(request)


def clocked(call: Callable[[Any], Any], make_request: Callable[[int], Any], seconds: float,
            min_calls: int = 5, warmup: int = 2) -> list[float]:
    """Seconds of each call, until ``seconds`` of clocked time (request building is unclocked)."""
    for i in range(warmup):
        call(make_request(-1 - i))
    durations: list[float] = []
    spent = 0.0
    wall_limit = time.monotonic() + 5 * seconds + 10
    i = 0
    while (spent < seconds or len(durations) < min_calls) and time.monotonic() < wall_limit:
        request = make_request(i)
        t0 = time.perf_counter()
        call(request)
        dt = time.perf_counter() - t0
        durations.append(dt)
        spent += dt
        i += 1
    return durations


# =============================================================================================
# figures 1 and 2: Get/Put throughput


@dataclass(frozen=True)
class Case:
    op: str      # "get" or "put"
    size: int
    batch: int

    @property
    def label(self) -> str:
        return f"{self.op} {size_name(self.size)} x{self.batch}"


def fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def load_working_set(backends: Sequence[Backend], size: int, nblocks: int, payload: bytes) -> list[bytes]:
    """Put ``nblocks`` blocks of ``payload`` into every backend; check one comes back intact."""
    keys = fresh_keys(nblocks)
    for backend in backends:
        for start in range(0, nblocks, 16):
            backend.put(backend.put_request(keys[start:start + 16], payload))
        got = backend.get(backend.get_request(keys[:1]))
        if got != [payload]:
            raise RuntimeError(f"{backend.name}: a {size_name(size)} block did not come back intact")
    return keys


def run_case(backend: Backend, case: Case, keys: list[bytes], payload: bytes, seconds: float) -> dict[str, float]:
    """One round of one case on one backend: throughput, per-call latency, and the server's CPU
    time and minor page faults per call (warm-up calls included, which is noise)."""
    before, client_before = proc_times(backend.pid), proc_times(os.getpid())
    if case.op == "get":
        requests = [backend.get_request(keys[i:i + case.batch]) for i in range(0, len(keys) - case.batch + 1, case.batch)]
        durations = clocked(backend.get, lambda i: requests[i % len(requests)], seconds)
    else:
        def make(i: int) -> Any:
            return backend.put_request(fresh_keys(case.batch), payload)

        def put(request: Any) -> None:
            stored = backend.put(request)
            if stored != case.batch:
                raise RuntimeError(f"{backend.name}: put stored {stored} of {case.batch} fresh blocks")
        durations = clocked(put, make, seconds)
    after, client_after = proc_times(backend.pid), proc_times(os.getpid())
    spent = sum(durations)
    n = len(durations)
    return {"gbps": n * case.batch * case.size / spent / 1e9,
            "calls_per_s": n / spent,
            "p50_us": statistics.median(durations) * 1e6,
            "p99_us": percentile(durations, 0.99) * 1e6,
            "calls": n,
            "server_user_us_per_call": (after[0] - before[0]) / n * 1e6,
            "server_sys_us_per_call": (after[1] - before[1]) / n * 1e6,
            "server_minflt_per_call": (after[2] - before[2]) / n,
            "client_minflt_per_call": (client_after[2] - client_before[2]) / n}


def fill_bytes(backend: Backend, s: Settings) -> int:
    budget = int(s.ram_gib * 1024) * MiB
    return (budget // 2 if backend.name == "bare" else budget) + 64 * MiB


def fill(backend: Backend, s: Settings) -> float:
    """Put fresh 1 MiB blocks until the server's memory budget (kvcached's arena, the bare
    servicer's cap, redis' maxmemory) is full, so the Put cases run in the steady state of a
    long-lived cache: memory already touched once, every put evicting. Returns GB/s."""
    payload = os.urandom(MiB)
    total = fill_bytes(backend, s)
    t0 = time.perf_counter()
    for _ in range(0, total, 4 * MiB):
        backend.put(backend.put_request(fresh_keys(4), payload))
    return total / (time.perf_counter() - t0) / 1e9


def bench_throughput(backends: Sequence[Backend], s: Settings) -> tuple[dict[tuple[Case, str], dict[str, Any]], dict[str, float]]:
    """Every case on every backend, interleaved by round; median round per (case, backend).
    Also returns the GB/s of each server's first fill (puts into memory never touched before)."""
    results: dict[tuple[Case, str], dict[str, Any]] = {}
    payloads = {size: os.urandom(size) for size in SIZES}
    working = {}
    for size in SIZES:
        progress(f"loading the Get working set: {s.working_set >> 20} MiB of {size_name(size)} blocks per server")
        nblocks = max(max(BATCHES), s.working_set // size)
        working[size] = load_working_set(backends, size, nblocks, payloads[size])
    fills: dict[str, float] = {}
    for op in ("get", "put"):
        if op == "put":
            for backend in backends:
                progress(f"filling {backend.name} to its memory budget ({fill_bytes(backend, s) >> 20} MiB of 1 MiB puts)")
                fills[backend.name] = fill(backend, s)
            progress("first fill (cold memory): " + ", ".join(f"{n} {v:.3f} GB/s" for n, v in fills.items()))
        for case in (Case(op, size, batch) for size in SIZES for batch in BATCHES):
            rounds: dict[str, list[dict[str, float]]] = {b.name: [] for b in backends}
            for r in range(s.rounds):
                order = backends if r % 2 == 0 else list(reversed(backends))
                for backend in order:
                    rounds[backend.name].append(run_case(backend, case, working[case.size], payloads[case.size], s.seconds))
            for backend in backends:
                runs = sorted(rounds[backend.name], key=lambda x: x["gbps"])
                median = runs[len(runs) // 2]
                results[(case, backend.name)] = {**median, "rounds_gbps": [x["gbps"] for x in rounds[backend.name]]}
            progress(f"{case.label:>16}: " + ", ".join(f"{b.name} {results[(case, b.name)]['gbps']:.3f} GB/s" for b in backends))
    return results, fills


def paired_ratio(kv: dict[str, Any], base: dict[str, Any]) -> float:
    """Median over rounds of kvcached / baseline within the same round: the machine's speed
    drifts during a case, and a round's two sides ran seconds apart."""
    return statistics.median(k / b for k, b in zip(kv["rounds_gbps"], base["rounds_gbps"]))


def throughput_rows(results: dict[tuple[Case, str], dict[str, Any]], have_redis: bool) -> list[Row]:
    rows = []
    cases = sorted({c for c, _ in results}, key=lambda c: (c.op, c.size, c.batch))
    for case in cases:
        kv = results[(case, "kvcached")]
        bare = results[(case, "bare")]
        row = Row(1, case.label, "GB/s", kv["gbps"], "bare grpc.aio servicer", bare["gbps"], True,
                  f">= {GRPC_TARGET:.2f}x", details={"kvcached": kv, "baseline": bare}, paired_ratio=paired_ratio(kv, bare))
        row.passed = row.ratio >= GRPC_TARGET
        rows.append(row)
    if have_redis:
        for case in cases:
            kv = results[(case, "kvcached")]
            rd = results[(case, "redis")]
            name = "redis-py " + {("get", 1): "GET", ("get", 16): "MGET", ("put", 1): "SET", ("put", 16): "MSET"}[(case.op, case.batch)]
            row = Row(2, case.label, "GB/s", kv["gbps"], name, rd["gbps"], True, details={"kvcached": kv, "baseline": rd},
                      paired_ratio=paired_ratio(kv, rd))
            if case.op == "get":
                row.target = f">= {REDIS_GET_TARGET:.1f}x"
                row.passed = row.ratio >= REDIS_GET_TARGET
            rows.append(row)
    return rows


def fault_notes(results: dict[tuple[Case, str], dict[str, Any]]) -> list[str]:
    """Cases where kvcached's server takes many more page faults per call than the bare one."""
    out = []
    for (case, name), kv in results.items():
        bare = results.get((case, "bare"))
        if name != "kvcached" or bare is None:
            continue
        if kv["server_minflt_per_call"] > max(100.0, 2 * bare["server_minflt_per_call"]):
            out.append(f"{case.label}: kvcached server {kv['server_minflt_per_call']:.0f} minor page faults and "
                       f"{kv['server_sys_us_per_call'] / 1000:.1f} ms system time per call, bare servicer "
                       f"{bare['server_minflt_per_call']:.0f} and {bare['server_sys_us_per_call'] / 1000:.1f} ms")
    return out


# =============================================================================================
# figure 3: Lookup latency


def percentile(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_lookup(kv_channel: Any, bare_channel: Any, s: Settings) -> list[Row]:
    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
    from kvcached_agent.address import chain_digests

    kv = pb_grpc.KvCacheStub(kv_channel)
    bare = pb_grpc.KvCacheStub(bare_channel)
    digests = chain_digests(list(range(64 * 16)), 16, model="bench/lookup", dtype="bfloat16")
    payload = os.urandom(4 * KiB)
    kv.Put(pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=d), payload=payload) for d in digests]), timeout=60)
    request = pb.LookupRequest(digests=digests)
    answer = kv.Lookup(request, timeout=60)
    if answer.longest != 64 or answer.ram != 64:
        raise RuntimeError(f"kvcached Lookup of the 64 blocks just put says longest={answer.longest} ram={answer.ram}")
    empty = pb.StatsRequest()
    sides: dict[str, tuple[Callable[[Any], Any], Any]] = {
        "kvcached Lookup": (kv.Lookup, request),
        "bare Stats (empty)": (bare.Stats, empty),
        "bare Lookup (same request)": (bare.Lookup, request),
    }
    rounds = max(1, min(10, s.lookup_calls // 100))   # interleaved, against drifting noise
    per_round = s.lookup_calls // rounds
    latencies: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, (method, req) in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            for _ in range(20):     # warm-up
                method(req, timeout=10)
            for _ in range(per_round):
                t0 = time.perf_counter()
                method(req, timeout=10)
                latencies[name].append(time.perf_counter() - t0)
    stats = {name: {"p50_us": percentile(xs, 0.50) * 1e6, "p99_us": percentile(xs, 0.99) * 1e6,
                    "mean_us": statistics.fmean(xs) * 1e6, "calls": len(xs)} for name, xs in latencies.items()}
    progress("lookup: " + ", ".join(f"{n} p50 {v['p50_us']:.0f} us" for n, v in stats.items()))
    k, e, same = stats["kvcached Lookup"], stats["bare Stats (empty)"], stats["bare Lookup (same request)"]
    return [
        Row(3, "lookup 64 blocks, p50", "us", k["p50_us"], "bare empty round trip", e["p50_us"], False,
            details={"kvcached": k, "baseline": e}),
        Row(3, "lookup 64 blocks, p99", "us", k["p99_us"], "bare empty round trip", e["p99_us"], False,
            details={"kvcached": k, "baseline": e}),
        Row(3, "lookup 64 blocks, p50", "us", k["p50_us"], "bare Lookup, same request", same["p50_us"], False,
            details={"kvcached": k, "baseline": same}),
    ]


# =============================================================================================
# figure 4: metadata memory per block (each probe in a fresh subprocess)


def _random_table(n: int) -> bytes:
    return os.urandom(32 * n)


def child_index(n: int, path: str) -> dict[str, Any]:
    """Write n BlockRecords to a fresh BlockIndex; RSS growth and disk bytes."""
    from kvcached.index import BlockIndex, BlockRecord, Tier
    from kvcached_agent.address import CROSS_LAYER

    keys, digests, checksums = _random_table(n), _random_table(n), _random_table(n)
    index = BlockIndex(path)
    gc.collect()
    rss0 = read_status()
    now = time.time()
    checkpoints = []
    next_checkpoint = n // 4
    t0 = time.perf_counter()
    batch = 10_000
    for start in range(0, n, batch):
        records = [(keys[i * 32:i * 32 + 32],
                    BlockRecord(digests[i * 32:i * 32 + 32], CROSS_LAYER, MODEL, 4096, checksums[i * 32:i * 32 + 32], now, now, Tier.RAM))
                   for i in range(start, min(n, start + batch))]
        index.write(records)
        done = min(n, start + batch)
        if done >= next_checkpoint:     # about every quarter
            gc.collect()
            checkpoints.append((done, read_status()["VmRSS"] - rss0["VmRSS"]))
            next_checkpoint = min(n, next_checkpoint + n // 4)
    elapsed = time.perf_counter() - t0
    del records
    gc.collect()
    rss1 = read_status()
    index.close()
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    record_bytes = 32 + len(BlockRecord(digests[:32], CROSS_LAYER, MODEL, 4096, checksums[:32], now, now).encode())
    return {"n": n, "rss_growth": rss1["VmRSS"] - rss0["VmRSS"], "rss_open": rss0["VmRSS"], "checkpoints": checkpoints,
            "disk_bytes": disk, "raw_bytes_per_block": record_bytes, "write_s": elapsed}


def child_ram(n: int) -> dict[str, Any]:
    """Reserve + commit n 4 KiB blocks in a RamTier (no payload written); RSS growth."""
    from kvcached.policies import make_eviction_policy
    from kvcached.tiers.arena import SharedArena
    from kvcached.tiers.ram import RamTier

    slab = 16 * MiB   # kv.max_block_mib default
    arena = SharedArena(-(-n * 4096 // slab) * slab)
    keys = _random_table(n)
    payload = bytes(4096)
    gc.collect()
    rss0 = read_status()
    ram = RamTier(arena, slab, make_eviction_policy("clock"))
    t0 = time.perf_counter()
    for i in range(n):
        # len(payload): a fresh int per block, as Store.put passes it
        block = ram.reserve(keys[i * 32:i * 32 + 32], len(payload))
        ram.commit(block)
    elapsed = time.perf_counter() - t0
    gc.collect()
    rss1 = read_status()
    assert len(ram) == n
    return {"n": n, "rss_growth": rss1["VmRSS"] - rss0["VmRSS"], "anon_growth": rss1["RssAnon"] - rss0["RssAnon"],
            "shmem_growth": rss1["RssShmem"] - rss0["RssShmem"], "arena_bytes": arena.size, "reserve_commit_s": elapsed}


def child_dict(n: int) -> dict[str, Any]:
    """Baseline: dict of n 32-byte keys -> 32-byte bytes; RSS growth."""
    keys, values = _random_table(n), _random_table(n)
    gc.collect()
    rss0 = read_status()
    d = {keys[i * 32:i * 32 + 32]: values[i * 32:i * 32 + 32] for i in range(n)}
    gc.collect()
    rss1 = read_status()
    assert len(d) == n
    return {"n": n, "rss_growth": rss1["VmRSS"] - rss0["VmRSS"], "anon_growth": rss1["RssAnon"] - rss0["RssAnon"]}


def run_child(kind: str, n: int, *extra: str) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(n), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {kind} failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def bench_memory(s: Settings, tmp: Path, notes: list[str]) -> list[Row]:
    n = s.mem_blocks
    progress(f"memory: dict baseline, {n} keys")
    base = run_child("dict", n)
    progress(f"memory: BlockIndex, {n} records")
    idx = run_child("index", n, str(tmp / "mem-index"))
    progress(f"memory: RamTier, {n} blocks of 4 KiB (reserve + commit)")
    ram = run_child("ram", n)

    def per(probe: dict[str, Any]) -> float:
        return probe["rss_growth"] / probe["n"]

    cps = idx["checkpoints"]
    marginal = (cps[-1][1] - cps[-2][1]) / (cps[-1][0] - cps[-2][0]) if len(cps) >= 2 else float("nan")
    idx_details = {**idx, "marginal_rss_per_block_last_quarter": marginal}
    notes.append("index RSS growth after " + ", ".join(f"{n_ // 1000}k records: {rss >> 20} MiB" for n_, rss in cps)
                 + " (RocksDB memtables and caches: bounded, so RSS per block falls as the index grows)")
    progress(f"memory: index {per(idx):.0f} B/block RSS ({idx['disk_bytes'] / n:.0f} B on disk), "
             f"RAM tier {per(ram):.0f} B/block, dict {per(base):.0f} B/block")
    rows = [
        Row(4, f"index RSS/block ({n // 1000}k)", "B", per(idx), "dict 32 B -> 32 B", per(base), False,
            f"<= {MEMORY_TARGET} B", per(idx) <= MEMORY_TARGET, {"kvcached": idx_details, "baseline": base}),
        Row(4, f"RAM tier RSS/block ({n // 1000}k)", "B", per(ram), "dict 32 B -> 32 B", per(base), False,
            f"<= {MEMORY_TARGET} B", per(ram) <= MEMORY_TARGET, {"kvcached": ram, "baseline": base}),
        Row(4, f"index disk/block ({n // 1000}k)", "B", idx["disk_bytes"] / n, "raw key+record bytes",
            idx["raw_bytes_per_block"], False, details={"kvcached": idx_details}),
    ]
    return rows


# =============================================================================================
# output


TITLES = {
    1: "1. gRPC Get/Put vs a bare grpc.aio servicer (same proto, dict), Unix sockets, one call in flight",
    2: "2. gRPC Get/Put vs redis-server through redis-py (Unix socket)",
    3: "3. Lookup of a 64-block prefix (all hit), blocking calls; lower is better",
    4: "4. Metadata memory per block (fresh subprocess each, VmRSS growth); lower is better",
}


def fmt(value: float, unit: str) -> str:
    if unit == "GB/s":
        return f"{value:.3f} GB/s"
    if unit == "us":
        return f"{value:.0f} us"
    return f"{value:.0f} {unit}"


def print_fitted(rows: list[Row], header: str, titles: dict[int, str], fmt: Callable[[float, str], str],
                 footer: Sequence[str] = ()) -> None:
    """:func:`print_table`'s layout with columns as wide as their longest cell; ``fmt(value,
    unit)`` writes a value, ``footer`` lines go after the figures."""
    heads = ["case", "kvcached", "baseline", "", "ratio", "target", "verdict"]
    cells = [[r.case, fmt(r.kvcached, r.unit), r.baseline_name, fmt(r.baseline, r.unit), f"{r.ratio:.2f}x",
              r.target or "-", r.verdict] for r in rows]
    widths = [max(len(x) for x in col) + 2 for col in zip(heads, *cells)]
    print(header)
    for fig in sorted({r.figure for r in rows}):
        print()
        print(titles[fig])
        print("  " + "".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip())
        for r, line in zip(rows, cells):
            if r.figure == fig:
                print("  " + "".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print()
    for line in footer:
        print(line)


def print_table(rows: list[Row], header: str, titles: dict[int, str] | None = None) -> None:
    print(header)
    for fig in sorted({r.figure for r in rows}):
        print()
        print((titles or TITLES)[fig])
        w = [28, 14, 28, 14, 8, 10, 12]
        print("  " + "".join(h.ljust(x) for h, x in zip(
            ["case", "kvcached", "baseline", "", "ratio", "target", "verdict"], w)).rstrip())
        for r in (r for r in rows if r.figure == fig):
            cells = [r.case, fmt(r.kvcached, r.unit), r.baseline_name, fmt(r.baseline, r.unit), f"{r.ratio:.2f}x",
                     r.target or "-", r.verdict]
            print("  " + "".join(c.ljust(x) for c, x in zip(cells, w)).rstrip())
    print()
    print("ratio = kvcached / baseline (throughput: higher is better; latency and bytes: lower is better).")
    print("Throughput: each side's median round; ratio = median over rounds of the two sides' ratio in that round.")


# =============================================================================================
# main


def tune_client_malloc() -> bool:
    """Keep freed memory in this (client) process's heap instead of giving it back to the kernel
    after every big message and faulting it in again on the next one. Page faults are slow on
    these VMs (about 1 GB/s); untuned, the client's own faults on 16 MiB messages dilute every
    ratio towards 1. Servers are left as they are deployed. mallopt affects this process only."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * MiB)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """SIGTERM ends a benchmark as Ctrl-C does (KeyboardInterrupt), so its ``finally`` blocks stop
    what it started (daemons, namespaces, temp dirs). For the other benchmarks to call."""
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached core benchmark (figures with same-run baselines)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (~30 s): 0.5 GiB arena, 3 rounds of 0.1 s, 250k blocks for memory")
    parser.add_argument("--figures", default="1234", help="which figures to run, e.g. 13 (default: 1234)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:   # memory probe in a fresh process: print one JSON line
        kind, n, *extra = args.child
        probe = {"index": child_index, "ram": child_ram, "dict": child_dict}[kind]
        print(json.dumps(probe(int(n), *extra)))
        return 0

    # SIGTERM behaves like Ctrl-C, so every finally below runs and no server is left behind.
    signal.signal(signal.SIGTERM, _interrupt)
    rows: list[Row] = []
    notes: list[str] = []
    s = QUICK if args.quick else FULL
    if not tune_client_malloc():
        notes.append("could not tune the client's malloc (not glibc?): client page faults dilute the ratios")
    figures = set(args.figures)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcbench-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        if figures & {"1", "2", "3"}:
            progress("starting kvcached, the bare servicer" + (" and redis-server" if "2" in figures else ""))
            kv_proc, kv_channel = start_kvcached(stack, tmp, s.ram_gib)
            bare_proc, bare_channel = start_bare(stack, tmp, s.ram_gib)
            redis = start_redis(stack, tmp, s.ram_gib) if "2" in figures else None
            if "2" in figures and redis is None:
                notes.append("figure 2 skipped: redis-server or redis-py is not installed (make system-deps)")
            if figures & {"1", "2"}:
                backends: list[Backend] = [GrpcBackend("kvcached", kv_channel, kv_proc.proc.pid),
                                           GrpcBackend("bare", bare_channel, bare_proc.proc.pid)]
                if redis is not None:
                    backends.append(RedisBackend(redis[1], redis[0].proc.pid))
                results, fills = bench_throughput(backends, s)
                notes += fault_notes(results)
                notes.append("first fill of each server (1 MiB x4 puts into memory never touched before, before the "
                             "Put cases): " + ", ".join(f"{n} {v:.3f} GB/s" for n, v in fills.items()))
                rows += [r for r in throughput_rows(results, redis is not None) if str(r.figure) in figures]
            if "3" in figures:
                rows += bench_lookup(kv_channel, bare_channel, s)
            stack.close()   # servers down before the memory probes
        if "4" in figures:
            rows += bench_memory(s, tmp, notes)

    header = (f"kvcached core benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\n"
              f"settings: arena {s.ram_gib:g} GiB, {s.rounds} rounds x {s.seconds:g} s per side and case, "
              f"{s.lookup_calls} lookups per side, {s.mem_blocks} blocks for memory")
    print_table(rows, header)
    for note in notes:
        print(f"note: {note}")
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                        "settings": asdict(s)},
               "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "notes": notes}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); servers stopped, temp dir removed")
        sys.exit(130)
