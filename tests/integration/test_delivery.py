"""What a source of blocks delivers, measured by the daemon from its own reads (issue 42, "loads
that pay"): two daemons in network namespaces, one pulling from the other, the holder's link
held to a rate by tc (a token bucket; netem is not in these machines' kernels). The puller's
estimate of its peers' rate follows the link: fast, then near the throttle, then fast again
once it is lifted. An agent's load plan follows it: peer blocks are skipped as slower than
recomputing them while the link is throttled, and loaded once it is lifted; RAM blocks always."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from kvcached_agent.address import BlockAddress
from kvcached_agent.agent import Agent
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_operations import free_tcp_port
from tests.integration.test_peers import Cluster, connected
from tests.netns import Hosts, netns_usable

BLOCK = 64 << 10
BATCH = 8                    # blocks a Get pulls at once: 512 KiB
GETS = 8                     # Gets a phase: the estimate's whole window
RECOMPUTE_S = 0.005          # what recomputing a block costs the engine, as an agent says


def scraped(address: str, series: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    found = re.search(f"^{re.escape(series)} (\\S+)$", text, re.M)
    assert found, f"no {series}"
    return float(found.group(1))


def peer_rate(address: str) -> float:
    return scraped(address, 'kvcached_delivery_bytes_per_second{source="peer"}')


def chain_on(puller: DaemonProcess, holder: DaemonProcess, tag: int) -> list[bytes]:
    """Six blocks: the first two in ``puller``'s RAM, the rest at ``holder`` alone."""
    chain = [bytes([tag, i]) + os.urandom(30) for i in range(6)]
    with puller.client() as client:
        client.put([(BlockAddress(d), os.urandom(BLOCK)) for d in chain[:2]])
    with holder.client() as client:
        client.put([(BlockAddress(d), os.urandom(BLOCK)) for d in chain[2:]])
    with puller.client() as client:
        wait_for(lambda: client.lookup(chain).longest == 6, timeout=10, text="the puller learns of the chain")
    return chain


def pull_phase(puller: DaemonProcess, holder: DaemonProcess, tag: int) -> None:
    """``GETS`` Gets on ``puller`` of ``BATCH`` blocks each that only ``holder`` has."""
    for g in range(GETS):
        blocks = {BlockAddress(bytes([tag, g, i]) + os.urandom(29)): os.urandom(BLOCK) for i in range(BATCH)}
        with holder.client() as client:
            client.put(list(blocks.items()))
        with puller.client() as client:
            wait_for(lambda: client.lookup([a.digest for a in blocks]).peer == BATCH, timeout=10,
                     text="the puller learns of the holder's blocks")
            got, _ = client.get(list(blocks))
            assert {f.address: f.payload for f in got} == blocks


@pytest.mark.skipif(not netns_usable(), reason="network namespaces need root and the ip tool")
def test_the_peer_rate_follows_a_throttled_link(tmp_path: Path) -> None:
    hosts = Hosts(tag="kvd", subnet="10.251.9")
    try:
        a_ns, b_ns = hosts.add("a"), hosts.add("b")
        cluster = Cluster(tmp_path, ("node-a", "node-b"))
        cluster.addresses = {"node-a": f"{hosts.hosts[a_ns]}:7500", "node-b": f"{hosts.hosts[b_ns]}:7501"}
        metrics = f"{hosts.hosts[a_ns]}:{free_tcp_port()}"
        try:
            a = cluster.daemon("node-a", f'metrics.listen="{metrics}"', "quic.pull_timeout_s=10", start=False)
            b = cluster.daemon("node-b", start=False)
            a.prefix, b.prefix = hosts.exec(a_ns), hosts.exec(b_ns)
            a.start(), b.start()
            wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), timeout=20, text="peers connected")
            pull_phase(a, b, 1)
            fast = peer_rate(metrics)
            hosts.throttle(b_ns, "16mbit")                     # 2 MB/s from the holder
            pull_phase(a, b, 2)
            slow = peer_rate(metrics)
            assert 1.0e6 < slow < 3.0e6, slow
            assert fast > 5 * slow, (fast, slow)
            with Agent.connect(str(a.state / "agent.sock"), agent_id="plan", model="m", dtype="bf16", block_tokens=16,
                               num_layers=1, layer_block_bytes=BLOCK, use_cuda=False, timeout=30) as agent:
                chain = chain_on(a, b, 4)
                # 5 ms to recompute a block: loading 64 KiB at 2 MB/s (33 ms) loses, at 40 MB/s wins.
                plan = agent.plan_loads(chain, RECOMPUTE_S)
                assert (plan.load, plan.held, plan.skipped_peer) == (2, 6, 4), plan
                assert plan.seconds < plan.load_all_s and plan.seconds <= plan.recompute_all_s
                assert scraped(metrics, 'kvcached_loads_skipped_total{source="peer"}') == 4
                hosts.throttle(b_ns, None)
                pull_phase(a, b, 3)
                again = peer_rate(metrics)
                print(f"peer rate: {fast:.3g} B/s, throttled {slow:.3g}, lifted {again:.3g}")
                assert again > 5 * slow, "the throttle's end shows within a window of pulls"
                plan = agent.plan_loads(chain_on(a, b, 5), RECOMPUTE_S)
                assert (plan.load, plan.held, plan.skipped_peer) == (6, 6, 0), plan
        finally:
            cluster.stop()
    finally:
        hosts.close()
