"""kvcached peer-tier benchmark: pulls between two real daemons, every figure next to a baseline
measured in the same run on the same machine, at two QUIC datagram sizes, and where the time of
a pull goes.

    python bench/bench_peers.py [--json PATH] [--quick]

Setup: a cluster CA and two node certificates (kvcached.peers.certs.make_cluster, what ``kvcached
certs`` does) in a temp dir; redis-server and the blocks it holds are started and put once for
the whole run. Then, for each datagram size (DATAGRAMS: 1350, the daemon's default
``quic.max_datagram_size``, right for any path with a 1500-byte MTU; 16000, the largest aioquic
takes on loopback), a fresh pair of ``kvcached serve`` subprocesses (bench_core.start_kvcached:
all state in the temp dir, gRPC on a Unix socket) peering over loopback: ``quic.listen`` on free
UDP ports of 127.0.0.1, ``quic.peers`` naming each other, ``quic.max_datagram_size`` of that
size, the default flow-control windows (64 MiB per connection, 16 MiB per stream),
``kv.ssd_gib=0`` (RAM only), ``kv.mirror_pulls=false`` (a pulled block is dropped again once
read, so every Get on B pulls from A again), ``quic.pull_timeout_s=30`` and
``grpc.max_message_mib=96`` (a Get of 64 x 1 MiB is over gRPC's default 64 MiB; this process's
channels take 96 MiB too). Blocks are put on daemon A through gRPC; once daemon B's Lookup shows
all of them in its peer column, B's Gets of them are pulls. Also per datagram size: a bare
aioquic server process and this process's QUIC clients (below) with that datagram size. The
pair, its bare server and the clients are stopped before the next size. Before timing, every
side fetches the first blocks of each size (at most 4 MiB: all 64 of 64 KiB, 4 of 1 MiB) and
must bring back the bytes put.

1. Pull throughput: gRPC Get on daemon B of 64 blocks a call (64 KiB and 1 MiB blocks), every
   block pulled from A over QUIC (B checks each block's BLAKE3 checksum on arrival), one call
   in flight, one blocking grpcio client in this process (no client-side checksum; each answer
   must hold 64 payloads of the block size). B's peer counters must show a pull for every block
   its Gets answered. Baselines, all sending the same bytes:
   - bare aioquic: a server in its own process (this file with ``--bare-server``: aioquic
     ``serve``, uvloop, the node-a certificate, the same datagram size and flow-control
     windows, no kvcached code) holding the same blocks in a dict, and an aioquic client
     (node-b certificate) in this process on a uvloop event loop in a thread: one
     bidirectional stream per call, as a kvcached Pull (the request: the blocks' 36-byte wire
     addresses; the answer: their payloads back to back, written into a preallocated buffer).
     One stream per block would make the baseline slower than it need be: aioquic visits every
     open stream for each packet it builds. Target: pull >= 0.8x bare aioquic.
   - the same pull without gRPC or daemon B: a kvcached.peers.tier.PeerTier in this process
     (on the same event-loop thread, node-b's certificate, a stand-in store that holds nothing)
     connected to daemon A, its directory told that A holds the blocks, timing
     ``PeerTier.fetch`` of 64 blocks (one Pull, one stream) into a preallocated buffer
     (checksums checked, as in the daemon). Target: >= 0.8x bare aioquic.
   - Redis: redis-server (its own process, TCP on 127.0.0.1, ``--save "" --appendonly no``)
     holding the same blocks, read with redis-py GET, one block a call (64 calls a batch). The
     issue's goal is to pass redis-py; the target printed is >= 0.2x (../shared/BASELINES.md
     has bare aioquic at ~0.3x redis-py GET on this kind of machine; 0.7 x 0.3 ~ 0.2). This
     process tunes its heap as bench_core does (tune_client_malloc), which lifts redis-py GET
     of 1 MiB values from ~0.3 to ~1 GB/s here: at 1 MiB even bare aioquic is then far below
     the target, which measures Python QUIC, not the daemon. Skipped, with a line saying so,
     where redis-server or redis-py is missing (``make system-deps`` installs redis-server).
   - also shown, no target: gRPC Get of the same batch on daemon A, where the blocks are in RAM
     (no pull): what the gRPC hop alone costs.
   Interleaved rounds (the sides in order, then reversed). A side's round starts with one
   untimed warm-up call of at most 4 MiB (the whole 64 x 64 KiB batch; 4 of the 1 MiB blocks),
   then runs batches until its clocked time reaches the round length (at least ``min_calls``;
   a 64 x 1 MiB batch at 1350-byte datagrams takes several seconds, so that is one batch).
   Each side's figure is its median round; a ratio is the median over rounds of the two
   sides' ratio within the round.
2. Latency of one 64 KiB block on a warm connection, p50 and p99: gRPC Get on B (pulled from A),
   PeerTier.fetch in this process, against one request of bare aioquic (one stream); also
   shown, no target: the same Get against daemon A, whose RAM holds the block (the gRPC hop
   alone), and redis GET. Interleaved rounds as in figure 1 (three untimed calls first), a
   fixed number of calls per side and round: 5 x 100 per side and datagram size (quick: 3 x 35).
   p50 ratio: the median over rounds of the two sides' p50 ratio within a round. Targets: Get
   on B <= 2x bare aioquic (the gRPC round trip alone costs ~1 ms here, a bare QUIC request
   ~2 ms at 16000-byte datagrams), PeerTier.fetch <= 1.5x. p99 ratio: the p99 of all calls over
   the p99 of all the baseline's calls; no target (on a shared 2-core VM the tail is the
   scheduler's more than the code's).
3. Where the time goes: after the measured figures, daemon A's side is built in this process
   too (a real Store: SharedArena, RamTier with ClockPolicy, BlockIndex in the temp dir, and
   its PeerTier listening with the node-a certificate, wired as the daemon wires them), holding
   64 KiB blocks, and a PeerTier client (listening too, so each side dials the other as daemons
   do) pulls from it, both on the one event-loop thread. Per datagram size, cProfile (enabled
   inside a coroutine on that loop: it profiles one thread) records a number of
   ``PeerTier.fetch`` batches of 64 x 64 KiB, so it sees both ends of a pull. Own time is
   summed into buckets by where the code lives; a C function's own time (pstats file '~') goes
   to its callers' buckets in proportion to the time it spent under each (a checksum by its
   name). uvloop's methods are invisible to cProfile, so sendto and timers count in
   aioquic.asyncio's transmit, which is why aioquic.asyncio is in the event-loop bucket.
   cProfile inflates the cost of every Python call, so the shares are indicative. Printed: the
   buckets, the top functions by own time, the time of a batch with and without the profiler.

Notes printed: CPU time per MiB of each process involved, per side; how a Get on B's median call
splits into the pull alone (PeerTier.fetch), the gRPC hop alone (Get on A) and the rest (daemon
B's own work around the pull); the peer counters of daemon B (pulled, failed, hedged, missed);
how long B took to see A's blocks; how much CPU other processes took during the run.

--lane tls: the daemons and the in-process tiers pull over the TLS lane ([quic] lane = "tls",
kvcached.peers.lane) instead of QUIC; every baseline stays what it is, so the ratios say how the
lane compares with bare aioquic and redis-py. Default: quic (what the figures above describe; the
daemons are given ``quic.lane="quic"``).

--quick: 128 x 64 KiB and 64 x 1 MiB blocks, 1 round of 0.1 s, 3 x 35 single-block calls per
side, 2 profiled batches: about a minute for both datagram sizes. Full: 512 x 64 KiB and 128 x
1 MiB, 5 rounds of 1 s, 5 x 100 calls, 8 profiled batches: about 5 minutes on 2 cores. Most of
either goes to the 1 MiB batches at 1350-byte datagrams. Progress goes to stderr, the table to
stdout. Every process is stopped and the temp dir removed whatever happens (servers run under
``setpriv --pdeathsig``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import hashlib
import json
import os
import platform
import pstats
import random
import signal
import socket
import ssl
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import (  # noqa: E402
    KiB,
    MiB,
    Proc,
    Row,
    fmt,
    percentile,
    print_fitted,
    proc_times,
    progress,
    size_name,
    start_kvcached,
    start_redis,
    tune_client_malloc,
)

SIZES = (64 * KiB, 1 * MiB)
LAT_SIZE = 64 * KiB           # the single-block latency figure and the profile use this block size
BATCH = 64                    # blocks a call; also the bare client's streams in flight
DATAGRAMS = (1350, 16000)     # quic.max_datagram_size: the daemon's default; the largest aioquic takes on loopback
MAX_DATA = 64 << 20           # the daemon's default flow-control windows ([quic] max_data_mib, max_stream_data_mib)
MAX_STREAM_DATA = 16 << 20
MAX_PAYLOAD = 16 << 20        # largest block a PeerTier takes: the daemon's default kv.max_block_mib
MAX_MESSAGE = 96 * MiB        # gRPC message limit of both daemons and this process's channels (64 x 1 MiB + framing)
WARM_BYTES = 4 * MiB          # a throughput round's untimed warm-up call moves at most this
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
    lat_calls: int            # single 64 KiB calls per side per round
    profile_batches: int      # profiled PeerTier.fetch batches of 64 x 64 KiB, per datagram size


LANE = "quic"          # what pulls go over (--lane)

FULL = Settings(blocks={64 * KiB: 512, 1 * MiB: 128}, rounds=5, seconds=1.0, min_calls=1, lat_rounds=5,
                lat_calls=100, profile_batches=8)
QUICK = Settings(blocks={64 * KiB: 128, 1 * MiB: 64}, rounds=1, seconds=0.1, min_calls=1, lat_rounds=3,
                 lat_calls=35, profile_batches=2)


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
    """A free port on 127.0.0.1 of ``kind``; a UDP one is also free for TCP (a daemon's lane
    listens on its QUIC port's number)."""
    while True:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if kind != socket.SOCK_DGRAM:
                return port
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


def quic_config(certs: Path, me: str, datagram: int, *, client: bool) -> Any:
    from aioquic.quic.configuration import QuicConfiguration

    config = QuicConfiguration(is_client=client, alpn_protocols=[ALPN], server_name="node-a" if client else None,
                               cadata=(certs / "ca.pem").read_bytes(), verify_mode=ssl.CERT_REQUIRED,
                               max_datagram_size=datagram, max_data=MAX_DATA, max_stream_data=MAX_STREAM_DATA,
                               idle_timeout=120.0)
    config.load_cert_chain(str(certs / f"{me}.pem"), str(certs / f"{me}-key.pem"))
    return config


def quic_options(datagram: int) -> Any:
    from kvcached.peers.tls import QuicOptions

    return QuicOptions(datagram, MAX_DATA, MAX_STREAM_DATA)


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
        """Answers each stream's 36-byte addresses with the blocks' payloads back to back, then
        ends the stream."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.partial: dict[int, bytes] = {}

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                data = self.partial.pop(event.stream_id, b"") + event.data
                if not event.end_stream:
                    self.partial[event.stream_id] = data
                    return
                for i in range(0, len(data), 36):
                    self._quic.send_stream_data(event.stream_id, blocks.get(data[i:i + 36], b""))
                self._quic.send_stream_data(event.stream_id, b"", end_stream=True)
                self.transmit()

    async def run() -> None:
        config = quic_config(Path(args.certs), "node-a", args.datagram, client=False)
        await serve("127.0.0.1", args.port, configuration=config, create_protocol=BareServer)
        Path(args.ready).write_text("ready\n")
        await asyncio.Event().wait()

    loop = new_loop()
    asyncio.set_event_loop(loop)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    with contextlib.suppress(RuntimeError):
        loop.run_until_complete(run())
    return 0


# =============================================================================================
# this process's QUIC clients (and, for the profile, a server side): on one event loop in a thread


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
        """One stream per call: the request is the blocks' addresses, the answer (their payloads
        back to back) lands in ``view``."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.waiting: dict[int, list[Any]] = {}      # stream -> [future, view, bytes in]

        async def fetch(self, addresses: Sequence[bytes], view: memoryview) -> int:
            sid = self._quic.get_next_available_stream_id()
            future = asyncio.get_running_loop().create_future()
            self.waiting[sid] = [future, view, 0]
            self._quic.send_stream_data(sid, b"".join(addresses), end_stream=True)
            self.transmit()
            return int(await future)

        def quic_event_received(self, event: Any) -> None:
            if isinstance(event, events.StreamDataReceived):
                w = self.waiting.get(event.stream_id)
                if w is None:
                    return
                n = len(event.data)
                if w[2] + n > len(w[1]):
                    del self.waiting[event.stream_id]
                    w[0].set_exception(RuntimeError(f"bare server: more than the {len(w[1])} bytes asked for"))
                    return
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


