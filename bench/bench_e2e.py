"""Time to first token of a real vLLM engine with kvcached, against recomputing, in the same run.

    .venv-e2e/bin/python bench/bench_e2e.py [--json PATH] [--quick] [--lengths 2048,8192] [--set KEY=VALUE ...]
        [--no-hybrid | --only-hybrid]

Runs in the end-to-end environment (``make bench`` builds it and runs this there): vLLM's CPU
build serves a Llama-architecture model built here from a fixed seed (tests/e2e/model.py, 8
layers, 768 wide, bfloat16: a 2,048-token prompt takes seconds to prefill on 2 cores), prompts as
token ids, greedy. Each engine is a fresh process (tests/e2e/engine_run.py) and a real
``kvcached serve`` subprocess (bench_core.start_kvcached; write-through, so every stored block is
on SSD too) holds the blocks. Every engine first serves a warm-up prompt that shares nothing.

Time to first token is the wall time of a request with ``max_tokens=1``. Per prompt length:

- recompute: a new prompt, no connector (the baseline of every ratio);
- vLLM prefix hit: the same prompt again in the same engine, from vLLM's own prefix cache (the
  floor: nothing to copy). vLLM's own CPU offloading (OffloadingConnector), the anchor the issue
  names, refuses to start on vLLM's CPU platform ("CPU Offloading is currently only supported on
  CUDA-alike and XPU GPUs"), so it cannot be measured here;
- storing: the first request of a prompt with the connector (it computes and saves its blocks);
- kvcached RAM hit: a new engine process (its own prefix cache empty) loading every whole block
  of the prompt from the daemon's RAM;
- kvcached SSD hit: the same after the daemon was restarted (RAM empty, the blocks on SSD).

Decode: tokens per second of one request generating ``DECODE_TOKENS`` after a short prompt,
from the difference between that request and a request of the same length with
``max_tokens=1``. Every engine ends with ``DECODE_REPEATS`` such pairs of prompts of its own (so
each engine with the connector stores its decode blocks anew), and one more engine without the
connector runs after the others: two engines without, three with, interleaved in time. The rate
on each side is the median over its engines' pairs. Engine-to-engine spread on this shared
2-core machine is several per cent (a py-spy profile of the connector's engine put its connector
calls at under 0.2% of the decode samples), so a single pair of engines cannot tell 0.95x from
1.0x. Targets: RAM hit <= 0.1x recompute at 2,048 tokens, SSD hit <= 0.25x, decode with the
connector >= 0.95x without.
Hybrid models (``--hybrid``, on by default; ``--no-hybrid`` leaves them out): a Gemma 3
(sliding-window layers, window 512, beside full attention) and a Qwen3-Next (Mamba-style state
layers beside full attention), 8 layers, 768 wide, built here the same way, vLLM's hybrid KV
cache manager on. Per kind, a prompt of 2,049 tokens: time to first token of a kvcached RAM hit
(a new engine) against recomputing and against vLLM's own prefix hit (both in one engine without
the connector), same run; and the bytes the daemon stores for the prompt, per prompt token,
against a plain model of the same width (every layer full attention at the model's KV heads and
head size: what vLLM holds with its hybrid manager off): sliding-window layers must store no more
than their window, state layers one snapshot.
--quick: 2,048 tokens only and fewer decode tokens (a smoke test). Progress goes to stderr, the
table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_core import progress, start_kvcached  # noqa: E402

from kvcached.client import KvCacheClient  # noqa: E402
from tests.e2e.model import TinyLlama, TinyModel  # noqa: E402

BLOCK = 32
DECODE_PROMPT = 128
DECODE_TOKENS = 256
DECODE_REPEATS = 3          # decode pairs per engine; the median rate is reported
BENCH_MODEL = TinyLlama(layers=8, hidden=768, seed=0)
HYBRID_MODELS = {"gemma3": TinyModel("gemma3", layers=8, hidden=768, window=512),
                 "qwen3next": TinyModel("qwen3next", layers=8, hidden=768)}
HYBRID_PROMPT = 2049            # a replay boundary of 2,048 tokens: a whole number of blocks of any size vLLM picks


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def engine(tmp: Path, model: Path, rounds: list[dict[str, Any]], connector: dict[str, Any] | None,
           max_model_len: int, block_size: int | None = BLOCK) -> list[dict[str, Any]]:
    """One engine process through ``rounds``; returns its rounds' results."""
    n = len(list(tmp.glob("plan-*.json")))
    plan, result = tmp / f"plan-{n}.json", tmp / f"result-{n}.json"
    plan.write_text(json.dumps({"model": str(model), "connector": connector, "rounds": rounds,
                                "max_model_len": max_model_len, "block_size": block_size}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "KVCACHED_FINGERPRINT_CACHE": str(tmp / "weights.json")}
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.engine_run", str(plan), str(result)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"engine failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return list(json.loads(result.read_text())["rounds"])


def one(prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    return {"prompts": [prompt], "max_tokens": max_tokens}


def measure(tmp: Path, lengths: list[int], decode_tokens: int, settings: list[str]) -> dict[str, Any]:
    model = BENCH_MODEL.build(tmp / "model")
    max_len = max(lengths) + decode_tokens + DECODE_PROMPT + 64
    prompts = {n: tokens(n, n) for n in lengths}
    warm = one(tokens(1, 256))
    engines = iter(range(1, 100))

    def decode() -> list[dict[str, Any]]:
        """Decode pairs on prompts no other engine has seen (a connector engine stores them anew)."""
        base = 1000 * next(engines)
        return [r for k in range(DECODE_REPEATS) for r in (one(tokens(base + 2 * k, DECODE_PROMPT)),
                                                           one(tokens(base + 2 * k + 1, DECODE_PROMPT), decode_tokens))]
    figures: dict[str, Any] = {"lengths": lengths, "ttft": {n: {} for n in lengths}, "cached_tokens": {}}

    def record(name: str, results: list[dict[str, Any]], offset: int, per_length: int) -> None:
        for i, n in enumerate(lengths):
            r = results[offset + i * per_length]
            figures["ttft"][n][name] = r["seconds"]
            figures["cached_tokens"].setdefault(n, {})[name] = r["outputs"][0]["num_cached_tokens"]

    rates: dict[str, list[float]] = {"without": [], "with": []}

    def decode_rates(side: str, results: list[dict[str, Any]]) -> None:
        pairs = results[-2 * DECODE_REPEATS:]
        rates[side] += [(decode_tokens - 1) / max(pairs[i + 1]["seconds"] - pairs[i]["seconds"], 1e-9)
                        for i in range(0, len(pairs), 2)]

    with contextlib.ExitStack() as stack:
        progress("recompute and vLLM's own prefix hit, no connector")
        plain = engine(tmp, model, [warm] + [r for n in lengths for r in (one(prompts[n]), one(prompts[n]))] + decode(),
                       None, max_len)
        record("recompute", plain, 1, 2)
        record("vllm_prefix_hit", plain, 2, 2)
        decode_rates("without", plain)

        state = tmp / "daemon"
        state.mkdir()
        extra = ['kv.write_policy="write_through"', "kv.max_block_mib=64", *settings]
        proc, _ = start_kvcached(stack, state, 2, extra)
        connector = {"kind": "kvcached", "socket": str(state / "agent.sock")}
        progress("storing, with the connector")
        stored = engine(tmp, model, [warm] + [one(prompts[n]) for n in lengths] + decode(), connector, max_len)
        record("storing", stored, 1, 1)
        decode_rates("with", stored)

        progress("kvcached RAM hit, a new engine")
        hit = engine(tmp, model, [warm] + [one(prompts[n]) for n in lengths] + decode(), connector, max_len)
        record("kvcached_ram_hit", hit, 1, 1)
        decode_rates("with", hit)

        progress("kvcached SSD hit, the daemon restarted")
        proc.stop()
        start_kvcached(stack, state, 2, extra)
        hit = engine(tmp, model, [warm] + [one(prompts[n]) for n in lengths] + decode(), connector, max_len)
        record("kvcached_ssd_hit", hit, 1, 1)
        decode_rates("with", hit)

        progress("decode again without the connector")
        decode_rates("without", engine(tmp, model, [warm] + decode(), None, max_len))
    figures["decode_tokens_per_s"] = {side: statistics.median(r) for side, r in rates.items()}
    figures["decode_rates"] = rates
    return figures


def plain_bytes_per_token(model: Path) -> int:
    """KV bytes per token of a model of this width with every layer full attention (bfloat16):
    K and V of every KV head in every layer."""
    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head * 2


def measure_hybrid(tmp: Path) -> dict[str, Any]:
    """Per hybrid kind: TTFT of recompute, vLLM's own prefix hit and a kvcached RAM hit, and the
    bytes stored for the prompt against a plain model of the same width."""
    out: dict[str, Any] = {}
    prompt = tokens(7, HYBRID_PROMPT)
    warm = one(tokens(1, 256))
    max_len = HYBRID_PROMPT + 64
    for kind, spec in HYBRID_MODELS.items():
        model = spec.build(tmp / kind)
        progress(f"{kind}: recompute and vLLM's own prefix hit, no connector")
        plain = engine(tmp, model, [warm, one(prompt), one(prompt)], None, max_len, None)
        with contextlib.ExitStack() as stack:
            state = tmp / f"daemon-{kind}"
            state.mkdir()
            start_kvcached(stack, state, 2, ["kv.max_block_mib=64"])
            connector = {"kind": "kvcached", "socket": str(state / "agent.sock")}
            progress(f"{kind}: storing, with the connector")
            engine(tmp, model, [one(prompt)], connector, max_len, None)
            with KvCacheClient(f"unix:{state}/kvcached.sock") as client:
                stored = client.stats().tiers[0].bytes
            progress(f"{kind}: kvcached RAM hit, a new engine")
            hit = engine(tmp, model, [warm, one(prompt)], connector, max_len, None)
        out[kind] = {
            "ttft": {"recompute": plain[1]["seconds"], "vllm_prefix_hit": plain[2]["seconds"],
                     "kvcached_ram_hit": hit[1]["seconds"]},
            "cached_tokens": {"vllm_prefix_hit": plain[2]["outputs"][0]["num_cached_tokens"],
                              "kvcached_ram_hit": hit[1]["outputs"][0]["num_cached_tokens"]},
            "stored_bytes_per_token": stored / len(prompt),
            "plain_bytes_per_token": plain_bytes_per_token(model),
        }
    return out


def report_hybrid(hybrid: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    print(f"\nhybrid models, {HYBRID_PROMPT}-token prompt")
    print(f"{'model':<10} {'case':<18} {'TTFT':>9} {'cached':>7} {'x recompute':>12}")
    for kind, f in hybrid.items():
        t = f["ttft"]
        for name in ("recompute", "vllm_prefix_hit", "kvcached_ram_hit"):
            cached = f["cached_tokens"].get(name, 0)
            print(f"{kind:<10} {name:<18} {t[name] * 1000:>7.0f} ms {cached:>7} {t[name] / t['recompute']:>11.3f}x")
        stored, plain = f["stored_bytes_per_token"], f["plain_bytes_per_token"]
        print(f"{kind:<10} kvcached RAM hit / vLLM's own prefix hit: {t['kvcached_ram_hit'] / t['vllm_prefix_hit']:.2f}x;"
              f" stored {stored:.0f} bytes per prompt token, {stored / plain:.3f}x a plain model of its width "
              f"({plain} bytes)")
        rows.append({"model": kind, "ttft": t, "ratio_ram_hit": t["kvcached_ram_hit"] / t["recompute"],
                     "ratio_vs_vllm_hit": t["kvcached_ram_hit"] / t["vllm_prefix_hit"],
                     "stored_bytes_per_token": stored, "plain_bytes_per_token": plain,
                     "stored_ratio": stored / plain, "cached_tokens": f["cached_tokens"]})
    return rows


def report(figures: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    targets = {"kvcached_ram_hit": 0.1, "kvcached_ssd_hit": 0.25}
    print(f"{'prompt':>7}  {'case':<18} {'TTFT':>9} {'cached':>7} {'x recompute':>12}  target")
    for n in figures["lengths"]:
        t = figures["ttft"][n]
        base = t["recompute"]
        for name in ("recompute", "vllm_prefix_hit", "storing", "kvcached_ram_hit", "kvcached_ssd_hit"):
            ratio = t[name] / base
            target = targets.get(name) if n == 2048 else None
            verdict = "" if target is None else ("met" if ratio <= target else "MISSED") + f" (<= {target}x)"
            print(f"{n:>7}  {name:<18} {t[name] * 1000:>7.0f} ms {figures['cached_tokens'][n][name]:>7} "
                  f"{ratio:>11.3f}x  {verdict}")
            rows.append({"tokens": n, "case": name, "seconds": t[name], "ratio": ratio, "target": target,
                         "cached_tokens": figures["cached_tokens"][n][name]})
        hit, floor = t["kvcached_ram_hit"], t["vllm_prefix_hit"]
        print(f"{n:>7}  kvcached RAM hit / vLLM's own prefix hit: {hit / floor:.2f}x")
    d = figures["decode_tokens_per_s"]
    ratio = d["with"] / d["without"]
    print(f"decode: {d['without']:.1f} tokens/s without the connector, {d['with']:.1f} with: {ratio:.3f}x "
          f"({'met' if ratio >= 0.95 else 'MISSED'} (>= 0.95x))")
    rows.append({"case": "decode", "without": d["without"], "with": d["with"], "ratio": ratio, "target": 0.95})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                        help="also the hybrid models (sliding window, Mamba-style state)")
    parser.add_argument("--only-hybrid", action="store_true", help="the hybrid models alone")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a daemon setting on top of the benchmark's (e.g. kv.write_policy=\"write_back\")")
    args = parser.parse_args()
    lengths = [2048] if args.quick else [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-e2e-") as tmp:
        figures = {} if args.only_hybrid else measure(Path(tmp), lengths, 32 if args.quick else DECODE_TOKENS,
                                                      args.set)
        hybrid = measure_hybrid(Path(tmp)) if args.hybrid or args.only_hybrid else {}
    rows = report(figures) if figures else []
    if hybrid:
        rows += report_hybrid(hybrid)
    if args.json:
        args.json.write_text(json.dumps({"figures": rows, "raw": figures, "hybrid": hybrid}, indent=1) + "\n")


if __name__ == "__main__":
    main()
