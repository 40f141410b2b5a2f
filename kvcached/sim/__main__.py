"""``kvcached sim``: the policy simulator from the command line (also ``python -m kvcached.sim``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from kvcached.policies import EVICTION_POLICIES
from kvcached.sim.replay import Result, simulate
from kvcached.sim.report import svg, table
from kvcached.sim.workloads import WORKLOADS, make_trace

FRACTIONS = (0.002, 0.01, 0.05, 0.2, 0.5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", action="append", choices=list(WORKLOADS),
                   help="a workload to replay (repeatable; default: all)")
    p.add_argument("--policy", action="append", choices=sorted(EVICTION_POLICIES),
                   help="a policy to replay (repeatable; default: all)")
    p.add_argument("--sizes", default=",".join(map(str, FRACTIONS)),
                   help="cache sizes as shares of each workload's distinct blocks (default %(default)s)")
    p.add_argument("--scale", type=float, default=1.0, help="requests per workload, times the usual number")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", metavar="FILE.svg", help="also write the hit-rate plot there")


def run(args: argparse.Namespace) -> list[Result]:
    fractions = [float(x) for x in args.sizes.split(",")]
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--sizes: shares in (0, 1], got {args.sizes!r}")
    policies = args.policy or ["lru", "clock", "arc", "s3fifo"]
    results = []
    for name in args.workload or list(WORKLOADS):
        t0 = time.monotonic()
        result = simulate(name, make_trace(name, args.scale, args.seed), policies, fractions)
        print(f"[sim {time.monotonic() - t0:5.1f}s] {name}: {result.accesses} accesses", file=sys.stderr)
        results.append(result)
    return results


def execute(args: argparse.Namespace) -> int:
    results = run(args)
    print(table(results))
    if args.plot:
        Path(args.plot).write_text(svg(results))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcached sim", description="replay synthetic workloads against the "
                                     "eviction policies and Belady's MIN")
    add_arguments(parser)
    return execute(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
