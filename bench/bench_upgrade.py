"""Upgrades and crashes with the RAM tier kept: what a client sees, how long a crashed daemon takes
to check its arena, and the hit rate an engine finds after a crash. Real ``kvcached serve``
processes on this machine, every figure next to a baseline measured in the same run.

    python bench/bench_upgrade.py [--quick] [--json PATH] [--parts 12345] [--logs DIR] [--trace PATH] [--block-kib N]

Daemons: ``config/kvcached.toml`` with all state in a temp dir (gRPC and agent on Unix sockets
there, metrics off), ``kv.ssd_gib=0`` (the SSD tier stays out of every figure). The first daemon of
parts 1 and 2 runs under tests/fdstore.py's ServiceManager (systemd's side of sd_notify and the
file descriptor store: NOTIFY_SOCKET, FDSTORE=1, and a restart with LISTEN_FDS), so the arena
and slot directory memfds outlive a SIGKILL. Every daemon is started in a session of its own;
an upgrade's successor is a child of the daemon it replaces, so it stays in that process group,
and this process is a child subreaper (it reaps successors whose parent exited). At the end, on
an error, Ctrl-C or SIGTERM, every group started is sent SIGTERM, then SIGKILL, and the temp dir
is removed. Each daemon started also runs under ``setpriv --pdeathsig TERM``; a successor started
by an upgrade cannot (if this process is SIGKILLed, the serving successor outlives it).

1. Upgrade, per arena size (``kv.ram_gib`` 1 and 8; --quick 0.25 and 1): the arena is filled to
   FILL (85 %) of its bytes through gRPC Put, 16 blocks a call, blocks of 256, 512, 768 and 1024
   KiB in turn (exact slot classes, so nothing is evicted; Stats must say so). Payloads are a
   function of the address (the digest, then a slice of a fixed pseudo-random pool chosen by the
   digest), so every byte can be checked. Then CLIENTS (3) load processes (this file,
   ``--child-load``), each with kvcached.client.KvCacheClient (its retry policy included), call
   in a loop: a Get of one resident 256 KiB block (bytes compared), then a Put of one (answered
   already present), THINK_S (5 ms) apart, timing each call. A call that raises is counted as a
   failed call and tried again on a new channel every 20 ms until it succeeds; the time of a
   call runs from its first try to its success, so a gap shows as one long call. While they
   run, ``kvcached upgrade --json`` is called UPGRADES times (--quick once), each time after a
   quiet stretch; the upgrade window runs from starting the command until SETTLE_S (1 s) after
   both the command has returned and the old process has exited. Its baseline window has the same
   length and ends where the upgrade command starts (no upgrade in it); where the quiet stretch
   before was shorter, a window of the same length after the upgrade is used. A call belongs to
   a window if it overlaps it. Reported: the handover time (``elapsed_s``) and ``total_s`` of
   the command's answer, the longest call in the upgrade windows against the longest call in
   the baseline windows (same total length) and against the cold-restart gap below, failed
   calls, and afterwards every block put: Stats' RAM block count, a Lookup of all of them (in
   slices of 1024) and 64 random blocks fetched and compared byte for byte.
   Cold restart (same run, same size, after part 2's crash): with the clients running, SIGTERM
   the daemon, start a fresh one (no fd store: the RAM tier starts empty). Its gap is the
   longest call the clients saw around it; also printed: SIGTERM until a Stats is answered
   again, seen from this process (polled every 20 ms).
   Target, "no client-visible gap": 0 failed calls during the upgrades, and the longest call in
   the upgrade windows <= MAX_CALL_S (1 s) and <= COLD_FRACTION (0.25) x the cold-restart gap.
   1 s: an engine gives the cache about that long before it recomputes instead (vLLM's and
   SGLang's KV-transfer timeouts are seconds); the 0.25x says the upgrade is not a restart in
   disguise: a cold restart's gap is a whole process start, the upgrade's must be a fraction.
2. Crash, per arena size: right after part 1's upgrades, the serving daemon (the last
   successor) is SIGKILLed; while no daemon runs, this process maps the arena memfd from the fd
   store (a fresh mapping, as the restarted daemon's is) and hashes as many bytes as the blocks
   hold, in the same block sizes, with one blake3 thread per block as the daemon does for blocks
   under 4 MiB: the floor. Then the daemon starts again with the stored descriptors; this
   process polls Admin ReconcileStatus every 50 ms from the moment it starts the process:
   "restart -> ram_done" (every RAM block checked against its BLAKE3 checksum), also
   "restart -> serving" (the first answer) and the daemon's own ``elapsed_s`` from ram_summary.
   Every block must be adopted, none mismatched; all are looked up again and 64 compared.
   Baselines: the floor (ratio, no target), and for "restart -> serving" the cold start of part 1.
3. Hit rate after a crash, on the Mooncake conversation trace (/work/shared/traces: 12,031
   requests over one hour, each a list of prefix block ids of 512 tokens). Each block id maps to
   a block address (BLAKE3 of "mooncake-conversation/<id>") and a TRACE_BLOCK (16 KiB) payload
   made like part 1's. Per request, as an engine with a prefix cache: Lookup of the request's
   digests; hit = the prefix the answer says is held (``longest``); Get of that prefix (bytes
   compared; a Get that misses blocks the Lookup promised is counted); Put of the blocks after
   it. One request at a time, as fast as the daemon answers: trace time is compressed. The crash
   comes at trace time CRASH_S (1200 s; --quick 300 s); the window is as many requests as the
   trace has in the 60 s from there (its "first minute"); "before" is the same number of
   requests just before the crash point, "after" the requests of that first minute. The RAM tier
   is RAM_FRACTION (half) of the distinct block bytes replayed before the crash point. Replays:
   (c) no crash, one daemon through both windows (the control: how the trace itself moves between
   the windows); a daemon under the ServiceManager replayed up to the crash point and SIGKILLed
   at once; its index directory copied twice and its arena and slot directory memfds once (same
   seals); then (a) it restarts with the fd store and replays the first minute at once (while
   it checks its RAM blocks), (b) a plain daemon on an index copy (same index, RAM tier empty)
   replays it, (a') a daemon on the other copies with the copied memfds as its fd store waits for
   ram_done, then replays it. Target: (a) after / before >= HIT_TARGET (0.9x). Figure 2 also
   shows (a)'s check of the trace arena (many 16 KiB blocks) against the BLAKE3 floor of its bytes.

4. Tenants' arenas (issue 61): two daemons with a 1 GiB RAM tier, one with no tenants (one
   arena), one with ARENA_TENANTS (4) tenants configured, each filled to FILL with the first
   block size, the tenants' blocks in turn (the operator's Puts naming each tenant); CLIENTS load
   clients on each, client i as tenant i (on the first, the operator); upgrades in turns (at
   least 2 each), the order swapped each turn, the load running only on the daemon being
   upgraded. The longest call in each upgrade's window. Target (issue 61): 4 arenas' <= 1.2x one
   arena's, no failed call, no wrong byte.

5. The arena's backing (issue 62): daemons with a 1 GiB RAM tier whose arena is a memfd (today's
   upgrade), files on a tmpfs (``kv.arena = "file"``, as the Kubernetes chart keeps it), and files
   on hugetlbfs where this machine can have huge pages (run as root: the pool is grown for the run
   and put back), filled as part 4's, upgraded in turns as part 4's. Target: the longest call
   with files <= 1.2x the memfd's, no failed call, no wrong byte.

--quick: arenas 0.25 and 1 GiB, one upgrade each, crash at trace time 300 s (about a minute; the
full run about 3-4 minutes). --block-kib N fills parts 1 and 2 with blocks of one size instead (the
clients then get and put blocks of that size): a handover takes the RAM tier up block by block, so
its stall grows with the number of blocks, not their bytes (--block-kib 16 shows it).
--parts 3 runs only the trace, --parts 1 (or 2) only the arena sizes, --parts 4 only the tenants'
arenas, --parts 5 only the arena's backings. Progress goes to stderr, the
table to stdout.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import KiB, MiB, Row, print_fitted, progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "kvcached.toml"
KVCACHED = [sys.executable, "-m", "kvcached.cli"]
TRACE = Path("/work/shared/traces/conversation_trace.jsonl")
GiB = 1 << 30
PAGE = 4096

BLOCK_SIZES = (256 * KiB, 512 * KiB, 768 * KiB, 1024 * KiB)   # exact slot classes; the clients use the first
FILL = 0.85                  # of the arena's bytes
PUT_BYTES = 16 * MiB         # about the bytes of one Put of the fill (25 blocks of the mix)
CLIENT_KEYS = 256            # resident blocks each client picks from
CLIENTS = 3
THINK_S = 0.005
SETTLE_S = 1.0
ARENA_UPGRADE_TARGET = 1.2   # part 4: longest call with the tenants' arenas / with one arena
ARENA_TENANTS = 4
ARENA_GIB = 1.0              # part 4's tier (two daemons filled at once: the largest size would not fit)
QUIET_S = 5.0                # at least this long between upgrades (the baseline window's room)
MAX_CALL_S = 1.0             # target: longest call during an upgrade
COLD_FRACTION = 0.25         # target: longest call during an upgrade / cold-restart gap
SPOT = 64                    # blocks compared byte for byte after an upgrade or a crash

TRACE_BLOCK = 16 * KiB
RAM_FRACTION = 0.5
WINDOW_S = 60.0
HIT_TARGET = 0.9

POOL_BYTES = 4 * MiB


@dataclass(frozen=True)
class Settings:
    arenas: tuple[float, ...]    # GiB
    upgrades: int                # per arena size
    crash_s: float               # trace time of the crash, seconds
    block_sizes: tuple[int, ...] = BLOCK_SIZES     # of the fill of parts 1 and 2, in turn


FULL = Settings(arenas=(1.0, 8.0), upgrades=3, crash_s=1200.0)
QUICK = Settings(arenas=(0.25, 1.0), upgrades=1, crash_s=300.0)

_POOL: bytes | None = None


def pool() -> bytes:
    global _POOL
    if _POOL is None:
        import blake3

        _POOL = blake3.blake3(b"bench-upgrade-pool").digest(length=POOL_BYTES)
    return _POOL


def payload(digest: bytes, size: int) -> bytes:
    """The payload of a block: its digest, then a slice of the pool the digest chooses."""
    off = (int.from_bytes(digest[:4], "little") * PAGE) % (POOL_BYTES - size)
    return digest + pool()[off:off + size - len(digest)]


def key_of(text: str) -> bytes:
    import blake3

    return blake3.blake3(text.encode()).digest()


# =============================================================================================
# processes


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def reap(pid: int) -> None:
    """Collect ``pid`` if it is a child of this process (a successor whose parent exited is one:
    this process is a subreaper)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def become_subreaper() -> bool:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


