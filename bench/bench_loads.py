"""Loads that pay (issue 42): an agent's load plan against loading everything and against
recomputing everything, measured in the same run while tc throttles the link to the peer holding
the blocks.

    python bench/bench_loads.py [--json PATH] [--quick]      # root: network namespaces and tc

Setup: two real ``kvcached serve`` daemons in network namespaces on a bridge (tests/netns.py
``Hosts``), peering with mutual TLS (tests/integration/test_peers.py ``Cluster``: certificates
from ``kvcached certs``, QUIC control plus the daemon's default TLS lane for payloads,
``quic.max_datagram_size=1350``, ``quic.pull_timeout_s=10``), as tests/integration/test_delivery.py
does. The holder's link is held to a rate by tc tbf (``Hosts.throttle``; no netem here). Daemons
run under ``setpriv --pdeathsig TERM``; everything is stopped and the namespaces removed in
``finally``. An ``Agent`` in this process is connected to the puller's agent socket.

The engine's stand-in prefill is real CPU work: 256 x 256 float32 matmuls (torch, one thread), as
many per block as make a block cost ~RECOMPUTE_MS, calibrated at start. Its cost per block is
measured as an engine would: ``kvcached_agent.prefill.PrefillRate`` fed with timed steps of 1..16
blocks (and with every compute step of the run after that), ``recompute_s =
seconds_per_token() * BLOCK_TOKENS``.

Each request: a fresh chain of N=16 blocks of 64 KiB (random digests: nothing cached from an
earlier one), the first 2 put in the puller's RAM, the other 14 at the holder only; the clock
starts once the puller's Lookup sees all 16. Three strategies, interleaved (load all, plan,
recompute all; repeated), each on its own chain, timed wall clock from the first agent call to
the end of the compute:

1. load all: ``agent.lookup`` then ``agent.load`` of every held block, recompute what was not loaded;
2. recompute all: the stand-in compute for 16 blocks (baseline, no daemon call);
3. plan: ``agent.plan_loads(chain, recompute_s)``, load the first ``plan.load`` blocks, recompute the rest.

Sweep: unthrottled, 200, 100, 64, 16, 4 mbit, then unthrottled again (the estimate climbing back
up). Loading 14 x 64 KiB takes as long as recomputing 14 blocks at ~100 mbit, so the crossover is
inside the sweep. Per rate the medians per strategy; ratios are of medians of the same run.

Target (issue 42): plan <= 1.10 x the slower of load-all and recompute-all at every rate. Also
shown, no target: plan / the better of the two.

Caveat printed with the table: the load-all requests' pulls keep the daemon's peer estimate
(kvcached/store/reads.py DeliveryRates: the last 8 pulls, unused once 30 s old) fresh, which a
plan alone would not. So a plan-only phase follows the sweep (full run only): 10 plan requests
spread over 45 s at 16 mbit, nothing else pulling, showing each plan's choice and the estimate it
went by (implied by the reply: 14 x 64 KiB / load_all_s; 0 = no current estimate, every peer
block taken to pay: the probe once per 30 s).

--quick: 2 requests per strategy and rate, no plan-only phase (~20 s). Full: 7 requests
(~2-3 minutes). Progress on stderr, the table on stdout; ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_core import KiB, progress  # noqa: E402

from kvcached.client import KvCacheClient  # noqa: E402
from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402
from kvcached_agent.prefill import PrefillRate  # noqa: E402
from tests.integration.conftest import DaemonProcess, wait_for  # noqa: E402
from tests.integration.test_peers import Cluster, connected  # noqa: E402
from tests.netns import Hosts, netns_usable  # noqa: E402

BLOCK = 64 * KiB
N = 16                       # blocks in a chain
IN_RAM = 2                   # of them in the puller's RAM; the rest only at the holder
PEER_BYTES = (N - IN_RAM) * BLOCK
BLOCK_TOKENS = 16
RECOMPUTE_MS = 5.0           # what the stand-in prefill is calibrated to cost per block
SIDE = 256                   # the stand-in's matmuls: SIDE x SIDE float32
TARGET = 1.10                # plan / slower of load-all and recompute-all
RATES: tuple[tuple[str, str | None], ...] = (
    ("unthrottled", None), ("200mbit", "200mbit"), ("100mbit", "100mbit"), ("64mbit", "64mbit"),
    ("16mbit", "16mbit"), ("4mbit", "4mbit"), ("unthrottled again", None))
SOLO_RATE = "16mbit"


@dataclass(frozen=True)
class Settings:
    reps: int                # timed requests per strategy and rate
    solo: int                # plan-only requests after the sweep (0: phase skipped)
    solo_s: float            # spread over this long


FULL = Settings(reps=7, solo=10, solo_s=45.0)
QUICK = Settings(reps=2, solo=0, solo_s=0.0)


class Prefill:
    """The engine's stand-in: ``per_block`` matmuls a block, fed to ``rate`` as steps."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.a, self.b = torch.randn(SIDE, SIDE), torch.randn(SIDE, SIDE)
        self.out = torch.empty(SIDE, SIDE)
        self.per_block = 1
        self.rate = PrefillRate()

    def run(self, blocks: int) -> None:
        for _ in range(blocks * self.per_block):
            torch.mm(self.a, self.b, out=self.out)

    def step(self, blocks: int) -> None:
        """Recompute ``blocks`` blocks, telling the rate what it took (as an engine's steps do)."""
        if blocks > 0:
            t0 = time.perf_counter()
            self.run(blocks)
            self.rate.step(blocks * BLOCK_TOKENS, time.perf_counter() - t0)

    def calibrate(self) -> dict[str, float]:
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            self.run(1)
            times.append(time.perf_counter() - t0)
        self.per_block = max(1, round(RECOMPUTE_MS / 1e3 / statistics.median(times[50:])))
        for _ in range(4):
            for blocks in (1, 2, 4, 8, 16):
                self.step(blocks)
        return {"matmuls_per_block": self.per_block, "recompute_s": self.recompute_s()}

    def recompute_s(self) -> float:
        per_token = self.rate.seconds_per_token()
        assert per_token is not None, "the prefill rate is measured in calibrate()"
        return per_token * BLOCK_TOKENS