class _StubStore:
    """What PeerTier asks of a store (kvcached.peers.store_link.StoreLink) while it only pulls:
    nothing held, nothing served."""

    def present_wire_keys(self) -> list[bytes]:
        return []

    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int:
        return 0

    async def pin(self, addresses: Sequence[Any], *, allow_partial: bool = False, peers: bool = True) -> list[Any]:
        raise RuntimeError("this stub serves no pulls")

    def unpin(self, pinned: Any) -> None:
        pass

    def owners(self, keys: list[bytes]) -> list[tuple[str, str] | None]:
        return [None] * len(keys)

    def view(self, block: Any) -> memoryview:
        raise RuntimeError("this stub holds no blocks")


@dataclass
class Clients:
    """The QUIC clients in this process, on ``lt``'s loop, all with QUIC datagrams of ``datagram``."""

    lt: LoopThread
    datagram: int
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
            "127.0.0.1", port, configuration=quic_config(certs, "node-b", self.datagram, client=True),
            create_protocol=make_bare_client_class())), 20)
        self.bare_stack = stack

    async def bare_batch(self, addresses: Sequence[bytes], size: int) -> float:
        self.views(size, 1)
        view = memoryview(self.buffers[size])[:size * len(addresses)]
        t0 = time.perf_counter()
        got = await self.bare.fetch(addresses, view)
        dt = time.perf_counter() - t0
        if got != size * len(addresses):
            raise RuntimeError(f"bare aioquic: an answer of {got} bytes, expected {size * len(addresses)}")
        return dt

    # -- PeerTier --

    async def open_tier(self, port_a: int, certs: Path, listen: int | None = None) -> None:
        """A PeerTier with node-b's certificate, connected to the node-a listening on ``port_a``;
        with ``listen``, its own server listens there (as a daemon's: node-a dials it back)."""
        from kvcached.peers.tier import PeerSettings, PeerTier
        from kvcached.peers.tls import PeerAuth

        auth = PeerAuth.from_files(str(certs / "ca.pem"), str(certs / "node-b.pem"), str(certs / "node-b-key.pem"),
                                   ["node-a"])
        # max_payload is per block (the Pull of a 64-block fetch carries it once): the daemon's 16 MiB
        settings = PeerSettings(listen=None if listen is None else ("127.0.0.1", listen),
                                peers={"node-a": ("127.0.0.1", port_a)},
                                options=quic_options(self.datagram), pull_timeout_s=30.0, hedge_s=0.05,
                                max_payload=MAX_PAYLOAD, lane=LANE)
        self.tier = PeerTier(_StubStore(), auth, settings)
        await self.tier.start()
        deadline = time.monotonic() + 20
        while not (self.tier.links["node-a"].client is not None and self.tier.links["node-a"].client.verified):
            if time.monotonic() > deadline:
                raise RuntimeError(f"in-process PeerTier did not connect to node-a: {self.tier.stats()}")
            await asyncio.sleep(0.02)

    def announce(self, digests: Sequence[bytes]) -> None:
        """Tell the tier's directory that A holds these (what A's snapshot says to daemon B)."""
        self.tier.locator.directory.announce("node-a", [wire(d) for d in digests])

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