class Groups:
    """Every process group this benchmark started (one per daemon start: upgrades' successors
    stay in their predecessor's group) and the daemon pids seen; :meth:`close` ends them all."""

    def __init__(self) -> None:
        self.pgids: list[int] = []
        self.pids: set[int] = set()
        self.popens: dict[int, subprocess.Popen[bytes]] = {}

    def wait_gone(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            popen = self.popens.get(pid)
            if popen is not None:
                popen.poll()
            else:
                reap(pid)
            if not alive(pid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in self.pgids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            deadline = time.monotonic() + 15
            while any(not self.wait_gone(pid, 0) for pid in self.pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not any(alive(pid) for pid in self.pids):
                break
        for popen in self.popens.values():
            with contextlib.suppress(Exception):
                popen.wait(1)
        self.pgids.clear()


def plain_env() -> dict[str, str]:
    """This environment without a service manager's variables: a plain start is a plain start
    even where the benchmark itself runs under systemd."""
    return {k: v for k, v in os.environ.items()
            if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")}


def stub_call(target: str, method: str, request: Any, timeout: float = 2.0, admin: bool = False) -> Any:
    import grpc

    from kvcached.v1 import kvcache_pb2_grpc as pbg

    with grpc.insecure_channel(target) as channel:
        stub = pbg.AdminStub(channel) if admin else pbg.KvCacheStub(channel)
        return getattr(stub, method)(request, timeout=timeout)


class Daemon:
    """A ``kvcached serve`` whose serving process changes at upgrades; ``pid`` is the current one."""

    def __init__(self, groups: Groups, state: Path, ram_gib: float, extra: Sequence[str] = ()) -> None:
        self.groups, self.state = groups, state
        state.mkdir(parents=True, exist_ok=True)
        self.sets = [f"kv.ram_gib={ram_gib}", "kv.ssd_gib=0", f'kv.index_dir="{state / "index"}"',
                     f'kv.ssd_dir="{state / "ssd"}"', f'grpc.listen=["unix:{state / "kvcached.sock"}"]',
                     f'agent.socket="{state / "agent.sock"}"', 'metrics.listen=""', *extra]
        self.pid = 0
        self.starts = 0
        self.log_path = state / "daemon.log"

    @property
    def target(self) -> str:
        return f"unix:{self.state / 'kvcached.sock'}"

    def args(self) -> list[str]:
        return ["--config", str(CONFIG)] + [a for s in self.sets for a in ("--set", s)]

    def start(self, manager: Any = None, wait: bool = True) -> float:
        """Start the daemon (with ``manager``: as systemd starts it with its fd store); the
        seconds until it answers a Stats (``wait``), else 0."""
        from kvcached.v1 import kvcache_pb2 as pb

        prefix, env, fds = manager.start_prefix() if manager is not None else ([], {}, ())
        pdeath = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
        self.starts += 1
        self.log_path = self.state / f"daemon-{self.starts}.log"
        t0 = time.monotonic()
        try:
            with open(self.log_path, "wb") as log:
                popen = subprocess.Popen([*pdeath, *prefix, *KVCACHED, "serve", *self.args()], cwd=self.state,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**plain_env(), **env}, pass_fds=fds, start_new_session=True)
        finally:
            if manager is not None:
                manager.started()
        self.pid = popen.pid
        self.groups.pgids.append(popen.pid)
        self.groups.pids.add(popen.pid)
        self.groups.popens[popen.pid] = popen
        if not wait:
            return 0.0
        deadline = t0 + 120
        while True:
            if not alive(self.pid):
                self.groups.wait_gone(self.pid, 0)
                raise RuntimeError(f"the daemon exited at start:\n{self.tail()}")
            try:
                stub_call(self.target, "Stats", pb.StatsRequest(), timeout=1)
                return time.monotonic() - t0
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not answer within 120 s:\n{self.tail()}") from None
                time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        if self.pid and alive(self.pid):
            os.kill(self.pid, sig)
            if not self.groups.wait_gone(self.pid, timeout):
                os.kill(self.pid, signal.SIGKILL)
                self.groups.wait_gone(self.pid, 10)
                raise RuntimeError(f"daemon {self.pid} did not stop within {timeout:.0f} s:\n{self.tail()}")

    def upgrade(self) -> tuple[dict[str, Any], float, float, float]:
        """``kvcached upgrade --json``: (its answer, when it started, when it returned, when the
        old process was gone), monotonic seconds."""
        old = self.pid
        t0 = time.monotonic()
        r = subprocess.run([*KVCACHED, "upgrade", "--json", *self.args()], cwd=self.state, capture_output=True,
                           text=True, timeout=300)
        t1 = time.monotonic()
        try:
            answer = json.loads(r.stdout)
        except json.JSONDecodeError:
            answer = {}
        if r.returncode != 0 or answer.get("op") != "upgraded" or not answer.get("ok"):
            raise RuntimeError(f"kvcached upgrade failed ({r.returncode}): {r.stdout}{r.stderr}\n{self.tail()}")
        self.pid = int(answer["pid"])
        self.groups.pids.add(self.pid)
        if not self.groups.wait_gone(old, 60):
            raise RuntimeError(f"the old daemon {old} did not exit after the upgrade:\n{self.tail()}")
        return answer, t0, t1, time.monotonic()

    def tail(self, lines: int = 25) -> str:
        out = []
        for path in sorted(self.state.glob("daemon-*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out[-2:])

    def client(self, timeout: float = 60.0) -> Any:
        from kvcached.client import KvCacheClient

        return KvCacheClient(self.target, timeout=timeout)

    def ram_blocks(self) -> int:
        with self.client() as c:
            return int(next((t.blocks for t in c.stats().tiers if t.tier == 2), 0))

    def reconcile(self) -> Any:
        from kvcached.v1 import kvcache_pb2 as pb

        return stub_call(self.target, "ReconcileStatus", pb.ReconcileStatusRequest(), timeout=5, admin=True)


# =============================================================================================
# load clients (child processes)


def describe(exc: BaseException, limit: int = 160) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        text = f"{code().name}: {details()}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


def child_load(target: str, keys_path: str, seed: str, out_path: str, block: str, tenant: str = "") -> int:
    """Get then Put one resident block, THINK_S apart, until SIGTERM; write every call's
    (start, end, kind, failed tries, ok) to ``out_path`` as JSON. ``tenant``: act as that
    tenant (the operator's header; part 4)."""
    from kvcached.client import KvCacheClient
    from kvcached_agent.address import BlockAddress

    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    keys = [bytes.fromhex(h) for h in json.loads(Path(keys_path).read_text())]
    rng = random.Random(seed)
    client = KvCacheClient(target, timeout=30, tenant=tenant or None)
    records: list[tuple[float, float, int, int, bool]] = []
    errors: list[str] = []
    counts = {"wrong": 0, "misses": 0}
    client.stats()
    print(json.dumps({"started": True}), flush=True)
    n = 0
    while not stopping:
        key = rng.choice(keys)
        kind = n % 2          # 0: Get, 1: Put
        n += 1
        data = payload(key, int(block))
        fails, ok = 0, False
        t0 = time.monotonic()
        while True:
            try:
                if kind == 0:
                    fetched, misses = client.get([BlockAddress(key)], allow_partial=True)
                    counts["misses"] += len(misses)
                    counts["wrong"] += sum(f.payload != data for f in fetched)
                else:
                    client.put([(BlockAddress(key), data)])
                ok = True
                break
            except Exception as exc:    # grpc.RpcError, ChecksumMismatch: a failed call, tried again
                fails += 1
                if len(errors) < 5:
                    errors.append(describe(exc))
                if stopping or time.monotonic() - t0 > 180:
                    break
                client.close()
                client = KvCacheClient(target, timeout=30, tenant=tenant or None)
                time.sleep(0.02)
        records.append((t0, time.monotonic(), kind, fails, ok))
        time.sleep(THINK_S)
    client.close()
    Path(out_path).write_text(json.dumps({"records": records, "errors": errors, **counts}))
    return 0


@dataclass
class Load:
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    outs: list[Path] = field(default_factory=list)


def start_load(target: str, keys: Sequence[bytes] | dict[str, list[bytes]], block: int, tmp: Path, tag: str,
               tenants: Sequence[str] = ("",)) -> Load:
    """CLIENTS load clients; client i acts as ``tenants[i % len(tenants)]`` ("": the operator),
    on ``keys`` (or that tenant's, where ``keys`` is by tenant)."""
    load = Load()
    pdeath = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
    for i in range(CLIENTS):
        tenant = tenants[i % len(tenants)]
        keys_path = tmp / f"keys-{tag}-{i}.json"
        keys_path.write_text(json.dumps([k.hex() for k in (keys[tenant] if isinstance(keys, dict) else keys)]))
        out = tmp / f"load-{tag}-{i}.json"
        err = open(tmp / f"load-{tag}-{i}.err", "w")
        proc = subprocess.Popen([*pdeath, sys.executable, str(Path(__file__).resolve()), "--child-load", target,
                                 str(keys_path), f"{tag}-{i}", str(out), str(block), tenant],
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        load.procs.append(proc)
        load.outs.append(out)
    for i, proc in enumerate(load.procs):
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith('{"started"'):
            stop_load(load)
            raise RuntimeError(f"load client {i} did not start: " + (tmp / f"load-{tag}-{i}.err").read_text()[-2000:])
    return load


def stop_load(load: Load) -> dict[str, Any]:
    """Stop the clients; every call of all of them, and their counts."""
    for proc in load.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in load.procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    records: list[tuple[float, float, int, int, bool]] = []
    out: dict[str, Any] = {"errors": [], "wrong": 0, "misses": 0}
    for path in load.outs:
        if not path.exists():
            raise RuntimeError(f"a load client wrote no result ({path.name})")
        got = json.loads(path.read_text())
        records += [tuple(r) for r in got["records"]]   # type: ignore[misc]
        out["errors"] += got["errors"]
        out["wrong"] += got["wrong"]
        out["misses"] += got["misses"]
    load.procs.clear()
    out["records"] = records
    return out


def window(records: Sequence[tuple[float, float, int, int, bool]], t0: float, t1: float) -> dict[str, Any]:
    """The calls overlapping [t0, t1]: how many, the longest, p50, failed tries, unfinished."""
    sel = [r for r in records if r[1] >= t0 and r[0] <= t1]
    durations = [r[1] - r[0] for r in sel]
    return {"calls": len(sel), "max_s": max(durations, default=0.0),
            "p50_s": statistics.median(durations) if durations else 0.0,
            "failed": sum(r[3] for r in sel), "unfinished": sum(not r[4] for r in sel), "length_s": t1 - t0}


# =============================================================================================
# parts 1 and 2: upgrade, crash, cold restart at one arena size


def fill(d: Daemon, gib: float, sizes: Sequence[int], tenants: Sequence[str] = ("",)) -> list[tuple[bytes, int]]:
    """Put blocks of ``sizes`` in turn up to FILL of the arena; with several ``tenants``, each
    Put as the next of them (the operator's header; part 4): the same digests each time."""
    from kvcached.client import KvCacheClient
    from kvcached_agent.address import BlockAddress

    budget = int(gib * GiB * FILL)
    blocks: list[tuple[bytes, int]] = []
    total = 0
    i = 0
    while True:
        size = sizes[i % len(sizes)]
        if total + size > budget:
            break
        blocks.append((key_of(f"bench-upgrade/{gib:g}/{i}"), size))
        total += size
        i += 1
    t0 = time.monotonic()
    clients = [KvCacheClient(d.target, timeout=60, tenant=t or None) for t in tenants]
    try:
        per_put = max(1, PUT_BYTES * len(sizes) // sum(sizes))
        for n, start in enumerate(range(0, len(blocks), per_put)):
            batch = blocks[start:start + per_put]
            answer = clients[n % len(clients)].put([(BlockAddress(k), payload(k, s)) for k, s in batch])
            if answer.stored + answer.already_present != len(batch):
                raise RuntimeError(f"a Put stored {answer.stored} of {len(batch)} blocks")
    finally:
        for c in clients:
            c.close()
    progress(f"  filled {len(blocks)} blocks, {total / GiB:.2f} GiB in {time.monotonic() - t0:.1f} s "
             f"({total / (time.monotonic() - t0) / 1e9:.2f} GB/s)")
    return blocks


def check_blocks(d: Daemon, blocks: Sequence[tuple[bytes, int]], rng: random.Random) -> dict[str, Any]:
    """How many of ``blocks`` the daemon holds in RAM (Stats; a Lookup of all of them, in slices)
    and whether SPOT of them come back byte for byte."""
    from kvcached_agent.address import BlockAddress

    found = 0
    with d.client() as c:
        ram = int(next((t.blocks for t in c.stats().tiers if t.tier == 2), 0))
        for start in range(0, len(blocks), 1024):
            digests = [k for k, _ in blocks[start:start + 1024]]
            held = c.lookup(digests).ram
            if held == len(digests):
                found += held
            else:             # one by one: which are missing
                found += sum(c.lookup([k]).ram for k in digests)
        spot = dict(rng.sample(list(blocks), min(SPOT, len(blocks))))
        fetched, misses = c.get([BlockAddress(k) for k in spot], allow_partial=True)
        same = sum(f.payload == payload(f.address.digest, spot[f.address.digest]) for f in fetched)
    return {"stats_ram_blocks": ram, "looked_up": found, "spot": len(spot), "spot_same": same,
            "spot_missing": len(misses)}


def blake3_floor(fd: int, blocks: Sequence[tuple[bytes, int]]) -> tuple[float, float]:
    """Seconds to hash as many bytes as ``blocks`` hold, in their sizes, from a fresh mapping of
    the arena memfd (one blake3 thread per block, as the daemon hashes blocks under 4 MiB): the
    faster of two fresh mappings (each pays the page-table faults the restarted daemon pays);
    and the same on a mapping already warm."""
    import blake3

    total = sum(s for _, s in blocks)
    size = os.fstat(fd).st_size
    if total > size:
        raise RuntimeError("the blocks hold more bytes than the arena")

    def one_pass(view: memoryview) -> float:
        t0 = time.perf_counter()
        off = 0
        for _, s in blocks:
            blake3.blake3(view[off:off + s]).digest()
            off += s
        return time.perf_counter() - t0

    fresh, warm = [], 0.0
    for i in range(2):
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        view = memoryview(mm)
        try:
            fresh.append(one_pass(view))
            if i == 1:
                warm = one_pass(view)
        finally:
            view.release()
            mm.close()
    return min(fresh), warm


def logged_at(path: Path, message: str) -> float | None:
    """The time (epoch seconds) of the first line of the daemon log ``path`` whose msg is
    ``message`` (text format: ``ts=2026-11-26T03:14:34.151Z ... msg="..."``), or None."""
    from datetime import datetime

    for line in path.read_text(errors="replace").splitlines():
        if f'msg="{message}"' in line and line.startswith("ts="):
            stamp = line.split()[0][3:].replace("Z", "+00:00")
            return datetime.fromisoformat(stamp).timestamp()
    return None


def wait_ram_done(d: Daemon, t0: float, timeout: float = 600) -> tuple[float, float, dict[str, str]]:
    """Poll ReconcileStatus every 50 ms: (seconds from t0 to the first answer, to ram_done,
    the ram_summary)."""
    first = None
    deadline = time.monotonic() + timeout
    while True:
        if not alive(d.pid):
            raise RuntimeError(f"the restarted daemon exited:\n{d.tail()}")
        try:
            status = d.reconcile()
        except Exception:
            status = None
        now = time.monotonic()
        if status is not None:
            if first is None:
                first = now - t0
                if not status.ram_taken_over:
                    raise RuntimeError(f"the restarted daemon did not take the RAM tier over:\n{d.tail()}")
            if status.ram_done:
                summary = dict(item.split("=", 1) for item in status.ram_summary.split())
                return first, now - t0, summary
        if now > deadline:
            raise RuntimeError(f"ram_done not within {timeout:.0f} s:\n{d.tail()}")
        time.sleep(0.05)


def bench_size(groups: Groups, tmp: Path, gib: float, s: Settings, parts: str, rng: random.Random,
               logs: dict[str, str]) -> tuple[list[Row], list[str], dict[str, Any]]:
    from tests.fdstore import ServiceManager

    name = f"{gib:g} GiB"
    state = tmp / f"ram-{gib:g}"
    notes: list[str] = []
    rows: list[Row] = []
    details: dict[str, Any] = {}
    manager = ServiceManager(tmp / f"notify-{gib:g}")
    d = Daemon(groups, state, gib)
    try:
        progress(f"{name}: starting the daemon under the stand-in service manager (fd store)")
        d.start(manager)
        manager.wait_for("READY", "1", timeout=60)
        blocks = fill(d, gib, s.block_sizes)
        n = len(blocks)
        if d.ram_blocks() != n:
            raise RuntimeError(f"after the fill the RAM tier holds {d.ram_blocks()} blocks, {n} were put")
        client_block = s.block_sizes[0]
        small = [k for k, size in blocks if size == client_block][:CLIENT_KEYS]

        up: dict[str, Any] = {}
        if "1" in parts:
            progress(f"{name}: {CLIENTS} load clients; {s.upgrades} upgrade(s), each after >= {QUIET_S:g} s quiet")
            load = start_load(d.target, small, client_block, tmp, f"up-{gib:g}")
            try:
                t_prev = time.monotonic() + 1.0         # the clients' first second is warm-up
                time.sleep(QUIET_S + 1.0)
                upgrades, up_windows, base_windows = [], [], []
                longest = 0.0
                for i in range(s.upgrades):
                    if i:
                        time.sleep(max(QUIET_S, 1.3 * longest + 0.5))
                    answer, t0, t1, t2 = d.upgrade()
                    end = max(t1, t2) + SETTLE_S
                    length = end - t0
                    longest = max(longest, length)
                    time.sleep(max(0.0, end - time.monotonic()))
                    if t0 - length >= t_prev:
                        base = (t0 - length, t0)
                    else:                               # not quiet long enough before: the same length after
                        time.sleep(0.5 + length)
                        base = (end + 0.5, end + 0.5 + length)
                    t_prev = max(end, base[1])
                    upgrades.append(answer)
                    up_windows.append((t0, end))
                    base_windows.append(base)
                    progress(f"  upgrade {i + 1}: pid {answer['pid']}, handover {answer['elapsed_s']:.3f} s, "
                             f"total {answer['total_s']:.3f} s, window {length:.2f} s")
                time.sleep(0.5)
            finally:
                result = stop_load(load)
            recs = result["records"]
            uw = [window(recs, a, b) for a, b in up_windows]
            bw = [window(recs, a, b) for a, b in base_windows]
            all_calls = window(recs, min(r[0] for r in recs), max(r[1] for r in recs))
            up = {"answers": upgrades, "upgrade_windows": uw, "baseline_windows": bw, "all": all_calls,
                  "errors": result["errors"], "wrong": result["wrong"], "misses": result["misses"]}
            progress(f"  longest call: {max(w['max_s'] for w in uw) * 1e3:.0f} ms during upgrades, "
                     f"{max(w['max_s'] for w in bw) * 1e3:.0f} ms without; failed calls {all_calls['failed']}, "
                     f"wrong bytes {result['wrong']}, misses {result['misses']}")
            progress(f"{name}: checking every block after the upgrades")
            up["after"] = check_blocks(d, blocks, rng)
            details["upgrade"] = up

        crash: dict[str, Any] = {}
        if "2" in parts or "1" in parts:
            progress(f"{name}: SIGKILL, the BLAKE3 floor on the arena, restart with the fd store")
            d.stop(signal.SIGKILL)
            floor, floor_warm = blake3_floor(manager.stored["kvcached-arena"], blocks)
            t0 = time.monotonic()
            d.start(manager, wait=False)
            serving, done, summary = wait_ram_done(d, t0)
            progress(f"  serving after {serving:.2f} s, ram_done after {done:.2f} s (daemon: {summary.get('elapsed_s')} s); "
                     f"floor {floor:.2f} s ({floor_warm:.2f} s warm); {summary}")
            crash = {"serving_s": serving, "ram_done_s": done, "summary": summary, "floor_s": floor,
                     "floor_warm_s": floor_warm, "bytes": sum(size for _, size in blocks), "after": check_blocks(d, blocks, rng)}
            details["crash"] = crash
        manager.close()             # our copies of the arena: the daemon holds its own

        cold: dict[str, Any] = {}
        if "1" in parts:
            progress(f"{name}: cold restart (SIGTERM, plain start: RAM lost) under the same load")
            load = start_load(d.target, small, client_block, tmp, f"cold-{gib:g}")
            try:
                time.sleep(2.0)
                t0 = time.monotonic()
                d.stop(signal.SIGTERM)
                down = time.monotonic() - t0
                start_s = d.start(None)
                back = time.monotonic() - t0
                time.sleep(2.0)
            finally:
                result = stop_load(load)
            w = window(result["records"], t0 - 0.5, t0 + back + 1.0)
            cold = {"window": w, "stop_s": down, "start_s": start_s, "sigterm_to_serving_s": back,
                    "errors": result["errors"], "misses": result["misses"], "ram_blocks_after": d.ram_blocks()}
            details["cold"] = cold
            progress(f"  stopped in {down:.2f} s, serving again {back:.2f} s after SIGTERM; clients' longest call "
                     f"{w['max_s']:.2f} s, {w['failed']} failed tries; RAM blocks after: {cold['ram_blocks_after']}")
        d.stop()
    finally:
        manager.close()
        logs.update({f"{name} {p.name}": p.read_text(errors="replace") for p in sorted(state.glob("daemon-*.log"))})

    # ---- rows
    if up:
        uw, bw = up["upgrade_windows"], up["baseline_windows"]
        up_max = max(w["max_s"] for w in uw)
        base_max = max(w["max_s"] for w in bw)
        failed = sum(w["failed"] for w in uw)
        gap = cold["window"]["max_s"]
        passed = failed == 0 and up["all"]["failed"] == 0 and up_max <= MAX_CALL_S and up_max <= COLD_FRACTION * gap
        handover = max(a["elapsed_s"] for a in up["answers"])
        total = max(a["total_s"] for a in up["answers"])
        after = up["after"]
        k = len(uw)
        rows += [
            Row(1, f"{name}: longest call, {k} upgrade(s)", "s", up_max, "longest call, no upgrade", base_max, False,
                details={"upgrade_windows": uw, "baseline_windows": bw}),
            Row(1, f"{name}: longest call, {k} upgrade(s)", "s", up_max, "cold restart: longest call", gap, False,
                f"<= {MAX_CALL_S:g} s and <= {COLD_FRACTION:g}x, 0 failed", passed),
            Row(1, f"{name}: failed calls, upgrades", "calls", failed, "failed calls, cold restart", cold["window"]["failed"],
                False, "0", failed == 0 and up["all"]["failed"] == 0),
            Row(1, f"{name}: handover (elapsed_s, max)", "s", handover, "cold restart: longest call", gap, False),
            Row(1, f"{name}: upgrade total_s (max)", "s", total, "cold restart: longest call", gap, False),
            Row(1, f"{name}: cold restart, SIGTERM -> serving", "s", cold["sigterm_to_serving_s"], "cold restart: longest call",
                gap, False),
            Row(1, f"{name}: blocks in RAM after upgrades", "blocks", after["looked_up"], "blocks put", n, True,
                f"all, {SPOT} equal", after["looked_up"] == n and after["stats_ram_blocks"] == n
                and after["spot_same"] == after["spot"] and up["wrong"] == 0),
        ]
        calls = up["all"]["calls"]
        notes.append(f"{name}: clients made {calls} calls during the upgrade part ({up['all']['failed']} failed tries, "
                     f"{up['wrong']} wrong payloads, {up['misses']} misses); p50 call {up['all']['p50_s'] * 1e3:.1f} ms; "
                     f"upgrade windows {', '.join(format(w['length_s'], '.2f') for w in uw)} s; handovers "
                     f"{', '.join(str(a['elapsed_s']) for a in up['answers'])} s, totals "
                     f"{', '.join(str(a['total_s']) for a in up['answers'])} s")
        if up["errors"]:
            notes.append(f"{name}: client errors during the upgrade part: {up['errors'][:3]}")
        notes.append(f"{name}: cold restart: stop {cold['stop_s']:.2f} s, start {cold['start_s']:.2f} s, "
                     f"{cold['window']['failed']} failed tries, RAM blocks after {cold['ram_blocks_after']} "
                     f"(of {n}: RAM lost), client errors e.g. {cold['errors'][:2]}")
    if crash:
        summary = crash["summary"]
        after = crash["after"]
        adopted_ok = (summary.get("adopted") == str(n) and summary.get("mismatched") == "0"
                      and after["looked_up"] == n and after["spot_same"] == after["spot"])
        rows += [
            Row(2, f"{name}: restart -> ram_done", "s", crash["ram_done_s"], "BLAKE3 floor, same bytes", crash["floor_s"], False,
                details=crash),
            Row(2, f"{name}: daemon's own adoption (elapsed_s)", "s", float(summary.get("elapsed_s", "nan")),
                "BLAKE3 floor, same bytes", crash["floor_s"], False),
            Row(2, f"{name}: blocks adopted", "blocks", float(summary.get("adopted", "nan")), "blocks put", n, True,
                "all, 0 mismatched", adopted_ok),
        ]
        if cold:
            rows.append(Row(2, f"{name}: restart -> serving", "s", crash["serving_s"], "cold start -> serving",
                            cold["start_s"], False))
        notes.append(f"{name}: crash: {crash['bytes'] / GiB:.2f} GiB in {n} blocks; floor {crash['floor_s']:.2f} s on a fresh "
                     f"mapping ({crash['bytes'] / crash['floor_s'] / 1e9:.2f} GB/s), {crash['floor_warm_s']:.2f} s warm; "
                     f"ram_summary: {' '.join(f'{k}={v}' for k, v in summary.items())}")
    return rows, notes, details


# =============================================================================================
# part 3: hit rate after a crash


@dataclass
class Replay:
    hits: int = 0
    blocks: int = 0
    requests: int = 0
    seconds: float = 0.0
    short_gets: int = 0          # a Get returned fewer blocks than the Lookup said were held
    wrong: int = 0
    put_errors: int = 0
    errors: list[str] = field(default_factory=list)
    held: list[int] = field(default_factory=list)     # per request: the prefix the Lookup said is held
    done_at: list[float] = field(default_factory=list)  # per request: when it was done (time.time())

    @property
    def rate(self) -> float:
        return self.hits / self.blocks if self.blocks else float("nan")


class TraceClient:
    def __init__(self) -> None:
        self.digests: dict[int, bytes] = {}

    def digest(self, block_id: int) -> bytes:
        d = self.digests.get(block_id)
        if d is None:
            d = self.digests[block_id] = key_of(f"mooncake-conversation/{block_id}")
        return d

    def replay(self, client: Any, requests: Sequence[dict[str, Any]]) -> Replay:
        import grpc

        from kvcached_agent.address import BlockAddress

        out = Replay()
        t0 = time.monotonic()
        for r in requests:
            digests = [self.digest(b) for b in r["hash_ids"]]
            held = client.lookup(digests).longest
            if held:
                fetched, _ = client.get([BlockAddress(d) for d in digests[:held]], allow_partial=True)
                out.short_gets += held - len(fetched)
                out.wrong += sum(f.payload != payload(f.address.digest, TRACE_BLOCK) for f in fetched)
            if held < len(digests):
                try:
                    client.put([(BlockAddress(d), payload(d, TRACE_BLOCK)) for d in digests[held:]], model="mooncake")
                except grpc.RpcError as exc:
                    out.put_errors += 1
                    if len(out.errors) < 3:
                        out.errors.append("Put: " + describe(exc))
            out.hits += held
            out.held.append(held)
            out.done_at.append(time.time())
            out.blocks += len(digests)
            out.requests += 1
        out.seconds = time.monotonic() - t0
        return out


def load_trace(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def copy_memfd(fd: int, name: str) -> int:
    """A new memfd with the bytes and seals of ``fd`` (a second copy of a crashed daemon's arena)."""
    size = os.fstat(fd).st_size
    new = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(new, size)
    src = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    dst = mmap.mmap(new, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        for at in range(0, size, 64 * MiB):
            chunk = src[at:at + 64 * MiB]
            if chunk.count(0) != len(chunk):        # pages never written stay holes
                dst[at:at + len(chunk)] = chunk
    finally:
        src.close()
        dst.close()
    fcntl.fcntl(new, fcntl.F_ADD_SEALS, fcntl.fcntl(fd, fcntl.F_GET_SEALS))
    return new


def bench_trace(groups: Groups, tmp: Path, s: Settings, trace_path: Path,
                logs: dict[str, str]) -> tuple[list[Row], list[str], dict[str, Any]]:
    from tests.fdstore import ServiceManager

    reqs = load_trace(trace_path)
    stamps = [r["timestamp"] for r in reqs]
    c = bisect.bisect_left(stamps, s.crash_s * 1000)
    n60 = bisect.bisect_left(stamps, (s.crash_s + WINDOW_S) * 1000) - c
    distinct = len({b for r in reqs[:c] for b in r["hash_ids"]})
    ram_bytes = distinct * TRACE_BLOCK * RAM_FRACTION
    ram_gib = round(ram_bytes / GiB, 4)
    before_reqs, after_reqs = reqs[c - n60:c], reqs[c:c + n60]
    progress(f"trace: {len(reqs)} requests; crash at {s.crash_s:g} s = request {c}; the first minute after it is {n60} "
             f"requests ({sum(len(r['hash_ids']) for r in after_reqs)} blocks); {distinct} distinct blocks before it "
             f"x {TRACE_BLOCK // KiB} KiB; RAM tier {ram_gib:g} GiB ({RAM_FRACTION:g} of them)")
    notes: list[str] = []
    details: dict[str, Any] = {"crash_request": c, "window_requests": n60, "distinct_blocks_before": distinct,
                               "ram_gib": ram_gib}
    tc = TraceClient()
    runs: dict[str, Replay] = {}
    daemons: list[Daemon] = []
    manager2 = None
    at_crash = 0
    try:
        # (c) no crash
        progress(f"trace (c): no crash, replaying {c + n60} requests")
        d0 = Daemon(groups, tmp / "trace-nocrash", ram_gib)
        daemons.append(d0)
        d0.start()
        with d0.client() as cl:
            tc.replay(cl, reqs[:c - n60])
            runs["c before"] = tc.replay(cl, before_reqs)
            runs["c after"] = tc.replay(cl, after_reqs)
        d0.stop()
        progress(f"  before {runs['c before'].rate:.3f}, after {runs['c after'].rate:.3f} "
                 f"({runs['c after'].seconds:.1f} s for the window)")

        # the crash pass
        manager = ServiceManager(tmp / "notify-trace")
        try:
            da = Daemon(groups, tmp / "trace-crash", ram_gib)
            daemons.append(da)
            progress(f"trace: under the service manager, replaying {c} requests up to the crash point")
            da.start(manager)
            manager.wait_for("READY", "1", timeout=60)
            with da.client() as cl:
                warm = tc.replay(cl, reqs[:c - n60])
                runs["before"] = tc.replay(cl, before_reqs)
            progress(f"  before {runs['before'].rate:.3f} (warm-up {warm.requests} requests in {warm.seconds:.1f} s); SIGKILL")
            at_crash = da.ram_blocks()
            details["ram_blocks_at_crash"] = at_crash
            da.stop(signal.SIGKILL)
            # the crash state, twice more: the index for (b) and (a'), the arena and slot directory for (a')
            db = Daemon(groups, tmp / "trace-plain", ram_gib)
            da2 = Daemon(groups, tmp / "trace-waited", ram_gib)
            daemons += [db, da2]
            for copy in (db, da2):
                shutil.copytree(da.state / "index", copy.state / "index", ignore=shutil.ignore_patterns("*.sock"))
            manager2 = ServiceManager(tmp / "notify-trace-2")
            with manager2._lock:
                manager2.stored.update({name: copy_memfd(fd, name) for name, fd in manager.stored.items()})
            floor, floor_warm = blake3_floor(manager.stored["kvcached-arena"], [(b"", TRACE_BLOCK)] * at_crash)

            progress("trace (a): restart with the fd store, replaying the first minute at once")
            t0, wall0 = time.monotonic(), time.time()
            da.start(manager)
            started = time.monotonic() - t0
            with da.client() as cl:
                runs["a after"] = tc.replay(cl, after_reqs)
            window_end = time.monotonic() - t0
            _, polled, summary = wait_ram_done(da, t0)
            # when the check ended, from the daemon's log line (polling meanwhile would slow the replay)
            logged = logged_at(da.log_path, "RAM tier taken over")
            done = logged - wall0 if logged is not None else polled
            ra = runs["a after"]
            early = sum(1 for at in ra.done_at if at - wall0 <= done)
            late = Replay(hits=sum(ra.held[early:]), blocks=sum(len(r["hash_ids"]) for r in after_reqs[early:]))
            details["a"] = {"start_s": started, "window_end_s": window_end, "ram_done_s": done, "summary": summary,
                            "floor_s": floor, "floor_warm_s": floor_warm, "requests_before_ram_done": early,
                            "rate_after_ram_done": late.rate}
            progress(f"  after {ra.rate:.3f}; serving {started:.2f} s after the start, ram_done at {done:.2f} s "
                     f"({early} of {len(after_reqs)} requests done by then; {late.rate:.3f} over the rest), window done at "
                     f"{window_end:.2f} s; {summary}; BLAKE3 floor {floor:.3f} s")
            da.stop()
        finally:
            manager.close()

        progress("trace (b): plain start on a copy of the index (no fd store), replaying the first minute")
        t0 = time.monotonic()
        started_b = db.start()
        with db.client() as cl:
            runs["b after"] = tc.replay(cl, after_reqs)
        details["b"] = {"start_s": started_b, "window_end_s": time.monotonic() - t0}
        progress(f"  after {runs['b after'].rate:.3f}")
        db.stop()

        progress("trace (a'): the same crash state (copies), restart with the fd store, replay once ram_done")
        t0 = time.monotonic()
        da2.start(manager2)
        _, done2, summary2 = wait_ram_done(da2, t0)
        manager2.close()
        with da2.client() as cl:
            runs["a2 after"] = tc.replay(cl, after_reqs)
        details["a2"] = {"ram_done_s": done2, "summary": summary2}
        progress(f"  after {runs['a2 after'].rate:.3f} (ram_done {done2:.2f} s after the start: {summary2})")
        da2.stop()
    finally:
        if manager2 is not None:
            manager2.close()
        for dd in daemons:
            for p in sorted(dd.state.glob("daemon-*.log")):
                logs[f"trace {dd.state.name} {p.name}"] = p.read_text(errors="replace")

    details["runs"] = {k: {**asdict(v), "rate": v.rate} for k, v in runs.items()}
    before = runs["before"].rate
    a, b = runs["a after"].rate, runs["b after"].rate
    da_ = details["a"]
    rows = [
        Row(2, f"trace arena, {at_crash} x {TRACE_BLOCK // KiB} KiB: daemon's adoption", "s", float(da_["summary"]["elapsed_s"]),
            "BLAKE3 floor, same bytes", da_["floor_s"], False, details=da_),
        Row(2, f"trace arena, {at_crash} x {TRACE_BLOCK // KiB} KiB: restart -> ram_done (replaying)", "s", da_["ram_done_s"],
            "BLAKE3 floor, same bytes", da_["floor_s"], False),
        Row(3, "(a) crash, fd store: after", "%", a * 100, "before the crash", before * 100, True, f">= {HIT_TARGET:g}x",
            a >= HIT_TARGET * before),
        Row(3, "(a') the same, replayed once ram_done", "%", runs["a2 after"].rate * 100, "before the crash", before * 100, True),
        Row(3, "(b) crash, no fd store: after", "%", b * 100, "before the crash", before * 100, True),
        Row(3, "(c) no crash: after", "%", runs["c after"].rate * 100, "before (no crash)", runs["c before"].rate * 100, True),
        Row(3, "(a) crash, fd store: after", "%", a * 100, "(c) no crash: after", runs["c after"].rate * 100, True),
    ]
    for k, v in runs.items():
        if v.short_gets or v.wrong or v.put_errors:
            notes.append(f"trace {k}: {v.short_gets} blocks a Lookup promised were missing from the Get, {v.wrong} wrong "
                         f"payloads, {v.put_errors} failed Puts {v.errors}")
    notes.append(f"trace: window = {n60} requests (the trace's {WINDOW_S:g} s from {s.crash_s:g} s), replayed in "
                 f"{runs['a after'].seconds:.1f} s (a), {runs['b after'].seconds:.1f} s (b), {runs['c after'].seconds:.1f} s (c); "
                 f"blocks of {TRACE_BLOCK // KiB} KiB, RAM tier {ram_gib:g} GiB = {RAM_FRACTION:g} x {distinct} distinct blocks "
                 f"before the crash; RAM blocks at the crash {details.get('ram_blocks_at_crash')}; "
                 f"(a) ram_done {details['a']['ram_done_s']:.2f} s after the restart, when "
                 f"{details['a']['requests_before_ram_done']} of its {n60} requests were done (hit rate over the rest "
                 f"{details['a']['rate_after_ram_done']:.4f}), the window done at {details['a']['window_end_s']:.2f} s; "
                 f"hits before the crash: no-crash run {runs['c before'].rate:.4f}, crash run {before:.4f}")
    return rows, notes, details


# =============================================================================================
# main


def upgrade_turns(groups: Groups, tmp: Path, gib: float, s: Settings, cases: dict[str, tuple[list[str], list[str]]],
                  part: int, label: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Upgrades of a daemon per case (its ``--set`` overrides, the tenants its clients are), each
    filled with a share of the blocks per tenant, in turns (at least 2 each), the order turned
    each turn, the load running only on the daemon being upgraded: each upgrade's window."""
    daemons: dict[str, Daemon] = {}
    keys: dict[str, dict[str, list[bytes]]] = {}
    windows: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    block = s.block_sizes[0]
    try:
        for case, (extra, who) in cases.items():
            d = daemons[case] = Daemon(groups, tmp / f"part{part}-{case}", gib, extra)
            d.start()
            blocks = fill(d, gib, (block,), who)
            per_put = max(1, PUT_BYTES // block)          # fill's batches, each Put as the next tenant
            keys[case] = {t: [k for n, (k, _) in enumerate(blocks) if (n // per_put) % len(who) == j][:CLIENT_KEYS]
                          for j, t in enumerate(who)}
        order = list(cases)
        for r in range(max(2, s.upgrades)):
            for case in (order if r % 2 == 0 else order[::-1]):
                d, who = daemons[case], cases[case][1]
                load = start_load(d.target, keys[case], block, tmp, f"part{part}-{case}-{r}", who)
                try:
                    time.sleep(QUIET_S / 2)
                    answer, t0, t1, t2 = d.upgrade()
                    end = max(t1, t2) + SETTLE_S
                    time.sleep(max(0.0, end - time.monotonic()) + 0.2)
                finally:
                    result = stop_load(load)
                w = window(result["records"], t0, end)
                w.update(handover_s=answer["elapsed_s"], wrong=result["wrong"])
                windows[case].append(w)
                progress(f"  part {part}, {label[case]}, round {r + 1}: longest call {w['max_s'] * 1e3:.0f} ms, "
                         f"handover {answer['elapsed_s']:.3f} s, failed {w['failed']}, wrong {result['wrong']}")
    finally:
        for d in daemons.values():
            d.stop()
    return windows


def bench_arenas(groups: Groups, tmp: Path, gib: float, s: Settings, tenants: int) -> tuple[list[Row], dict[str, Any]]:
    """Part 4 (issue 61): the longest call during an upgrade of a daemon whose RAM tier is
    ``tenants`` tenants' arenas (each filled with a share of the blocks, every client a
    tenant's) against one arena (no tenants)."""
    names = [f"t{j}" for j in range(tenants)]
    cases = {"one": ([], [""]), "many": ([f"tenants.uids={{ {', '.join(f'{n} = [{70000 + j}]' for j, n in enumerate(names))} }}"],
                                         names)}
    windows = upgrade_turns(groups, tmp, gib, s, cases, 4, {"one": "one arena", "many": f"{tenants} arenas"})
    many = max(w["max_s"] for w in windows["many"])
    one = max(w["max_s"] for w in windows["one"])
    failed = sum(w["failed"] + w["wrong"] for ws in windows.values() for w in ws)
    rows = [Row(4, f"longest call during an upgrade, {tenants} tenants' arenas", "s", many, "one arena (no tenants)",
                one, False, f"<= {ARENA_UPGRADE_TARGET:g}x, 0 failed", many <= ARENA_UPGRADE_TARGET * one and not failed,
                {"windows": windows}),
            Row(4, "handover (the old daemon's part), the longest", "s",
                max(w["handover_s"] for w in windows["many"]), "one arena",
                max(w["handover_s"] for w in windows["one"]), False)]
    return rows, {"windows": windows}


@contextlib.contextmanager
def hugetlbfs_dir(tmp: Path, gib: float) -> Any:
    """A directory on hugetlbfs with room for an arena of ``gib`` and its slot directory (the
    pool grown for the run and put back after), or None where this machine cannot have one."""
    pool = Path("/proc/sys/vm/nr_hugepages")
    mount = tmp / "hugetlbfs"
    if os.geteuid() != 0 or not pool.exists():
        yield None
        return
    before = int(pool.read_text())
    try:
        pool.write_text(str(before + int(gib * GiB * 1.02) // (2 * MiB) + 8))
        mount.mkdir()
        subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        progress(f"  no hugetlbfs here ({exc}): part 5 without it")
        pool.write_text(str(before))
        yield None
        return
    try:
        yield mount / "arena"
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        pool.write_text(str(before))


def bench_backings(groups: Groups, tmp: Path, gib: float, s: Settings) -> tuple[list[Row], dict[str, Any]]:
    """Part 5 (issue 62): the longest call during an upgrade with the arena in files (kv.arena =
    "file": a tmpfs, as a Kubernetes pod keeps it, and hugetlbfs where this machine has huge
    pages) against the memfd of today's upgrade."""
    shm = Path(tempfile.mkdtemp(prefix="kvcbench-arena-", dir="/dev/shm"))
    try:
        with hugetlbfs_dir(tmp, gib) as huge:
            cases = {"memfd": ([], [""]), "tmpfs": (['kv.arena="file"', f'kv.arena_dir="{shm / "arena"}"'], [""])}
            if huge is not None:
                cases["hugetlbfs"] = (['kv.arena="file"', f'kv.arena_dir="{huge}"'], [""])
            label = {"memfd": "memfd", "tmpfs": "files on tmpfs", "hugetlbfs": "files on hugetlbfs"}
            windows = upgrade_turns(groups, tmp, gib, s, cases, 5, label)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    memfd = max(w["max_s"] for w in windows["memfd"])
    rows = []
    for case in [c for c in windows if c != "memfd"]:
        longest = max(w["max_s"] for w in windows[case])
        failed = sum(w["failed"] + w["wrong"] for w in windows[case])
        rows.append(Row(5, f"longest call during an upgrade, arena {label[case]}", "s", longest, "a memfd arena",
                        memfd, False, f"<= {ARENA_UPGRADE_TARGET:g}x, 0 failed",
                        longest <= ARENA_UPGRADE_TARGET * memfd and not failed, {"windows": windows[case]}))
    return rows, {"windows": windows}


TITLES = {
    1: "1. kvcached upgrade under load ({clients} gRPC client processes, Get/Put of resident {kib} KiB blocks); lower is better",
    2: "2. Crash (SIGKILL) and restart with systemd's fd store (stand-in): every RAM block checked; lower is better",
    3: "3. Hit rate of the Mooncake conversation trace, first minute after a crash (trace time compressed); higher is better",
    4: "4. kvcached upgrade with tenants' arenas (each client a tenant's) against one arena; lower is better",
    5: "5. kvcached upgrade with the arena in files (kv.arena = \"file\", as a Kubernetes pod keeps it) against a memfd; "
       "lower is better",
}


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:,.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "%":
        return f"{value:.1f} %"
    return f"{value:,.0f} {unit}"


def cpu_busy_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (daemons, successors, clients)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (about a minute): arenas 0.25 and 1 GiB, "
                                                             "one upgrade each, crash at trace time 300 s")
    parser.add_argument("--parts", default="12345", help="which parts to run, e.g. 3 (default 12345; 1 includes 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--logs", metavar="DIR", help="keep the daemons' logs in DIR")
    parser.add_argument("--trace", default=str(TRACE), help=f"the Mooncake trace (default {TRACE})")
    parser.add_argument("--block-kib", type=int, help="parts 1 and 2: fill with blocks of this one size (KiB) instead of "
                                                      "the 256/512/768/1024 KiB mix; the clients use it too")
    parser.add_argument("--child-load", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_load:
        return child_load(*args.child_load)

    signal.signal(signal.SIGTERM, _interrupt)
    s = QUICK if args.quick else FULL
    if args.block_kib:
        from kvcached.tiers.slabs import size_classes

        if args.block_kib * KiB not in size_classes(16 * MiB) or args.block_kib * KiB > POOL_BYTES // 2:
            parser.error("--block-kib: a slot class of 4 KiB .. 2 MiB (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, ...)")
        s = replace(s, block_sizes=(args.block_kib * KiB,))
    subreaper = become_subreaper()
    started = time.time()
    rows: list[Row] = []
    notes: list[str] = []
    details: dict[str, Any] = {}
    logs: dict[str, str] = {}
    rng = random.Random(1)
    load_avg = os.getloadavg()[0]
    busy0, own0 = cpu_busy_s(), own_cpu_s()
    groups = Groups()
    try:
        with tempfile.TemporaryDirectory(prefix="kvcbench-upgrade-") as tmp_s:
            tmp = Path(tmp_s)
            try:
                if "1" in args.parts or "2" in args.parts:
                    for gib in s.arenas:
                        r, n, d = bench_size(groups, tmp, gib, s, args.parts, rng, logs)
                        rows += r
                        notes += n
                        details[f"{gib:g} GiB"] = d
                if "4" in args.parts:
                    gib = min(s.arenas[-1], ARENA_GIB)
                    progress(f"part 4: upgrades with {ARENA_TENANTS} tenants' arenas against one arena, {gib:g} GiB")
                    r4, d4 = bench_arenas(groups, tmp, gib, s, ARENA_TENANTS)
                    rows += r4
                    details["arenas"] = d4
                if "5" in args.parts:
                    gib = min(s.arenas[-1], ARENA_GIB)
                    progress(f"part 5: upgrades with the arena in files against a memfd, {gib:g} GiB")
                    r5, d5 = bench_backings(groups, tmp, gib, s)
                    rows += r5
                    details["backings"] = d5
                if "3" in args.parts:
                    r, n, d = bench_trace(groups, tmp, s, Path(args.trace), logs)
                    rows += r
                    notes += n
                    details["trace"] = d
            finally:
                groups.close()
    finally:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for name, text in logs.items():
                (Path(args.logs) / (name.replace(" ", "_") + ".log")).write_text(text)

    others = (cpu_busy_s() - busy0) - (own_cpu_s() - own0)
    notes.append(f"other processes on this machine took about {others:.0f} CPU-s during the {time.time() - started:.0f} s run "
                 f"({os.cpu_count()} CPUs): the first thing to check when a figure is off")
    header = (f"kvcached upgrade / crash benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s, "
              f"load average {load_avg:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n"
              f"settings: arenas {', '.join(f'{g:g}' for g in s.arenas)} GiB filled to {FILL:.0%} with "
              f"{'/'.join(str(b // KiB) for b in s.block_sizes)} KiB blocks, SSD off; {s.upgrades} upgrade(s) per size; "
              f"{CLIENTS} clients, {THINK_S * 1e3:g} ms apart; trace crash at {s.crash_s:g} s, {TRACE_BLOCK // KiB} KiB "
              f"blocks, RAM = {RAM_FRACTION:g} x distinct bytes before it; subreaper: {subreaper}")
    titles = {**TITLES, 1: TITLES[1].format(clients=CLIENTS, kib=s.block_sizes[0] // KiB)}
    print_fitted(rows, header, titles, fmt, [
        "ratio = kvcached / baseline; every baseline measured in the same run.",
        f"target of figure 1 (\"no client-visible gap\"): 0 failed calls and the longest call during the upgrades "
        f"<= {MAX_CALL_S:g} s and <= {COLD_FRACTION:g}x the cold restart's longest call.",
        f"target of figure 3: hit rate in the first minute after a crash with the fd store >= {HIT_TARGET:g}x the rate "
        "in the same number of requests before it."])
    for note in notes:
        print("note: " + note)
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "started": started, "elapsed_s": time.time() - started, "settings": asdict(s)},
               "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows], "notes": notes,
               "details": details}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); daemons stopped, temp dir removed")
        sys.exit(130)
