"""kvcached peer-tier benchmark: pulls between two real daemons, every figure next to a baseline
measured in the same run on the same machine.

    python bench/bench_peers.py [--json PATH] [--quick]

Setup: a cluster CA and two node certificates (kvcached.certs.make_cluster, what ``kvcached
certs`` does) in a temp dir, and two ``kvcached serve`` subprocesses (bench_core.start_kvcached:
all state in the temp dir, gRPC on a Unix socket) that peer over loopback: ``quic.listen`` on
free UDP ports of 127.0.0.1, ``quic.peers`` naming each other, ``quic.max_datagram_size=16000``,
the default flow-control windows (64 MiB per connection, 16 MiB per stream), ``kv.ssd_gib=0``
(RAM only), ``kv.mirror_pulls=false`` (a pulled block is dropped again once read, so every Get
on B pulls from A again) and ``quic.pull_timeout_s=30``. Blocks are put on daemon A through
gRPC; once daemon B's Lookup shows all of them in its peer column, B's Gets of them are pulls.

1. Pull throughput: gRPC Get on daemon B of 32 blocks a call (64 KiB and 1 MiB blocks), every
   block pulled from A over QUIC (B checks each block's BLAKE3 checksum on arrival), one call
   in flight, one blocking grpcio client in this process (no client-side checksum; the first
   batch of each size is checked byte for byte before timing). Baselines, all sending the same
   bytes:
   - bare aioquic: a server in its own process (this file with ``--bare-server``: aioquic
     ``serve``, uvloop, the node-a certificate, the same datagram size and flow-control
     windows) holding the same blocks in a dict, and an aioquic client (node-b certificate) in
     this process on a uvloop event loop in a thread: one bidirectional stream per block (the
     request: the block's 36-byte wire address; the answer: its payload), 32 streams in flight,
     each payload written into a preallocated buffer. Target: pull >= 0.8x bare aioquic.
   - the same pull without gRPC or daemon B: a kvcached.peers.tier.PeerTier in this process
     (on the same event-loop thread, node-b's certificate, a stand-in store that holds nothing)
     connected to daemon A, its directory told that A holds the blocks, timing
     ``PeerTier.fetch`` of 32 blocks into a preallocated buffer (checksums checked, as in the
     daemon). Target: >= 0.8x bare aioquic.
   - Redis: redis-server (its own process, TCP on 127.0.0.1, ``--save "" --appendonly no``)
     holding the same blocks, read with redis-py GET, one block a call (32 calls a batch).
     Target: pull >= 0.2x redis GET (../shared/BASELINES.md has bare aioquic at ~0.3x redis-py
     GET on this kind of machine; 0.7 x 0.3 ~ 0.2). This process tunes its heap as bench_core
     does (tune_client_malloc), which lifts redis-py GET of 1 MiB values from ~0.3 to ~1 GB/s
     here: at 1 MiB even bare aioquic is then far below the target, which measures Python QUIC,
     not the daemon. Skipped, with a line saying so, where redis-server or redis-py is missing
     (``make system-deps`` installs redis-server).
   - also shown, no target: gRPC Get of the same batch on daemon A, where the blocks are in RAM
     (no pull): what the gRPC hop alone costs.
   Interleaved rounds (the sides in order, then reversed); each side runs batches until its
   clocked time reaches the round length. Each side's figure is its median round; a ratio is
   the median over rounds of the two sides' ratio within the round.
2. Latency of one block (64 KiB and 1 MiB), p50: gRPC Get on B (pulled from A), PeerTier.fetch
   in this process, against one request of bare aioquic (one stream); also shown, no target:
   the same Get against daemon A, whose RAM holds the block (the gRPC hop alone), and redis GET.
   Interleaved rounds as in figure 1, a fixed number of calls per side and round.
   Targets: Get on B <= 2x bare aioquic (the gRPC round trip alone costs ~0.6 ms here, a bare
   QUIC request ~1 ms), PeerTier.fetch <= 1.5x.

Notes printed: CPU time per MiB of each process involved, per side (where the work goes); the
peer counters of daemon B (pulled, failed, hedged, missed); how long B took to see A's blocks;
how much CPU other processes took during the run.

--quick: 256 x 64 KiB and 64 x 1 MiB blocks, 3 rounds of 0.25 s, 30 (64 KiB) and 10 (1 MiB)
single-block calls per side and round: about 35-45 s. Full: 512 x 64 KiB and 128 x 1 MiB, 5 rounds
of 1 s, 80 and 30 calls: about 2 minutes on an idle machine. Progress goes to stderr, the table
to stdout. Every process is stopped and the temp dir removed whatever happens (servers run
under ``setpriv --pdeathsig``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import (KiB, MiB, Proc, Row, percentile, print_table, proc_times,  # noqa: E402
                        progress, size_name, start_kvcached, tune_client_malloc)

SIZES = (64 * KiB, 1 * MiB)
BATCH = 32                    # blocks a call; also the bare client's streams in flight
DATAGRAM = 16000              # quic.max_datagram_size, the largest aioquic takes on loopback
MAX_DATA = 64 << 20           # the daemon's default flow-control windows ([quic] max_data_mib, max_stream_data_mib)
MAX_STREAM_DATA = 16 << 20
BARE_TARGET = 0.8             # pull GB/s / bare aioquic GB/s
REDIS_TARGET = 0.2            # pull GB/s / redis-py GET GB/s
LAT_TARGET_GRPC = 2.0         # single-block Get on B p50 / bare aioquic single request p50
LAT_TARGET_TIER = 1.5         # single-block PeerTier.fetch p50 / bare aioquic p50
ALPN = "kvcbench-bare"
CROSS = 0xFFFFFFFF            # kvcached_agent.address.CROSS_LAYER


@dataclass(frozen=True)
class Settings:
    blocks: dict[int, int]    # block size -> blocks put on A (the working set Gets cycle over)
    rounds: int
    seconds: float            # clocked time per side per round (throughput)
    min_calls: int
    lat_rounds: int
    lat_calls: dict[int, int]  # block size -> single-block calls per side per round


FULL = Settings(blocks={64 * KiB: 512, 1 * MiB: 128}, rounds=5, seconds=1.0, min_calls=3, lat_rounds=5,
                lat_calls={64 * KiB: 80, 1 * MiB: 30})
QUICK = Settings(blocks={64 * KiB: 256, 1 * MiB: 64}, rounds=3, seconds=0.25, min_calls=2, lat_rounds=3,
                 lat_calls={64 * KiB: 30, 1 * MiB: 10})


# =============================================================================================
# the blocks: the same bytes for every side, made the same way in every process


def digest_of(size: int, i: int) -> bytes:
    return hashlib.blake2b(f"kvcbench-peers/{size}/{i}".encode(), digest_size=32).digest()


def payload_of(size: int, i: int) -> bytes:
    return random.Random(f"kvcbench-peers/{size}/{i}").randbytes(size)


def wire(digest: bytes) -> bytes:
    """The 36-byte wire address of a cross-layer block (kvcached.peers.directory.wire_key)."""
    return digest + CROSS.to_bytes(4, "little")


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quic_config(certs: Path, me: str, *, client: bool) -> Any:
    from aioquic.quic.configuration import QuicConfiguration

    config = QuicConfiguration(is_client=client, alpn_protocols=[ALPN], server_name="node-a" if client else None,
                               cadata=(certs / "ca.pem").read_bytes(), verify_mode=ssl.CERT_REQUIRED,
                               max_datagram_size=DATAGRAM, max_data=MAX_DATA, max_stream_data=MAX_STREAM_DATA,
                               idle_timeout=120.0)
    config.load_cert_chain(str(certs / f"{me}.pem"), str(certs / f"{me}-key.pem"))
    return config


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


# =============================================================================================
# the bare aioquic server (its own process: this file with --bare-server)


def bare_server_main(args: argparse.Namespace) -> int:
    from aioquic.asyncio import QuicConnectionProtocol, serve
    from aioquic.quic import events

    blocks = {wire(digest_of(size, i)): payload_of(size, i)
              for size, n in (map(int, spec.split(":")) for spec in args.blocks.split(",")) for i in range(n)}

    class BareServer(QuicConnectionProtocol):
        """Answers each stream's 36-byte address with the block's payload, then ends the stream."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.partial: dict[int, bytes] = {}

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                data = self.partial.pop(event.stream_id, b"") + event.data
                if not event.end_stream:
                    self.partial[event.stream_id] = data
                    return
                self._quic.send_stream_data(event.stream_id, blocks.get(data, b""), end_stream=True)
                self.transmit()

    async def run() -> None:
        await serve("127.0.0.1", args.port, configuration=quic_config(Path(args.certs), "node-a", client=False),
                    create_protocol=BareServer)
        Path(args.ready).write_text("ready\n")
        await asyncio.Event().wait()

    loop = new_loop()
    asyncio.set_event_loop(loop)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    with contextlib.suppress(RuntimeError):
        loop.run_until_complete(run())
    return 0