class ServingNode:
    """Daemon A's side in this process, for the profile: a real Store (memfd arena, RAM tier,
    RocksDB index) and, while ``serve`` is on, its PeerTier listening with node-a's certificate.
    Every method but ``close`` runs on the loop thread."""

    SLAB = 1 * MiB

    def __init__(self, root: Path, nbytes: int) -> None:
        from kvcached.index import BlockIndex
        from kvcached.policies.clock import ClockPolicy
        from kvcached.store import Store
        from kvcached.tiers.arena import SharedArena
        from kvcached.tiers.ram import RamTier

        self.arena = SharedArena(2 * nbytes + 2 * self.SLAB, name="kvcbench-peers-profile")
        self.ram = RamTier(self.arena, self.SLAB, ClockPolicy())
        self.index = BlockIndex(root / "profile-index")
        self.store = Store(self.ram, self.index)
        self.tier: Any = None

    async def put(self, digests: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        from kvcached.store import PutItem
        from kvcached_agent.address import BlockAddress

        for i in range(0, len(digests), BATCH):
            items = [PutItem(BlockAddress(d), p, model="bench/peers")
                     for d, p in zip(digests[i:i + BATCH], payloads[i:i + BATCH])]
            result = await self.store.put(items)
            if result.stored + result.present != len(items):
                raise RuntimeError(f"the in-process store stored {result.stored} of {len(items)} blocks")

    async def serve(self, certs: Path, port: int, port_b: int, datagram: int) -> None:
        """Listen on ``port``, with node-b (listening on ``port_b``) as the one peer, as daemon A."""
        from kvcached.peers.tier import PeerSettings, PeerTier
        from kvcached.peers.tls import PeerAuth

        auth = PeerAuth.from_files(str(certs / "ca.pem"), str(certs / "node-a.pem"), str(certs / "node-a-key.pem"),
                                   ["node-b"])
        settings = PeerSettings(listen=("127.0.0.1", port), peers={"node-b": ("127.0.0.1", port_b)},
                                options=quic_options(datagram), pull_timeout_s=30.0, max_payload=MAX_PAYLOAD,
                                lane=LANE)
        self.tier = PeerTier(self.store, auth, settings)
        await self.tier.start()
        self.store.peers = self.tier              # wired as daemon._start_peers does
        self.index.presence = self.tier.presence

    async def stop_serving(self) -> None:
        if self.tier is not None:
            self.index.presence = None
            self.store.peers = None
            await self.tier.stop()
            self.tier = None
            await asyncio.sleep(0.05)             # let the closes go out

    def close(self) -> None:
        self.index.close()
        gc.collect()                              # arena slices kept alive by finished tasks
        with contextlib.suppress(BufferError):
            self.arena.close()


# =============================================================================================
# sides: one way each to fetch a batch; each returns the seconds of the fetch only


@dataclass
class Side:
    name: str
    fetch: Callable[[Sequence[int]], float]       # block indices -> seconds
    pids: Sequence[int]                           # server processes whose CPU time counts for it


def grpc_side(name: str, channel: Any, digests: Sequence[bytes], size: int, pids: Sequence[int]) -> Side:
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

    return Side(name, fetch, pids)


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


@dataclass
class Common:
    """What every datagram size's part of the run shares."""

    s: Settings
    tmp: Path
    certs: Path
    digests: dict[int, list[bytes]]
    payloads: dict[int, list[bytes]]
    lt: LoopThread
    redis_proc: Proc | None
    redis_client: Any
    procs: list[Proc]                    # every server started, for their logs if something fails


@dataclass
class Pair:
    """Daemons A (holds the blocks) and B (pulls), the bare server and the clients of one datagram size."""

    datagram: int
    proc_a: Proc
    proc_b: Proc
    chan_a: Any
    chan_b: Any
    client_b: Any
    bare_proc: Proc
    clients: Clients


def start_daemon(stack: contextlib.ExitStack, tmp: Path, certs: Path, me: str, peer: str, listen: int,
                 peer_port: int, ram_gib: float, datagram: int, extra: Sequence[str] = ()) -> tuple[Proc, Any]:
    tmp.mkdir()
    sets = ["kv.ssd_gib=0", 'kv.write_policy="write_back"', "kv.mirror_pulls=false",
            f"grpc.max_message_mib={MAX_MESSAGE // MiB}",
            f'quic.listen="127.0.0.1:{listen}"',
            f'quic.peers=[{{ name = "{peer}", address = "127.0.0.1:{peer_port}" }}]',
            f'quic.ca="{certs / "ca.pem"}"', f'quic.cert="{certs / f"{me}.pem"}"',
            f'quic.key="{certs / f"{me}-key.pem"}"',
            f"quic.max_datagram_size={datagram}", f"quic.max_data_mib={MAX_DATA / MiB:g}",
            f"quic.max_stream_data_mib={MAX_STREAM_DATA / MiB:g}", "quic.pull_timeout_s=30", f'quic.lane="{LANE}"',
            *extra]
    return start_kvcached(stack, tmp, ram_gib, sets, max_message=MAX_MESSAGE)


def start_bare_server(stack: contextlib.ExitStack, tmp: Path, certs: Path, s: Settings,
                      datagram: int) -> tuple[Proc, int]:
    port = free_port(socket.SOCK_DGRAM)
    ready = tmp / f"bare-{datagram}.ready"
    spec = ",".join(f"{size}:{n}" for size, n in s.blocks.items())
    proc = Proc(f"bare aioquic server (dgram {datagram})",
                [sys.executable, str(Path(__file__).resolve()), "--bare-server", "--port", str(port), "--certs",
                 str(certs), "--blocks", spec, "--datagram", str(datagram), "--ready", str(ready)],
                cwd=tmp, log=tmp / f"bare-{datagram}.log")
    stack.callback(proc.stop)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"bare aioquic server not up:\n{proc.tail()}")
        time.sleep(0.05)
    return proc, port


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


