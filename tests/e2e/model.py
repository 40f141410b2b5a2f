"""A small Llama-architecture model built here, from a fixed seed: no weights can be downloaded.

    python -m tests.e2e.model OUT [--layers N] [--hidden N] [--seed N] [--dtype bfloat16|float32]

Random weights, written as a Hugging Face folder (config.json + model.safetensors) that vLLM
loads like any other; prompts are token ids (vLLM runs with ``skip_tokenizer_init``). The output
layer is scaled up so the logits are peaked: greedy tokens of a random model with nearly flat
logits flip on the last bit of a sum, which would make "the same output" a matter of luck.
The same arguments build the same bytes (the seed fixes every weight).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB = 4096
LOGIT_SCALE = 24.0          # output layer x this: the top token's probability is near 1 most of the time


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 2
    hidden: int = 256
    seed: int = 0
    dtype: str = "bfloat16"

    def build(self, out: Path) -> Path:
        """Write the model to ``out`` (created); returns it. Imports torch and transformers."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(self.seed)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                             num_hidden_layers=self.layers, num_attention_heads=max(1, self.hidden // 64),
                             num_key_value_heads=max(1, self.hidden // 256), max_position_embeddings=16384,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config).to(getattr(torch, self.dtype))
        with torch.no_grad():
            model.lm_head.weight.mul_(LOGIT_SCALE)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        (out / "tiny_llama.json").write_text(json.dumps(asdict(self)) + "\n")
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=TinyLlama.layers)
    parser.add_argument("--hidden", type=int, default=TinyLlama.hidden)
    parser.add_argument("--seed", type=int, default=TinyLlama.seed)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=TinyLlama.dtype)
    args = parser.parse_args()
    TinyLlama(args.layers, args.hidden, args.seed, args.dtype).build(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
