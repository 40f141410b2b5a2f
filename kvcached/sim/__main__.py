"""``kvcached sim``: the policy simulator from the command line (also ``python -m kvcached.sim``).

Replays synthetic workloads (``--workload``) and trace files (``--trace``, kvcached.sim.traces),
each under its own name (a trace's is its file's stem); with neither, every workload. The
policies are the registered ones (kvcached.policies.EVICTION_POLICIES), all by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Sequence

from kvcached.policies import EVICTION_POLICIES
from kvcached.sim.replay import Result, simulate
from kvcached.sim.report import svg, table
from kvcached.sim.traces import LoadedTrace, load_trace
from kvcached.sim.workloads import WORKLOADS, make_trace

FRACTIONS = (0.002, 0.01, 0.05, 0.2, 0.5)          # of a synthetic workload's distinct blocks
TRACE_FRACTIONS = (0.01, 0.05, 0.1, 0.2)            # of a trace file's: most of a real trace is seen once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", action="append", choices=list(WORKLOADS),
                   help="a synthetic workload to replay (repeatable; default: all, unless --trace is given)")
    p.add_argument("--trace", action="append", metavar="FILE.jsonl", type=Path,
                   help="a trace file to replay: JSON Lines with timestamp (ms) and hash_ids per request, as in "
                   "the Mooncake trace release (repeatable)")
    p.add_argument("--policy", action="append", choices=sorted(EVICTION_POLICIES),
                   help="a policy to replay (repeatable; default: all)")
    p.add_argument("--sizes", help="cache sizes as shares of each workload's distinct blocks (default "
                   f"{','.join(map(str, FRACTIONS))} for workloads, {','.join(map(str, TRACE_FRACTIONS))} for traces)")
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="block hits only: skip the prefix-hit replays (half the time)")
    p.add_argument("--scale", type=float, default=1.0, help="requests per workload, times the usual number")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", metavar="FILE.svg", help="also write the hit-rate plot there")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table (per "
                   "workload: its sizes in blocks and each policy's hit rate at each, block and prefix hits)")


def _sizes(text: str | None, default: Sequence[float]) -> list[float]:
    if text is None:
        return list(default)
    try:
        fractions = [float(x) for x in text.split(",")]
    except ValueError:
        fractions = []
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--sizes: shares in (0, 1], got {text!r}")
    return fractions


def _progress(t0: float, line: str) -> None:
    print(f"[sim {time.monotonic() - t0:5.1f}s] {line}", file=sys.stderr)


def _inputs(args: argparse.Namespace) -> tuple[list[float], list[float], list[LoadedTrace]]:
    """The sizes for workloads and for traces, and the trace files loaded: every input error
    (ValueError for --sizes, TraceError, OSError) before any replay."""
    workload_sizes, trace_sizes = _sizes(args.sizes, FRACTIONS), _sizes(args.sizes, TRACE_FRACTIONS)
    traces = []
    for path in args.trace or []:
        t0 = time.monotonic()
        traces.append(load_trace(path))
        _progress(t0, f"{traces[-1].name}: {len(traces[-1].requests)} requests from {path}")
    return workload_sizes, trace_sizes, traces


def _replay(args: argparse.Namespace, workload_sizes: list[float], trace_sizes: list[float],
            traces: list[LoadedTrace]) -> list[Result]:
    policies = args.policy or list(EVICTION_POLICIES)
    workloads = args.workload or ([] if traces else list(WORKLOADS))
    results = []
    for name in workloads:
        t0 = time.monotonic()
        results.append(simulate(name, make_trace(name, args.scale, args.seed), policies, workload_sizes,
                                prefix=args.prefix, progress=partial(_progress, t0)))
        _progress(t0, f"{name}: {results[-1].accesses} accesses")
    for trace in traces:
        t0 = time.monotonic()
        results.append(simulate(trace.name, trace.requests, policies, trace_sizes, prefix=args.prefix,
                                span_ms=trace.span_ms, progress=partial(_progress, t0)))
        _progress(t0, f"{trace.name}: {results[-1].accesses} accesses")
    return results


def run(args: argparse.Namespace) -> list[Result]:
    """Every workload and trace file of ``args``, replayed (see :func:`simulate`)."""
    return _replay(args, *_inputs(args))


def execute(args: argparse.Namespace) -> int:
    """Run, print the table (and write the plot). Bad input (--sizes, a trace file that cannot
    be read or is not a trace) is found before any replay: ``kvcached sim: error: ...`` on
    stderr, and 2."""
    try:
        inputs = _inputs(args)
    except OSError as exc:
        return _error(f"cannot read {exc.filename}: {exc.strerror or exc}")
    except ValueError as exc:                           # TraceError among them
        return _error(str(exc))
    results = _replay(args, *inputs)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    else:
        print(table(results))
    if args.plot:
        Path(args.plot).write_text(svg(results))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _error(message: str) -> int:
    print(f"kvcached sim: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcached sim", description="replay synthetic workloads and trace files "
                                     "against the eviction policies and Belady's MIN")
    add_arguments(parser)
    return execute(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
