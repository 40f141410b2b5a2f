"""The live miss-ratio curves on a real daemon (docs/operations.md "Sizing the tiers"): a
cyclic stream over twice the RAM tier's blocks, through gRPC, reads back as curves in Stats,
`kvcached mrc` (text, JSON, an SVG plot) and the metrics: at 1x and below the RAM tier's
policy hits little of it, at 4x nearly every pass after the first; MIN never below the policy."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from kvcached.policies.curves import MAX_RATE
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress
from tests.integration.conftest import run_cli
from tests.integration.test_operations import free_tcp_port

BLOCK = 16 << 10
KEYS = 2048                      # twice the 16 MiB RAM tier's 1024 blocks of 16 KiB
PASSES = 3


def test_curves_of_a_cyclic_stream(make_daemon: Any, tmp_path: Path) -> None:
    metrics = free_tcp_port()
    d = make_daemon("kv.ram_gib=0.015625", "kv.ssd_gib=0.0625", 'kv.ram_policy="lru"',
                    f'metrics.listen="127.0.0.1:{metrics}"')
    addresses = [BlockAddress(i.to_bytes(4, "big") * 8) for i in range(KEYS)]
    with d.client() as client:
        for _ in range(PASSES):
            for i in range(0, KEYS, 128):
                client.put([(a, bytes([i % 251]) * BLOCK) for a in addresses[i:i + 128]])
        curves = client.stats().curves
    assert curves.accesses == KEYS * PASSES and 0 < curves.sampling_rate <= MAX_RATE
    points = {(pb.Tier.Name(p.tier), p.size_multiple): p for p in curves.points}
    assert sorted(points) == sorted((t, m) for t in ("TIER_RAM", "TIER_SSD") for m in (0.5, 1.0, 2.0, 4.0))
    ram = {m: points["TIER_RAM", m] for m in (0.5, 1.0, 2.0, 4.0)}
    assert all(p.known and p.policy == "lru" for p in ram.values())
    assert ram[1.0].size_blocks == 1024, "16 MiB of 16 KiB slots"
    assert ram[0.5].hit_rate < 0.05 and ram[1.0].hit_rate < 0.05, "LRU over a loop twice its size hits nothing"
    assert ram[4.0].hit_rate > 0.5, "at 4x the loop fits: every pass after the first hits"
    assert all(p.min_hit_rate >= p.hit_rate - 0.02 for p in points.values()), [(k, p.hit_rate, p.min_hit_rate) for k, p in points.items()]
    assert ram[1.0].min_hit_rate > 0.2, "MIN keeps half the loop at 1x"
    assert 0 < curves.busy_seconds < 60 and 0 < curves.min_busy_seconds < 60, "what they took is counted"

    text = run_cli(["mrc", "--target", d.target, "--plot", str(tmp_path / "mrc.svg")])
    assert text.returncode == 0, text
    assert "RAM tier (lru): 1024 blocks" in text.stdout and "SSD tier (lru)" in text.stdout
    assert "s counting uses (on the event loop)" in text.stdout
    assert "<svg" in (tmp_path / "mrc.svg").read_text() and "polyline" in (tmp_path / "mrc.svg").read_text()
    as_json = json.loads(run_cli(["mrc", "--json", "--target", d.target]).stdout)
    assert len(as_json["points"]) == 8 and int(as_json["accesses"]) == KEYS * PASSES
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    assert 'kvcached_curve_hit_ratio{multiple="4",of="policy",tier="ram"}' in scraped
    assert 'kvcached_curve_hit_ratio{multiple="1",of="min",tier="ssd"}' in scraped
    busy = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in scraped.splitlines()
            if line.startswith("kvcached_curve_busy_seconds_total{")}
    assert set(busy) == {'part="uses"', 'part="min"'} and all(v > 0 for v in busy.values()), busy


def test_a_daemon_without_curves_says_so(make_daemon: Any) -> None:
    d = make_daemon("kv.curves=false")
    with d.client() as client:
        assert not client.stats().HasField("curves")
    refused = run_cli(["mrc", "--target", d.target])
    assert refused.returncode == 1 and "keeps none (kv.curves = false)" in refused.stderr
