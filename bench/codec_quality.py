"""What lossy fp8 KV would cost in quality, measured on a trained model before any lossy codec is built.

    .venv-e2e/bin/python bench/codec_quality.py --model DIR [--prompts 24] [--tokens 32] [--json PATH]

Issue 64 asks for a lossy fp8 (e4m3) codec on the cold tiers, opt in, gated on measured quality.
This measures that quality first. The model is a trained one: SmolLM2-135M-Instruct, built by
``python -m tests.e2e.trained_model DIR``. The text is real: sections of Python's reference
manual (``pydoc_data.topics``), the same texts ``bench/kv_corpus.py`` feeds vLLM. The forward
passes are transformers' own, with its KV cache.

- For each prompt, the prompt's KV is computed exactly.
- A copy of that KV is then made as a lossy tier would hand it back: each value cast to fp8
  e4m3, under one of the scalings below, and back to bf16.
- Greedy decoding then continues from the exact KV and from each lossy copy. The tokens
  generated after the prompt are computed exactly, as an engine computes new tokens.

Printed per scaling, against exact KV in the same run:

- how many of ``--tokens`` greedy tokens agree before the first difference (mean, worst, and
  how many prompts agree all the way);
- the perplexity of held texts' second halves given their first halves' KV, as a ratio to exact;
- the bytes a block would take (fp8 values plus their scales) against bf16.

Scalings:

- ``none``: a plain cast. Values past e4m3's 448 saturate, small ones lose precision.
- ``mx32``, ``mx128``: a power-of-two scale per 32 or 128 consecutive values (OCP MX style: one
  byte of scale each), so each group's largest value lands near 448.
- ``block``: one scale per block.

And a control, ``ulp``: each value moved by at most one bf16 step (scaled by a random factor
within half a step of 1, then rounded to bf16 again): no codec, the smallest change KV can
undergo (a kernel that sums in another order does as much). Greedy decoding differs under it
too wherever two tokens are all but tied, so the rows above are read against it: what fp8
costs is what it loses beyond ``ulp``.

Groups run along the head dimension here. A codec in the daemon sees a block's bytes without
its layout, so its groups would run along whatever the engine lays out contiguously. This is a
measurement of the idea, not of a codec that exists: kvcached stores no lossy block yet
(docs/codecs.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

E4M3_MAX = 448.0
SCALINGS: dict[str, int | None] = {"none": None, "mx32": 32, "mx128": 128, "block": 0}
CONTROL = "ulp"                  # a row of its own: no fp8, one bf16 step at most (see the module)
PROMPT_TOKENS = 256
HELD_TOKENS = 512
AGREE_TARGET = 0.9       # of the greedy tokens, on average, before the first difference: a bar for "usable"


def progress(message: str) -> None:
    print(f"[quality] {message}", file=sys.stderr, flush=True)


def texts(count: int, skip: int = 0) -> list[str]:
    """Reference-manual sections in sorted order, long ones only, after the first ``skip``."""
    from pydoc_data.topics import topics

    long = [topics[k] for k in sorted(topics) if len(topics[k]) > 3000]
    return long[skip:skip + count]


def fp8_roundtrip(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` (bf16) cast to e4m3 and back under the scaling ``group`` (see the module)."""
    if group is None:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32).to(x.dtype)
    flat = x.float().flatten()          # in memory order: along the head dimension, then tokens, then heads
    size = flat.numel() if group == 0 else group
    groups = torch.nn.functional.pad(flat, (0, -flat.numel() % size)).reshape(-1, size)
    amax = groups.abs().amax(dim=1, keepdim=True).clamp(min=2.0 ** -126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))            # a power of two: one byte of exponent
    back = (groups / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return back.flatten()[:flat.numel()].reshape(x.shape).to(x.dtype)


def ulp_noise(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (bf16) with each value scaled by a random factor within half a bf16 step of 1 and
    rounded to bf16 again: about half the values move by one step, none by more."""
    step = 2.0 ** -8                    # half of bf16's relative step (7 stored mantissa bits)
    factor = 1 + (torch.rand(x.shape, generator=generator) * 2 - 1) * step
    return (x.float() * factor).to(x.dtype)


def bytes_ratio(group: int | None) -> float:
    """bf16 bytes / fp8 bytes with one byte of scale per group."""
    if group is None or group == 0:
        return 2.0
    return 2.0 / (1.0 + 1.0 / group)


def copy_of(cache: Any, name: str | None) -> Any:
    """A new cache holding ``cache``'s KV: as it is (``name`` None), through fp8 under the
    scaling ``name``, or moved by the control (:data:`CONTROL`)."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(0)
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        if name == CONTROL:
            k, v = ulp_noise(k, generator), ulp_noise(v, generator)
        elif name is not None:
            k, v = fp8_roundtrip(k, SCALINGS[name]), fp8_roundtrip(v, SCALINGS[name])
        out.update(k.clone(), v.clone(), i)
    return out


@torch.inference_mode()
def greedy(model: Any, cache: Any, last: int, n: int) -> list[int]:
    tokens, nxt = [], torch.tensor([[last]])
    for _ in range(n):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        nxt = torch.tensor([[tok]])
    return tokens


@torch.inference_mode()
def prefix_cache(model: Any, ids: list[int]) -> Any:
    return model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values


@torch.inference_mode()
def continuation_nll(model: Any, cache: Any, last: int, cont: list[int]) -> float:
    """Mean negative log-likelihood of ``cont`` after the prefix whose KV is ``cache`` (its last token ``last``)."""
    ids = torch.tensor([[last] + cont[:-1]])
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(cont)))


