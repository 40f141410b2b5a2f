"""A slice of a production trace through a real daemon: the hits the daemon counts are the
hits the simulator predicts for the same policy and size.

The slice is the first 1,500 requests of the Mooncake conversation trace (tests/data). An
engine-like client (a real agent on the Unix socket, 4 KiB blocks) replays it: per request it
loads what the daemon holds and saves what it did not, as an engine's connector does. The RAM
tier is sized in whole blocks (4 KiB slabs, one block each), so its capacity in blocks is
exact, and the simulator (kvcached.sim.replay, the same policy classes) replays the same keys
at that capacity. Both counts are checked:

- prefix: the engine asks the longest RAM prefix (Lookup), loads it, saves the rest; the
  daemon's hit count equals the simulator's prefix hits;
- block: the engine loads every block of the request (the missing ones are reported), saves
  the missing ones; the daemon's hits and misses equal the simulator's block count.

Policies: ``slru`` with its ratio tuned online (the RAM tier's default: the tuner samples keys
by their bytes, so the daemon and the simulator tune the same way), ARC and S3-FIFO; the counts
agree exactly, and each beats LRU's simulated count at the same size. This test found that the
daemon's own hold of a block it had just committed (until recorded) counted as a use: every
saved block looked reused, and ARC, S3-FIFO and slru ran as LRU (RamTier.hold now).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvcached.policies import make_keyed_policy
from kvcached.sim.replay import replay_requests
from kvcached.sim.traces import load_trace
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress

from .test_agent import agent_socket

torch = pytest.importorskip("torch")
from kvcached_agent.agent import Agent  # noqa: E402  (needs torch)

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"
BLOCK = 4096
GIB = 1 << 30


def daemon_replay(agent: Agent, trace: list[list[BlockAddress]], prefix: bool) -> None:
    """Each request as an engine serves it: load what is there, save what is not."""
    payload = torch.zeros(BLOCK, dtype=torch.uint8)
    target = torch.empty(BLOCK, dtype=torch.uint8)
    for request in trace:
        if prefix:
            found = agent.lookup([a.digest for a in request]).ram
            if found:
                assert agent.load(request[:found], [target] * found).loaded == found
            todo = request[found:]
        else:
            missing = agent.load(request, [target] * len(request)).missing
            todo = [request[i] for i in missing]
        save_all(agent, todo, payload)


def save_all(agent: Agent, todo: list[BlockAddress], payload: torch.Tensor) -> None:
    """Save every block of ``todo``, in order. A block the daemon refuses for now (FULL: the
    blocks it holds until their checksums are recorded reached its bound, which a busy machine
    reaches sooner) is saved again once the daemon caught up, as nothing was used in between
    (a refusal touches no policy): the same inserts in the same order as the simulator's."""
    deadline = time.monotonic() + 60
    while todo:
        saved = agent.save(todo, [payload] * len(todo))
        assert saved.stored + saved.present + len(saved.skipped) == len(todo) and not saved.declined
        todo = [todo[i] for i in saved.skipped]
        if todo:
            assert time.monotonic() < deadline, f"{len(todo)} blocks refused for a minute"
            time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("mode, share, policy", [("prefix", 0.05, "slru"), ("block", 0.10, "slru"),
                                                 ("prefix", 0.10, "arc"), ("block", 0.05, "s3fifo")])
def test_the_daemon_counts_the_hits_the_simulator_predicts(make_daemon, mode: str, share: float, policy: str) -> None:
    loaded = load_trace(SLICE)
    trace = [[BlockAddress(digest) for digest in request] for request in loaded.requests]
    keys = [[a.key for a in request] for request in trace]
    accesses = sum(map(len, keys))
    capacity = int(len({k for request in keys for k in request}) * share)
    daemon = make_daemon("kv.ssd_gib=0", f"kv.ram_gib={capacity * BLOCK / GIB!r}",
                         f"kv.max_block_mib={BLOCK / (1 << 20)!r}", f'kv.ram_policy="{policy}"')
    with daemon.client() as c:
        ram = next(t for t in c.stats().tiers if t.tier == pb.TIER_RAM)
        assert ram.capacity_bytes == capacity * BLOCK
    with Agent.connect(agent_socket(daemon), agent_id="trace", model="trace/model", dtype="uint8", block_tokens=512,
                       num_layers=1, layer_block_bytes=BLOCK, timeout=30) as agent:
        daemon_replay(agent, trace, prefix=mode == "prefix")
    with daemon.client() as c:
        stats = c.stats()
        ram = next(t for t in stats.tiers if t.tier == pb.TIER_RAM)
    expected = sum(replay_requests(make_keyed_policy(policy), capacity, keys, prefix=mode == "prefix"))
    assert ram.blocks == capacity and ram.evictions > 0
    assert stats.hits == expected, (stats.hits, expected, accesses)
    if mode == "block":
        assert stats.hits + stats.misses == accesses
    lru = sum(replay_requests(make_keyed_policy("lru"), capacity, keys, prefix=mode == "prefix"))
    assert stats.hits > lru > 0.03 * accesses      # the policy's own order, not one the daemon imposes
