"""Hybrid models through KvcachedConnector on a real vLLM engine (the CPU build), with vLLM's
hybrid KV cache manager kept on: a sliding-window model (Gemma 3: sliding and full attention
layers alternating) and a Mamba-style one (Qwen3-Next: gated delta-net state layers beside full
attention), both built here with random weights (tests/e2e/model.py).

What vLLM's own prefix cache gives is the reference: the hit length of each prompt and its
output, bit for bit. A fresh engine (its own prefix cache empty) hitting kvcached must resume at
the same length with the same output, and a prompt that shares only part of a stored one must
get the length vLLM's own prefix cache gives it (the groups that keep less than every block
resume only where their blocks or state were kept: kvcached_agent.engines.hybrid).

MLA (DeepSeek's attention: one latent cache per layer) has a test of its own, which skips where
the platform turns prefix caching off for MLA (vLLM's CPU build has done so on CPUs without AMX);
its interface test (tests/engines/test_vllm.py) runs everywhere.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import EngineRun
from tests.e2e.test_vllm_e2e import MAX_TOKENS, RETRY_MAX_S, kvcached, prompt, same_output
from tests.integration.conftest import DaemonProcess

pytestmark = pytest.mark.timeout(900)

# Per kind: the model, the prompt's length and how much of it the partial prompts share. vLLM
# picks the block size of a hybrid model (128 for this Gemma 3, whose sliding window is 128
# tokens; 256 for this Qwen3-Next, the attention block grown to hold a state page).
SHAPES = {"gemma3": (1000, 500), "qwen3next": (1025, 600)}
MLA_PROMPT = 600


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.e2e.model import TinyModel

    root = tmp_path_factory.mktemp("hybrid")
    return {kind: TinyModel(kind, layers=4).build(root / kind) for kind in SHAPES}


def hits(rounds: list[dict[str, Any]]) -> list[int]:
    return [r["outputs"][0]["num_cached_tokens"] for r in rounds]


def wait_file(path: Path, run: "concurrent.futures.Future[dict[str, Any]]") -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        assert time.monotonic() < deadline and not run.done(), run.exception() if run.done() else f"no {path.name}"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_hybrid_model_resumes_from_kvcached_as_from_vllms_own_prefix_cache(
        kind: str, make_daemon, hybrid_models: dict[str, Path], engine: EngineRun,  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    """One engine serves prompt A with the daemon down (served, nothing stored), then with it
    back (stored), then from vLLM's own prefix cache; then B, sharing A's first part (stored,
    with the junction where the share ends), and, the daemon down again, C sharing the same part
    (vLLM's own prefix cache resumes it at the junction B kept; nothing of C is stored). The
    daemon starts again (its RAM empty: every block comes from its SSD tier) and the engine, its
    own prefix cache emptied as a fresh engine's is, runs A and C from kvcached: the hit lengths
    vLLM's own prefix cache gave, the same output bit for bit, the hybrid manager on."""
    d: DaemonProcess = make_daemon('kv.write_policy="write_through"')
    model = hybrid_models[kind]
    n, shared = SHAPES[kind]
    a = prompt(40, n)
    b, c = a[:shared] + prompt(41, n - shared), a[:shared] + prompt(42, n - shared)
    assert d.stop() == 0
    signals = {name: tmp_path / name for name in ("a-done", "back", "b-done", "down", "c-done", "restarted")}
    rounds = [{"prompts": [a], "max_tokens": MAX_TOKENS, "signal_after": str(signals["a-done"])},
              {"prompts": [a], "max_tokens": MAX_TOKENS, "wait_for": str(signals["back"]), "reset_prefix_cache": True},
              {"prompts": [a], "max_tokens": MAX_TOKENS},
              {"prompts": [b], "max_tokens": MAX_TOKENS, "signal_after": str(signals["b-done"])},
              {"prompts": [c], "max_tokens": MAX_TOKENS, "wait_for": str(signals["down"]),
               "signal_after": str(signals["c-done"])},
              {"prompts": [a], "max_tokens": MAX_TOKENS, "wait_for": str(signals["restarted"]), "reset_prefix_cache": True},
              {"prompts": [c], "max_tokens": MAX_TOKENS}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(engine, model, rounds, kvcached(d, retry_s=0.2, retry_max_s=RETRY_MAX_S), block_size=None)
        wait_file(signals["a-done"], run)
        d.start()
        time.sleep(2 * RETRY_MAX_S)      # the agents try again at their next call once their backoff ends
        signals["back"].touch()
        wait_file(signals["b-done"], run)
        assert d.stop() == 0
        signals["down"].touch()
        wait_file(signals["c-done"], run)
        d.start()
        with d.client() as client:
            assert client.stats().tiers[0].blocks == 0
        time.sleep(2 * RETRY_MAX_S)
        signals["restarted"].touch()
        first = run.result()
    assert first["hybrid_manager"], "vLLM turned its hybrid KV cache manager off for the connector"
    down, cold, own, partial, junction, hit, hit_partial = (r["outputs"][0] for r in first["rounds"])
    # Daemon down: served as without kvcached; back: computed again, the same tokens bit for bit.
    assert hits(first["rounds"][:2]) == [0, 0] and same_output(down, cold), (down, cold)
    assert own["num_cached_tokens"] > 0, "vLLM's own prefix cache resumes the same prompt"
    # The first prompt sharing part of A finds no window or state where the share ends (nor does
    # vLLM's own prefix cache); the second finds the junction the first one kept.
    assert partial["num_cached_tokens"] == 0
    assert 0 < junction["num_cached_tokens"] <= shared
    # Restarted, RAM empty: both again from kvcached's SSD tier, as vLLM's own cache gave them.
    assert hit["num_cached_tokens"] == own["num_cached_tokens"]
    assert same_output(hit, own), (hit, own)
    assert hit_partial["num_cached_tokens"] == junction["num_cached_tokens"]
    assert same_output(hit_partial, junction), (hit_partial, junction)
    with d.client() as client:
        assert client.stats().promotions > 0, "the blocks came from the SSD tier"


NO_MLA_PREFIX_CACHING = ("vLLM's platform turns prefix caching off for MLA here (vLLM's CPU build does on x86 "
                         "CPUs without AMX): there is no prefix-cache hit to resume from or to compare with")


def mla_prefix_caching() -> bool:
    """Whether vLLM's CPU platform keeps prefix caching on for an MLA model here: on x86 only
    with AMX tiles (vllm/platforms/cpu.py, check_and_update_config). Asked before an engine is
    started (half a minute here) only to find out; the engine's own answer is checked after."""
    import platform

    import torch

    return platform.machine() not in ("x86_64", "AMD64") or bool(torch.cpu._is_amx_tile_supported())


def test_an_mla_model_resumes_from_kvcached_as_from_vllms_own_prefix_cache(
        daemon: DaemonProcess, engine: EngineRun, tmp_path: Path) -> None:
    """DeepSeek V2's MLA (kv_lora_rank 512, qk_rope_head_dim 64): a prompt stored by the engine
    resumes from kvcached once vLLM's own prefix cache is emptied (as a new engine's is), at
    vLLM's own hit length, bit-identical."""
    from tests.e2e.model import TinyModel

    if not mla_prefix_caching():
        pytest.skip(NO_MLA_PREFIX_CACHING)
    model = TinyModel("deepseekv2", layers=2).build(tmp_path / "deepseek")
    p = prompt(43, MLA_PROMPT)
    first = engine(model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2
                   + [{"prompts": [p], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}], kvcached(daemon),
                   block_size=None)
    if not first["prefix_caching"]:
        pytest.skip(NO_MLA_PREFIX_CACHING)
    own = first["rounds"][1]["outputs"][0]
    assert own["num_cached_tokens"] > 0
    with daemon.client() as c:
        assert c.stats().hits > 0, "the daemon served the blocks"
    hit = first["rounds"][2]["outputs"][0]
    assert hit["num_cached_tokens"] == own["num_cached_tokens"]
    assert same_output(hit, own), (hit, own)