def start_pair(c: Common, stack: contextlib.ExitStack, datagram: int) -> tuple[Pair, str]:
    """Daemons A and B, the bare server and the clients of one datagram size, the blocks on A and
    seen by B; the pair is stopped when ``stack`` closes. Also says how long B took to see them."""
    from kvcached.client import KvCacheClient

    s, tmp = c.s, c.tmp
    total = sum(size * n for size, n in s.blocks.items())
    ram_a = max(0.25, round(total * 2 / (1 << 30), 2))
    ram_b = max(0.25, round(2 * BATCH * max(SIZES) / (1 << 30), 2))
    port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    progress(f"dgram {datagram}: starting daemons A (RAM {ram_a:g} GiB, UDP {port_a}) and B (UDP {port_b}) "
             "and the bare aioquic server")
    proc_a, chan_a = start_daemon(stack, tmp / f"a-{datagram}", c.certs, "node-a", "node-b", port_a, port_b,
                                  ram_a, datagram)
    c.procs.append(proc_a)
    proc_b, chan_b = start_daemon(stack, tmp / f"b-{datagram}", c.certs, "node-b", "node-a", port_b, port_a,
                                  ram_b, datagram)
    c.procs.append(proc_b)
    bare_proc, bare_port = start_bare_server(stack, tmp, c.certs, s, datagram)
    c.procs.append(bare_proc)
    client_a = KvCacheClient(f"unix:{tmp}/a-{datagram}/kvcached.sock", max_message_mib=MAX_MESSAGE // MiB,
                             timeout=120)
    client_b = KvCacheClient(f"unix:{tmp}/b-{datagram}/kvcached.sock", max_message_mib=MAX_MESSAGE // MiB,
                             timeout=120)
    stack.callback(client_a.close)
    stack.callback(client_b.close)
    progress(f"dgram {datagram}: putting {', '.join(f'{n} x {size_name(size)}' for size, n in s.blocks.items())} "
             "on daemon A")
    for size, n in s.blocks.items():
        put_blocks(client_a, size, n, c.payloads[size])
    everything = [d for size in s.blocks for d in c.digests[size]]
    seen_s = wait_peer_column(client_b, everything)
    seen = (f"dgram {datagram}: daemon B's Lookup showed all {len(everything)} blocks in its peer column "
            f"{seen_s:.2f} s after the last Put on A")
    progress(seen)
    clients = Clients(c.lt, datagram)
    stack.callback(lambda: close_clients(c.lt, clients))       # closed before the daemons stop
    c.lt.call(clients.open_bare(bare_port, c.certs), 30)
    c.lt.call(clients.open_tier(port_a, c.certs), 30)
    clients.announce(everything)
    return Pair(datagram, proc_a, proc_b, chan_a, chan_b, client_b, bare_proc, clients), seen


def check_bytes(c: Common, pair: Pair) -> None:
    """Every side fetches the first blocks of each size, at most 4 MiB (all 64 of 64 KiB, 4 of
    1 MiB: a 64 MiB call at 1350-byte datagrams takes seconds), and brings back the bytes put."""
    from kvcached_agent.address import BlockAddress

    clients = pair.clients
    for size in SIZES:
        idx = list(range(warm_blocks(size)))
        want = b"".join(c.payloads[size][i] for i in idx)
        got, _ = pair.client_b.get([BlockAddress(c.digests[size][i]) for i in idx])
        if b"".join(f.payload for f in got) != want:
            raise RuntimeError(f"daemon B: {size_name(size)} blocks pulled from A are not the bytes put")
        del got
        c.lt.call(clients.bare_batch([wire(c.digests[size][i]) for i in idx], size))
        if clients.buffers[size][:len(want)] != want:
            raise RuntimeError(f"bare aioquic: {size_name(size)} blocks are not the bytes expected")
        clients.buffers[size][:] = bytes(len(clients.buffers[size]))
        c.lt.call(clients.tier_batch([c.digests[size][i] for i in idx], size))
        if clients.buffers[size][:len(want)] != want:
            raise RuntimeError(f"PeerTier.fetch: {size_name(size)} blocks are not the bytes put")
        if c.redis_client is not None and c.redis_client.get(c.digests[size][0]) != c.payloads[size][0]:
            raise RuntimeError("redis: a block is not the bytes put")


def make_sides(c: Common, pair: Pair, size: int) -> list[Side]:
    d, clients = c.digests[size], pair.clients
    pa, pb = pair.proc_a.proc.pid, pair.proc_b.proc.pid
    sides = [grpc_side("pull: Get on B", pair.chan_b, d, size, [pa, pb]),
             loop_side("PeerTier.fetch", clients, lambda idx: clients.tier_batch([d[i] for i in idx], size), [pa]),
             loop_side("bare aioquic", clients, lambda idx: clients.bare_batch([wire(d[i]) for i in idx], size),
                       [pair.bare_proc.proc.pid]),
             grpc_side("Get on A (RAM, no pull)", pair.chan_a, d, size, [pa])]
    if c.redis_client is not None and c.redis_proc is not None:
        sides.append(redis_side(c.redis_client, d, size, c.redis_proc.proc.pid))
    return sides


