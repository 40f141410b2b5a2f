"""What metrics cost on the hot path: RAM-tier Lookup and Get with metrics on against off, same run.

    python bench/bench_metrics.py [--quick] [--json PATH]

With metrics on ([metrics] listen set), every read also reads the clock twice and drops its
duration into a lock-free histogram (kvcached.store.reads); every read counts per-tier hits and misses
either way. Two measurements, each as interleaved rounds (on, off, then off, on, ...), each
side's figure its median round, the ratio the median of the per-round ratios:

1. In process, where the cost is most visible: Store.lookup of a 16-block chain and Store.get
   of one 4 KiB block, all in RAM, on a real Store (memfd arena, RocksDB index in a temp dir),
   with read timing on (ReadStats.time_reads, as the daemon does when metrics are on) and off:
   the same store, the histograms switched on and off between rounds, so only that differs.
2. Through the daemon: two ``kvcached serve`` processes, one with ``metrics.listen`` on a free
   port and one with ``metrics.listen = ""``, the same blocks put on each; gRPC Lookup and Get
   over their Unix sockets from this process, one call at a time. Prometheus scrapes the
   metrics one every second meanwhile (a real scrape is part of the cost).

Target: on / off <= 1.05 for each (overhead under 5%). Also shown, no target: one observation
into kvcached's histogram against one into prometheus_client's (which takes a lock).
--quick: fewer calls (~20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import KiB, MiB, Row, print_table, progress, start_kvcached  # noqa: E402

TARGET = 1.05
CHAIN = 16
PAYLOAD = 4 * KiB
TITLES = {0: "0. One latency observation: kvcached.store.reads' histogram vs prometheus_client's (per call; why the daemon keeps its own)",
          1: "1. In process: Store.lookup / Store.get of RAM blocks, read timing on vs off (per call)",
          2: "2. Through the daemon: gRPC Lookup / Get on a Unix socket, metrics on vs off (per call)"}


def timed_rounds(sides: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each side, per round; sides alternate order round by round."""
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            call = sides[name]
            for _ in range(max(1, calls // 20)):         # warm-up
                call()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            out[name].append((time.perf_counter() - t0) / calls)
    return out


def overhead_row(figure: int, case: str, per_round: dict[str, list[float]]) -> Row:
    on, off = per_round["on"], per_round["off"]
    row = Row(figure, case, "us", statistics.median(on) * 1e6, "metrics off", statistics.median(off) * 1e6, False,
              f"<= {TARGET:g}x", details={"on_us": [x * 1e6 for x in on], "off_us": [x * 1e6 for x in off]},
              paired_ratio=statistics.median(a / b for a, b in zip(on, off)))
    row.passed = row.ratio <= TARGET
    return row


# =============================================================================================
# 0. one observation


def observe_rows(rounds: int, calls: int) -> list[Row]:
    """The hot-path step itself: kvcached's lock-free histogram against prometheus_client's
    Histogram (a bound child, as a careful caller would use it), same buckets, same value."""
    from prometheus_client import CollectorRegistry, Histogram

    from kvcached.store.reads import LATENCY_BUCKETS, LatencyHistogram

    ours = LatencyHistogram()
    theirs = Histogram("bench_seconds", "bench", ["tier"], buckets=LATENCY_BUCKETS,
                       registry=CollectorRegistry()).labels("ram")
    per_round = timed_rounds({"on": lambda: ours.observe(1.5e-4), "off": lambda: theirs.observe(1.5e-4)},
                             rounds, calls)
    row = overhead_row(0, "LatencyHistogram.observe", per_round)
    row.baseline_name, row.target, row.passed = "prometheus_client", "", None
    row.unit, row.kvcached, row.baseline = "ns", row.kvcached * 1e3, row.baseline * 1e3
    return [row]


# =============================================================================================
# 1. in process


def in_process(rounds: int, calls: int, tmp: Path) -> list[Row]:
    from kvcached.index import BlockIndex
    from kvcached.policies.clock import ClockPolicy
    from kvcached.store import PutItem, Store
    from kvcached.tiers.arena import SharedArena
    from kvcached.tiers.ram import RamTier
    from kvcached_agent.address import BlockAddress

    loop = asyncio.new_event_loop()
    arena = SharedArena(64 * MiB, name="kvcbench-metrics")
    store = Store(RamTier(arena, MiB, ClockPolicy()), BlockIndex(str(tmp / "index")))
    try:
        chain = [os.urandom(32) for _ in range(CHAIN)]
        addresses = [BlockAddress(d) for d in chain]
        loop.run_until_complete(store.put([PutItem(a, os.urandom(PAYLOAD), model="bench") for a in addresses]))
        store.reads.time_reads(["ram"])              # what the daemon does when metrics are on
        histograms = store.reads.latency

        def side(on: bool, call: Callable[[], Any]) -> Callable[[], Any]:
            """The same store either way: only whether reads are timed differs."""
            def run() -> Any:
                store.reads.latency = histograms if on else None
                return call()
            return run

        layer, one = addresses[0].layer, addresses[:1]
        lookup = {"on": side(True, lambda: store.lookup(chain, layer)),
                  "off": side(False, lambda: store.lookup(chain, layer))}
        get = {"on": side(True, lambda: loop.run_until_complete(store.get(one))),
               "off": side(False, lambda: loop.run_until_complete(store.get(one)))}
        progress(f"in process: {rounds} rounds x {calls} calls per side (Store.lookup of {CHAIN}, Store.get of 1)")
        rows = [overhead_row(1, f"Store.lookup x{CHAIN}", timed_rounds(lookup, rounds, calls)),
                overhead_row(1, "Store.get 1 x 4 KiB", timed_rounds(get, rounds, calls))]
        assert histograms and sum(sum(h.counts) for h in histograms.values()) > 0
        return rows
    finally:
        store.index.close()
        loop.close()


# =============================================================================================
# 2. through the daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def through_daemons(rounds: int, calls: int, tmp: Path) -> list[Row]:
    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

    chain = [os.urandom(32) for _ in range(CHAIN)]
    port = free_port()
    with contextlib.ExitStack() as stack:
        stubs = {}
        for name, listen in (("on", f"127.0.0.1:{port}"), ("off", "")):
            (tmp / name).mkdir()
            _, channel = start_kvcached(stack, tmp / name, 0.125, [f'metrics.listen="{listen}"', "kv.ssd_gib=0"])
            stub = pb_grpc.KvCacheStub(channel)
            stub.Put(pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=d), payload=os.urandom(PAYLOAD))
                                           for d in chain]), timeout=30)
            stubs[name] = stub
        stop = threading.Event()

        def scrape() -> None:          # Prometheus's share of the cost, at its usual pace and faster
            while not stop.wait(1.0):
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        stack.callback(stop.set)
        lookup_req = pb.LookupRequest(digests=chain)
        get_req = pb.GetRequest(addresses=[pb.BlockAddress(digest=chain[0])])
        lookup = {n: (lambda s=s: s.Lookup(lookup_req, timeout=30)) for n, s in stubs.items()}
        get = {n: (lambda s=s: s.Get(get_req, timeout=30)) for n, s in stubs.items()}
        progress(f"through the daemons: {rounds} rounds x {calls} calls per side (gRPC Lookup of {CHAIN}, Get of 1)")
        rows = [overhead_row(2, f"gRPC Lookup x{CHAIN}", timed_rounds(lookup, rounds, calls)),
                overhead_row(2, "gRPC Get 1 x 4 KiB", timed_rounds(get, rounds, calls))]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        if 'kvcached_lookup_seconds_count{outcome="hit",tier="ram"}' not in text:
            raise RuntimeError("the metrics-on daemon exports no RAM read latencies")
        return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rounds, calls_proc, calls_grpc = (5, 2000, 300) if args.quick else (9, 20000, 2000)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcbench-metrics-") as tmpdir:
        tmp = Path(tmpdir)
        rows = observe_rows(rounds, calls_proc)
        rows += in_process(rounds, calls_proc, tmp)
        rows += through_daemons(rounds, calls_grpc, tmp)
    header = (f"kvcached metrics overhead ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s; "
              f"{rounds} interleaved rounds")
    print_table(rows, header, TITLES)
    print("Ratio = median over rounds of (metrics on / metrics off) per call within the round; target: overhead "
          f"under {TARGET - 1:.0%}.")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict}
                                                           for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
