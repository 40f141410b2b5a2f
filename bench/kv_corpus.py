"""A corpus of real KV cache blocks: a trained model's KV for English text, as kvcached stores it on SSD.

    .venv-e2e/bin/python bench/kv_corpus.py --model DIR --out CORPUS_DIR [--prompts 24] [--max-tokens 48]

For measuring compression codecs on real KV bytes rather than random ones. It starts a real
``kvcached serve`` as the end-to-end tests do (``python -m kvcached.cli``: the kvcached installed
in the running environment, its built-in defaults; all its state in a temp dir, write-through, so
every saved block is published on the SSD tier), runs one vLLM engine (its CPU build:
tests/e2e/engine_run.py, as the end-to-end tests do) with KvcachedConnector over the model in DIR
(a Hugging Face folder with a tokenizer, e.g. ``python -m tests.e2e.trained_model DIR``), greedy,
over ``--prompts`` English texts, so the connector saves the prompts' KV blocks; then stops the
engine and the daemon and copies each SSD block file's payload into CORPUS_DIR.

The prompts: the sections of Python's reference manual shipped in the standard library
(``pydoc_data.topics.topics``), in sorted key order, those of fewer than MIN_PROMPT tokens skipped,
each cut to its first MAX_PROMPT tokens; tokenized here with the model's tokenizer (engine_run
feeds token ids, with no tokenizer of its own).

CORPUS_DIR (created; must be empty or new) then holds ``block-NNNNN.bin``, one block's payload
each (the SSD file's ``length`` bytes after its 4096-byte header page, checked against the
header's BLAKE3 checksum: a block stored coded or sealed fails it, so the corpus is raw KV), in
the order the daemon wrote them, and ``meta.json``: model, dtype, kv_cache_dtype, block_size
(tokens), bytes_per_block, num_blocks, num_prompts, vLLM's version, the byte layout of a block
(read from the connector and vLLM's CPU attention backend, where this machine's attention ISA is
one whose layout is known here), the prompts with the text each generated, the daemon's
counters, and per block its file, digest, layer and length. Progress goes to stderr; one summary
line to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_core import Proc, progress, wait_grpc  # noqa: E402

from kvcached.client import KvCacheClient  # noqa: E402
from kvcached.tiers.ssd_format import HEADER_BYTES, SUFFIX, BlockHeader  # noqa: E402
from kvcached.v1 import kvcache_pb2 as pb  # noqa: E402

BLOCK = 32                  # vLLM's block size, tokens (its CPU attention wants a multiple of 32)
MIN_PROMPT = 256            # tokens: shorter reference sections are skipped
MAX_PROMPT = 512            # tokens: longer ones are cut
SETTLE_S = 120.0            # longest wait for the daemon's SSD tier to catch up with its RAM tier


def prompts(tokenizer: Any, count: int) -> list[tuple[str, list[int]]]:
    """``count`` (topic, token ids) pairs from the reference manual's sections (module docstring)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        ids = tokenizer(topics[key])["input_ids"]
        if len(ids) >= MIN_PROMPT:
            out.append((key, list(ids[:MAX_PROMPT])))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} reference sections have {MIN_PROMPT} tokens or more; asked for {count}")


def head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def block_layout(config: dict[str, Any], isa: str) -> dict[str, Any]:
    """How a block's bytes are laid out: the connector stores every layer's vLLM page, layer after
    layer in vLLM's order (one page per block: kvcached's block is vLLM's), each page as vLLM's
    CPU attention holds it: [num_kv_heads, 2 * block_size, head_dim] (K's half, then V's, per head);
    the "vec" ISA's kernel writes K transposed within its half (csrc/cpu/cpu_attn_vec.hpp). Checked
    once for SmolLM2 on the "vec" ISA against transformers' own K and V of the same tokens (layers
    0, 15 and 29 agree within bfloat16 rounding; K read untransposed does not)."""
    heads, dim = config["num_key_value_heads"], head_dim(config)
    layout = {"layers": config["num_hidden_layers"], "kv_heads": heads, "head_dim": dim, "block_size": BLOCK,
              "element": "bfloat16, little-endian", "attention_isa": isa,
              "order": "[layer][kv_head][K, V]: per layer (vLLM's order, model.layers.0 first) one page of "
                       f"{heads} kv heads, each head K's {BLOCK * dim} values then V's {BLOCK * dim}"}
    if isa == "vec":
        layout["k"] = "[head_dim][block_size]: dimension-major, token fastest (transposed)"
        layout["v"] = "[block_size][head_dim]: token-major, dimension fastest"
    else:
        layout["k"] = layout["v"] = f"the {isa} kernel's own arrangement within the half (not described here)"
    return layout