# =============================================================================================
# measuring


def warm_blocks(size: int) -> int:
    """Blocks of a warm-up (or check) call: at most WARM_BYTES, at most a batch."""
    return max(1, min(BATCH, WARM_BYTES // size))


def cpu_now(pids: Sequence[int]) -> float:
    own = os.times()
    return own.user + own.system + sum(sum(proc_times(pid)[:2]) for pid in pids)


def busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def run_round(side: Side, batches: list[list[int]], cursor: list[int], seconds: float, min_calls: int,
              warmup: int, warm_blocks: int) -> tuple[list[float], float, int]:
    """``warmup`` untimed calls of the first ``warm_blocks`` blocks of a batch, then batches until
    ``seconds`` of clocked time (and ``min_calls``); returns the timed durations, the CPU seconds
    this process and the side's servers spent meanwhile, and the blocks fetched (warm-ups included)."""
    cpu0 = cpu_now(side.pids)
    fetched = 0
    for _ in range(warmup):
        idx = batches[cursor[0] % len(batches)][:warm_blocks]
        side.fetch(idx)
        fetched += len(idx)
        cursor[0] += 1
    out: list[float] = []
    wall_limit = time.monotonic() + 5 * seconds + 30
    while (sum(out) < seconds or len(out) < min_calls) and time.monotonic() < wall_limit:
        idx = batches[cursor[0] % len(batches)]
        out.append(side.fetch(idx))
        fetched += len(idx)
        cursor[0] += 1
    return out, cpu_now(side.pids) - cpu0, fetched


def interleaved(sides: Sequence[Side], batches: list[list[int]], rounds: int, seconds: float, min_calls: int,
                warmup: int = 1, warm_blocks: int = BATCH) -> dict[str, dict[str, Any]]:
    cursors = {side.name: [i * 7] for i, side in enumerate(sides)}      # sides start at different batches
    res: dict[str, dict[str, Any]] = {side.name: {"rounds": [], "cpu_s": 0.0, "blocks": 0} for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else list(reversed(sides))):
            durations, cpu, fetched = run_round(side, batches, cursors[side.name], seconds, min_calls, warmup,
                                                warm_blocks)
            res[side.name]["rounds"].append(durations)
            res[side.name]["cpu_s"] += cpu
            res[side.name]["blocks"] += fetched
    return res


def throughput_row(size: int, res: dict[str, dict[str, Any]], side: str, base: str, target: float | None,
                   case: str) -> Row:
    nbytes = size * BATCH
    kv = [len(d) * nbytes / sum(d) / 1e9 for d in res[side]["rounds"]]
    bl = [len(d) * nbytes / sum(d) / 1e9 for d in res[base]["rounds"]]
    row = Row(1, case, "GB/s", statistics.median(kv), base, statistics.median(bl), True,
              f">= {target:g}x" if target else "",
              details={"kvcached": {"rounds_gbps": kv, "p50_ms": percentile(sum(res[side]["rounds"], []), 0.5) * 1e3},
                       "baseline": {"rounds_gbps": bl, "p50_ms": percentile(sum(res[base]["rounds"], []), 0.5) * 1e3}},
              paired_ratio=statistics.median(k / b for k, b in zip(kv, bl)))
    if target:
        row.passed = row.ratio >= target
    return row


def latency_row(res: dict[str, dict[str, Any]], side: str, base: str, q: float, target: float | None,
                case: str) -> Row:
    """p50 (q 0.5): the ratio is the median over rounds of the p50 ratio within a round; other
    quantiles: the quantile of all calls over the baseline's."""
    kv, bl = sum(res[side]["rounds"], []), sum(res[base]["rounds"], [])
    paired = None
    if q == 0.5:
        paired = statistics.median(statistics.median(a) / statistics.median(b)
                                   for a, b in zip(res[side]["rounds"], res[base]["rounds"]))
    row = Row(2, case, "us", percentile(kv, q) * 1e6, base, percentile(bl, q) * 1e6, False,
              f"<= {target:g}x" if target else "",
              details={who: {"p50_us": percentile(x, 0.5) * 1e6, "p90_us": percentile(x, 0.9) * 1e6,
                             "p99_us": percentile(x, 0.99) * 1e6, "calls": len(x)}
                       for who, x in (("kvcached", kv), ("baseline", bl))},
              paired_ratio=paired)
    if target:
        row.passed = row.ratio <= target
    return row


def cpu_note(label: str, res: dict[str, dict[str, Any]], size: int) -> str:
    parts = []
    for name, r in res.items():
        mib = r["blocks"] * size / MiB
        parts.append(f"{name} {r['cpu_s'] * 1e3 / mib:.1f}")
    return f"{label}: CPU ms per MiB moved (this process + the side's servers, warm-ups included): " + ", ".join(parts)


def split_note(label: str, res: dict[str, dict[str, Any]], unit: str, scale: float) -> str:
    """How a Get on B's median call splits: the pull alone (PeerTier.fetch in this process), the
    gRPC hop alone (Get on A, from RAM), and what is left: daemon B's own work around the pull."""
    med = {k: statistics.median(sum(v["rounds"], [])) * scale for k, v in res.items()}
    get_b, fetch, hop = med["pull: Get on B"], med["PeerTier.fetch"], med["Get on A (RAM, no pull)"]
    return (f"{label}: a Get on B takes {get_b:.0f} {unit} (median call) = PeerTier.fetch {fetch:.0f} + the gRPC hop "
            f"(Get on A) {hop:.0f} {'+' if get_b >= fetch + hop else '-'} {abs(get_b - fetch - hop):.0f} {unit} "
            f"(daemon B's own work around the pull; within the noise where small or negative); bare aioquic "
            f"{med['bare aioquic']:.0f} {unit}")


def check_pulled(client_b: Any, before: dict[str, int], res: dict[str, dict[str, Any]]) -> None:
    """Daemon B pulled every block its Gets answered (mirror_pulls off: nothing was kept from before)."""
    pulled = peer_counters(client_b)["pulled"] - before["pulled"]
    want = res["pull: Get on B"]["blocks"]
    if pulled != want:
        raise RuntimeError(f"daemon B pulled {pulled} blocks for {want} blocks got: not every Get pulled "
                           "(is mirror_pulls off?)")


def bench_throughput(c: Common, pair: Pair, size: int) -> tuple[list[Row], list[str], dict[str, Any]]:
    s = c.s
    n = len(c.digests[size])
    batches = [list(range(i, i + BATCH)) for i in range(0, n - BATCH + 1, BATCH)]
    sides = make_sides(c, pair, size)
    label = f"{size_name(size)} x{BATCH}, dgram {pair.datagram}"
    progress(f"throughput, {label}: {s.rounds} interleaved rounds of {s.seconds:g} s per side "
             f"({', '.join(x.name for x in sides)})")
    before = peer_counters(pair.client_b)
    res = interleaved(sides, batches, s.rounds, s.seconds, s.min_calls, warm_blocks=warm_blocks(size))
    check_pulled(pair.client_b, before, res)
    rows = [throughput_row(size, res, "pull: Get on B", "bare aioquic", BARE_TARGET, f"pull {label}"),
            throughput_row(size, res, "PeerTier.fetch", "bare aioquic", BARE_TARGET, f"PeerTier.fetch {label}")]
    if "redis-py GET" in res:
        rows += [throughput_row(size, res, "pull: Get on B", "redis-py GET", REDIS_TARGET, f"pull {label}"),
                 throughput_row(size, res, "bare aioquic", "redis-py GET", None, f"bare aioquic {label}")]
    rows.append(throughput_row(size, res, "pull: Get on B", "Get on A (RAM, no pull)", None, f"pull {label}"))
    progress(", ".join(f"{r.case} vs {r.baseline_name}: {r.kvcached:.3f} / {r.baseline:.3f} GB/s ({r.ratio:.2f}x)"
                       for r in rows[:3]))
    raw = {k: {"rounds_s": v["rounds"], "cpu_s": v["cpu_s"], "blocks": v["blocks"]} for k, v in res.items()}
    return rows, [cpu_note(label, res, size), split_note(label, res, "ms", 1e3)], raw


def bench_latency(c: Common, pair: Pair) -> tuple[list[Row], list[str], dict[str, Any]]:
    s, size = c.s, LAT_SIZE
    singles = [[i] for i in range(len(c.digests[size]))]
    sides = make_sides(c, pair, size)
    progress(f"latency, one {size_name(size)} block, dgram {pair.datagram}: {s.lat_rounds} rounds x {s.lat_calls} "
             "calls per side")
    before = peer_counters(pair.client_b)
    res = interleaved(sides, singles, s.lat_rounds, 0.0, s.lat_calls, warmup=3, warm_blocks=1)
    check_pulled(pair.client_b, before, res)
    rows: list[Row] = []
    for q, tag in ((0.5, "p50"), (0.99, "p99")):
        label = f"1x {size_name(size)} {tag}, dgram {pair.datagram}"
        rows += [latency_row(res, "pull: Get on B", "bare aioquic", q, LAT_TARGET_GRPC if q == 0.5 else None,
                             f"pull {label}"),
                 latency_row(res, "PeerTier.fetch", "bare aioquic", q, LAT_TARGET_TIER if q == 0.5 else None,
                             f"PeerTier.fetch {label}"),
                 latency_row(res, "pull: Get on B", "Get on A (RAM, no pull)", q, None, f"pull {label}")]
        if "redis-py GET" in res:
            rows.append(latency_row(res, "pull: Get on B", "redis-py GET", q, None, f"pull {label}"))
    progress(", ".join(f"{r.case}: {r.kvcached:.0f} us vs {r.baseline_name} {r.baseline:.0f} us ({r.ratio:.2f}x)"
                       for r in rows if r.baseline_name == "bare aioquic"))
    note = split_note(f"1x {size_name(size)}, dgram {pair.datagram}", res, "us", 1e6)
    return rows, [note], {k: {"rounds_s": v["rounds"]} for k, v in res.items()}


def peer_counters(client: Any) -> dict[str, int]:
    st = client.stats()
    return {k: getattr(st, f"peer_{k}") for k in ("pulled", "pulled_bytes", "missed", "corrupt", "failed", "hedged",
                                                   "served")}


def close_clients(lt: LoopThread, clients: Clients) -> None:
    if lt.loop.is_running():
        with contextlib.suppress(Exception):
            lt.call(clients.close(), 10)


def bench_datagram(c: Common, datagram: int) -> tuple[list[Row], list[str], dict[str, Any], float, float]:
    """Figures 1 and 2 at one datagram size, on a fresh pair of daemons stopped at the end.
    Also returns the wall seconds measured and the CPU seconds other processes took meanwhile."""
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        pair, seen = start_pair(c, stack, datagram)
        notes = [seen]
        check_bytes(c, pair)
        progress(f"dgram {datagram}: every side brought back the bytes put")
        pids = [p.proc.pid for p in (pair.proc_a, pair.proc_b, pair.bare_proc, c.redis_proc) if p is not None]
        counters0 = peer_counters(pair.client_b)
        busy0, mine0, t_run = busy_cpu_s(), cpu_now(pids), time.monotonic()
        for size in SIZES:
            got, cpu, raw = bench_throughput(c, pair, size)
            rows += got
            notes += cpu
            extra[f"throughput {size_name(size)} x{BATCH}, dgram {datagram}"] = raw
        got, more, raw = bench_latency(c, pair)
        rows += got
        notes += more
        extra[f"latency 1x {size_name(LAT_SIZE)}, dgram {datagram}"] = raw
        counters1 = peer_counters(pair.client_b)
        wall = time.monotonic() - t_run
        other = max(0.0, busy_cpu_s() - busy0 - (cpu_now(pids) - mine0))
        delta = {k: counters1[k] - counters0[k] for k in counters1}
        notes.append(f"dgram {datagram}: daemon B's peer counters over the timed part: "
                     + ", ".join(f"{k} {v}" for k, v in delta.items()))
        if delta["failed"] or delta["missed"] or delta["corrupt"]:
            notes.append(f"dgram {datagram}: daemon B counted failed, missed or corrupt pulls: see the counters above")
        tier_c = vars(pair.clients.tier.counters)
        notes.append(f"dgram {datagram}: in-process PeerTier counters: "
                     + ", ".join(f"{k} {v}" for k, v in tier_c.items() if not k.startswith("served")))
        progress(f"dgram {datagram}: stopping the pair")
    return rows, notes, extra, wall, other


# =============================================================================================
# figure 3: where a pull's time goes (cProfile of both ends in this process)


CRYPTO = "QUIC packet protection (aioquic crypto / AEAD)"
QUIC = "QUIC framing, streams, ACKs, recovery (aioquic.quic.*)"
PEER = "kvcached peer code (kvcached.peers.*)"
STORE = "store / RAM tier / index (kvcached.store, kvcached.tiers.*)"
BLAKE3 = "BLAKE3 checksums"
LOOP = "UDP send/receive + event loop (uvloop, asyncio, aioquic.asyncio)"
HARNESS = "this benchmark's fetch harness"
OTHER = "other"
BUCKETS = (CRYPTO, QUIC, PEER, STORE, BLAKE3, LOOP, HARNESS, OTHER)
Func = tuple[str, int, str]          # pstats' (file, line, name); file '~' for a C function


def bucket_of(func: Func) -> str | None:
    """The bucket of a function by where it lives; None for a C function its callers answer for."""
    path, _, name = func
    if path == "~":
        if "blake3" in name:
            return BLAKE3
        if any(word in name for word in ("uvloop", "sendto", "recvfrom", "_socket", "epoll", "select")):
            return LOOP
        return None
    path = path.replace("\\", "/")
    if any(part in path for part in ("/aioquic/_crypto.py", "/aioquic/quic/crypto.py", "/cryptography/")):
        return CRYPTO
    if "/aioquic/asyncio/" in path:
        return LOOP           # its own time is mostly uvloop calls cProfile does not see (sendto, timers)
    if "/aioquic/" in path:
        return QUIC
    if "/kvcached_agent/integrity" in path or "/blake3" in path:
        return BLAKE3
    if "/kvcached/peers/" in path or "/kvcached_agent/" in path:
        return PEER
    if "/kvcached/" in path:
        return STORE
    if any(part in path for part in ("/asyncio/", "uvloop", "/socket.py", "/selectors.py")):
        return LOOP
    if path == str(Path(__file__).resolve()) or path.endswith("/bench_peers.py"):
        return HARNESS
    return OTHER


def bucket_times(stats: dict[Func, Any]) -> dict[str, float]:
    """Own time per bucket; a C function's own time is shared among its callers' buckets in
    proportion to the time it spent under each (call counts where no time was recorded)."""
    shares: dict[Func, dict[str, float]] = {}

    def share(func: Func, depth: int) -> dict[str, float]:
        direct = bucket_of(func)
        if direct is not None:
            return {direct: 1.0}
        if func in shares:
            return shares[func]
        shares[func] = {OTHER: 1.0}            # a cycle of C callers ends here
        entry = stats.get(func)
        callers = entry[4] if entry is not None and depth < 30 else {}
        weights = {caller: v[2] for caller, v in callers.items()}
        if sum(weights.values()) <= 0:
            weights = {caller: v[0] for caller, v in callers.items()}
        total = sum(weights.values())
        out: dict[str, float] = defaultdict(float)
        for caller, w in weights.items():
            for bucket, f in share(caller, depth + 1).items():
                out[bucket] += f * w / total
        shares[func] = dict(out) or {OTHER: 1.0}
        return shares[func]

    times = dict.fromkeys(BUCKETS, 0.0)
    for func, (_, _, own, _, _) in stats.items():
        for bucket, f in share(func, 0).items():
            times[bucket] += own * f
    return times


def func_name(func: Func) -> str:
    """``package/module.py:line name``: the path below site-packages or the repository."""
    path, line, name = func
    if path == "~":
        return name
    for root in ("/site-packages/", f"{ROOT}/", f"{sysconfig.get_paths()['stdlib']}/"):
        if root in path:
            path = path.split(root, 1)[1]
            break
    return f"{path}:{line} {name}"


def top_functions(stats: dict[Func, Any], total: float, n: int = 8) -> list[dict[str, Any]]:
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": func_name(func), "own_share": v[2] / total, "own_s": v[2], "calls": v[1],
             "bucket": bucket_of(func) or "(C, by callers)"} for func, v in ranked]