# =============================================================================================
# this process's QUIC clients: on one event loop in a thread


class LoopThread:
    """A uvloop event loop running in a thread; ``call`` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self._run, name="quic-clients", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Awaitable[Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


def make_bare_client_class() -> type:
    from aioquic.asyncio import QuicConnectionProtocol
    from aioquic.quic import events

    class BareClient(QuicConnectionProtocol):
        """One stream per block: the request is the address, the answer lands in ``view``."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.waiting: dict[int, list[Any]] = {}      # stream -> [future, view, bytes in]

        def request(self, address: bytes, view: memoryview) -> asyncio.Future[int]:
            sid = self._quic.get_next_available_stream_id()
            future = asyncio.get_running_loop().create_future()
            self.waiting[sid] = [future, view, 0]
            self._quic.send_stream_data(sid, address, end_stream=True)
            return future

        async def fetch(self, addresses: Sequence[bytes], views: Sequence[memoryview]) -> list[int]:
            futures = [self.request(a, v) for a, v in zip(addresses, views)]
            self.transmit()
            return list(await asyncio.gather(*futures))

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                w = self.waiting.get(event.stream_id)
                if w is None:
                    return
                n = len(event.data)
                w[1][w[2]:w[2] + n] = event.data
                w[2] += n
                if event.end_stream:
                    del self.waiting[event.stream_id]
                    w[0].set_result(w[2])
            elif isinstance(event, events.ConnectionTerminated):
                for w in self.waiting.values():
                    if not w[0].done():
                        w[0].set_exception(ConnectionError(f"bare server closed: {event.reason_phrase}"))
                self.waiting.clear()

    return BareClient