@dataclass
class Rig:
    hosts: Hosts
    holder_ns: str
    puller: KvCacheClient
    holder: KvCacheClient
    agent: Agent
    prefill: Prefill
    bufs: list[torch.Tensor]

    def chain(self) -> tuple[list[bytes], list[bytes]]:
        """A fresh chain: its first IN_RAM blocks in the puller's RAM, the rest at the holder."""
        digests = [os.urandom(32) for _ in range(N)]
        payloads = [os.urandom(BLOCK) for _ in range(N)]
        blocks = [(BlockAddress(d), p) for d, p in zip(digests, payloads)]
        self.puller.put(blocks[:IN_RAM])
        self.holder.put(blocks[IN_RAM:])
        wait_for(lambda: self.puller.lookup(digests).longest == N, timeout=30, text="the puller sees the chain")
        return digests, payloads

    def load(self, digests: Sequence[bytes], payloads: Sequence[bytes], n: int) -> int:
        """Load the first ``n`` blocks; how many from the first arrived (checked byte for byte
        after the clock stops: see :meth:`check`)."""
        return self.agent.load(Agent.addresses(digests[:n]), self.bufs[:n]).prefix if n else 0

    def check(self, payloads: Sequence[bytes], n: int) -> None:
        for i in range(n):
            if self.bufs[i].numpy().tobytes() != payloads[i]:
                raise RuntimeError(f"block {i} loaded is not the block put")


def load_all(rig: Rig) -> dict[str, Any]:
    digests, payloads = rig.chain()
    t0 = time.perf_counter()
    held = rig.agent.lookup(digests).longest
    loaded = rig.load(digests, payloads, held)
    rig.prefill.step(N - loaded)
    seconds = time.perf_counter() - t0
    rig.check(payloads, loaded)
    return {"s": seconds, "loaded": loaded}


def recompute_all(rig: Rig) -> dict[str, Any]:
    t0 = time.perf_counter()
    rig.prefill.step(N)
    return {"s": time.perf_counter() - t0, "loaded": 0}


def plan(rig: Rig) -> dict[str, Any]:
    digests, payloads = rig.chain()
    recompute_s = rig.prefill.recompute_s()
    t0 = time.perf_counter()
    answer = rig.agent.plan_loads(digests, recompute_s)
    loaded = rig.load(digests, payloads, answer.load)
    rig.prefill.step(N - loaded)
    seconds = time.perf_counter() - t0
    rig.check(payloads, loaded)
    # With every block held, load_all_s is what the 14 peer blocks cost by the daemon's estimate;
    # 0 when it has none current (stale or never measured): peer blocks are then taken to pay.
    estimate = PEER_BYTES / answer.load_all_s / 1e6 if answer.load_all_s > 0 else 0.0
    return {"s": seconds, "loaded": loaded, "plan_load": answer.load, "held": answer.held,
            "skipped_peer": answer.skipped_peer, "expected_s": answer.seconds, "load_all_s": answer.load_all_s,
            "recompute_all_s": answer.recompute_all_s, "recompute_s": recompute_s, "estimate_mb_s": estimate}


