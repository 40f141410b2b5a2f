"""The live miss-ratio curves on a real daemon (docs/operations.md "Sizing the tiers"):

- a slice of the production trace served at full speed through gRPC (each request's blocks
  asked with Get, the missing ones saved with Put), with the curves' cost budget on as it ships:
  `kvcached mrc --json` against `kvcached sim --trace` over the same slice, policy and sizes:
  within 0.03 at 0.5x to 4x, MIN at or above the policy, the 1x figure the daemon's own hit rate;
- a cyclic stream over twice the RAM tier's blocks reads back as curves in Stats, `kvcached mrc`
  (text, JSON, an SVG plot) and the metrics: at 1x and below LRU hits nothing, at 4x every pass
  after the first; a daemon with the curves off, and too small a sample, say so."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from kvcached.api.convert import address_to_pb
from kvcached.policies.curves import MAX_RATE
from kvcached.sim.traces import load_trace
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress
from tests.integration.conftest import run_cli
from tests.integration.test_operations import free_tcp_port

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"
GIB = 1 << 30
BLOCK = 4096
SHARE = 0.25                     # the RAM tier: a quarter of the slice's distinct blocks (4x: all of them)


def test_a_trace_served_at_full_speed_reads_back_as_the_simulators_curve(make_daemon: Any) -> None:
    requests = [[BlockAddress(d) for d in r] for r in load_trace(SLICE).requests]
    unique = len({a.key for r in requests for a in r})
    blocks = int(unique * SHARE)
    d = make_daemon("kv.ssd_gib=0", f"kv.ram_gib={blocks * BLOCK / GIB!r}", f"kv.max_block_mib={BLOCK / (1 << 20)!r}")
    payload = bytes(BLOCK)
    with d.client() as client:
        for request in requests:          # an engine's round: what the daemon holds, then the rest saved
            asked = [address_to_pb(a) for a in request]
            found = {bytes(b.address.digest) for b in client.stub.Get(pb.GetRequest(addresses=asked, allow_partial=True),
                                                                      timeout=60).blocks}
            todo = list({a.digest: a for a in request if a.digest not in found}.values())
            if todo:
                client.stub.Put(pb.PutRequest(blocks=[pb.Block(address=address_to_pb(a), payload=payload) for a in todo]),
                                timeout=60)
        stats = client.stats()
    live = json.loads(run_cli(["mrc", "--json", "--target", d.target]).stdout)
    ram = [p for p in live["points"] if p["tier"] == "TIER_RAM"]
    assert [p["size_multiple"] for p in ram] == [0.5, 1.0, 2.0, 4.0]
    shares = ",".join(f"{SHARE * p['size_multiple']:g}" for p in ram)
    simulated = run_cli(["sim", "--trace", str(SLICE), "--policy", "slru", "--sizes", shares, "--no-prefix", "--json"],
                        timeout=300)
    assert simulated.returncode == 0, simulated.stderr
    exact = json.loads(simulated.stdout)[0]["hit_rate"]["slru"]
    worst = max(max(p.get("error", 0.0), p.get("min_error", 0.0)) for p in ram)
    report = [(p["size_multiple"], round(p["hit_rate"], 3), round(e, 3), p.get("copy_entries")) for p, e in zip(ram, exact)]
    assert worst <= live["accuracy"] and min(int(p["copy_entries"]) for p in ram) >= 64, (report, live)
    for p, e in zip(ram, exact):
        assert abs(p["hit_rate"] - e) <= 0.03, report
        assert p["hit_rate"] <= p["min_hit_rate"] <= 1.0
    one = next(p for p in ram if p["size_multiple"] == 1.0)
    assert abs(one["hit_rate"] - stats.hits / sum(map(len, requests))) <= 0.01, "at 1x: the daemon's own hit rate"
    assert live["busy_seconds"] > 0 and live["rate_limited_by"] in ("cap", "budget")
    text = run_cli(["mrc", "--target", d.target]).stdout
    assert "every figure within" in text and "too few" not in text


KEYS = 8192                      # twice the RAM tier's 4,096 blocks of 4 KiB
PASSES = 3


def test_curves_of_a_cyclic_stream(make_daemon: Any, tmp_path: Path) -> None:
    metrics = free_tcp_port()
    d = make_daemon("kv.ram_gib=0.015625", "kv.ssd_gib=0.125", 'kv.ram_policy="lru"', f"kv.max_block_mib={BLOCK / (1 << 20)!r}",
                    f'metrics.listen="127.0.0.1:{metrics}"')
    addresses = [BlockAddress(i.to_bytes(4, "big") * 8) for i in range(KEYS)]
    with d.client() as client:
        for _ in range(PASSES):
            for i in range(0, KEYS, 256):
                client.put([(a, bytes([i % 251]) * BLOCK) for a in addresses[i:i + 256]])
        curves = client.stats().curves
    assert curves.accesses == KEYS * PASSES and 0 < curves.sampling_rate <= MAX_RATE
    points = {(pb.Tier.Name(p.tier), p.size_multiple): p for p in curves.points}
    assert sorted(points) == sorted((t, m) for t in ("TIER_RAM", "TIER_SSD") for m in (0.5, 1.0, 2.0, 4.0))
    ram = {m: points["TIER_RAM", m] for m in (0.5, 1.0, 2.0, 4.0)}
    assert all(p.known and p.policy == "lru" for p in ram.values())
    assert ram[1.0].size_blocks == 4096, "16 MiB of 4 KiB slots"
    assert ram[0.5].hit_rate < 0.05 and ram[1.0].hit_rate < 0.05, "LRU over a loop twice its size hits nothing"
    assert ram[4.0].hit_rate > 0.5, "at 4x the loop fits: every pass after the first hits"
    assert all(p.hit_rate <= p.min_hit_rate <= 1.0 for p in points.values())
    assert ram[1.0].min_hit_rate > 0.2, "MIN keeps half the loop at 1x"
    # One key in 8 of 8,192 at the cap; the CPU budget (1% of the daemon's, the default a user
    # runs) may cut the rate where the machine is busy (a loaded CI run measured 404 keys): the
    # figures then stand on fewer keys and must say so in their error, never be off by more.
    least = 500 if curves.rate_limited_by == "cap" else 200
    assert all(p.window_keys > least and p.window_uses >= p.window_keys and p.error <= curves.accuracy
               for p in points.values()), [(k, p.window_keys, p.error, curves.rate_limited_by) for k, p in points.items()]
    assert 0 < curves.busy_seconds < 60 and 0 < curves.min_busy_seconds < 60, "what they took is counted"

    text = run_cli(["mrc", "--target", d.target, "--plot", str(tmp_path / "mrc.svg")])
    assert text.returncode == 0, text
    assert "RAM tier (lru): 4096 blocks" in text.stdout and "SSD tier (lru)" in text.stdout, text.stdout
    assert "every figure within" in text.stdout and "s counting uses (on the event loop)" in text.stdout
    assert "<svg" in (tmp_path / "mrc.svg").read_text() and "polyline" in (tmp_path / "mrc.svg").read_text()
    as_json = json.loads(run_cli(["mrc", "--json", "--target", d.target]).stdout)
    assert len(as_json["points"]) == 8 and int(as_json["accesses"]) == KEYS * PASSES
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    assert 'kvcached_curve_hit_ratio{multiple="4",of="policy",tier="ram"}' in scraped
    assert 'kvcached_curve_hit_ratio{multiple="1",of="min",tier="ssd"}' in scraped
    assert 'kvcached_curve_error{multiple="0.5",of="policy",tier="ram"}' in scraped
    assert 'kvcached_curve_window_keys{tier="ram"}' in scraped
    busy = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in scraped.splitlines()
            if line.startswith("kvcached_curve_busy_seconds_total{")}
    assert set(busy) == {'part="uses"', 'part="min"'} and all(v > 0 for v in busy.values()), busy


def test_too_small_a_sample_says_so_instead_of_a_curve(make_daemon: Any, tmp_path: Path) -> None:
    """Copies of 256 keys in all ([kv] curve_sample_keys, its least) for a tier of 4,096 blocks:
    17 keys at 0.5x, and `kvcached mrc` prints no curve, says why and what would give more, and
    writes no plot."""
    d = make_daemon("kv.ram_gib=0.015625", "kv.ssd_gib=0", "kv.curve_sample_keys=256",
                    f"kv.max_block_mib={BLOCK / (1 << 20)!r}")
    addresses = [BlockAddress(i.to_bytes(4, "big") * 8) for i in range(KEYS)]
    with d.client() as client:
        for _ in range(2):
            client.put([(a, bytes(BLOCK)) for a in addresses])
    text = run_cli(["mrc", "--target", d.target, "--plot", str(tmp_path / "mrc.svg")])
    assert text.returncode == 0, text
    assert "too few for a curve" in text.stdout and "curve_sample_keys bounds the copies" in text.stdout, text.stdout
    assert "MIN" not in text.stdout and not (tmp_path / "mrc.svg").exists()


def test_a_daemon_without_curves_says_so(make_daemon: Any) -> None:
    d = make_daemon("kv.curves=false")
    with d.client() as client:
        assert not client.stats().HasField("curves")
    refused = run_cli(["mrc", "--target", d.target])
    assert refused.returncode == 1 and "keeps none (kv.curves = false)" in refused.stderr
