"""Figure 4 of bench_curves: a trace through a real daemon at full speed, then `kvcached mrc`
against `kvcached sim --trace` over the same requests (issue 60's check, as an operator runs it).

A `kvcached serve` subprocess, RAM only, 4 KiB blocks, its RAM tier a ``share`` of the trace's
distinct blocks, the curves as they ship (their cost budget on); one client replays the trace
as fast as the daemon answers: per request a gRPC Get of its blocks, then a Put of the ones it
did not find. Then `kvcached mrc --json` is asked, and `kvcached sim --trace` replays the same
requests for the tier's policy at 0.5x to 4x the tier (the exact figures). Per run: each size's
live figure against the exact one (target: within 0.03), MIN at or above the policy at every
size, what the curves stand on (keys, rate, what holds the rate), and their share of the
daemon's CPU (counting uses, and computing the figures) over the replay.

The default trace is requests 4,000 to 8,000 of the Mooncake conversation trace (../shared/
traces; the tests use its first 1,500), or a file given with --trace (all its requests).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench_core import proc_times, progress, start_kvcached

from kvcached.api.convert import address_to_pb
from kvcached.sim.traces import load_trace
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import BlockAddress

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"
BLOCK = 4096
TARGET = 0.03
KVCACHED = [str(Path(sys.executable).with_name("kvcached"))]


def trace_file(tmp: Path, given: str | None) -> Path:
    """The trace to replay: ``given``, else requests 4,000-8,000 of the conversation trace
    (written to ``tmp``), else the tests' slice."""
    if given:
        return Path(given)
    if not CONVERSATION.exists():
        return SLICE
    out = tmp / "conversation_4000_8000.jsonl"
    with CONVERSATION.open("rb") as f, out.open("wb") as w:
        for i, line in enumerate(f):
            if 4000 <= i < 8000:
                w.write(line)
    return out


def serve(stub: Any, requests: Sequence[Sequence[BlockAddress]]) -> None:
    """Each request as an engine's round: what the daemon holds, then the rest saved."""
    payload = bytes(BLOCK)
    for request in requests:
        asked = [address_to_pb(a) for a in request]
        found = {bytes(b.address.digest) for b in stub.Get(pb.GetRequest(addresses=asked, allow_partial=True),
                                                           timeout=60).blocks}
        todo = list({a.digest: a for a in request if a.digest not in found}.values())
        if todo:
            stub.Put(pb.PutRequest(blocks=[pb.Block(address=address_to_pb(a), payload=payload) for a in todo]),
                     timeout=60)


def cli(args: Sequence[str]) -> Any:
    done = subprocess.run(KVCACHED + list(args), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"kvcached {' '.join(args)}: {done.stderr}")
    return json.loads(done.stdout)


def trace_runs(runs: int, given: str | None, share: float = 0.05) -> dict[str, Any]:
    """The figure's numbers: the exact replay and each run's live figures (see the module)."""
    with tempfile.TemporaryDirectory(prefix="kvcb-trace-") as tmp_name:
        tmp = Path(tmp_name)
        path = trace_file(tmp, given)
        requests = [[BlockAddress(d) for d in r] for r in load_trace(path).requests]
        uses = sum(map(len, requests))
        unique = len({a.key for r in requests for a in r})
        blocks = int(unique * share)
        shares = [share * m for m in (0.5, 1.0, 2.0, 4.0)]
        progress(f"4. {path.name}: {len(requests)} requests, {uses} block uses, {unique} distinct; RAM {blocks} blocks")
        out: dict[str, Any] = {"trace": str(path), "requests": len(requests), "uses": uses, "unique": unique,
                               "blocks": blocks, "runs": []}
        for run in range(runs):
            with contextlib.ExitStack() as stack:
                home = tmp / f"run{run}"
                home.mkdir()
                proc, channel = start_kvcached(stack, home, blocks * BLOCK / (1 << 30),
                                               ["kv.ssd_gib=0", f"kv.max_block_mib={BLOCK / (1 << 20)!r}"])
                pid = proc.proc.pid
                user, system, _ = proc_times(pid)
                started = time.monotonic()
                serve(pb_grpc.KvCacheStub(channel), requests)
                seconds = time.monotonic() - started
                user2, system2, _ = proc_times(pid)
                live = cli(["mrc", "--json", "--target", f"unix:{home}/kvcached.sock"])
                cpu = (user2 - user) + (system2 - system)
                out["runs"].append({"seconds": seconds, "uses_per_s": uses / seconds, "daemon_cpu": cpu, "live": live})
                progress(f"4. run {run + 1}: {uses / seconds:.0f} uses/s, daemon {cpu / seconds:.2f} cores")
        policy = out["runs"][0]["live"]["points"][0]["policy"]
        progress(f"4. kvcached sim --trace {path.name} --policy {policy}")
        exact = cli(["sim", "--trace", str(path), "--policy", policy, "--sizes", ",".join(f"{s:g}" for s in shares),
                     "--no-prefix", "--json"])[0]
        out["policy"], out["exact"] = policy, exact["hit_rate"][policy]
        return out


def print_trace(result: dict[str, Any]) -> bool:
    """Figure 4's table; True where every run met the targets."""
    print()
    print(f"4. A trace through a real daemon at full speed: `kvcached mrc` against `kvcached sim --trace` "
          f"({result['requests']} requests, {result['uses']} block uses, RAM {result['blocks']} blocks of 4 KiB, "
          f"{result['policy']})")
    print(f"  {'run':<5}{'uses/s':>8}{'size':>6}{'exact':>8}{'live':>8}{'diff':>8}{'error':>7}{'ratio':>7}"
          f"{'MIN':>7}{'keys':>7}{'rate':>8}  {'held by':<8}{'curves CPU':>11}  verdict")
    ok = True
    for i, run in enumerate(result["runs"], 1):
        live = run["live"]
        ram = [p for p in live["points"] if p["tier"] == "TIER_RAM"]
        share = (live.get("busy_seconds", 0.0) + live.get("min_busy_seconds", 0.0)) / run["daemon_cpu"]
        for p, exact in zip(ram, result["exact"]):
            diff = p.get("hit_rate", 0.0) - exact
            passed = abs(diff) <= TARGET and p.get("hit_rate", 0.0) <= p.get("min_hit_rate", 0.0) <= 1.0
            ok = ok and passed
            print(f"  {i:<5}{run['uses_per_s']:>8.0f}{p['size_multiple']:>5g}x{exact:>8.3f}{p.get('hit_rate', 0.0):>8.3f}"
                  f"{diff:>+8.3f}{p.get('error', 0.0):>7.3f}{p.get('hit_rate', 0.0) / exact if exact else 0:>6.2f}x"
                  f"{p.get('min_hit_rate', 0.0):>7.3f}{int(p.get('window_keys', 0)):>7}{live['sampling_rate']:>8.4f}  "
                  f"{live.get('rate_limited_by', ''):<8}{share:>10.2%}  {'PASS' if passed else 'BELOW TARGET'}")
    print(f"  target: within {TARGET} of the exact replay at every size, MIN at or above the policy; ratio: live / exact;"
          " curves CPU: counting uses and computing the figures, over the daemon's CPU in the replay")
    return ok


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print_trace(trace_runs(int(os.environ.get("RUNS", "1")), sys.argv[1] if len(sys.argv) > 1 else None))
