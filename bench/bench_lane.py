"""kvcached bulk-lane benchmark ([quic] lane = "tls", kvcached.peers.lane): pulls of 64 blocks
from a real daemon over the lane, next to bare socket pairs moving the same bytes in the same run.

    python bench/bench_lane.py [--quick] [--json PATH]

Setup: a cluster CA and node certificates (kvcached.certs.make_cluster) in a temp dir; daemon A, a
``kvcached serve`` subprocess (bench_peers.start_daemon: RAM only, ``quic.lane="tls"``), holding
64 KiB and 1 MiB blocks put through gRPC; in this process a kvcached.peers.tier.PeerTier with
node-b's certificate (bench_peers.Clients, on a uvloop loop in a thread) that pulls 64 blocks a
call from A into preallocated buffers with ``PeerTier.fetch``: over the lane, every block's
BLAKE3 checked on arrival, as in the daemon. Baselines, the same bytes from a server subprocess
(this file with ``--bare-server``: the payloads in a dict, a thread per connection, Python's
socket and ssl modules only, no kvcached code) read by a blocking client in this process
(``recv_into`` a preallocated buffer):

- bare TLS pair: TLS 1.3 with the same certificates, both sides verified; a request is a count
  and 32-byte digests, the answer the payloads back to back (``sendall``);
- bare TCP pair: the same without TLS (the ceiling of any lane on this machine).

1. Throughput, GB/s of the median round; interleaved rounds (the sides in order, then reversed),
   each side running batches until its clocked time reaches the round length; a ratio is the
   median over rounds of the two sides' ratio within the round. Target (issue 23): the lane
   >= 0.8x the bare TLS pair. The bare TCP pair is shown as the ceiling, no target (the ``mac``
   mode, whose targets it is, is not built yet).
2. One 64 KiB block on a warm connection, p50: the lane's ``PeerTier.fetch`` against a bare TCP
   round trip of the same bytes. Target (issue 23): <= 2x.

--quick: fewer blocks, 1 round of 0.2 s, 50 single-block calls (about 30 s). Full: 3 rounds of
1 s, 300 calls. Progress goes to stderr, the table to stdout.
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
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_peers  # noqa: E402
from bench_core import KiB, MiB, Proc, Row, progress  # noqa: E402
from bench_peers import BATCH, MAX_MESSAGE, Clients, LoopThread, digest_of, free_port, payload_of  # noqa: E402

SIZES = (64 * KiB, 1 * MiB)
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

    Path(args.ready).write_text("ready")
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class BareClient:
    def __init__(self, port: int, certs: Path, tls: bool) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = _ctx(certs, "node-b", server=False).wrap_socket(sock, server_hostname="node-a") if tls else sock
        self.buffer = bytearray(BATCH * max(SIZES))

    def batch(self, digests: Sequence[bytes], size: int) -> float:
        view = memoryview(self.buffer)[:size * len(digests)]
        t0 = time.perf_counter()
        self.sock.sendall(_COUNT.pack(len(digests)) + b"".join(digests))
        _recv_exact(self.sock, view)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()


def start_bare(stack: contextlib.ExitStack, tmp: Path, certs: Path, blocks: dict[int, int], tls: bool) -> int:
    port = free_port(socket.SOCK_STREAM)
    ready = tmp / f"bare-{'tls' if tls else 'tcp'}.ready"
    argv = [sys.executable, str(Path(__file__).resolve()), "--bare-server", "--port", str(port), "--certs",
            str(certs), "--blocks", json.dumps(blocks), "--ready", str(ready)] + (["--tls"] if tls else [])
    proc = Proc("bare-" + ("tls" if tls else "tcp"), argv, cwd=tmp, log=tmp / f"bare-{'tls' if tls else 'tcp'}.log")
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


def run(quick: bool) -> tuple[list[Row], list[str]]:
    from kvcached.certs import make_cluster
    from kvcached.client import KvCacheClient

    bench_peers.LANE = "tls"
    blocks = {64 * KiB: 128, 1 * MiB: 64} if quick else {64 * KiB: 256, 1 * MiB: 128}
    rounds, seconds, calls = (1, 0.2, 50) if quick else (3, 1.0, 300)
    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-lane-") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        certs = tmp / "certs"
        make_cluster(certs, ["node-a", "node-b"])
        port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        total = sum(size * n for size, n in blocks.items())
        progress(f"starting daemon A (lane tls, port {port_a}) and the bare servers")
        proc_a, _ = bench_peers.start_daemon(stack, tmp / "a", certs, "node-a", "node-b", port_a, port_b,
                                             max(0.25, round(total * 2 / (1 << 30), 2)), 16000)
        client_a = KvCacheClient(f"unix:{tmp}/a/kvcached.sock", max_message_mib=MAX_MESSAGE // MiB, timeout=120)
        stack.callback(client_a.close)
        payloads = {size: [payload_of(size, i) for i in range(n)] for size, n in blocks.items()}
        for size, n in blocks.items():
            bench_peers.put_blocks(client_a, size, n, payloads[size])
        bare = {tls: BareClient(start_bare(stack, tmp, certs, blocks, tls), certs, tls) for tls in (True, False)}
        for client in bare.values():
            stack.callback(client.close)
        lt = LoopThread()
        stack.callback(lt.close)
        clients = Clients(lt, 16000)
        stack.callback(lambda: lt.call(clients.close(), 10))
        lt.call(clients.open_tier(port_a, certs, listen=port_b), 30)
        clients.announce([digest_of(size, i) for size, n in blocks.items() for i in range(n)])
        for size, n in blocks.items():
            digests = [digest_of(size, i) for i in range(n)]
            batches = [digests[i:i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
            lt.call(clients.tier_batch(batches[0], size))
            if clients.buffers[size][:size * BATCH] != b"".join(payloads[size][:BATCH]):
                raise RuntimeError("the lane did not bring back the bytes put")
            progress(f"throughput, {BATCH} x {size // KiB} KiB: {rounds} round(s) of {seconds:g} s per side")
            sides: dict[str, Callable[[list[bytes]], float]] = {
                "lane": lambda b, s=size: lt.call(clients.tier_batch(b, s)),
                "bare TLS pair": lambda b, s=size: bare[True].batch(b, s),
                "bare TCP pair": lambda b, s=size: bare[False].batch(b, s)}
            gbs = interleaved(sides, batches, size, rounds, seconds)
            med = {name: statistics.median(v) for name, v in gbs.items()}
            name = f"pull {size // KiB} KiB x{BATCH}" if size < MiB else f"pull {size // MiB} MiB x{BATCH}"
            tls_ratio = paired(gbs, "lane", "bare TLS pair")
            rows.append(Row(1, name, "GB/s", med["lane"], "bare TLS pair", med["bare TLS pair"], True, ">= 0.8x",
                            tls_ratio >= 0.8, {"rounds": gbs}, paired_ratio=tls_ratio))
            rows.append(Row(1, name, "GB/s", med["lane"], "bare TCP pair", med["bare TCP pair"], True,
                            details={"rounds": gbs}, paired_ratio=paired(gbs, "lane", "bare TCP pair")))
            counters = clients.tier.counters
            notes.append(f"{name}: {counters.lane_pulls} pulls over the lane, {counters.lane_fallbacks} fell back to QUIC")
        progress(f"latency: {calls} single 64 KiB pulls per side")
        one = [digest_of(64 * KiB, 0)]
        lane_s, tcp_s = [], []
        for i in range(calls):
            for side in ((lane_s, tcp_s) if i % 2 == 0 else (tcp_s, lane_s)):
                side.append(lt.call(clients.tier_batch(one, 64 * KiB)) if side is lane_s
                            else bare[False].batch(one, 64 * KiB))
        p50_lane, p50_tcp = statistics.median(lane_s) * 1e6, statistics.median(tcp_s) * 1e6
        rows.append(Row(2, "pull 1x 64 KiB p50", "us", p50_lane, "bare TCP round trip", p50_tcp, False, "<= 2x",
                        p50_lane / p50_tcp <= 2.0, {"calls": calls}))
        if not proc_a.alive():
            raise RuntimeError("daemon A exited during the run")
    return rows, notes


TITLES = {1: f"1. Pull throughput over the lane, {BATCH} blocks a call, loopback; GB/s of the median round",
          2: "2. One 64 KiB block on a warm connection, p50 latency; lower is better"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (about 30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--certs", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        return bare_server_main(args)
    rows, notes = run(args.quick)
    bench_peers.TITLES.update(TITLES)
    bench_peers.print_figures(rows, f"kvcached bulk lane benchmark ({os.uname().nodename}, {os.cpu_count()} CPUs)")
    for note in notes:
        print("note: " + note)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