def attention_isa(config: dict[str, Any]) -> str:
    """The ISA vLLM's CPU attention picks on this machine for a bfloat16 KV cache."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(torch.bfloat16, BLOCK, head_dim(config), "auto"))


def start_daemon(stack: contextlib.ExitStack, tmp: Path) -> Proc:
    """``kvcached serve`` with its state, sockets and log in ``tmp``, stopped when ``stack`` closes."""
    sets = [f'kv.index_dir="{tmp}/index"', f'kv.ssd_dir="{tmp}/ssd"', f'grpc.listen=["unix:{tmp}/kvcached.sock"]',
            f'agent.socket="{tmp}/agent.sock"', 'metrics.listen=""', "kv.ram_gib=1", 'kv.write_policy="write_through"',
            "grpc.grace_s=2"]
    daemon = Proc("kvcached", [sys.executable, "-m", "kvcached.cli", "serve", *(a for s in sets for a in ("--set", s))],
                  cwd=tmp, log=tmp / "kvcached.log")
    stack.callback(daemon.stop)
    stack.callback(wait_grpc(daemon, f"unix:{tmp}/kvcached.sock").close)
    return daemon


def run_engine(tmp: Path, model: Path, token_prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One engine process (tests/e2e/engine_run.py) with KvcachedConnector, one round; its result."""
    plan, result, log = tmp / "plan.json", tmp / "result.json", tmp / "engine.log"
    plan.write_text(json.dumps({
        "model": str(model), "block_size": BLOCK, "max_model_len": MAX_PROMPT + max_tokens + BLOCK,
        "eager": True, "in_process": True,
        "connector": {"kind": "kvcached", "socket": str(tmp / "agent.sock"), "extra": {}},
        "rounds": [{"prompts": token_prompts, "max_tokens": max_tokens}]}))
    env = {**os.environ, "KVCACHED_FINGERPRINT_CACHE": str(tmp / "weights.json")}
    with open(log, "wb") as f:
        code = subprocess.run([sys.executable, "-m", "tests.e2e.engine_run", str(plan), str(result)], cwd=ROOT,
                              env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"engine exited with {code}:\n{log.read_text(errors='replace')[-4000:]}")
    return dict(json.loads(result.read_text()))


def settled_stats(target: str) -> pb.StatsResponse:
    """The daemon's counters once its SSD tier holds every block of its RAM tier (write-through
    publishes each save on SSD; the engine does not wait for that before it exits), and no more
    come in."""
    deadline = time.monotonic() + SETTLE_S
    last: tuple[int, ...] = ()
    with KvCacheClient(target) as client:
        while True:
            stats = client.stats()
            tiers = {t.tier: t.blocks for t in stats.tiers}
            now = (stats.puts, tiers.get(pb.TIER_RAM, 0), tiers.get(pb.TIER_SSD, 0))
            if now == last and now[2] >= now[1] > 0:       # unchanged for a second: the saves are all in
                return stats
            if time.monotonic() > deadline:
                raise SystemExit(f"the SSD tier did not catch up within {SETTLE_S:.0f} s: {tiers}")
            last = now
            time.sleep(1.0)


