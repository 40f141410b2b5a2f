"""What the live miss-ratio curves cost and how close they come (kvcached.policies.curves, issue 42).

    python bench/bench_curves.py [--quick] [--json PATH]

1. Cost. Three ``kvcached serve`` subprocesses alike (bench_core.start_kvcached: RAM 0.5 GiB,
   SSD 1 GiB written back): "curves" with ``kv.curves = true`` (the default: RAM and SSD
   curves), "off" and "off-b" with ``kv.curves = false``. Gets of a working set, then Puts of
   fresh blocks, through gRPC, 16 KiB x64 and 64 KiB x16, rounds interleaved (the order reversed
   each round); before the Puts each daemon is filled once, so every Put round evicts, and its
   write-back of the fill is waited out (and after each Put round, so that no daemon's round
   runs beside another's write-back), and each case runs untimed for 2 s on each daemon first
   (the steady state: a busy daemon's curves sample fewer keys within seconds). The ratio is the
   median over rounds of curves / off. Target (issue 42): >= 0.98x. Figures 1b and 2b: the
   daemon's CPU time per call, the ratio off / curves. Figure 2 is the same against "off-b", two
   daemons alike (A/A): the spread that is noise. Figure 1c: the curves daemon's own count of
   what the curves took (Stats' curves.busy_seconds, its event loop's CPU clock around the
   counting of sampled uses, and min_busy_seconds, computing the figures) against its CPU in the
   same rounds: their share of its CPU, what a CPU-bound daemon's throughput loses to them,
   without the A/A spread (ratio 1 - share, target >= 0.99x: at most 1%, issue 60). Not in it:
   the ``min`` of each call's keys against the sample's threshold.
   Figures 1d and 2d: each round's p99 call latency, curves / off and off-b / off (the sampled
   uses are counted after the call that made them is answered, kvcached.store.curves; no target).
3. Accuracy. The curves fed, as the daemon feeds them, the block uses of the Mooncake trace
   (../shared/traces) and of every synthetic workload (at 8 times their default length; 2 with
   --quick), beside the tier's own policy; against the simulator's exact replay of the same
   stream over the window's span at 0.5x, 1x, 2x and 4x a tier of a tenth of the distinct
   blocks, and Belady's MIN over the whole stream counted in the same span (the live MIN starts
   from the state of a MIN run behind the window, which sees only as far ahead as the window;
   a MIN started cold at the window's start is below both by what the window's first uses
   miss). Targets (issue 42): within 0.02, MIN within 0.03.
4. A trace through a real daemon at full speed, the curves' budget on, then `kvcached mrc`
   against `kvcached sim --trace` (bench/curves_trace.py; 3 runs, 1 with --quick). Target
   (issue 60): within 0.03 at 0.5x-4x, MIN at or above the policy.

--quick: 3 rounds of 0.3 s, the workloads at twice their length, one run of figure 4 (about
three minutes). Full: 5 rounds of 1 s, three runs (about twelve minutes). --trace-only: figure 4.
--accuracy-only skips figures 1-2 and 4; --rekey SALT
replays every stream with its keys re-hashed (other keys fall in the sample: runs with several
salts show the spread sampling gives); --cost-only skips figure 3; --max-rate R sets the sample's
rate cap (default 1/8).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import (  # noqa: E402
    Case,
    GrpcBackend,
    Row,
    drained,
    fresh_keys,
    load_working_set,
    print_fitted,
    progress,
    run_case,
    start_kvcached,
)
from curves_trace import print_trace, trace_runs  # noqa: E402

from kvcached.policies import make_keyed_policy  # noqa: E402
from kvcached.policies.belady import belady_hits  # noqa: E402
from kvcached.policies.curves import MAX_RATE, MULTIPLES, MissRatioCurves, TierSpec  # noqa: E402
from kvcached.sim.replay import accesses_of, replay_hits  # noqa: E402
from kvcached.sim.traces import load_trace  # noqa: E402
from kvcached.sim.workloads import WORKLOADS, make_trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
CASES = (Case("get", 16 << 10, 64), Case("get", 64 << 10, 16), Case("put", 16 << 10, 64), Case("put", 64 << 10, 16))
COST_TARGET = 0.98
SHARE_TARGET = 0.99     # the curves' own count: at most 1% of the daemon's CPU (issue 60)
WARM_UP_S = 2.0     # of each case on each daemon before its rounds: a busy daemon's curves lower their rate within seconds
ACCURACY, MIN_ACCURACY = 0.02, 0.03


def cost_rows(backends: dict[str, GrpcBackend], rounds: int, seconds: float) -> list[Row]:
    rows = []
    payloads = {case.size: os.urandom(case.size) for case in CASES}
    working = {size: load_working_set(list(backends.values()), size, max(64, (16 << 20) // size), payload)
               for size, payload in payloads.items()}
    for backend in backends.values():        # the working sets written back before any round is timed
        drained(backend)
    for case in CASES:
        if case is CASES[2]:               # the Gets' working set is no longer needed: fill, so every Put evicts
            for backend in backends.values():
                progress(f"filling {backend.name}: 0.6 GiB of 64 KiB puts, so every Put round evicts")
                for _ in range(0, 10_000, 16):
                    backend.put(backend.put_request(fresh_keys(16), payloads[64 << 10]))
            for backend in backends.values():        # the fill's write-back done: every daemon starts alike
                drained(backend)
        runs: dict[str, list[float]] = {name: [] for name in backends}
        cpu: dict[str, list[float]] = {name: [] for name in backends}
        tail: dict[str, list[float]] = {name: [] for name in backends}      # p99 of a call, us
        busy: list[float] = []           # the curves daemon's own count of their time, us per call
        for name, backend in backends.items():     # untimed: each daemon in its steady state for the case
            run_case(backend, case, working[case.size], payloads[case.size], WARM_UP_S)   # (the curves' rate settled)
            if case.op == "put":
                drained(backend)
        for r in range(rounds):
            for name in (list(backends) if r % 2 == 0 else list(reversed(backends))):
                before = busy_seconds(backends[name])
                got = run_case(backends[name], case, working[case.size], payloads[case.size], seconds)
                if before is not None:
                    busy.append(((busy_seconds(backends[name]) or 0.0) - before) / got["calls"] * 1e6)
                runs[name].append(got["gbps"])
                tail[name].append(got["p99_us"])
                cpu[name].append(got["server_user_us_per_call"] + got["server_sys_us_per_call"])
                if case.op == "put":              # its write-back runs out before the next daemon's round
                    drained(backends[name])
        for figure, name, base, target in ((1, "curves", "off", f">= {COST_TARGET:.2f}x"), (2, "off-b", "off", "")):
            ratio = statistics.median(a / b for a, b in zip(runs[name], runs[base]))
            rows.append(Row(figure, f"{case.label}, {name}", "GB/s", statistics.median(runs[name]), base,
                            statistics.median(runs[base]), True, target, ratio >= COST_TARGET if target else None,
                            {"rounds": runs}, ratio))
            # The daemon's CPU per call: the less noisy measure of what the curves add.
            mine, theirs = statistics.median(cpu[name]), statistics.median(cpu[base])
            rows.append(Row(figure + 2, f"{case.label}, {name}", "us", mine, base, theirs, False, target,
                            theirs / mine >= COST_TARGET if target else None, {"rounds": cpu}, theirs / mine))
            # A call's p99: the curves' work on a sampled use must not land on the call that made it.
            rows.append(Row(figure + 5, f"{case.label}, {name}", "us", statistics.median(tail[name]), base,
                            statistics.median(tail[base]), False, details={"rounds": tail},
                            paired_ratio=statistics.median(a / b for a, b in zip(tail[name], tail[base]))))
        # The curves' share of their daemon's CPU, by their own timer (kvcached_curve_busy_seconds):
        # what a CPU-bound daemon's throughput loses to them, without the A/A spread of figure 1.
        shares = [b / c for b, c in zip(busy, cpu["curves"])]
        rows.append(Row(5, f"{case.label}, share {statistics.median(shares):.2%}", "us", statistics.median(busy),
                        "daemon CPU", statistics.median(cpu["curves"]), False, f">= {SHARE_TARGET:.2f}x",
                        statistics.median(1 - x for x in shares) >= SHARE_TARGET, {"busy": busy},
                        statistics.median(1 - x for x in shares)))
        progress(f"{case.label}: " + ", ".join(f"{n} {statistics.median(v):.3f} GB/s" for n, v in runs.items()))
    return rows


def busy_seconds(backend: GrpcBackend) -> float | None:
    """The daemon's count of the time its curves took: counting uses on the event loop, and
    computing the figures (None: it keeps none)."""
    from kvcached.v1 import kvcache_pb2 as pb
    stats = backend.stub.Stats(pb.StatsRequest(), timeout=10)
    return stats.curves.busy_seconds + stats.curves.min_busy_seconds if stats.HasField("curves") else None


def accuracy(name: str, stream: Sequence[bytes], policy: str, share: float = 0.1,
             max_rate: float = MAX_RATE) -> list[dict[str, Any]]:
    """The live curves against the exact replay of ``stream`` over the same span (see the
    module), fed beside the tier with its own hit count, their budget off."""
    size = max(1, int(len(set(stream)) * share))
    tier = make_keyed_policy(policy)
    own = [0]
    curves = MissRatioCurves([TierSpec("ram", policy, tier.policy, size * 4096, lambda n: n)], lambda: 0.0,
                             min_every_s=0.0, busy_share=None, max_rate=max_rate, own_hits=lambda: (own[0],))
    for hit, key in zip(replay_hits(tier, size, stream), stream):
        own[0] += hit
        curves.access(key, 4096)
    points = {p.multiple: p for p in curves.points()}
    first, last = curves.min_span
    window = stream[first - 1:last]
    out = []
    for m in MULTIPLES:
        at = round(m * size)
        exact = sum(list(replay_hits(make_keyed_policy(policy), at, stream))[first - 1:last]) / len(window)
        least = sum(belady_hits(at, stream)[first - 1:last]) / len(window)     # MIN over the whole stream, in the span
        p = points[m]
        out.append({"workload": name, "policy": policy, "multiple": m, "blocks": at, "live": p.hit_rate, "exact": exact,
                    "live_min": p.min_hit_rate, "exact_min": least, "rate": curves.sample.rate,
                    "sampled": curves.sampled})
    return out


def rekeyed(stream: Sequence[bytes], salt: str) -> list[bytes]:
    """``stream`` with every key replaced by its keyed BLAKE2b (the same key, the same new key):
    the same traffic with other keys falling in the sample, so that runs apart show the spread
    that which keys are sampled gives."""
    new: dict[bytes, bytes] = {}
    return [new.get(key) or new.setdefault(key, hashlib.blake2b(key, key=salt.encode(), digest_size=32).digest())
            for key in stream]


def print_accuracy(results: list[dict[str, Any]]) -> bool:
    print()
    print("3. Accuracy: live curves against the exact replay of the same stream (a tier of 10% of the distinct blocks)")
    print(f"  {'workload':<22}{'policy':<8}{'size':>6}{'blocks':>9}{'live':>8}{'exact':>8}{'diff':>8}"
          f"{'MIN live':>10}{'exact':>8}{'diff':>8}  verdict")
    ok = True
    for r in results:
        diff, dmin = abs(r["live"] - r["exact"]), abs(r["live_min"] - r["exact_min"])
        passed = diff <= ACCURACY and dmin <= MIN_ACCURACY
        ok = ok and passed
        print(f"  {r['workload']:<22}{r['policy']:<8}{r['multiple']:>5g}x{r['blocks']:>9}{r['live']:>8.3f}"
              f"{r['exact']:>8.3f}{diff:>8.3f}{r['live_min']:>10.3f}{r['exact_min']:>8.3f}{dmin:>8.3f}  "
              f"{'PASS' if passed else 'BELOW TARGET'}")
    print(f"  targets: within {ACCURACY}, MIN within {MIN_ACCURACY} (absolute hit rate)")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--accuracy-only", action="store_true", help="skip the cost figures (1-2)")
    parser.add_argument("--cost-only", action="store_true", help="skip the accuracy figure (3)")
    parser.add_argument("--rekey", metavar="SALT", help="accuracy of the streams re-keyed with SALT (see rekeyed)")
    parser.add_argument("--max-rate", type=float, default=MAX_RATE, help=f"the sample's rate cap (default {MAX_RATE:g})")
    parser.add_argument("--trace-only", action="store_true", help="figure 4 alone (a trace through a real daemon)")
    parser.add_argument("--trace", metavar="FILE.jsonl", help="figure 4's trace (default: requests 4,000-8,000 of the "
                        "conversation trace)")
    args = parser.parse_args(argv)
    if not 0 < args.max_rate <= 1:
        parser.error(f"--max-rate must be in (0, 1], not {args.max_rate}")
    rounds, seconds, scale = (3, 0.3, 2.0) if args.quick else (5, 1.0, 8.0)
    if args.trace_only:
        args.accuracy_only = args.cost_only = True
    rows = [] if args.accuracy_only else cost(rounds, seconds)
    trace = None if args.accuracy_only and not args.trace_only else trace_runs(1 if args.quick else 3, args.trace)
    return _report(args, rows, rounds, seconds, scale, trace)


def cost(rounds: int, seconds: float) -> list[Row]:
    """Figures 1-2: three daemons, the curves on in one (see the module)."""
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcb-curves-")))
        backends = {}
        for name, on in (("curves", "true"), ("off", "false"), ("off-b", "false")):
            home = tmp / name
            home.mkdir()
            proc, channel = start_kvcached(stack, home, 0.5, ["kv.ssd_gib=1", f"kv.curves={on}"])
            backends[name] = GrpcBackend(name, channel, proc.proc.pid)
        progress(f"1-2. Gets and Puts with the curves on and off: {rounds} rounds of {seconds:g} s a case")
        return cost_rows(backends, rounds, seconds)


def _report(args: argparse.Namespace, rows: list[Row], rounds: int, seconds: float, scale: float,
            trace: dict[str, Any] | None) -> int:
    """The accuracy figures, then every figure printed (and written with --json)."""
    results = []
    streams = [("trace", "slru"), ("trace", "lru"), ("trace", "s3fifo")] if TRACE.exists() else []
    streams += [(name, "slru") for name in WORKLOADS]
    if args.cost_only:
        streams = []
    for name, policy in streams:
        progress(f"3. accuracy: {name}, {policy}")
        stream = (accesses_of(load_trace(str(TRACE)).requests) if name == "trace"
                  else accesses_of(make_trace(name, scale)))
        if args.rekey:
            stream = rekeyed(stream, args.rekey)
        results += accuracy(name if name == "trace" else f"{name} x{scale:g}", stream, policy, max_rate=args.max_rate)
    titles = {1: "1. Cost: Gets and Puts with the curves on against off (higher is better)",
              2: "2. Spread: the same on two daemons alike, both off (A/A; how far from 1.00x is noise)",
              3: "1b. The daemon's CPU (user and system) per call, curves on against off (ratio: off / on)",
              4: "2b. The same, A/A",
              5: "1c. The curves' own time per call (their timer) against the daemon's CPU per call, same rounds "
                 "(ratio: 1 - share)",
              6: "1d. A call's p99 latency, curves on against off (lower is better)",
              7: "2d. The same, A/A"}
    if rows:
        print_fitted(rows, f"kvcached curves benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
                     f"{rounds} rounds of {seconds:g} s", titles, lambda v, u: f"{v:.3f} {u}",
                     ["ratio: median over rounds of the two sides in the same round."])
    if results:
        print_accuracy(results)
    if trace is not None:
        print_trace(trace)
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": [r.__dict__ for r in rows], "accuracy": results, "trace": trace},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