async def profiled_fetches(clients: Clients, batches: list[list[bytes]], size: int) -> tuple[cProfile.Profile, float]:
    """``batches`` fetched under cProfile; runs on the loop thread, where both ends of the pull run."""
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    try:
        for digests in batches:
            await clients.tier_batch(digests, size)
    finally:
        profile.disable()
    return profile, time.perf_counter() - t0


def profile_datagram(c: Common, node: ServingNode, datagram: int, digests: list[bytes]) -> dict[str, Any]:
    """Fetches of 64 x 64 KiB from the in-process node at ``datagram``: a few unprofiled, then
    ``profile_batches`` under cProfile. Returns the buckets and top functions."""
    size, lt = LAT_SIZE, c.lt
    batches = [digests[i:i + BATCH] for i in range(0, len(digests) - BATCH + 1, BATCH)]
    port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    clients = Clients(lt, datagram)
    lt.call(node.serve(c.certs, port_a, port_b, datagram), 30)
    try:
        lt.call(clients.open_tier(port_a, c.certs, listen=port_b), 30)
        clients.announce(digests)
        plain = [lt.call(clients.tier_batch(batches[i % len(batches)], size)) for i in range(max(3, len(batches)))]
        last = (len(plain) - 1) % len(batches) * BATCH
        if clients.buffers[size] != b"".join(c.payloads[size][last:last + BATCH]):
            raise RuntimeError("the in-process pull did not bring back the bytes put")
        todo = [batches[i % len(batches)] for i in range(c.s.profile_batches)]
        profile, wall = lt.call(profiled_fetches(clients, todo, size), 600)
    finally:
        close_clients(lt, clients)
        lt.call(node.stop_serving(), 10)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    buckets = bucket_times(stats)
    total = sum(buckets.values())
    return {"batches": len(todo), "ms_per_batch_profiled": wall / len(todo) * 1e3,
            "ms_per_batch": statistics.median(plain[1:]) * 1e3, "profiled_share_of_wall": total / wall,
            "buckets": {b: t / total for b, t in buckets.items()}, "top": top_functions(stats, total)}


