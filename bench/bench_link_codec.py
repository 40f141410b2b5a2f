"""Codecs on the links between daemons (issue 64): a peer pull with ``quic.link_codec`` "none",
"planes-zstd" and "auto", measured in the same run, unthrottled and with tc holding the holder's
link to 1 Gbit/s.

    python bench/bench_link_codec.py [--corpus DIR] [--block-kib 256] [--json PATH] [--quick]   # root: netns, tc

Setup: four real ``kvcached serve`` daemons, each in its own network namespace on a bridge
(tests/netns.py ``Hosts``), peering with mutual TLS (tests/integration/test_peers.py ``Cluster``:
certificates from ``kvcached certs``, QUIC control plus the daemon's default TLS lane for
payloads, ``quic.max_datagram_size=1350``, ``quic.pull_timeout_s=10``), as
tests/integration/test_delivery.py and bench/bench_loads.py do. One holder lists the three
pullers as peers; each puller lists the holder alone, with ``kv.mirror_pulls=false`` (a pulled
block is not kept nor announced, so no puller ever pulls from another) and its own
``quic.link_codec``: "none", "planes-zstd", "auto". Every daemon has ``kv.ssd_gib=0`` (no SSD
write-back competing for the 2 cores) and metrics on (``metrics.listen`` on its own address,
scraped over the bridge as test_delivery does). Daemons run under ``setpriv --pdeathsig TERM``;
everything is stopped and the namespaces removed in ``finally``. The holder's link is held to a
rate by tc tbf on its side (``Hosts.throttle``: what the holder sends; no netem here).

Loads go through an ``Agent`` (kvcached_agent) in this process connected to each puller's agent
socket, as bench_loads does: the puller pulls into its arena and the agent copies out of the
shared mapping, so no gRPC message carries the payloads back.

Data: with ``--corpus DIR``, real KV blocks written by bench/kv_corpus.py (``block-NNNNN.bin``,
one block's raw payload each, and ``meta.json``), taken in order and wrapping, at the corpus'
block size; without it, synthetic bf16: float32 standard normals truncated to their top 16 bits
(fresh values every round), ``--block-kib`` (256) a block. The codec's ratio on the blocks used
is printed (planes-zstd's encode, margin 0.05, as the holder codes them for the link).

Each round: the holder is given N fresh blocks (random digests: nothing cached anywhere; N = 32,
or more to make 8 MiB); each puller's Lookup must see all N at the peer; then each puller in
turn (the order rotated every round) loads all N, timed wall clock around ``agent.load``; every
load is checked byte for byte after the clock stops. Each daemon's /metrics is scraped after
each load, so each load's coded pulls (puller) and coded blocks and saved bytes (holder) are
known.

Rates: unthrottled; 1gbit by ``Hosts.throttle`` (tc tbf, its burst what the rate sends in one
timer tick: a burst of 16 KiB at 1 Gbit/s, a tenth of a tick, cost both daemons two to four
times the CPU of a load, which on 2 cores is the CPU the codec needs); then unthrottled again
(full run only). Each rate starts with warm-up rounds, not timed. "auto" starts raw with a
peer, probes the other form once it has moved LinkCoding.PROBE_BYTES and then once per
LinkCoding.PROBE_S (30 s), for PROBE_BYTES; those probes stay in the timed rounds: they are
part of what auto costs. Which form each of auto's loads took is printed, in order.

Per rate: each puller's median seconds a load, GB/s (block bytes / median), p25-p75 and min-max
of its rounds, the ratios planes-zstd vs none and auto vs none (speedup = none's median / its
median), the mean CPU (user + system, /proc ticks) of the holder and of that puller a load, and
the holder's tc counters at the end of each throttled rate. Targets (issue 64): throttled, the
coded pull >= 1.2x faster than raw (for planes-zstd and for auto); unthrottled, auto no slower
than raw beyond the spread, taken as raw's slowest round over its median (whether auto is also
within raw's p75 is printed).

--quick: 3 warm-up and 8 timed rounds a rate, no "unthrottled again" (~20 s). Full: 6 warm-up
and 100 timed rounds a rate (~3 minutes). Progress on stderr, the table on stdout; ``--json
PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_core import KiB, MiB, proc_times, progress, stop_on_sigterm  # noqa: E402

from kvcached.client import KvCacheClient  # noqa: E402
from kvcached.codecs import codec_named  # noqa: E402
from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402
from kvcached_agent.transfer import chunks  # noqa: E402
from tests.integration.conftest import DaemonProcess, wait_for  # noqa: E402
from tests.integration.test_peers import Cluster, connected  # noqa: E402
from tests.netns import Hosts, netns_usable  # noqa: E402

HOLDER = "holder"
PULLERS = ("none", "planes-zstd", "auto")          # each puller's quic.link_codec
MIN_BLOCKS = 32
MIN_ROUND_BYTES = 8 * MiB
METRICS_PORT = 9464
LINK_MARGIN = 0.05           # kvcached/peers/lane_server.py: a block coding shrinks by less goes raw
TARGET_SLOW = 1.2            # at 1gbit: the coded pull's speedup over raw
RATE = "1gbit"


@dataclass(frozen=True)
class Rate:
    label: str
    tc_rate: str | None = None       # None: unthrottled


RATES = (Rate("unthrottled"), Rate(RATE, RATE), Rate("unthrottled again"))
COUNTERS = {"lane_pulls": "kvcached_lane_pulls_total", "coded_pulls": "kvcached_lane_coded_pulls_total",
            "coded_blocks": "kvcached_lane_coded_blocks_total", "saved_bytes": "kvcached_lane_coded_saved_bytes_total",
            "failed": 'kvcached_quic_pulls_total{outcome="failed"}', "fallbacks": "kvcached_lane_fallbacks_total"}


@dataclass(frozen=True)
class Settings:
    warmup: int              # rounds a rate, not timed
    timed: int               # rounds a rate, timed
    rates: int               # of RATES


FULL = Settings(warmup=6, timed=100, rates=3)
QUICK = Settings(warmup=3, timed=8, rates=2)


class Blocks:
    """Where each round's payloads come from: the corpus' blocks in order (wrapping), or fresh
    synthetic bf16."""

    def __init__(self, corpus: str | None, block_kib: int) -> None:
        self.files: list[Path] = []
        self.at = 0
        self.rng = np.random.default_rng(64)
        if corpus:
            meta_path = Path(corpus, "meta.json")
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            files = sorted(Path(corpus).glob("block-*.bin"))
            if not files:
                raise SystemExit(f"bench_link_codec: no block-*.bin in {corpus} (bench/kv_corpus.py writes them)")
            sizes: dict[int, int] = {}
            for f in files:
                sizes[f.stat().st_size] = sizes.get(f.stat().st_size, 0) + 1
            self.size = max(sizes, key=lambda s: sizes[s])          # the corpus' block size (one, normally)
            self.files = [f for f in files if f.stat().st_size == self.size]
            self.what = (f"real KV: {len(self.files)} blocks of {self.size // KiB} KiB, {meta.get('model', '?')} "
                         f"({meta.get('dtype', '?')}), from {corpus}")
        else:
            self.size = block_kib * KiB
            self.what = (f"SYNTHETIC bf16 (float32 standard normals, top 16 bits), {block_kib} KiB blocks: "
                         "real KV codes differently (--corpus)")
        self.n = max(MIN_BLOCKS, math.ceil(MIN_ROUND_BYTES / self.size))

    def take(self, n: int) -> list[bytes]:
        if self.files:
            out = [self.files[(self.at + i) % len(self.files)].read_bytes() for i in range(n)]
            self.at = (self.at + n) % len(self.files)
            return out
        values = self.rng.standard_normal(n * self.size // 2, dtype=np.float32)
        words = (values.view(np.uint32) >> 16).astype(np.uint16)
        return [words[i * self.size // 2:(i + 1) * self.size // 2].tobytes() for i in range(n)]


def codec_ratio(payloads: Sequence[bytes]) -> dict[str, float]:
    """planes-zstd on ``payloads`` as the holder codes them for the link."""
    codec = codec_named("planes-zstd")
    assert codec is not None
    raw = wire = coded = 0
    t0 = time.perf_counter()
    for b in payloads:
        form = codec.encode(memoryview(b), LINK_MARGIN)
        raw += len(b)
        wire += len(form) if form is not None else len(b)
        coded += form is not None
    seconds = time.perf_counter() - t0
    return {"ratio": raw / wire, "coded": coded, "blocks": len(payloads), "encode_gb_s": raw / seconds / 1e9}


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(address: str) -> dict[str, float]:
    text = _OPENER.open(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for key, series in COUNTERS.items():
        found = re.search(f"^{re.escape(series)} (\\S+)$", text, re.M)
        out[key] = float(found.group(1)) if found else float("nan")
    return out


@dataclass
class Puller:
    codec: str
    daemon: DaemonProcess
    client: KvCacheClient
    agent: Agent
    metrics: str
    counters: dict[str, float]

    @property
    def pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid


def cpu_s(pid: int) -> float:
    user, system, _ = proc_times(pid)
    return user + system


@dataclass
class Rig:
    hosts: Hosts
    holder_ns: str
    holder: KvCacheClient
    holder_metrics: str
    holder_counters: dict[str, float]
    holder_pid: int
    pullers: list[Puller]
    blocks: Blocks
    bufs: list[torch.Tensor]


def load(rig: Rig, p: Puller, digests: Sequence[bytes], payloads: Sequence[bytes]) -> dict[str, Any]:
    """``p`` loads the round's blocks: seconds, checked exact, the CPU seconds the holder and the
    puller spent meanwhile (the kernel's ticks: 10 ms steps), and what the metrics counted."""
    cpu0 = cpu_s(rig.holder_pid), cpu_s(p.pid)
    t0 = time.perf_counter()
    result = p.agent.load(Agent.addresses(digests), rig.bufs)
    seconds = time.perf_counter() - t0
    cpu = cpu_s(rig.holder_pid) - cpu0[0], cpu_s(p.pid) - cpu0[1]
    if result.missing:
        raise RuntimeError(f"puller {p.codec}: {len(result.missing)} of {len(digests)} blocks missing "
                           f"(prefix {result.prefix}); its log: {p.daemon.log_path}")
    for i, want in enumerate(payloads):
        if rig.bufs[i].numpy().tobytes() != want:
            raise RuntimeError(f"puller {p.codec}: block {i} loaded is not the block put")
    now, held = scrape(p.metrics), scrape(rig.holder_metrics)
    delta = {k: now[k] - p.counters[k] for k in ("lane_pulls", "coded_pulls", "failed", "fallbacks")}
    delta.update({k: held[k] - rig.holder_counters[k] for k in ("coded_blocks", "saved_bytes")})
    p.counters, rig.holder_counters = now, held
    return {"s": seconds, "holder_cpu_s": cpu[0], "puller_cpu_s": cpu[1], **delta}


def round_(rig: Rig, r: int) -> dict[str, dict[str, Any]]:
    """One round: fresh blocks at the holder, seen by every puller, loaded by each in turn."""
    n = rig.blocks.n
    digests = [os.urandom(32) for _ in range(n)]
    payloads = rig.blocks.take(n)
    rig.holder.put(list(zip((BlockAddress(d) for d in digests), payloads)))
    for p in rig.pullers:
        wait_for(lambda: p.client.lookup(digests).peer == n, timeout=30, text=f"puller {p.codec} sees the blocks")
    k = r % len(rig.pullers)
    return {p.codec: load(rig, p, digests, payloads) for p in rig.pullers[k:] + rig.pullers[:k]}


def form(x: dict[str, Any]) -> str:
    """A load's form, by the puller's counters: C coded, R raw, M mixed (several pulls), F a failure."""
    if x["failed"] or x["fallbacks"]:
        return "F"
    if x["coded_pulls"] == 0:
        return "R"
    return "C" if x["coded_pulls"] == x["lane_pulls"] else "M"


def qdisc_stats(rig: Rig) -> str:
    """What tc says of the holder's qdisc (tbf while throttled): bytes sent, drops, overlimits."""
    n = list(rig.hosts.hosts).index(rig.holder_ns) + 2
    out = subprocess.run(rig.hosts.exec(rig.holder_ns) + ["tc", "-s", "qdisc", "show", "dev", f"{rig.hosts.tag}i{n}"],
                         capture_output=True, text=True).stdout
    return " ".join(out.split())


def run_rate(rig: Rig, rate: Rate, s: Settings, r0: int) -> dict[str, Any]:
    qdisc, label = "", rate.label
    if rate.tc_rate:
        rig.hosts.throttle(rig.holder_ns, rate.tc_rate)
    try:
        warm: list[dict[str, dict[str, Any]]] = []
        for r in range(s.warmup):
            warm.append(round_(rig, r0 + r))
            progress(f"{label}: warm-up {r + 1}/{s.warmup}: " + ", ".join(
                f"{c} {x['s'] * 1e3:.0f} ms {form(x)}" for c, x in warm[-1].items()))
        runs: list[dict[str, dict[str, Any]]] = []
        for r in range(s.timed):
            runs.append(round_(rig, r0 + s.warmup + r))
            progress(f"{label}: round {r + 1}/{s.timed}: " + ", ".join(
                f"{c} {x['s'] * 1e3:.0f} ms {form(x)}" for c, x in runs[-1].items()))
        qdisc = qdisc_stats(rig)
    finally:
        if rate.tc_rate:
            rig.hosts.throttle(rig.holder_ns, None)
    nbytes = rig.blocks.n * rig.blocks.size
    per: dict[str, dict[str, Any]] = {}
    for c in PULLERS:
        xs = [run[c] for run in runs]
        secs = [x["s"] for x in xs]
        med = statistics.median(secs)
        per[c] = {"median_s": med, "mean_s": statistics.fmean(secs), "min_s": min(secs), "max_s": max(secs),
                  "gb_s": nbytes / med / 1e9, "forms": "".join(form(x) for x in xs),
                  "warm_forms": "".join(form(run[c]) for run in warm),
                  "holder_cpu_ms": statistics.fmean(x["holder_cpu_s"] for x in xs) * 1e3,
                  "puller_cpu_ms": statistics.fmean(x["puller_cpu_s"] for x in xs) * 1e3,
                  "p25_s": statistics.quantiles(secs, n=4)[0], "p75_s": statistics.quantiles(secs, n=4)[2],
                  **{k: sum(x[k] for x in xs) for k in ("lane_pulls", "coded_pulls", "coded_blocks", "saved_bytes",
                                                         "failed", "fallbacks")},
                  "s": secs}
    raw = per["none"]["median_s"]
    return {"rate": label, "tc_rate": rate.tc_rate, "pullers": per, "bytes": nbytes, "qdisc": qdisc,
            "speedup": {c: raw / per[c]["median_s"] for c in PULLERS},
            "raw_spread": (per["none"]["min_s"] / raw, per["none"]["max_s"] / raw),
            "raw_iqr": (per["none"]["p25_s"] / raw, per["none"]["p75_s"] / raw),
            "warmup": warm, "runs": runs}


def start_rig(stack: contextlib.ExitStack, tmp: Path, blocks: Blocks) -> Rig:
    hosts = Hosts(tag="kvk", subnet="10.251.64")
    stack.callback(hosts.close)
    names = (HOLDER, *(f"pull-{c}" for c in PULLERS))
    spaces = {name: hosts.add(name.replace("pull-", "p").replace("planes-zstd", "zstd")) for name in names}
    cluster = Cluster(tmp, names)
    stack.callback(cluster.stop)
    cluster.addresses = {name: f"{hosts.hosts[spaces[name]]}:7500" for name in names}
    metrics = {name: f"{hosts.hosts[spaces[name]]}:{METRICS_PORT}" for name in names}
    common = ("quic.max_datagram_size=1350", "quic.pull_timeout_s=10", "kv.ssd_gib=0")
    round_mib = blocks.n * blocks.size / MiB
    daemons: dict[str, DaemonProcess] = {}
    for name in names:
        if name == HOLDER:
            d = cluster.daemon(name, *common, f'metrics.listen="{metrics[name]}"',
                               f"kv.ram_gib={max(0.5, 4 * round_mib / 1024):g}", start=False)
        else:
            d = cluster.daemon(name, *common, f'metrics.listen="{metrics[name]}"', "kv.mirror_pulls=false",
                               f'quic.link_codec="{name.removeprefix("pull-")}"',
                               f"kv.ram_gib={max(0.25, 2 * round_mib / 1024):g}",
                               peers={HOLDER: cluster.addresses[HOLDER]}, start=False)
        d.prefix = hosts.exec(spaces[name]) + ["setpriv", "--pdeathsig", "TERM"]
        daemons[name] = d.start(wait=False)
    for d in daemons.values():
        d.wait_ready(timeout=60)
    holder = daemons[HOLDER]
    wait_for(lambda: connected(holder, *names[1:]) and all(connected(daemons[n], HOLDER) for n in names[1:]),
             timeout=60, text="peers connected")
    pullers = []
    for c in PULLERS:
        d = daemons[f"pull-{c}"]
        agent = Agent.connect(str(d.state / "agent.sock"), agent_id=f"bench-link-{c}", model="m", dtype="bf16",
                              block_tokens=16, num_layers=1, layer_block_bytes=blocks.size, use_cuda=False, timeout=60)
        stack.callback(agent.close)
        client = stack.enter_context(d.client(timeout=30))
        pullers.append(Puller(c, d, client, agent, metrics[d.state.name], scrape(metrics[d.state.name])))
    bufs = [torch.empty(blocks.size, dtype=torch.uint8) for _ in range(blocks.n)]
    assert holder.proc is not None
    return Rig(hosts, spaces[HOLDER], stack.enter_context(holder.client(timeout=60)), metrics[HOLDER],
               scrape(metrics[HOLDER]), holder.proc.pid, pullers, blocks, bufs)


def tally(forms: str) -> str:
    return " ".join(f"{f}{forms.count(f)}" for f in "CRMF" if f in forms)


def print_table(rows: list[dict[str, Any]], header: str) -> dict[str, bool]:
    cols = ("rate", "link_codec", "median s", "GB/s", "p25-p75 s", "min-max s", "vs none", "CPU ms holder",
            "CPU ms puller", "coded pulls/pulls", "holder coded blocks", "saved MiB", "loads by form")
    table = [cols]
    for r in rows:
        for c in PULLERS:
            x = r["pullers"][c]
            table.append((r["rate"] if c == PULLERS[0] else "", c, f"{x['median_s']:.4f}", f"{x['gb_s']:.3f}",
                          f"{x['p25_s']:.4f}-{x['p75_s']:.4f}", f"{x['min_s']:.4f}-{x['max_s']:.4f}",
                          "-" if c == "none" else f"{r['speedup'][c]:.2f}x", f"{x['holder_cpu_ms']:.0f}",
                          f"{x['puller_cpu_ms']:.0f}", f"{x['coded_pulls']:.0f}/{x['lane_pulls']:.0f}",
                          f"{x['coded_blocks']:.0f}", f"{x['saved_bytes'] / MiB:.1f}", tally(x["forms"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print(header)
    for row in table:
        print("  ".join(c.ljust(w) if i in (0, 1, 12) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    verdicts: dict[str, bool] = {}
    for r in rows:
        lo, hi = r["raw_spread"]
        q1, q3 = r["raw_iqr"]
        spread = f"raw's rounds: min-max {lo:.2f}-{hi:.2f}x, p25-p75 {q1:.2f}-{q3:.2f}x its median"
        if r["tc_rate"]:
            for c in ("planes-zstd", "auto"):
                ok = r["speedup"][c] >= TARGET_SLOW
                verdicts[f"{r['rate']}: {c}"] = ok
                print(f"target at {r['rate']}: {c} >= {TARGET_SLOW:.1f}x faster than raw: {'PASS' if ok else 'FAIL'} "
                      f"({r['speedup'][c]:.2f}x; {spread})")
        else:
            slower = 1 / r["speedup"]["auto"]
            ok = slower <= hi
            verdicts[f"{r['rate']}: auto"] = ok
            print(f"target {r['rate']}: auto no slower than raw beyond the spread: {'PASS' if ok else 'FAIL'} (auto "
                  f"takes {slower:.2f}x raw's median time; {spread}; within p75: {'yes' if slower <= q3 else 'no'}); "
                  f"planes-zstd on every pull: {r['speedup']['planes-zstd']:.2f}x (no target)")
    for r in rows:
        if r["tc_rate"]:
            print(f"holder's qdisc at the end of {r['rate']}: {r['qdisc']}")
        print(f"auto's timed loads at {r['rate']}, in order: {r['pullers']['auto']['forms']} "
              f"(warm-up: {r['pullers']['auto']['warm_forms']})")
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", metavar="DIR", help="real KV blocks from bench/kv_corpus.py (default: synthetic bf16)")
    parser.add_argument("--block-kib", type=int, default=256, help="synthetic block size, KiB (default 256)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smoke test (~20 s): 3 warm-up and 8 timed rounds a rate")
    args = parser.parse_args(argv)
    if not netns_usable() or shutil.which("tc") is None or shutil.which("setpriv") is None:
        print("bench_link_codec: skipped: it needs root, and the ip, tc and setpriv tools (network namespaces, a "
              "throttled link)")
        return 0
    if args.block_kib <= 0 or args.block_kib * KiB > 8 * MiB or args.block_kib * KiB % 2:
        parser.error("--block-kib: 1..8192 (the daemons' kv.max_block_mib is 8)")
    stop_on_sigterm()
    s = QUICK if args.quick else FULL
    started = time.time()
    blocks = Blocks(args.corpus, args.block_kib)
    sample = codec_ratio(blocks.take(min(blocks.n, 16)))
    progress(f"{blocks.what}; planes-zstd {sample['ratio']:.2f}x on {sample['blocks']} of them "
             f"({sample['coded']} coded), encode {sample['encode_gb_s']:.2f} GB/s on one thread here")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-link-") as tmpdir, contextlib.ExitStack() as stack:
        progress("starting a holder and three pullers in network namespaces, peering")
        rig = start_rig(stack, Path(tmpdir), blocks)
        r0 = 0
        for rate in RATES[:s.rates]:
            rows.append(run_rate(rig, rate, s, r0))
            r0 += s.warmup + s.timed
    header = (f"bench_link_codec ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\n"
              f"data: {blocks.what}\n"
              f"planes-zstd on it: {sample['ratio']:.2f}x ({sample['coded']} of {sample['blocks']} blocks coded, margin "
              f"{LINK_MARGIN}), encode {sample['encode_gb_s']:.2f} GB/s on one thread here\n"
              f"a load: {blocks.n} x {blocks.size // KiB} KiB = {blocks.n * blocks.size / MiB:.1f} MiB from the holder over "
              f"the TLS lane, through an Agent; medians of {s.timed} rounds a rate after {s.warmup} warm-up rounds")
    verdicts = print_table(rows, header)
    spans = chunks([blocks.size] * blocks.n)
    print("note: vs none = none's median / this median (speedup). CPU ms: the daemon's user+system CPU a load, mean "
          f"(10 ms ticks). A load is {len(spans)} pulls (the agent loads in chunks of "
          f"{', '.join(f'{len(x) * blocks.size / MiB:g}' for x in spans)} MiB, the next asked while one is copied); "
          "by the puller's counters a load "
          "is C (every pull asked coded), R (none did), M (some did) or F (a pull failed or fell back to QUIC). auto's "
          "probes of the other form (once per 30 s) are in its figures. Holder coded blocks / saved MiB: what the "
          "holder's counters moved by during that puller's loads. The 1gbit rows: tc tbf on the holder's side "
          "(Hosts.throttle: the burst one timer tick of the rate).")
    if args.json:
        doc = {"meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "started": started, "elapsed_s": time.time() - started,
                        "settings": asdict(s), "data": blocks.what, "block_bytes": blocks.size, "blocks": blocks.n,
                        "codec_sample": sample, "target_slow": TARGET_SLOW},
               "rates": rows, "verdicts": verdicts}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({exc or 'Ctrl-C'}); daemons stopped, namespaces removed")
        sys.exit(130)
