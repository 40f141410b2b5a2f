"""A real vLLM engine (the CPU build) runs the test model with KvcachedConnector: outputs are the proof.

A hit must give what vLLM's own prefix cache gives for the same prompt (the same KV reuse path:
any difference would be kvcached's), bit for bit; against a cold run, where vLLM computes the
whole prompt in one chunk instead of on top of cached KV, the logprobs agree within
``COLD_TOLERANCE`` and the greedy tokens are the same (the test model's logits are peaked).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from tests.e2e.conftest import ROOT, EngineRun
from tests.integration.conftest import DaemonProcess

BLOCK = 32                  # vLLM's block size here (its CPU attention wants a multiple of 32)
COLD_TOLERANCE = 0.05       # |logprob difference| hit vs cold: bfloat16 sums in another order
MAX_TOKENS = 8


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
    p = prompt(1, 1000)
    first = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2, kvcached(daemon))
    cold, local_hit = (r["outputs"][0] for r in first["rounds"])
    assert cold["num_cached_tokens"] == 0 and local_hit["num_cached_tokens"] >= loadable(len(p))
    with daemon.client() as c:
        before = c.stats()
    assert before.puts >= loadable(len(p)) // BLOCK, "the first engine stored its blocks"

    second = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}], kvcached(daemon))
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