class _StubIndex:
    def present_wire_keys(self) -> list[bytes]:
        return []                 # this side holds nothing: its snapshot to A is empty


class _StubStore:
    """What PeerTier asks of a store while it only pulls (no listener, nothing held)."""

    index = _StubIndex()

    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int:
        return 0

    async def serve_pull(self, rows: Any, max_payload: int, counters: Any) -> list[Any]:
        raise RuntimeError("the benchmark's PeerTier serves nothing")


@dataclass
class Clients:
    """The QUIC clients in this process, on ``lt``'s loop."""

    lt: LoopThread
    bare: Any = None
    bare_stack: Any = None
    tier: Any = None
    buffers: dict[int, bytearray] = field(default_factory=dict)      # block size -> BATCH slots

    def views(self, size: int, n: int) -> list[memoryview]:
        buf = self.buffers.get(size)
        if buf is None:
            buf = self.buffers[size] = bytearray(size * BATCH)
        view = memoryview(buf)
        return [view[i * size:(i + 1) * size] for i in range(n)]

    # -- bare aioquic --

    async def open_bare(self, port: int, certs: Path) -> None:
        from aioquic.asyncio import connect

        stack = contextlib.AsyncExitStack()
        self.bare = await asyncio.wait_for(stack.enter_async_context(connect(
            "127.0.0.1", port, configuration=quic_config(certs, "node-b", client=True),
            create_protocol=make_bare_client_class())), 20)
        self.bare_stack = stack

    async def bare_batch(self, addresses: Sequence[bytes], size: int) -> float:
        views = self.views(size, len(addresses))
        t0 = time.perf_counter()
        got = await self.bare.fetch(addresses, views)
        dt = time.perf_counter() - t0
        if got != [size] * len(addresses):
            raise RuntimeError(f"bare aioquic: answers of {sorted(set(got))} bytes, expected {size}")
        return dt

    # -- PeerTier --

    async def open_tier(self, port_a: int, certs: Path) -> None:
        from kvcached.peers.tier import PeerSettings, PeerTier
        from kvcached.peers.tls import PeerAuth, QuicOptions

        auth = PeerAuth.from_files(str(certs / "ca.pem"), str(certs / "node-b.pem"), str(certs / "node-b-key.pem"),
                                   ["node-a"])
        settings = PeerSettings(listen=None, peers={"node-a": ("127.0.0.1", port_a)},
                                options=QuicOptions(DATAGRAM, MAX_DATA, MAX_STREAM_DATA), pull_timeout_s=30.0,
                                hedge_s=0.05, max_payload=16 << 20)
        self.tier = PeerTier(_StubStore(), auth, settings)
        await self.tier.start()
        deadline = time.monotonic() + 20
        while not (self.tier.links["node-a"].client is not None and self.tier.links["node-a"].client.verified):
            if time.monotonic() > deadline:
                raise RuntimeError(f"in-process PeerTier did not connect to daemon A: {self.tier.stats()}")
            await asyncio.sleep(0.02)

    def announce(self, digests: Sequence[bytes]) -> None:
        """Tell the tier's directory that A holds these (what A's snapshot says to daemon B)."""
        self.tier.directory.announce("node-a", [wire(d) for d in digests])

    async def tier_batch(self, digests: Sequence[bytes], size: int) -> float:
        from kvcached_agent.address import BlockAddress

        addresses = [BlockAddress(d) for d in digests]
        views = self.views(size, len(addresses))
        slot = {a.key: i for i, a in enumerate(addresses)}

        def reserve(address: Any, length: int) -> tuple[Any, memoryview] | None:
            i = slot[address.key]
            return i, views[i][:length]

        t0 = time.perf_counter()
        got = await self.tier.fetch(addresses, reserve, lambda handle: None)
        dt = time.perf_counter() - t0
        if len(got) != len(addresses):
            raise RuntimeError(f"PeerTier.fetch got {len(got)} of {len(addresses)} blocks: {self.tier.stats()}")
        return dt

    async def close(self) -> None:
        if self.tier is not None:
            await self.tier.stop()
        if self.bare_stack is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.bare_stack.aclose(), 5)