def bench_profile(c: Common) -> dict[int, dict[str, Any]]:
    size = LAT_SIZE
    n = min(len(c.digests[size]), 4 * BATCH)
    digests = c.digests[size][:n]
    progress(f"profile: a Store and PeerTier serving {n} x {size_name(size)} in this process, "
             f"{c.s.profile_batches} PeerTier.fetch batches of {BATCH} under cProfile per datagram size")
    node = ServingNode(c.tmp, n * size)
    try:
        c.lt.call(node.put(digests, c.payloads[size][:n]), 60)
        out = {}
        for datagram in DATAGRAMS:
            out[datagram] = profile_datagram(c, node, datagram, digests)
            p = out[datagram]
            progress(f"profile, dgram {datagram}: {p['ms_per_batch_profiled']:.0f} ms a batch profiled "
                     f"({p['ms_per_batch']:.0f} ms without); " + ", ".join(
                         f"{b.split(' (')[0]} {f:.0%}" for b, f in p["buckets"].items() if f >= 0.05))
    finally:
        if c.lt.loop.is_running():
            with contextlib.suppress(Exception):
                c.lt.call(node.stop_serving(), 10)
        node.close()
    return out


def print_profile(profiles: dict[int, dict[str, Any]]) -> None:
    datagrams = sorted(profiles)
    print(f"3. Where a pull's time goes (cProfile of PeerTier.fetch, {BATCH} x {size_name(LAT_SIZE)}, client and "
          "serving Store + PeerTier in one process on one event loop)")
    width = max(len(b) for b in BUCKETS) + 4
    print("  " + "share of profiled time".ljust(width) + "".join(f"dgram {d}".ljust(14) for d in datagrams).rstrip())
    for bucket in BUCKETS:
        print("  " + bucket.ljust(width) + "".join(f"{profiles[d]['buckets'][bucket]:.1%}".ljust(14)
                                                   for d in datagrams).rstrip())
    for d in datagrams:
        p = profiles[d]
        print(f"  dgram {d}: {p['batches']} batches, {p['ms_per_batch_profiled']:.0f} ms a batch under the profiler "
              f"({p['ms_per_batch']:.0f} ms without); Python functions account for "
              f"{p['profiled_share_of_wall']:.0%} of the profiled wall time. Top functions by own time:")
        for t in p["top"]:
            print(f"    {t['own_share']:6.1%}  {t['calls']:>8} calls  {t['function']}")
    print("C functions' own time goes to their callers' buckets (checksums by name). uvloop's methods are not "
          "seen by cProfile: sendto and timers count in their caller, aioquic.asyncio's transmit, hence its "
          "bucket; epoll and recvfrom are not seen at all. cProfile inflates the cost of every Python call, so "
          "the shares are indicative.")


