"""A real vLLM engine (the CPU build) runs the test model with KvcachedConnector: outputs are the proof.

A hit must give what vLLM's own prefix cache gives for the same prompt (the same KV reuse path:
any difference would be kvcached's), bit for bit; against a cold run, where vLLM computes the
whole prompt in one chunk instead of on top of cached KV, the logprobs agree within
``COLD_TOLERANCE`` and the greedy tokens are the same (the test model's logits are peaked).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ROOT, EngineRun
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_peers import Cluster, connected, peer_stats

# A test runs two or three engines, each 25-60 s to start on two cores (the first of a fresh
# machine also compiles vLLM's kernels; eager ones less): the suite's 120 s default is for one
# daemon's tests.
pytestmark = pytest.mark.timeout(900)

BLOCK = 32                  # vLLM's block size here (its CPU attention wants a multiple of 32)
COLD_TOLERANCE = 0.05       # |logprob difference| hit vs cold: bfloat16 sums in another order
MAX_TOKENS = 8
RETRY_MAX_S = 0.5          # the agents' longest wait between tries while the daemon is away


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def kvcached(d: DaemonProcess, **extra: Any) -> dict[str, Any]:
    return {"kind": "kvcached", "socket": str(d.state / "agent.sock"), "extra": extra}


def loadable(tokens: int) -> int:
    """Prompt tokens a connector can hand back: whole blocks, the last token always left to vLLM."""
    return (tokens - 1) // BLOCK * BLOCK


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def close_to_cold(hit: dict[str, Any], cold: dict[str, Any]) -> None:
    assert hit["token_ids"] == cold["token_ids"]
    worst = max(abs(x - y) for x, y in zip(hit["logprobs"], cold["logprobs"]))
    assert worst <= COLD_TOLERANCE, f"logprobs differ by {worst} from the cold run"


def test_a_kvcached_hit_in_a_new_engine_gives_vllms_own_prefix_cache_output(
        daemon: DaemonProcess, tiny_model: Path, engine: EngineRun) -> None:
    """With vLLM's default execution (torch.compile): the other tests run eager engines."""
    p = prompt(1, 1000)
    first = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2, kvcached(daemon), eager=False)
    cold, local_hit = (r["outputs"][0] for r in first["rounds"])
    assert cold["num_cached_tokens"] == 0 and local_hit["num_cached_tokens"] >= loadable(len(p))
    with daemon.client() as c:
        before = c.stats()
    assert before.puts >= loadable(len(p)) // BLOCK, "the first engine stored its blocks"

    second = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}], kvcached(daemon), eager=False)
    hit = second["rounds"][0]["outputs"][0]
    assert hit["num_cached_tokens"] == loadable(len(p)), "a new engine's prefix cache is empty: kvcached loaded these"
    with daemon.client() as c:
        after = c.stats()
    assert after.hits - before.hits >= loadable(len(p)) // BLOCK, "the daemon served the blocks"
    assert same_output(hit, local_hit), (hit, local_hit)
    close_to_cold(hit, cold)


def test_a_prompt_sharing_half_matches_whole_blocks_of_the_shared_part(
        daemon: DaemonProcess, tiny_model: Path, engine: EngineRun) -> None:
    first, shared = prompt(2, 1000), 500
    second = first[:shared] + prompt(3, 500)
    engine(tiny_model, [{"prompts": [first], "max_tokens": 1}], kvcached(daemon))
    run = engine(tiny_model, [{"prompts": [second], "max_tokens": MAX_TOKENS}], kvcached(daemon))
    hit = run["rounds"][0]["outputs"][0]
    assert hit["num_cached_tokens"] == shared // BLOCK * BLOCK
    cold = engine(tiny_model, [{"prompts": [second], "max_tokens": MAX_TOKENS}])["rounds"][0]["outputs"][0]
    close_to_cold(hit, cold)


def test_with_the_daemon_down_the_engine_serves_as_without_kvcached(
        daemon: DaemonProcess, tiny_model: Path, engine: EngineRun) -> None:
    """No daemon behind the socket: every request is served, computed, with the output of an
    engine without the connector, bit for bit (nothing is loaded, so nothing can differ)."""
    assert daemon.stop() == 0
    prompts = [prompt(4, 700), prompt(5, 300)]
    rounds = [{"prompts": prompts, "max_tokens": MAX_TOKENS}]
    down = engine(tiny_model, rounds, kvcached(daemon, retry_s=0.2))["rounds"][0]["outputs"]
    plain = engine(tiny_model, rounds)["rounds"][0]["outputs"]
    assert [o["num_cached_tokens"] for o in down] == [0, 0]
    assert all(same_output(a, b) for a, b in zip(down, plain)), (down, plain)