def copy_blocks(ssd_dir: Path, out: Path) -> list[dict[str, Any]]:
    """Each SSD block file's payload to ``out/block-NNNNN.bin`` in the order written; per block its
    file, digest (hex), layer and length."""
    import blake3

    found = []
    for path in (ssd_dir / "blocks").rglob(f"*{SUFFIX}"):
        with open(path, "rb") as f:
            found.append((BlockHeader.decode(f.read(HEADER_BYTES)), path))
    found.sort(key=lambda f: (f[0].created, f[1].name))
    blocks = []
    for n, (header, path) in enumerate(found):
        payload = path.read_bytes()[HEADER_BYTES:HEADER_BYTES + header.length]
        if len(payload) != header.length or blake3.blake3(payload).digest() != header.checksum:
            raise SystemExit(f"{path}: payload does not match its header's length and checksum")
        name = f"block-{n:05d}.bin"
        (out / name).write_bytes(payload)
        blocks.append({"file": name, "digest": header.digest.hex(), "layer": header.layer, "length": header.length})
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder with a tokenizer")
    parser.add_argument("--out", type=Path, required=True, help="the corpus folder (created; must be empty)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per prompt (greedy)")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty")
    model = args.model.resolve()
    config = json.loads((model / "config.json").read_text())
    if (config.get("dtype") or config.get("torch_dtype")) != "bfloat16":
        raise SystemExit(f"{model} is not a bfloat16 model: the corpus and its layout are of bfloat16 KV")

    import vllm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen = prompts(tokenizer, args.prompts)
    isa = attention_isa(config)
    progress(f"{len(chosen)} prompts, {sum(len(p) for _, p in chosen)} tokens; vLLM {vllm.__version__}, "
             f"attention ISA {isa}")
    with tempfile.TemporaryDirectory(prefix="kv-corpus-") as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        daemon = start_daemon(stack, tmp)
        progress(f"kvcached serving, state in {tmp}; starting the engine")
        result = run_engine(tmp, model, [p for _, p in chosen], args.max_tokens)
        progress(f"engine done: started in {result['start_s']:.1f} s, served in {result['rounds'][0]['seconds']:.1f} s")
        stats = settled_stats(f"unix:{tmp}/kvcached.sock")
        stack.close()                                     # stops the daemon
        if daemon.proc.returncode != 0:
            raise SystemExit(f"kvcached exited with {daemon.proc.returncode}:\n{daemon.tail()}")
        args.out.mkdir(parents=True, exist_ok=True)
        blocks = copy_blocks(tmp / "ssd", args.out)
    ssd_blocks = {t.tier: t.blocks for t in stats.tiers}[pb.TIER_SSD]
    if len(blocks) != ssd_blocks:
        raise SystemExit(f"{len(blocks)} block files on SSD, but the daemon counted {ssd_blocks}")
    lengths = sorted({b["length"] for b in blocks})
    outputs = [o["token_ids"] for o in result["rounds"][0]["outputs"]]
    for (topic, _), ids in list(zip(chosen, outputs))[:3]:
        progress(f"{topic}: ... {tokenizer.decode(ids)!r}")
    source = json.loads((model / "source.json").read_text()) if (model / "source.json").exists() else {}
    meta = {
        "model": source.get("model", model.name), "model_dir": str(model), "source": source,
        "dtype": "bfloat16", "kv_cache_dtype": "auto", "block_size": BLOCK,
        "bytes_per_block": lengths[0] if len(lengths) == 1 else lengths, "num_blocks": len(blocks),
        "num_prompts": len(chosen), "vllm_version": vllm.__version__, "python": sys.version.split()[0],
        "layout": block_layout(config, isa),
        "prompts": [{"topic": topic, "tokens": len(ids), "generated": tokenizer.decode(out)}
                    for (topic, ids), out in zip(chosen, outputs)],
        "daemon": {"puts": stats.puts, "tiers": {pb.Tier.Name(t.tier): t.blocks for t in stats.tiers}},
        "blocks": blocks,
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(b["length"] for b in blocks)
    print(f"{len(blocks)} blocks of {meta['bytes_per_block']} bytes ({total / 2**20:.1f} MiB) from {len(chosen)} "
          f"prompts, {meta['model']} on vLLM {vllm.__version__} -> {args.out}")


if __name__ == "__main__":
    main()