# =============================================================================================
# sides: one way each to fetch a batch; each returns the seconds of the fetch only


@dataclass
class Side:
    name: str
    fetch: Callable[[Sequence[int]], float]       # block indices -> seconds
    pids: Sequence[int]                           # server processes whose CPU time counts for it
    info: bool = False                            # shown, no target


def grpc_side(name: str, channel: Any, digests: Sequence[bytes], size: int, pids: Sequence[int],
              info: bool = False) -> Side:
    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

    stub = pb_grpc.KvCacheStub(channel)
    cache: dict[tuple[int, ...], Any] = {}

    def fetch(idx: Sequence[int]) -> float:
        key = tuple(idx)
        request = cache.get(key)
        if request is None:
            request = cache[key] = pb.GetRequest(addresses=[pb.BlockAddress(digest=digests[i]) for i in idx])
        t0 = time.perf_counter()
        response = stub.Get(request, timeout=120)
        dt = time.perf_counter() - t0
        if len(response.blocks) != len(idx) or any(len(b.payload) != size for b in response.blocks):
            raise RuntimeError(f"{name}: Get answered {len(response.blocks)} blocks of {len(idx)}")
        return dt

    return Side(name, fetch, pids, info)


def redis_side(client: Any, digests: Sequence[bytes], size: int, pid: int) -> Side:
    def fetch(idx: Sequence[int]) -> float:
        keys = [digests[i] for i in idx]
        t0 = time.perf_counter()
        values = [client.get(k) for k in keys]
        dt = time.perf_counter() - t0
        if any(v is None or len(v) != size for v in values):
            raise RuntimeError("redis: a GET missed")
        return dt

    return Side("redis-py GET", fetch, [pid])


def loop_side(name: str, clients: Clients, make: Callable[[Sequence[int]], Awaitable[float]],
              pids: Sequence[int]) -> Side:
    return Side(name, lambda idx: clients.lt.call(make(idx)), pids)


# =============================================================================================
# daemons, baselines, setup


def start_daemon(stack: contextlib.ExitStack, tmp: Path, certs: Path, me: str, peer: str, listen: int,
                 peer_port: int, ram_gib: float) -> tuple[Proc, Any]:
    tmp.mkdir()
    sets = ["kv.ssd_gib=0", 'kv.write_policy="write_back"', "kv.mirror_pulls=false",
            f'quic.listen="127.0.0.1:{listen}"',
            f'quic.peers=[{{ name = "{peer}", address = "127.0.0.1:{peer_port}" }}]',
            f'quic.ca="{certs / "ca.pem"}"', f'quic.cert="{certs / f"{me}.pem"}"',
            f'quic.key="{certs / f"{me}-key.pem"}"',
            f"quic.max_datagram_size={DATAGRAM}", f"quic.max_data_mib={MAX_DATA / MiB:g}",
            f"quic.max_stream_data_mib={MAX_STREAM_DATA / MiB:g}", "quic.pull_timeout_s=30"]
    return start_kvcached(stack, tmp, ram_gib, sets)


def start_bare_server(stack: contextlib.ExitStack, tmp: Path, certs: Path, s: Settings) -> tuple[Proc, int]:
    port = free_port(socket.SOCK_DGRAM)
    ready = tmp / "bare.ready"
    spec = ",".join(f"{size}:{n}" for size, n in s.blocks.items())
    proc = Proc("bare aioquic server", [sys.executable, str(Path(__file__).resolve()), "--bare-server", "--port",
                                        str(port), "--certs", str(certs), "--blocks", spec, "--ready", str(ready)],
                cwd=tmp, log=tmp / "bare.log")
    stack.callback(proc.stop)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"bare aioquic server not up:\n{proc.tail()}")
        time.sleep(0.05)
    return proc, port


