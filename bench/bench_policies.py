"""Eviction policies: hit rates on synthetic workloads next to Belady's MIN, the cost of each
policy operation next to a bare dict lookup, and a daemon's RAM-tier Get rate per policy.

    python bench/bench_policies.py [--quick] [--json PATH] [--plot FILE.svg]

1. Hit rates (kvcached.sim: the daemon's own policy classes, replayed on the workloads of
   kvcached/sim/workloads.py at cache sizes of 0.2% to 50% of each workload's distinct blocks).
   Targets:
   - ARC at least as good as LRU on every workload, at every size (0.5 points of slack);
   - S3-FIFO (the scan-resistant policy) at least 20 points better than LRU on scan_mix, at the
     size where the difference is largest;
   - the best policy at least 0.9x Belady's hit rate on chatbot and multi_turn, averaged over
     the sizes.
2. Cost per operation: insert, touch (a hit), lookup (a membership test, as the tier's dict
   does before it touches) and evict (candidates() then evicted()) on a policy holding 100,000
   keys (driven by key, through KeyedPolicy, as the SSD tier's order is), in ns, against a bare
   dict lookup in the same run. No target: the figure says what a policy adds to a RAM-tier
   request (a Get of one block costs tens of microseconds).
3. A daemon's RAM-tier Get rate per policy: one ``kvcached serve`` per policy (RAM only), 64 KiB
   blocks cycling through a working set larger than the tier, so every Get is a hit or a miss
   that evicts; gRPC Get of one block at a time, interleaved rounds; Gets/s against the clock
   policy's in the same run. Target: every policy within 0.9x of clock.

--quick: smaller traces and fewer calls (about 1 minute). --plot: the hit-rate plot as SVG
(docs/policies.svg is one, from a full run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
import tracemalloc
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import KiB, Row, progress, start_kvcached  # noqa: E402

from kvcached.policies import make_keyed_policy  # noqa: E402
from kvcached.policies.admission import ReuseAdmission  # noqa: E402
from kvcached.sim.replay import Result, simulate  # noqa: E402
from kvcached.sim.report import svg, table  # noqa: E402
from kvcached.sim.workloads import WORKLOADS, make_trace  # noqa: E402

POLICIES = ("lru", "clock", "arc", "s3fifo")
FRACTIONS = (0.002, 0.01, 0.05, 0.2, 0.5)
TITLES = {1: "1. Hit rates against the targets (kvcached.sim; the full table is above)",
          2: "2. Cost of one policy operation, 100,000 keys resident; ns",
          3: "3. Daemon RAM-tier gRPC Get of one 64 KiB block, per policy; Gets/s of the median round"}


# =============================================================================================
# 1. hit rates


def hit_rate_rows(results: dict[str, Result]) -> list[Row]:
    rows = []
    for name, r in results.items():
        arc, lru = r.hit_rate["arc"], r.hit_rate["lru"]
        worst = min(range(len(r.sizes)), key=lambda i: arc[i] - lru[i])
        row = Row(1, f"arc vs lru, {name}", "rate", arc[worst], f"lru at {r.sizes[worst]} blocks", lru[worst], True,
                  ">= lru - 0.005", details={"arc": arc, "lru": lru, "sizes": r.sizes})
        row.passed = all(a >= b - 0.005 for a, b in zip(arc, lru))
        rows.append(row)
    r = results["scan_mix"]
    gaps = [s - lr for s, lr in zip(r.hit_rate["s3fifo"], r.hit_rate["lru"])]
    best = max(range(len(gaps)), key=gaps.__getitem__)
    row = Row(1, "s3fifo - lru, scan_mix", "rate", r.hit_rate["s3fifo"][best], f"lru at {r.sizes[best]} blocks",
              r.hit_rate["lru"][best], True, "+0.20", details={"gaps": gaps})
    row.paired_ratio = gaps[best]
    row.passed = gaps[best] >= 0.20
    rows.append(row)
    for name in ("chatbot", "multi_turn"):
        r = results[name]
        best_rates = [max(r.hit_rate[p][i] for p in POLICIES) for i in range(len(r.sizes))]
        mean_best, mean_min = statistics.mean(best_rates), statistics.mean(r.hit_rate["belady"])
        row = Row(1, f"best policy, {name}", "rate", mean_best, "belady (mean of sizes)", mean_min, True, ">= 0.9x",
                  details={"best": best_rates, "belady": r.hit_rate["belady"]})
        row.passed = mean_best >= 0.9 * mean_min
        rows.append(row)
    return rows


# =============================================================================================
# 2. cost per operation


def op_cost_rows(keys: int, number: int) -> list[Row]:
    universe = [os.urandom(32) for _ in range(keys)]        # 32 bytes: the daemon's index keys
    probe = universe[keys // 2]
    table_ = dict.fromkeys(universe)
    bare = min(timeit.repeat(lambda: probe in table_, number=number, repeat=5)) / number
    rows = []
    for name in POLICIES:
        policy = make_keyed_policy(name)
        for key in universe:
            policy.insert(key)
        fresh = iter([os.urandom(16) for _ in range(number * 5 + 10)])
        touch = min(timeit.repeat(lambda: policy.touch(probe), number=number, repeat=5)) / number
        insert = min(timeit.repeat(lambda: policy.insert(next(fresh)), number=number, repeat=5)) / number

        def evict() -> None:
            policy.evicted(next(iter(policy.candidates())))

        evict_s = min(timeit.repeat(evict, number=number, repeat=5)) / number
        for op, seconds in (("touch", touch), ("insert", insert), ("evict", evict_s)):
            rows.append(Row(2, f"{name} {op}", "ns", seconds * 1e9, "dict lookup", bare * 1e9, False, "",
                            details={"keys": keys}))
        rows += state_rows(name, universe)
    # the reuse gate is asked once per new block offered (a 32-byte BLAKE3 key, as in the daemon)
    gate = ReuseAdmission(threshold=2, window=100_000)
    offers = iter([os.urandom(32) for _ in range(number * 5 + 10)])
    admit = min(timeit.repeat(lambda: gate.admit(next(offers)), number=number, repeat=5)) / number
    rows.append(Row(2, "reuse admission offer", "ns", admit * 1e9, "dict lookup", bare * 1e9, False, "",
                    details={"window": 100_000}))
    return rows


def state_rows(name: str, universe: list[bytes]) -> list[Row]:
    """What keeping and saving a policy's state costs: the snapshot copy the event loop pays
    (kvcached.policy_state), against a bare list() of a dict of the same keys, and the memory per
    key (the SSD tier's in-memory policies pay it per block, through KeyedPolicy: the key's id
    and the policy's columns), against a bare dict of them."""
    keys = len(universe)
    table_ = dict.fromkeys(universe)
    policy = make_keyed_policy(name)
    for key in universe:
        policy.insert(key)
    copy = min(timeit.repeat(lambda: list(table_), number=3, repeat=3)) / 3
    snapshot = min(timeit.repeat(policy.snapshot, number=3, repeat=3)) / 3
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    bare = dict.fromkeys(universe)
    bare_bytes = tracemalloc.get_traced_memory()[0] - before
    fresh = make_keyed_policy(name)
    for key in universe:
        fresh.insert(key)
    policy_bytes = tracemalloc.get_traced_memory()[0] - before - bare_bytes
    tracemalloc.stop()
    del bare, fresh
    return [Row(2, f"{name} snapshot, per 1k keys", "us", snapshot / keys * 1e9, "list(dict), per 1k keys",
                copy / keys * 1e9, False, "", details={"keys": keys}),
            Row(2, f"{name} memory per key", "B", policy_bytes / keys, "dict entry per key", bare_bytes / keys,
                False, "", details={"keys": keys, "key_bytes": len(universe[0])})]


# =============================================================================================
# 3. the daemon's RAM-tier Get rate per policy


def daemon_rows(calls: int, rounds: int, tmp: Path) -> list[Row]:
    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

    block, working = 64 * KiB, 160                     # 10 MiB cycling through an 8 MiB tier
    digests = [os.urandom(32) for _ in range(working)]
    with contextlib.ExitStack() as stack:
        stubs = {}
        for name in POLICIES:
            (tmp / name).mkdir()
            _, channel = start_kvcached(stack, tmp / name, 0.0078125,
                                        [f'kv.ram_policy="{name}"', "kv.ssd_gib=0", "kv.max_block_mib=1"])
            stubs[name] = pb_grpc.KvCacheStub(channel)
        payload = os.urandom(block)
        rng = __import__("random").Random(7)
        order = [rng.randrange(working) if rng.random() < 0.5 else rng.randrange(working // 4) for _ in range(calls)]
        per_round: dict[str, list[float]] = {n: [] for n in POLICIES}
        for r in range(rounds):
            for name in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
                stub = stubs[name]
                t0 = time.perf_counter()
                for i in order:
                    answer = stub.Get(pb.GetRequest(addresses=[pb.BlockAddress(digest=digests[i])], allow_partial=True),
                                      timeout=30)
                    if not answer.blocks:                   # a miss: the engine would store it
                        stub.Put(pb.PutRequest(blocks=[pb.Block(address=pb.BlockAddress(digest=digests[i]),
                                                                payload=payload)]), timeout=30)
                per_round[name].append(calls / (time.perf_counter() - t0))
    rows = []
    for name in POLICIES:
        row = Row(3, f"Get, {name}", "Gets/s", statistics.median(per_round[name]), "clock",
                  statistics.median(per_round["clock"]), True, ">= 0.9x",
                  paired_ratio=statistics.median(a / b for a, b in zip(per_round[name], per_round["clock"])))
        row.passed = row.ratio >= 0.9
        rows.append(row)
    return rows


def print_rows(rows: list[Row]) -> None:
    for figure in sorted({r.figure for r in rows}):
        print(TITLES[figure])
        for r in (x for x in rows if x.figure == figure):
            if figure == 1 and r.paired_ratio is not None:
                ratio = f"{r.paired_ratio:+.3f}"
            elif figure == 1:
                ratio = f"{r.kvcached / r.baseline:.2f}x" if r.baseline else "-"
            else:
                ratio = f"{r.ratio:.2f}x"
            value = f"{r.kvcached:.3f}" if r.unit == "rate" else f"{r.kvcached:,.0f} {r.unit}"
            base = f"{r.baseline:.3f}" if r.unit == "rate" else f"{r.baseline:,.0f} {r.unit}"
            print(f"  {r.case:<32} {value:>14}  {r.baseline_name:<26} {base:>14}  {ratio:>8}  "
                  f"{r.target or '-':<14} {r.verdict}")
        print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="FILE.svg")
    args = parser.parse_args(argv)
    scale, op_number, calls, rounds = (0.3, 20_000, 300, 3) if args.quick else (1.0, 100_000, 1500, 5)
    started = time.time()
    results: dict[str, Result] = {}
    for name in WORKLOADS:
        t0 = time.monotonic()
        results[name] = simulate(name, make_trace(name, scale), POLICIES, FRACTIONS)
        progress(f"hit rates, {name}: {results[name].accesses} accesses, {time.monotonic() - t0:.1f} s")
    rows = hit_rate_rows(results)
    progress("cost per operation")
    rows += op_cost_rows(100_000, op_number)
    progress(f"daemons, one per policy: {rounds} rounds x {calls} Gets")
    with tempfile.TemporaryDirectory(prefix="kvcbench-policies-") as tmp:
        rows += daemon_rows(calls, rounds, Path(tmp))
    print(f"kvcached policy benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\n")
    print(table(list(results.values())))
    print_rows(rows)
    if args.plot:
        Path(args.plot).write_text(svg(list(results.values())))
        progress(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": [asdict(r) for r in rows],
                                               "hit_rates": {n: asdict(r) for n, r in results.items()}},
                                              indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