STRATEGIES = {"load_all": load_all, "plan": plan, "recompute_all": recompute_all}


def sweep_rate(rig: Rig, label: str, rate: str | None, reps: int) -> dict[str, Any]:
    if rate:
        rig.hosts.throttle(rig.holder_ns, rate)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in STRATEGIES}
    for r in range(reps):
        for name, strategy in STRATEGIES.items():
            runs[name].append(strategy(rig))
        progress(f"{label}: request {r + 1}/{reps}: load all {runs['load_all'][-1]['s'] * 1e3:.0f} ms, plan "
                 f"{runs['plan'][-1]['s'] * 1e3:.0f} ms ({runs['plan'][-1]['loaded']} loaded), recompute all "
                 f"{runs['recompute_all'][-1]['s'] * 1e3:.0f} ms")
    if rate:
        rig.hosts.throttle(rig.holder_ns, None)
    ms = {name: statistics.median(x["s"] for x in xs) * 1e3 for name, xs in runs.items()}
    slower, better = max(ms["load_all"], ms["recompute_all"]), min(ms["load_all"], ms["recompute_all"])
    return {"rate": label, "tc_rate": rate, "ms": ms, "plan_loaded": [x["loaded"] for x in runs["plan"]],
            "estimate_mb_s": [x["estimate_mb_s"] for x in runs["plan"]],
            "delivered_mb_s": PEER_BYTES / (ms["load_all"] / 1e3) / 1e6,
            "vs_slower": ms["plan"] / slower, "vs_better": ms["plan"] / better, "runs": runs}


def solo(rig: Rig, s: Settings) -> list[dict[str, Any]]:
    """Plan-only requests at SOLO_RATE, nothing else pulling, spread over ``s.solo_s`` seconds."""
    rig.hosts.throttle(rig.holder_ns, SOLO_RATE)
    out = []
    start = time.monotonic()
    try:
        for i in range(s.solo):
            time.sleep(max(0.0, start + i * s.solo_s / s.solo - time.monotonic()))
            x = plan(rig)
            x["at_s"] = time.monotonic() - start
            out.append(x)
            progress(f"plan only at {SOLO_RATE}, {x['at_s']:.0f} s: {x['s'] * 1e3:.0f} ms, {x['loaded']} loaded, "
                     f"estimate {x['estimate_mb_s']:.1f} MB/s")
    finally:
        rig.hosts.throttle(rig.holder_ns, None)
    return out


def start_rig(stack: contextlib.ExitStack, tmp: Path) -> Rig:
    hosts = Hosts(tag="kvl", subnet="10.251.42")
    stack.callback(hosts.close)
    puller_ns, holder_ns = hosts.add("a"), hosts.add("b")
    cluster = Cluster(tmp, ("node-a", "node-b"))
    stack.callback(cluster.stop)
    cluster.addresses = {"node-a": f"{hosts.hosts[puller_ns]}:7500", "node-b": f"{hosts.hosts[holder_ns]}:7501"}
    daemons: list[DaemonProcess] = []
    for name, ns in (("node-a", puller_ns), ("node-b", holder_ns)):
        d = cluster.daemon(name, "quic.max_datagram_size=1350", "quic.pull_timeout_s=10", start=False)
        d.prefix = hosts.exec(ns) + ["setpriv", "--pdeathsig", "TERM"]
        daemons.append(d.start())
    a, b = daemons
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), timeout=30, text="peers connected")
    agent = Agent.connect(str(a.state / "agent.sock"), agent_id="bench-loads", model="m", dtype="bf16",
                          block_tokens=BLOCK_TOKENS, num_layers=1, layer_block_bytes=BLOCK, use_cuda=False, timeout=30)
    stack.callback(agent.close)
    puller, holder = stack.enter_context(a.client(timeout=30)), stack.enter_context(b.client(timeout=30))
    bufs = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(N)]
    return Rig(hosts, holder_ns, puller, holder, agent, Prefill(), bufs)


