"""Small models built here, from a fixed seed: no weights can be downloaded.

    python -m tests.e2e.model OUT [--kind llama|gemma3|qwen3next] [--layers N] [--hidden N] [--seed N]
        [--dtype bfloat16|float32] [--window N]

Random weights, written as a Hugging Face folder (config.json + model.safetensors) that vLLM
loads like any other; prompts are token ids (vLLM runs with ``skip_tokenizer_init``). The output
layer is scaled up so the logits are peaked: greedy tokens of a random model with nearly flat
logits flip on the last bit of a sum, which would make "the same output" a matter of luck.
The same arguments build the same bytes (the seed fixes every weight).

Three kinds: ``llama`` (every layer full attention: one KV cache group in vLLM), ``gemma3``
(sliding-window and full-attention layers alternating: vLLM's hybrid manager keeps two groups,
the sliding one freeing blocks outside its window) and ``qwen3next`` (gated delta-net linear
attention, a Mamba-style state, beside full attention every other layer: a state group and an
attention group), and ``deepseekv2`` (MLA: one latent cache per layer, kv_lora_rank 512 and
qk_rope_head_dim 64, the head size vLLM's CPU MLA backend takes).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VOCAB = 4096
LOGIT_SCALE = 24.0          # output layer x this: the top token's probability is near 1 most of the time
KINDS = ("llama", "gemma3", "qwen3next", "deepseekv2")


@dataclass(frozen=True)
class TinyModel:
    kind: str = "llama"
    layers: int = 2
    hidden: int = 256
    seed: int = 0
    dtype: str = "bfloat16"
    window: int = 128             # gemma3: the sliding window, in tokens

    def _config(self) -> Any:
        heads = max(1, self.hidden // 64)
        common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                                      num_hidden_layers=self.layers, num_attention_heads=heads,
                                      max_position_embeddings=16384, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
        if self.kind == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(num_key_value_heads=max(1, self.hidden // 256), **common)
        if self.kind == "gemma3":
            from transformers import Gemma3TextConfig

            types = [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(self.layers)]
            return Gemma3TextConfig(num_key_value_heads=max(1, heads // 2), head_dim=64, query_pre_attn_scalar=64,
                                    sliding_window=self.window, layer_types=types, pad_token_id=0, **common)
        if self.kind == "qwen3next":
            from transformers import Qwen3NextConfig

            types = [("linear_attention" if i % 2 == 0 else "full_attention") for i in range(self.layers)]
            return Qwen3NextConfig(num_key_value_heads=max(1, heads // 2), head_dim=64, layer_types=types,
                                   linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                   linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=self.hidden,
                                   shared_expert_intermediate_size=self.hidden, decoder_sparse_step=1,
                                   full_attention_interval=2, **common)
        if self.kind == "deepseekv2":
            from transformers import DeepseekV2Config

            return DeepseekV2Config(num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                    qk_nope_head_dim=64, v_head_dim=64, head_dim=64, n_routed_experts=4,
                                    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=self.hidden,
                                    n_group=1, topk_group=1, first_k_dense_replace=1, **common)
        raise ValueError(f"unknown model kind {self.kind!r} (known: {', '.join(KINDS)})")

    def build(self, out: Path) -> Path:
        """Write the model to ``out`` (created); returns it. Imports torch and transformers."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_config(self._config()).to(getattr(torch, self.dtype))
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        (out / "tiny_model.json").write_text(json.dumps(asdict(self)) + "\n")
        return out


def TinyLlama(layers: int = 2, hidden: int = 256, seed: int = 0, dtype: str = "bfloat16") -> TinyModel:
    """The plain model of the first tests: every layer full attention."""
    return TinyModel("llama", layers, hidden, seed, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=KINDS, default=TinyModel.kind)
    parser.add_argument("--layers", type=int, default=TinyModel.layers)
    parser.add_argument("--hidden", type=int, default=TinyModel.hidden)
    parser.add_argument("--seed", type=int, default=TinyModel.seed)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=TinyModel.dtype)
    parser.add_argument("--window", type=int, default=TinyModel.window)
    args = parser.parse_args()
    TinyModel(args.kind, args.layers, args.hidden, args.seed, args.dtype, args.window).build(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