def start_redis_tcp(stack: contextlib.ExitStack, tmp: Path) -> tuple[Proc, Any] | str:
    """redis-server on 127.0.0.1 (TCP: a network path, as a pull's) and a redis-py client; or why not."""
    exe = shutil.which("redis-server")
    if exe is None:
        return "redis-server is not installed (make system-deps installs it)"
    try:
        import redis
    except ImportError:
        return "redis-py is not installed in this venv"
    port = free_port(socket.SOCK_STREAM)
    proc = Proc("redis-server", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", str(tmp), "--daemonize", "no"], cwd=tmp, log=tmp / "redis.log")
    stack.callback(proc.stop)
    client = redis.Redis(host="127.0.0.1", port=port)
    stack.callback(client.close)
    deadline = time.monotonic() + 20
    while True:
        if not proc.alive():
            raise RuntimeError(f"redis-server exited:\n{proc.tail()}")
        try:
            client.ping()
            return proc, client
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready:\n{proc.tail()}") from None
            time.sleep(0.05)


def put_blocks(client: Any, size: int, n: int, payloads: Sequence[bytes]) -> None:
    from kvcached_agent.address import BlockAddress

    per = max(1, (16 * MiB) // size)
    for start in range(0, n, per):
        chunk = range(start, min(n, start + per))
        result = client.put([(BlockAddress(digest_of(size, i)), payloads[i]) for i in chunk], model="bench/peers")
        if result.stored + result.already_present != len(chunk):
            raise RuntimeError(f"daemon A stored {result.stored} of {len(chunk)} blocks")


def wait_peer_column(client: Any, digests: Sequence[bytes], timeout: float = 60.0) -> float:
    """Seconds until B's Lookup shows every digest in its peer column."""
    t0 = time.monotonic()
    while True:
        seen = 0
        for i in range(0, len(digests), 256):
            chunk = digests[i:i + 256]
            peer = client.lookup(chunk).peer
            seen += peer
            if peer < len(chunk):
                break
        if seen >= len(digests):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"daemon B's Lookup shows {seen} of {len(digests)} blocks on its peer "
                               f"after {timeout:.0f} s")
        time.sleep(0.05)


# =============================================================================================
# measuring


def cpu_now(pids: Sequence[int]) -> float:
    own = os.times()
    return own.user + own.system + sum(sum(proc_times(pid)[:2]) for pid in pids)


def run_round(side: Side, batches: list[list[int]], cursor: list[int], seconds: float, min_calls: int,
              warmup: int = 1) -> tuple[list[float], float]:
    """Batches until ``seconds`` of clocked time (and ``min_calls``); returns the durations and the
    CPU seconds this process and the side's servers spent meanwhile (warm-up included)."""
    cpu0 = cpu_now(side.pids)
    for _ in range(warmup):
        side.fetch(batches[cursor[0] % len(batches)])
        cursor[0] += 1
    out: list[float] = []
    wall_limit = time.monotonic() + 5 * seconds + 20
    while (sum(out) < seconds or len(out) < min_calls) and time.monotonic() < wall_limit:
        out.append(side.fetch(batches[cursor[0] % len(batches)]))
        cursor[0] += 1
    return out, cpu_now(side.pids) - cpu0


def interleaved(sides: Sequence[Side], batches: list[list[int]], rounds: int, seconds: float, min_calls: int,
                warmup: int = 1) -> dict[str, dict[str, Any]]:
    cursors = {side.name: [i * 7] for i, side in enumerate(sides)}      # sides start at different batches
    res: dict[str, dict[str, Any]] = {side.name: {"rounds": [], "cpu_s": 0.0, "calls": 0} for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else list(reversed(sides))):
            durations, cpu = run_round(side, batches, cursors[side.name], seconds, min_calls, warmup)
            res[side.name]["rounds"].append(durations)
            res[side.name]["cpu_s"] += cpu
            res[side.name]["calls"] += len(durations) + warmup
    return res


def throughput_rows(size: int, res: dict[str, dict[str, Any]], pull: str, base: str, target: float, case: str,
                    figure: int = 1) -> Row:
    nbytes = size * BATCH
    kv = [len(d) * nbytes / sum(d) / 1e9 for d in res[pull]["rounds"]]
    bl = [len(d) * nbytes / sum(d) / 1e9 for d in res[base]["rounds"]]
    row = Row(figure, case, "GB/s", statistics.median(kv), base, statistics.median(bl), True, f">= {target:g}x",
              details={"kvcached": {"rounds_gbps": kv, "p50_ms": percentile(sum(res[pull]["rounds"], []), 0.5) * 1e3},
                       "baseline": {"rounds_gbps": bl, "p50_ms": percentile(sum(res[base]["rounds"], []), 0.5) * 1e3}},
              paired_ratio=statistics.median(k / b for k, b in zip(kv, bl)))
    row.passed = row.ratio >= target
    return row


def latency_row(size: int, res: dict[str, dict[str, Any]], side: str, base: str, target: float | None,
                case: str) -> Row:
    kv, bl = sum(res[side]["rounds"], []), sum(res[base]["rounds"], [])
    per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(res[side]["rounds"], res[base]["rounds"])]
    row = Row(2, case, "us", percentile(kv, 0.5) * 1e6, base, percentile(bl, 0.5) * 1e6, False,
              f"<= {target:g}x" if target else "",
              details={side: {"p50_us": percentile(x, 0.5) * 1e6, "p90_us": percentile(x, 0.9) * 1e6, "calls": len(x)}
                       for side, x in (("kvcached", kv), ("baseline", bl))},
              paired_ratio=statistics.median(per_round))
    if target:
        row.passed = row.ratio <= target
    return row


