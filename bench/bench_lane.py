"""kvcached bulk-lane benchmark ([quic] lane = "tls" and "mac", kvcached.peers.lane): pulls of 64
blocks from real daemons over the lane, next to bare socket pairs, redis-py GET and QUIC moving the
same bytes in the same run.

    python bench/bench_lane.py [--quick] [--json PATH]

Setup: a cluster CA and node certificates (kvcached.peers.certs.make_cluster) in a temp dir; two
daemons A, ``kvcached serve`` subprocesses (bench_peers.start_daemon: RAM only), one with
``quic.lane="tls"`` and one with ``quic.lane="mac"``, each holding the same 64 KiB and 1 MiB blocks
put through gRPC; in this process, on one uvloop loop in a thread (bench_peers.Clients), a
kvcached.peers.tier.PeerTier with node-b's certificate per mode that pulls 64 blocks a call with
``PeerTier.fetch`` into preallocated buffers, every block's BLAKE3 checked on arrival as in the
daemon, a PeerTier with ``lane="quic"`` pulling from the tls daemon over QUIC at 16,000-byte
datagrams, and one pulling from the mac daemon with its pulls striped over 4 lane connections. Baselines, the same bytes in the same run:

- bare TLS pair and bare TCP pair: a server subprocess (this file with ``--bare-server``: the
  payloads in a dict, a thread per connection, Python's socket and ssl modules only, no kvcached
  code) read by a blocking client in this process (``recv_into`` a preallocated buffer). TLS 1.3
  with the same certificates, both sides verified; a request is a count and 32-byte digests, the
  answer the payloads back to back (``sendall``). No checksum is computed on either side;
- the floor of doing what the lane must: the bare pairs with each payload's BLAKE3 computed
  and compared on arrival ("bare TLS pair + BLAKE3", "bare TCP pair + BLAKE3"), and a uvloop pair ("uvloop pair +
  BLAKE3": this file's server as one uvloop event loop, a buffered protocol on the benchmark's
  loop reading into a preallocated buffer and checking BLAKE3 as each payload completes; no
  kvcached code), plain and over asyncio's TLS ("uvloop TLS pair + BLAKE3": memory BIOs, as the
  tls lane). The first says what the checksum costs, the second what an asyncio process on
  each end costs on top; the lane's own overhead is its ratio to them;
- redis-py GET: redis-server on TCP 127.0.0.1 holding the same blocks, one GET per block (skipped,
  with a note, where redis-server or redis-py is missing; ``make system-deps`` installs it).

1. Throughput, GB/s of the median round; interleaved rounds (the sides in order, then reversed),
   each side running batches until its clocked time reaches the round length; a ratio is the
   median over rounds of the two sides' ratio within the round. Targets (issue 23): lane tls >=
   0.8x the bare TLS pair; lane mac >= 0.8x the bare TCP pair, and >= 1.5 GB/s at 1 MiB
   (Mooncake Store's TCP transfer figure on this kind of machine, ../shared/BASELINES.md). Also
   the mac lane with each pull striped over 4 connections against the same lane on one
   (``[quic] lane_stripes``; no target: it says which default fits this machine).
2. One 64 KiB block on a warm connection, p50: each lane's ``PeerTier.fetch`` against a bare TCP
   round trip of the same bytes. Target (issue 23): <= 2x. Also the uvloop pair's round trip
   against the same, and the mac lane against the uvloop pair.

3. The NIXL lane (issue 43; bench/lane_nixl.py, one process per UCX transport set: "tcp", and
   "tcp,sm" whose bytes go over shared memory): 64 blocks of 1 MiB pulled by a PeerTier with
   ``[quic] nixl`` from a daemon serving it, against a bare NIXL READ of the same bytes (NIXL's
   API only) and the same with each payload's BLAKE3. Target (issue 43): >= 0.8x the bare READ.
   Skipped, with a note, where NIXL is not installed (``make nixl``).

Notes after the table: for a 2,048-token prompt of Llama-3-8B (its KV bytes computed from the
model's published shape), the pull time at this run's 1 MiB rate of each lane, against the
prefill time one H100 needs at its published peak BF16 rate and at half of it.

--quick: fewer blocks, 1 round of 0.2 s, 50 single-block calls (about 20 s). Full: 3 rounds of
1 s, 300 calls (about a minute). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_peers  # noqa: E402
import lane_nixl  # noqa: E402
from bench_core import KiB, MiB, Proc, Row, progress, start_redis, tune_client_malloc  # noqa: E402
from bench_peers import BATCH, MAX_MESSAGE, Clients, LoopThread, digest_of, free_port, payload_of  # noqa: E402

SIZES = (64 * KiB, 1 * MiB)
SCRATCH = 4 << 10
_COUNT = struct.Struct("<I")


def _ctx(certs: Path, me: str, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(certs / f"{me}.pem"), str(certs / f"{me}-key.pem"))
    ctx.load_verify_locations(str(certs / "ca.pem"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False
    return ctx


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError("the other side closed")
        view = view[n:]


# =============================================================================================
# the bare server (its own process)


def bare_server_main(args: argparse.Namespace) -> int:
    blocks = {digest_of(size, i): payload_of(size, i) for size, n in json.loads(args.blocks).items()
              for i in range(n) for size in [int(size)]}
    ctx = _ctx(Path(args.certs), "node-a", server=True) if args.tls else None
    listener = socket.create_server(("127.0.0.1", args.port))

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock = ctx.wrap_socket(conn, server_side=True) if ctx is not None else conn
            head = bytearray(_COUNT.size)
            while True:
                _recv_exact(sock, memoryview(head))
                digests = bytearray(32 * _COUNT.unpack(head)[0])
                _recv_exact(sock, memoryview(digests))
                for i in range(0, len(digests), 32):
                    sock.sendall(blocks[bytes(digests[i:i + 32])])

    if args.uvloop:
        listener.close()
        return _uvloop_server(args.port, blocks, Path(args.ready), ctx)
    Path(args.ready).write_text("ready")
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _uvloop_server(port: int, blocks: dict[bytes, bytes], ready: Path, ctx: ssl.SSLContext | None) -> int:
    """The same answers from one uvloop event loop: a protocol that writes the payloads of each
    whole request (the floor of an asyncio server, next to the daemon's); over TLS with ``ctx``
    (asyncio's TLS: memory BIOs, as the lane's)."""
    import asyncio

    import uvloop

    class Serve(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.pending = bytearray()

        def data_received(self, data: bytes) -> None:
            self.pending += data
            while len(self.pending) >= _COUNT.size:
                end = _COUNT.size + 32 * _COUNT.unpack_from(self.pending)[0]
                if len(self.pending) < end:
                    return
                digests = bytes(self.pending[_COUNT.size:end])
                del self.pending[:end]
                self.transport.writelines([blocks[digests[i:i + 32]] for i in range(0, len(digests), 32)])

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Serve, "127.0.0.1", port, ssl=ctx)
        ready.write_text("ready")
        await server.serve_forever()

    uvloop.run(main())
    return 0


class BareClient:
    def __init__(self, port: int, certs: Path, tls: bool) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = _ctx(certs, "node-b", server=False).wrap_socket(sock, server_hostname="node-a") if tls else sock
        self.buffer = bytearray(BATCH * max(SIZES))

    def batch(self, digests: Sequence[bytes], size: int, checksums: dict[bytes, bytes] | None = None) -> float:
        """Seconds to get ``digests``' payloads; with ``checksums``, each payload's BLAKE3 is
        computed and compared on arrival, as the lane does."""
        view = memoryview(self.buffer)[:size * len(digests)]
        t0 = time.perf_counter()
        self.sock.sendall(_COUNT.pack(len(digests)) + b"".join(digests))
        if checksums is None:
            _recv_exact(self.sock, view)
        else:
            for i, digest in enumerate(digests):
                block = view[i * size:(i + 1) * size]
                _recv_exact(self.sock, block)
                if blake3.blake3(block).digest() != checksums[digest]:
                    raise RuntimeError("bare TCP pair: a payload failed its checksum")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()


class UvloopClient:
    """The uvloop side of the asyncio floor: a buffered protocol on the benchmark's loop reading
    each answer into a preallocated buffer and checking each payload's BLAKE3 on arrival."""

    def __init__(self, checksums: dict[bytes, bytes]) -> None:
        self.checksums = checksums
        self.buffer = memoryview(bytearray(BATCH * max(SIZES)))
        self.scratch = memoryview(bytearray(SCRATCH))
        self.transport: Any = None
        self.want = self.got = self.size = 0
        self.digests: Sequence[bytes] = ()
        self.done: Any = None

    async def open(self, port: int, certs: Path | None = None) -> None:
        """Connect to a uvloop bare server on ``port``; over TLS with ``certs``."""
        import asyncio

        client = self

        class Read(asyncio.BufferedProtocol):
            def get_buffer(self, sizehint: int) -> memoryview:
                return client.buffer[client.got:client.want] if client.got < client.want else client.scratch

            def buffer_updated(self, nbytes: int) -> None:
                client.arrived(nbytes)

        ctx = _ctx(certs, "node-b", server=False) if certs is not None else None
        self.transport, _ = await asyncio.get_running_loop().create_connection(
            Read, "127.0.0.1", port, ssl=ctx, server_hostname="node-a" if ctx is not None else None)

    def arrived(self, nbytes: int) -> None:
        start, self.got = self.got, self.got + nbytes
        for i in range(start // self.size, self.got // self.size):          # blocks completed by this read
            block = self.buffer[i * self.size:(i + 1) * self.size]
            if blake3.blake3(block).digest() != self.checksums[self.digests[i]] and not self.done.done():
                self.done.set_exception(RuntimeError("uvloop pair: a payload failed its checksum"))
        if self.got >= self.want and self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def batch(self, digests: Sequence[bytes], size: int) -> float:
        import asyncio

        self.digests, self.size, self.got, self.want = digests, size, 0, size * len(digests)
        self.done = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        self.transport.write(_COUNT.pack(len(digests)) + b"".join(digests))
        await self.done
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def start_bare(stack: contextlib.ExitStack, tmp: Path, certs: Path, blocks: dict[int, int], kind: str) -> int:
    """A bare server subprocess of ``kind``: "tls" or "tcp" (threads, blocking sockets) or
    "uvloop" or "uvloop-tls" (one event loop); returns its port."""
    port = free_port(socket.SOCK_STREAM)
    ready = tmp / f"bare-{kind}.ready"
    argv = [sys.executable, str(Path(__file__).resolve()), "--bare-server", "--port", str(port), "--certs",
            str(certs), "--blocks", json.dumps(blocks), "--ready", str(ready)]
    argv += {"tls": ["--tls"], "uvloop": ["--uvloop"], "uvloop-tls": ["--uvloop", "--tls"]}.get(kind, [])
    proc = Proc(f"bare-{kind}", argv, cwd=tmp, log=tmp / f"bare-{kind}.log")
    stack.callback(proc.stop)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bare server did not start: {proc.tail()}")
        time.sleep(0.05)
    return port


# =============================================================================================
# rounds


def interleaved(sides: dict[str, Callable[[list[bytes]], float]], batches: list[list[bytes]], size: int,
                rounds: int, seconds: float) -> dict[str, list[float]]:
    """GB/s of each side per round; the order of the sides alternates between rounds."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fetch = sides[name]
            fetch(batches[0])                                # warm-up, untimed
            spent = moved = 0.0
            i = 0
            while spent < seconds or i == 0:
                spent += fetch(batches[i % len(batches)])
                moved += size * len(batches[i % len(batches)])
                i += 1
            out[name].append(moved / spent / 1e9)
    return out


def paired(values: dict[str, list[float]], side: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(values[side], values[base]))


# For the line that says whether a pull pays: Llama-3-8B's KV cache per token (32 layers, 8 KV
# heads of 128 dimensions, K and V, 2 bytes each) and one H100's prefill of the prompt, from
# published figures (Meta's model card; NVIDIA's H100 SXM datasheet: 989 TFLOPS dense BF16).
MODEL_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
MODEL_PARAMS = 8.03e9
PROMPT_TOKENS = 2048
H100_BF16_FLOPS = 989e12


def prefill_ms(utilisation: float) -> float:
    """Prefill time of PROMPT_TOKENS on one H100 at this share of its peak (2 FLOP per parameter
    per token; attention over 2,048 tokens adds about 3%, left out: the figure is a floor)."""
    return 2 * MODEL_PARAMS * PROMPT_TOKENS / (H100_BF16_FLOPS * utilisation) * 1e3


def run(quick: bool) -> tuple[list[Row], list[str]]:
    from kvcached.client import KvCacheClient
    from kvcached.peers.certs import make_cluster

    blocks = {64 * KiB: 128, 1 * MiB: 64} if quick else {64 * KiB: 256, 1 * MiB: 128}
    rounds, seconds, calls = (1, 0.2, 50) if quick else (3, 1.0, 300)
    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-lane-") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        certs = tmp / "certs"
        make_cluster(certs, ["node-a", "node-b"])
        total = sum(size * n for size, n in blocks.items())
        ram_gib = max(0.25, round(total * 2 / (1 << 30), 2))
        payloads = {size: [payload_of(size, i) for i in range(n)] for size, n in blocks.items()}
        digests = {size: [digest_of(size, i) for i in range(n)] for size, n in blocks.items()}
        lt = LoopThread()
        stack.callback(lt.close)
        tiers: dict[str, Clients] = {}
        for mode in ("tls", "mac"):                 # daemon A per lane mode, and a PeerTier pulling from it
            port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
            progress(f"starting daemon A with lane {mode} (port {port_a})")
            bench_peers.LANE = mode
            bench_peers.start_daemon(stack, tmp / f"a-{mode}", certs, "node-a", "node-b", port_a, port_b, ram_gib, 16000)
            client_a = KvCacheClient(f"unix:{tmp}/a-{mode}/kvcached.sock", max_message_mib=MAX_MESSAGE // MiB,
                                     timeout=120)
            stack.callback(client_a.close)
            for size, n in blocks.items():
                bench_peers.put_blocks(client_a, size, n, payloads[size])
            tiers[mode] = Clients(lt, 16000)
            stack.callback(lambda c=tiers[mode]: lt.call(c.close(), 10))
            lt.call(tiers[mode].open_tier(port_a, certs, listen=port_b), 30)
            if mode == "mac":                      # the same lane, a pull striped over 4 connections
                tiers["mac x4"] = Clients(lt, 16000)
                stack.callback(lambda c=tiers["mac x4"]: lt.call(c.close(), 10))
                lt.call(tiers["mac x4"].open_tier(port_a, certs), 30)
            if mode == "tls":                      # QUIC at 16,000-byte datagrams, from the same daemon
                bench_peers.LANE = "quic"
                tiers["quic"] = Clients(lt, 16000)
                stack.callback(lambda c=tiers["quic"]: lt.call(c.close(), 10))
                lt.call(tiers["quic"].open_tier(port_a, certs), 30)
        for clients in tiers.values():
            clients.announce([d for size in blocks for d in digests[size]])
        progress("starting the bare servers and redis-server")
        bare = {tls: BareClient(start_bare(stack, tmp, certs, blocks, "tls" if tls else "tcp"), certs, tls)
                for tls in (True, False)}
        for client in bare.values():
            stack.callback(client.close)
        checksums = {d: blake3.blake3(v).digest() for size in blocks for d, v in zip(digests[size], payloads[size])}
        floor, tls_floor = UvloopClient(checksums), UvloopClient(checksums)
        lt.call(floor.open(start_bare(stack, tmp, certs, blocks, "uvloop")), 30)
        lt.call(tls_floor.open(start_bare(stack, tmp, certs, blocks, "uvloop-tls"), certs), 30)
        for f in (floor, tls_floor):
            stack.callback(lambda f=f: lt.loop.call_soon_threadsafe(f.close))
        redis = start_redis(stack, tmp, ram_gib, tcp_port=free_port(socket.SOCK_STREAM))
        if redis is not None:
            for size in blocks:
                redis[1].mset({d: v for d, v in zip(digests[size], payloads[size])})
        else:
            notes.append("redis-server or redis-py missing: no redis-py GET side (make system-deps installs it)")

        def redis_batch(batch: list[bytes], size: int) -> float:
            assert redis is not None
            t0 = time.perf_counter()
            values = [redis[1].get(d) for d in batch]
            dt = time.perf_counter() - t0
            if any(v is None or len(v) != size for v in values):
                raise RuntimeError("redis: a GET missed")
            return dt

        for size, n in blocks.items():
            batches = [digests[size][i:i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
            for mode, clients in tiers.items():
                lt.call(clients.tier_batch(batches[0], size))
                if clients.buffers[size][:size * BATCH] != b"".join(payloads[size][:BATCH]):
                    raise RuntimeError(f"{mode}: the pull did not bring back the bytes put")
            tiers["mac x4"].tier.links["node-a"].lane.stripes = 4
            progress(f"throughput, {BATCH} x {size // KiB} KiB: {rounds} round(s) of {seconds:g} s per side")
            sides: dict[str, Callable[[list[bytes]], float]] = {
                "lane tls": lambda b, s=size: lt.call(tiers["tls"].tier_batch(b, s)),
                "lane mac": lambda b, s=size: lt.call(tiers["mac"].tier_batch(b, s)),
                "lane mac, 4 stripes": lambda b, s=size: lt.call(tiers["mac x4"].tier_batch(b, s)),
                "bare TLS pair": lambda b, s=size: bare[True].batch(b, s),
                "bare TLS pair + BLAKE3": lambda b, s=size: bare[True].batch(b, s, checksums),
                "bare TCP pair": lambda b, s=size: bare[False].batch(b, s),
                "bare TCP pair + BLAKE3": lambda b, s=size: bare[False].batch(b, s, checksums),
                "uvloop pair + BLAKE3": lambda b, s=size: lt.call(floor.batch(b, s)),
                "uvloop TLS pair + BLAKE3": lambda b, s=size: lt.call(tls_floor.batch(b, s)),
                "QUIC 16000": lambda b, s=size: lt.call(tiers["quic"].tier_batch(b, s))}
            if redis is not None:
                sides["redis-py GET"] = lambda b, s=size: redis_batch(b, s)
            gbs = interleaved(sides, batches, size, rounds, seconds)
            med = {name: statistics.median(v) for name, v in gbs.items()}
            name = f"{size // KiB} KiB x{BATCH}" if size < MiB else f"{size // MiB} MiB x{BATCH}"

            def row(side: str, base: str, target: str = "", passed: bool | None = None) -> None:
                rows.append(Row(1, f"{side}, {name}", "GB/s", med[side], base, med[base], True, target, passed,
                                {"rounds": gbs}, paired_ratio=paired(gbs, side, base)))

            tls_ratio, mac_ratio = paired(gbs, "lane tls", "bare TLS pair"), paired(gbs, "lane mac", "bare TCP pair")
            row("lane tls", "bare TLS pair", ">= 0.8x", tls_ratio >= 0.8)
            if size >= MiB:
                row("lane mac", "bare TCP pair", ">= 0.8x and >= 1.5 GB/s", mac_ratio >= 0.8 and med["lane mac"] >= 1.5)
            else:
                row("lane mac", "bare TCP pair", ">= 0.8x", mac_ratio >= 0.8)
            if redis is not None:
                row("lane tls", "redis-py GET")
                row("lane mac", "redis-py GET")
            row("lane tls", "bare TLS pair + BLAKE3")
            row("lane tls", "uvloop TLS pair + BLAKE3")
            row("bare TLS pair + BLAKE3", "bare TLS pair")
            row("uvloop TLS pair + BLAKE3", "bare TLS pair")
            row("lane mac", "bare TCP pair + BLAKE3")
            row("lane mac", "uvloop pair + BLAKE3")
            row("bare TCP pair + BLAKE3", "bare TCP pair")
            row("uvloop pair + BLAKE3", "bare TCP pair")
            row("QUIC 16000", "bare TCP pair")
            row("lane mac, 4 stripes", "lane mac")
            if size >= MiB:
                kv = MODEL_KV_BYTES_PER_TOKEN * PROMPT_TOKENS
                for mode in ("mac", "tls"):
                    pull_ms = kv / (med[f"lane {mode}"] * 1e9) * 1e3
                    notes.append(f"a {PROMPT_TOKENS:,}-token prompt of an 8B model (Llama-3-8B: {kv / 1e6:.0f} MB of KV "
                                 f"in fp16) pulls over the {mode} lane here in {pull_ms:.0f} ms at this run's "
                                 f"{med[f'lane {mode}']:.2f} GB/s; one H100 prefills it in {prefill_ms(1.0):.0f} ms at "
                                 f"its peak BF16 rate, {prefill_ms(0.5):.0f} ms at 50% of it (published peak, not "
                                 f"measured here): the pull pays where it is under that")
        for mode, clients in tiers.items():
            counters = clients.tier.counters
            notes.append(f"{mode}: {counters.lane_pulls} pulls over the lane, {counters.lane_fallbacks} fell back to QUIC")
        progress(f"latency: {calls} single 64 KiB pulls per side")
        one = [digest_of(64 * KiB, 0)]
        samples: dict[str, list[float]] = {"lane tls": [], "lane mac": [], "QUIC 16000": [], "bare TCP": [],
                                           "uvloop pair + BLAKE3": []}
        order = list(samples)
        for i in range(calls):
            for side in order if i % 2 == 0 else reversed(order):
                if side == "bare TCP":
                    samples[side].append(bare[False].batch(one, 64 * KiB))
                elif side.startswith("uvloop"):
                    samples[side].append(lt.call(floor.batch(one, 64 * KiB)))
                else:
                    samples[side].append(lt.call(tiers[side.split()[-1] if side.startswith("lane") else "quic"]
                                                 .tier_batch(one, 64 * KiB)))
        p50 = {side: statistics.median(v) * 1e6 for side, v in samples.items()}
        for side in ("lane tls", "lane mac"):
            rows.append(Row(2, f"{side}, 1x 64 KiB p50", "us", p50[side], "bare TCP round trip", p50["bare TCP"], False,
                            "<= 2x", p50[side] / p50["bare TCP"] <= 2.0, {"calls": calls}))
        rows.append(Row(2, "uvloop pair + BLAKE3, 1x 64 KiB p50", "us", p50["uvloop pair + BLAKE3"],
                        "bare TCP round trip", p50["bare TCP"], False, details={"calls": calls}))
        rows.append(Row(2, "lane mac, 1x 64 KiB p50", "us", p50["lane mac"], "uvloop pair + BLAKE3",
                        p50["uvloop pair + BLAKE3"], False, details={"calls": calls}))
        rows.append(Row(2, "QUIC 16000, 1x 64 KiB p50", "us", p50["QUIC 16000"], "bare TCP round trip", p50["bare TCP"],
                        False, details={"calls": calls}))
    return rows, notes


TITLES = {1: f"1. Pull throughput, {BATCH} blocks a call, loopback; GB/s of the median round",
          2: "2. One 64 KiB block on a warm connection, p50 latency; lower is better",
          3: "3. The NIXL lane ([quic] nixl) against a bare NIXL transfer of the same bytes, per UCX transport set"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (about 30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--uvloop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        return bare_server_main(args)
    tune_client_malloc()                 # as bench_peers does for its redis-py side
    rows, notes = run(args.quick)
    nixl_rows, nixl_notes = lane_nixl.nixl_rows(args.quick, 3)     # a process per UCX transport set
    rows, notes = rows + nixl_rows, notes + nixl_notes
    bench_peers.TITLES.update(TITLES)
    bench_peers.print_figures(rows, f"kvcached bulk lane benchmark ({os.uname().nodename}, {os.cpu_count()} CPUs)")
    for note in notes:
        print("note: " + note)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