def print_table(rows: list[dict[str, Any]], header: str) -> bool:
    cols = ("rate", "delivered MB/s", "estimate MB/s", "load all ms", "recompute all ms", "plan ms",
            f"plan loaded of {N}", "plan/slower", "plan/better")
    table = [cols]
    for r in rows:
        table.append((r["rate"], f"{r['delivered_mb_s']:.1f}",
                      " ".join(f"{e:.0f}" if e else "-" for e in r["estimate_mb_s"]),
                      f"{r['ms']['load_all']:.1f}", f"{r['ms']['recompute_all']:.1f}", f"{r['ms']['plan']:.1f}",
                      ",".join(map(str, r["plan_loaded"])), f"{r['vs_slower']:.2f}", f"{r['vs_better']:.2f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print(header)
    for row in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    worst = max(r["vs_slower"] for r in rows)
    ok = worst <= TARGET
    print(f"target: plan <= {TARGET:.2f} x slower of (load all, recompute all) at every rate: "
          f"{'PASS' if ok else 'FAIL'} (worst {worst:.2f}); plan / better of the two: no target, "
          f"worst {max(r['vs_better'] for r in rows):.2f}, median {statistics.median(r['vs_better'] for r in rows):.2f}")
    return ok


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (~1 minute): 2 requests a strategy, no plan-only phase")
    args = parser.parse_args(argv)
    if not netns_usable() or shutil.which("tc") is None or shutil.which("setpriv") is None:
        print("bench_loads: skipped: it needs root, and the ip, tc and setpriv tools (network namespaces, a "
              "throttled link)")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    s = QUICK if args.quick else FULL
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcbench-loads-") as tmpdir, contextlib.ExitStack() as stack:
        progress("starting two daemons in network namespaces, peering")
        rig = start_rig(stack, Path(tmpdir))
        calibration = rig.prefill.calibrate()
        progress(f"stand-in prefill: {calibration['matmuls_per_block']} matmuls a block, PrefillRate says "
                 f"{calibration['recompute_s'] * 1e3:.2f} ms a block")
        rows = [sweep_rate(rig, label, rate, s.reps) for label, rate in RATES[:-1]]
        solo_runs = solo(rig, s) if s.solo else []
        rows.append(sweep_rate(rig, *RATES[-1], s.reps))      # the estimate climbing back up
    header = (f"bench_loads ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\n"
              f"chain of {N} x {BLOCK // KiB} KiB blocks, {IN_RAM} in the puller's RAM, {N - IN_RAM} at the peer; "
              f"recompute {calibration['recompute_s'] * 1e3:.2f} ms a block (PrefillRate at start); medians of "
              f"{s.reps} requests per strategy and rate")
    ok = print_table(rows, header)
    print(f"note: delivered = {N - IN_RAM} x 64 KiB / load-all median; estimate = the daemon's peer rate each plan "
          "went by, in order (implied by its reply; '-': none current, peer blocks taken to pay). The load-all "
          "requests' pulls keep that estimate fresh; a plan alone pulls nothing while it recomputes.")
    if solo_runs:
        recompute = next(r["ms"]["recompute_all"] for r in rows if r["tc_rate"] == SOLO_RATE)
        loads = next(r["ms"]["load_all"] for r in rows if r["tc_rate"] == SOLO_RATE)
        probes = [x for x in solo_runs if x["loaded"] > IN_RAM]
        print(f"plan only at {SOLO_RATE} ({len(solo_runs)} requests over {s.solo_s:.0f} s, nothing else pulling): "
              "at s / ms / loaded / estimate MB/s: "
              + "; ".join(f"{x['at_s']:.0f} / {x['s'] * 1e3:.0f} / {x['loaded']} / "
                          + (f"{x['estimate_mb_s']:.1f}" if x["estimate_mb_s"] else "-") for x in solo_runs))
        mean = statistics.fmean(x["s"] for x in solo_runs) * 1e3
        print(f"  {len(probes)} of them loaded peer blocks (the estimate went stale: a probe); mean {mean:.1f} ms, "
              f"median {statistics.median(x['s'] for x in solo_runs) * 1e3:.1f} ms, against the sweep's recompute all "
              f"{recompute:.1f} ms and load all {loads:.1f} ms at {SOLO_RATE}")
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                        "settings": asdict(s), "block_bytes": BLOCK, "chain": N, "in_ram": IN_RAM,
                        "block_tokens": BLOCK_TOKENS, "target": TARGET},
               "calibration": calibration, "rates": rows, "plan_only": {"rate": SOLO_RATE, "runs": solo_runs},
               "passed": ok}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); daemons stopped, namespaces removed")
        sys.exit(130)