def agreed(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a trained model's folder (python -m tests.e2e.trained_model DIR)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--held", type=int, default=8, help="held texts for perplexity")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    forms = [CONTROL, *SCALINGS]
    agree: dict[str, list[int]] = {name: [] for name in forms}
    prompts = [tok(t)["input_ids"][:PROMPT_TOKENS] for t in texts(args.prompts)]
    samples = []
    for i, ids in enumerate(prompts):
        cache = prefix_cache(model, ids[:-1])
        exact = greedy(model, copy_of(cache, None), ids[-1], args.tokens)
        for name in forms:
            got = greedy(model, copy_of(cache, name), ids[-1], args.tokens)
            agree[name].append(agreed(exact, got))
            if i < 2:
                samples.append((name, tok.decode(exact), tok.decode(got)))
        progress(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{n} {agree[n][-1]}" for n in forms))
    nll: dict[str, list[float]] = {name: [] for name in ["exact", *forms]}
    held = texts(args.held, skip=args.prompts)
    if len(held) < args.held:
        progress(f"only {len(held)} held texts after the {args.prompts} prompts (of {args.held} asked): the manual "
                 "has no more long sections")
    for i, text in enumerate(held):
        ids = tok(text)["input_ids"][:HELD_TOKENS]
        half = len(ids) // 2
        cache = prefix_cache(model, ids[:half - 1])
        nll["exact"].append(continuation_nll(model, copy_of(cache, None), ids[half - 1], ids[half:]))
        for name in forms:
            nll[name].append(continuation_nll(model, copy_of(cache, name), ids[half - 1], ids[half:]))
        progress(f"held text {i + 1}/{len(held)}: perplexity exact {math.exp(nll['exact'][-1]):.3f}")
    ppl = {name: math.exp(statistics.mean(v)) for name, v in nll.items()}
    print(f"lossy fp8 KV against exact KV: {Path(args.model).name} (transformers {__import__('transformers').__version__}, "
          f"torch {torch.__version__}), {len(prompts)} prompts of {PROMPT_TOKENS} tokens, {args.tokens} greedy tokens each, "
          f"{len(held)} held texts of {HELD_TOKENS} tokens, {time.monotonic() - t0:.0f} s")
    print()
    head = ["scaling", "bytes vs bf16", "greedy tokens agreeing (mean / worst)", "prompts agreeing all the way",
            "perplexity (exact: %.3f)" % ppl["exact"], "ratio"]
    rows = []
    for name in forms:
        a = agree[name]
        size = "control: 1.00x" if name == CONTROL else f"{bytes_ratio(SCALINGS[name]):.2f}x smaller"
        rows.append([name, size, f"{statistics.mean(a):.1f} / {min(a)} of {args.tokens}",
                     f"{sum(x == args.tokens for x in a)} of {len(a)}", f"{ppl[name]:.3f}", f"{ppl[name] / ppl['exact']:.4f}x"])
    widths = [max(len(str(c)) for c in col) + 2 for col in zip(head, *rows)]
    for line in [head, *rows]:
        print("  " + "".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
    print()
    print(f"note: 'usable' here would be at least {AGREE_TARGET:.0%} of the greedy tokens agreeing on average and a "
          "perplexity within 1% of exact; the exact baseline agrees with itself all the way by construction. The "
          f"'{CONTROL}' row moves KV by one bf16 step at most: greedy divergence it shows too comes from near-ties, "
          "not from fp8.")
    for name, a, b in samples:
        print(f"sample ({name}): exact: {a[:100]!r}\n{'':>{len(name) + 10}}lossy: {b[:100]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"agree": agree, "perplexity": ppl, "nll": nll}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