def cpu_note(label: str, res: dict[str, dict[str, Any]], nbytes_per_call: int) -> str:
    parts = []
    for name, r in res.items():
        mib = r["calls"] * nbytes_per_call / MiB
        parts.append(f"{name} {r['cpu_s'] * 1e3 / mib:.1f}")
    return f"{label}: CPU ms per MiB moved (this process + the side's servers, warm-ups included): " + ", ".join(parts)


# =============================================================================================
# main


TITLES = {
    1: f"1. Peer pull throughput, {BATCH} blocks a call, loopback, QUIC datagrams of {DATAGRAM} B; GB/s of the "
       "median round",
    2: "2. One block, p50 latency; lower is better",
}


def busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def peer_counters(client: Any) -> dict[str, int]:
    st = client.stats()
    return {k: getattr(st, f"peer_{k}") for k in ("pulled", "pulled_bytes", "missed", "corrupt", "failed", "hedged",
                                                   "served")}


def close_clients(lt: LoopThread, clients: Clients) -> None:
    if lt.loop.is_running():
        with contextlib.suppress(Exception):
            lt.call(clients.close(), 10)


def run(s: Settings) -> tuple[list[Row], list[str], dict[str, Any]]:
    from kvcached.certs import make_cluster
    from kvcached.client import KvCacheClient
    from kvcached_agent.address import BlockAddress

    rows: list[Row] = []
    notes: list[str] = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcbench-peers-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        certs = tmp / "certs"
        certs.mkdir()
        make_cluster(certs, ["node-a", "node-b"])
        payloads = {size: [payload_of(size, i) for i in range(n)] for size, n in s.blocks.items()}
        digests = {size: [digest_of(size, i) for i in range(n)] for size, n in s.blocks.items()}
        total = sum(size * n for size, n in s.blocks.items())
        ram_a = max(0.25, round(total * 2 / (1 << 30), 2))
        port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        progress(f"starting daemons A (RAM {ram_a:g} GiB, UDP {port_a}) and B (UDP {port_b}), the bare aioquic "
                 "server and redis-server")
        proc_a, chan_a = start_daemon(stack, tmp / "a", certs, "node-a", "node-b", port_a, port_b, ram_a)
        proc_b, chan_b = start_daemon(stack, tmp / "b", certs, "node-b", "node-a", port_b, port_a, 0.25)
        procs = [proc_a, proc_b]
        try:
            bare_proc, bare_port = start_bare_server(stack, tmp, certs, s)
            procs.append(bare_proc)
            redis = start_redis_tcp(stack, tmp)
            if isinstance(redis, str):
                progress(f"Redis baseline skipped: {redis}")
                notes.append(f"Redis baseline skipped: {redis}")
                redis_proc = redis_client = None
            else:
                redis_proc, redis_client = redis
                procs.append(redis_proc)
            client_a = KvCacheClient(f"unix:{tmp}/a/kvcached.sock", timeout=120)
            client_b = KvCacheClient(f"unix:{tmp}/b/kvcached.sock", timeout=120)
            stack.callback(client_a.close)
            stack.callback(client_b.close)

            progress(f"putting {', '.join(f'{n} x {size_name(size)}' for size, n in s.blocks.items())} on daemon A"
                     + (" and redis" if redis_client is not None else ""))
            for size, n in s.blocks.items():
                put_blocks(client_a, size, n, payloads[size])
                if redis_client is not None:
                    for i in range(0, n, 16):
                        redis_client.mset({digests[size][j]: payloads[size][j] for j in range(i, min(n, i + 16))})
            everything = [d for size in s.blocks for d in digests[size]]
            seen_s = wait_peer_column(client_b, everything)
            seen = (f"daemon B's Lookup showed all {len(everything)} blocks in its peer column {seen_s:.2f} s "
                    "after the last Put")
            progress(seen)
            notes.append(seen + " on A (announcements)")

            lt = LoopThread()
            clients = Clients(lt)
            stack.callback(lt.close)
            stack.callback(lambda: close_clients(lt, clients))
            lt.call(clients.open_bare(bare_port, certs), 30)
            lt.call(clients.open_tier(port_a, certs), 30)
            clients.announce(everything)

            # every side fetches one batch of each size and brings back the bytes put
            for size in s.blocks:
                idx = list(range(BATCH))
                got, _ = client_b.get([BlockAddress(digests[size][i]) for i in idx])
                if [f.payload for f in got] != [payloads[size][i] for i in idx]:
                    raise RuntimeError(f"daemon B: {size_name(size)} blocks pulled from A are not the bytes put")
                lt.call(clients.bare_batch([wire(digests[size][i]) for i in idx], size))
                if bytes(clients.buffers[size]) != b"".join(payloads[size][i] for i in idx):
                    raise RuntimeError(f"bare aioquic: {size_name(size)} blocks are not the bytes expected")
                clients.buffers[size][:] = bytes(len(clients.buffers[size]))
                lt.call(clients.tier_batch([digests[size][i] for i in idx], size))
                if bytes(clients.buffers[size]) != b"".join(payloads[size][i] for i in idx):
                    raise RuntimeError(f"PeerTier.fetch: {size_name(size)} blocks are not the bytes put")
                if redis_client is not None and redis_client.get(digests[size][0]) != payloads[size][0]:
                    raise RuntimeError("redis: a block is not the bytes put")
            progress("every side brought back the bytes put")

            counters0 = peer_counters(client_b)
            pa, pb = proc_a.proc.pid, proc_b.proc.pid
            busy0, t_run = busy_cpu_s(), time.monotonic()
            mine0 = cpu_now([p.proc.pid for p in procs])
            for size in SIZES:
                d = digests[size]
                n = len(d)
                batches = [list(range(i, i + BATCH)) for i in range(0, n - BATCH + 1, BATCH)]
                sides = [grpc_side("pull: Get on B", chan_b, d, size, [pa, pb]),
                         loop_side("PeerTier.fetch", clients, lambda idx, d=d, size=size: clients.tier_batch(
                             [d[i] for i in idx], size), [pa]),
                         loop_side("bare aioquic", clients, lambda idx, d=d, size=size: clients.bare_batch(
                             [wire(d[i]) for i in idx], size), [bare_proc.proc.pid]),
                         grpc_side("Get on A (RAM, no pull)", chan_a, d, size, [pa], info=True)]
                if redis_client is not None:
                    sides.append(redis_side(redis_client, d, size, redis_proc.proc.pid))
                progress(f"throughput, {size_name(size)} x{BATCH}: {s.rounds} interleaved rounds of {s.seconds:g} s "
                         f"per side ({', '.join(x.name for x in sides)})")
                before = peer_counters(client_b)
                res = interleaved(sides, batches, s.rounds, s.seconds, s.min_calls)
                after = peer_counters(client_b)
                want = res["pull: Get on B"]["calls"] * BATCH
                if after["pulled"] - before["pulled"] != want:
                    raise RuntimeError(f"daemon B pulled {after['pulled'] - before['pulled']} blocks for {want} "
                                       "blocks got: not every Get pulled (is mirror_pulls off?)")
                label = f"{size_name(size)} x{BATCH}"
                got_rows = [throughput_rows(size, res, "pull: Get on B", "bare aioquic", BARE_TARGET, f"pull {label}"),
                            throughput_rows(size, res, "PeerTier.fetch", "bare aioquic", BARE_TARGET,
                                            f"PeerTier.fetch {label}")]
                if redis_client is not None:
                    got_rows.append(throughput_rows(size, res, "pull: Get on B", "redis-py GET", REDIS_TARGET,
                                                    f"pull {label}"))
                    info = throughput_rows(size, res, "bare aioquic", "redis-py GET", REDIS_TARGET,
                                           f"bare aioquic {label}")
                    info.target, info.passed = "", None
                    got_rows.append(info)
                info = throughput_rows(size, res, "pull: Get on B", "Get on A (RAM, no pull)", 0, f"pull {label}")
                info.target, info.passed = "", None
                got_rows.append(info)
                rows += got_rows
                progress(", ".join(f"{r.case} vs {r.baseline_name}: {r.kvcached:.3f} / {r.baseline:.3f} GB/s "
                                   f"({r.ratio:.2f}x)" for r in got_rows[:3]))
                notes.append(cpu_note(label, res, size * BATCH))
                extra[f"throughput {label}"] = {k: {"rounds_s": v["rounds"], "cpu_s": v["cpu_s"]}
                                                for k, v in res.items()}

            for size in SIZES:
                d = digests[size]
                singles = [[i] for i in range(len(d))]
                sides = [grpc_side("pull: Get on B", chan_b, d, size, [pa, pb]),
                         loop_side("PeerTier.fetch", clients, lambda idx, d=d, size=size: clients.tier_batch(
                             [d[i] for i in idx], size), [pa]),
                         loop_side("bare aioquic", clients, lambda idx, d=d, size=size: clients.bare_batch(
                             [wire(d[i]) for i in idx], size), [bare_proc.proc.pid]),
                         grpc_side("Get on A (RAM, no pull)", chan_a, d, size, [pa], info=True)]
                if redis_client is not None:
                    sides.append(redis_side(redis_client, d, size, redis_proc.proc.pid))
                calls = s.lat_calls[size]
                progress(f"latency, one {size_name(size)} block: {s.lat_rounds} rounds x {calls} calls per side")
                res = interleaved(sides, singles, s.lat_rounds, 0.0, calls, warmup=3)
                label = f"1x {size_name(size)}"
                got_rows = [latency_row(size, res, "pull: Get on B", "bare aioquic", LAT_TARGET_GRPC, f"pull {label}"),
                            latency_row(size, res, "PeerTier.fetch", "bare aioquic", LAT_TARGET_TIER,
                                        f"PeerTier.fetch {label}")]
                got_rows.append(latency_row(size, res, "pull: Get on B", "Get on A (RAM, no pull)", None,
                                            f"pull {label}"))
                if redis_client is not None:
                    got_rows.append(latency_row(size, res, "pull: Get on B", "redis-py GET", None, f"pull {label}"))
                rows += got_rows
                progress(", ".join(f"{r.case}: {r.kvcached:.0f} us vs {r.baseline_name} {r.baseline:.0f} us "
                                   f"({r.ratio:.2f}x)" for r in got_rows))
                extra[f"latency {label}"] = {k: {"rounds_s": v["rounds"]} for k, v in res.items()}

            counters1 = peer_counters(client_b)
            delta = {k: counters1[k] - counters0[k] for k in counters1}
            notes.append("daemon B's peer counters over the timed part: "
                         + ", ".join(f"{k} {v}" for k, v in delta.items()))
            if delta["failed"] or delta["missed"] or delta["corrupt"]:
                notes.append("daemon B counted failed, missed or corrupt pulls: see the counters above")
            tier_c = vars(clients.tier.counters)
            notes.append("in-process PeerTier counters: " + ", ".join(f"{k} {v}" for k, v in tier_c.items()))
            wall = time.monotonic() - t_run
            mine = cpu_now([p.proc.pid for p in procs]) - mine0
            other = max(0.0, busy_cpu_s() - busy0 - mine)
            notes.append(f"other processes used about {other:.1f} CPU-s during the {wall:.0f} s measured "
                         f"({other / wall:.0%} of one core)"
                         + ("; the figures are disturbed by them" if other / wall > 0.1 else ""))
        except Exception:
            for p in procs:
                progress(f"{p.name} log, last lines:\n{p.tail(12)}")
            raise
    return rows, notes, extra


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached peer-tier benchmark (figures with same-run baselines)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (about 30-40 s): fewer blocks and rounds")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        return bare_server_main(args)
    s = QUICK if args.quick else FULL
    tuned = tune_client_malloc()
    load = os.getloadavg()[0]
    started = time.time()
    rows, notes, extra = run(s)
    header = (f"kvcached peer benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s, "
              f"load average {load:.2f} at the start\nsettings: two daemons on loopback, RAM only, mirror_pulls off, "
              f"datagrams {DATAGRAM} B, windows {MAX_DATA >> 20} MiB / {MAX_STREAM_DATA >> 20} MiB, "
              f"{', '.join(f'{n} x {size_name(size)}' for size, n in s.blocks.items())} on A, {s.rounds} rounds x "
              f"{s.seconds:g} s, latency {s.lat_rounds} x {'/'.join(map(str, s.lat_calls.values()))} calls; "
              f"client malloc tuned: {tuned}")
    print_table(rows, header, TITLES)
    print("Latency ratio = median over rounds of the p50 ratio within a round.")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        meta = {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                "settings": {**asdict(s), "blocks": {str(k): v for k, v in s.blocks.items()},
                             "lat_calls": {str(k): v for k, v in s.lat_calls.items()}}}
        doc = {"meta": meta, "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "notes": notes, "raw": extra}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        progress(f"wrote {args.json}")
    return 0


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); servers stopped, temp dir removed")
        sys.exit(130)