# =============================================================================================
# main


TITLES = {
    1: f"1. Peer pull throughput, {BATCH} blocks a call, loopback, QUIC datagrams of "
       f"{' and '.join(map(str, DATAGRAMS))} B; GB/s of the median round",
    2: f"2. One {size_name(LAT_SIZE)} block on a warm connection, p50 and p99 latency; lower is better",
}


def print_figures(rows: list[Row], header: str) -> None:
    """bench_core.print_table's layout, with columns as wide as their longest cell."""
    print_fitted(rows, header, TITLES, fmt, [
        "ratio = kvcached / baseline (throughput: higher is better; latency: lower is better).",
        "Throughput: each side's median round; ratio = median over rounds of the two sides' ratio in that round.",
        "Latency p50 ratio = median over rounds of the p50 ratio within a round; p99 ratio = p99 of all calls over "
        "the baseline's."])


def run(s: Settings) -> tuple[list[Row], list[str], dict[str, Any], dict[int, dict[str, Any]]]:
    from kvcached.peers.certs import make_cluster

    rows: list[Row] = []
    notes: list[str] = []
    extra: dict[str, Any] = {}
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-peers-") as tmpdir, contextlib.ExitStack() as stack:
        try:
            tmp = Path(tmpdir)
            certs = tmp / "certs"
            certs.mkdir()
            make_cluster(certs, ["node-a", "node-b"])
            payloads = {size: [payload_of(size, i) for i in range(n)] for size, n in s.blocks.items()}
            digests = {size: [digest_of(size, i) for i in range(n)] for size, n in s.blocks.items()}
            progress("starting redis-server")
            total_gib = sum(size * n for size, n in s.blocks.items()) / (1 << 30)
            redis = start_redis(stack, tmp, max(0.25, 2 * total_gib), tcp_port=free_port(socket.SOCK_STREAM))
            if redis is None:
                why = "redis-server or redis-py is not installed (make system-deps installs redis-server)"
                progress(f"Redis baseline skipped: {why}")
                notes.append(f"Redis baseline skipped: {why}")
                redis_proc, redis_client = None, None
            else:
                redis_proc, redis_client = redis
                procs.append(redis_proc)
                for size, n in s.blocks.items():
                    for i in range(0, n, 16):
                        redis_client.mset({digests[size][j]: payloads[size][j] for j in range(i, min(n, i + 16))})
            lt = LoopThread()
            stack.callback(lt.close)
            c = Common(s, tmp, certs, digests, payloads, lt, redis_proc, redis_client, procs)
            wall = other = 0.0
            for datagram in DATAGRAMS:
                got, more, raw, w, o = bench_datagram(c, datagram)
                rows += got
                notes += more
                extra.update(raw)
                wall, other = wall + w, other + o
            notes.append(f"other processes used about {other:.1f} CPU-s during the {wall:.0f} s measured "
                         f"({other / wall:.0%} of one core)"
                         + ("; the figures are disturbed by them" if other / wall > 0.1 else ""))
            profiles = bench_profile(c)
        except Exception:
            for p in procs:
                progress(f"{p.name} log, last lines:\n{p.tail(12)}")
            raise
    return rows, notes, extra, profiles


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached peer-tier benchmark (figures with same-run baselines)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (about a minute): fewer blocks and rounds")
    parser.add_argument("--lane", choices=("quic", "tls", "mac"), default="quic",
                        help="what the daemons and in-process tiers pull over: quic (default: what the figures "
                             "describe) or a bulk lane ([quic] lane; bench_lane.py compares them)")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", help=argparse.SUPPRESS)
    parser.add_argument("--datagram", type=int, default=DATAGRAMS[-1], help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global LANE
    LANE = args.lane
    if args.bare_server:
        return bare_server_main(args)
    s = QUICK if args.quick else FULL
    tuned = tune_client_malloc()
    load = os.getloadavg()[0]
    started = time.time()
    rows, notes, extra, profiles = run(s)
    header = (f"kvcached peer benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s, "
              f"load average {load:.2f} at the start\nsettings: two daemons on loopback, RAM only, mirror_pulls off, "
              f"datagrams {' and '.join(map(str, DATAGRAMS))} B (a fresh pair each), windows {MAX_DATA >> 20} MiB / "
              f"{MAX_STREAM_DATA >> 20} MiB, gRPC messages up to {MAX_MESSAGE >> 20} MiB, "
              f"{', '.join(f'{n} x {size_name(size)}' for size, n in s.blocks.items())} on A, {s.rounds} rounds x "
              f"{s.seconds:g} s, latency {s.lat_rounds} x {s.lat_calls} calls, {s.profile_batches} profiled batches; "
              f"client malloc tuned: {tuned}")
    print_figures(rows, header)
    print()
    print_profile(profiles)
    print()
    for note in notes:
        print(f"note: {note}")
    if args.json:
        meta = {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                "datagrams": list(DATAGRAMS), "batch": BATCH, "max_message_mib": MAX_MESSAGE >> 20,
                "settings": {**asdict(s), "blocks": {str(k): v for k, v in s.blocks.items()}}}
        doc = {"meta": meta, "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows],
               "profile": {str(d): p for d, p in profiles.items()}, "notes": notes, "raw": extra}
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