def test_the_cache_follows_the_model_not_its_path(daemon: DaemonProcess, engine: EngineRun, tmp_path: Path) -> None:
    """A relative path to the same folder shares the cache; new weights placed at the old path
    are another model: nothing stored for the old weights is loaded into the new ones."""
    from tests.e2e.model import TinyLlama

    folder = TinyLlama(seed=0).build(tmp_path / "swapped")
    p = prompt(6, 600)
    rounds = [{"prompts": [p], "max_tokens": MAX_TOKENS}]
    old = engine(folder, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    relative = Path(os.path.relpath(folder, ROOT))                  # the engine runs in ROOT
    again = engine(relative, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    assert again["num_cached_tokens"] == loadable(len(p))
    TinyLlama(seed=1).build(folder)                                 # new weights, same path, same shapes
    new = engine(folder, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    assert new["num_cached_tokens"] == 0, "KV of the old weights was loaded into the new ones"
    assert new["token_ids"] != old["token_ids"]


def test_after_a_daemon_restart_the_hit_comes_from_ssd(make_daemon, tiny_model: Path, engine: EngineRun) -> None:  # type: ignore[no-untyped-def]
    """Write-through: the blocks are on SSD when the first engine's request ends; the daemon
    restarts (its RAM tier empty) and a new engine loads them from SSD, output bit-identical to
    vLLM's own prefix-cache hit."""
    d = make_daemon('kv.write_policy="write_through"')
    p = prompt(7, 900)
    first = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2, kvcached(d))
    local_hit = first["rounds"][1]["outputs"][0]
    assert d.stop() == 0
    d.start()
    with d.client() as c:
        ram_before = c.stats().tiers[0].blocks
    hit = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}], kvcached(d))["rounds"][0]["outputs"][0]
    assert ram_before == 0 and hit["num_cached_tokens"] == loadable(len(p))
    with d.client() as c:
        assert c.stats().promotions >= loadable(len(p)) // BLOCK, "the blocks came from the SSD tier"
    assert same_output(hit, local_hit), (hit, local_hit)


def test_the_daemon_killed_during_a_request(daemon: DaemonProcess, tiny_model: Path, engine: EngineRun,
                                            tmp_path: Path) -> None:
    """SIGKILL while the engine serves a batch: that batch and the next (daemon down) complete
    with the tokens of an engine without kvcached (logprobs within ``COLD_TOLERANCE``: while
    lookups fail, vLLM may step the batch's requests in other groupings, and bfloat16 sums
    depend on the batch); once the daemon is back, a prompt stored then loads from it again
    (vLLM's own prefix cache emptied first), bit-identical to vLLM's own prefix-cache hit."""
    started, back = tmp_path / "round-started", tmp_path / "daemon-back"
    a = [prompt(10 + i, 1500) for i in range(4)]
    b = [prompt(20 + i, 400) for i in range(2)]
    c = [prompt(30, 700)]
    rounds = [{"prompts": a, "max_tokens": MAX_TOKENS, "signal": str(started)},
              {"prompts": b, "max_tokens": MAX_TOKENS},
              {"prompts": c, "max_tokens": MAX_TOKENS, "wait_for": str(back)},
              {"prompts": c, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(engine, tiny_model, rounds, kvcached(daemon, retry_s=0.2, retry_max_s=RETRY_MAX_S))
        deadline = time.monotonic() + 300
        while not started.exists():
            assert time.monotonic() < deadline and not run.done(), run.exception() if run.done() else "no start"
            time.sleep(0.02)
        time.sleep(0.2)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        time.sleep(2 * RETRY_MAX_S)      # the agents try again at their next call once their backoff ends
        back.touch()
        served = run.result()["rounds"]
    plain = engine(tiny_model, rounds[:2] + [{"prompts": c, "max_tokens": MAX_TOKENS}] * 2)["rounds"]
    for k in range(3):                   # a batch may be stepped otherwise while lookups fail: close, same tokens
        for got, want in zip(served[k]["outputs"], plain[k]["outputs"]):
            close_to_cold(got, want)
    hit = served[3]["outputs"][0]
    assert hit["num_cached_tokens"] == loadable(len(c[0])), "hits return once the daemon is back"
    assert same_output(hit, plain[3]["outputs"][0])


def test_a_peer_daemon_holding_the_blocks(cluster: Cluster, tiny_model: Path, engine: EngineRun) -> None:
    """Two daemons with the peer tier on (QUIC, mutual TLS): an engine on node A stores a prompt;
    a new engine on node B, whose daemon holds nothing, loads it through B pulling from A,
    bit-identical to vLLM's own prefix-cache hit on A."""
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="a and b connected")
    p = prompt(8, 800)
    first = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2, kvcached(a))
    local_hit = first["rounds"][1]["outputs"][0]
    blocks = loadable(len(p)) // BLOCK
    wait_for(lambda: peer_stats(b)["node-a"].blocks >= blocks, text="b learns a's blocks")
    hit = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}], kvcached(b))["rounds"][0]["outputs"][0]
    assert hit["num_cached_tokens"] == loadable(len(p))
    with b.client() as c:
        assert c.stats().peer_pulled >= blocks, "the blocks came from the peer"
    assert same_output(hit, local_hit), (hit, local_hit)
