"""Synthetic request traces for the policy simulator, after the workloads of the prefix-caching
seed's hit-rate table (../shared/seeds/001: chatbot, multi-turn chat, RAG, code completion,
batch summarization), plus random and a scan-heavy mix.

A trace is a list of requests; a request is the chain of block digests an engine would compute
for its prompt (kvcached_agent.address.chain_digests: BLAKE3, chained, 16 tokens a block), so
two requests share exactly the blocks of their common token prefix, as on a real node. Token
content is drawn from seeded generators: the same arguments give the same trace.
"""

from __future__ import annotations

import random
from typing import Callable

from kvcached_agent.address import chain_digests, chain_root

__all__ = ["WORKLOADS", "Trace", "make_trace"]

BLOCK_TOKENS = 16
Trace = list[list[bytes]]          # requests, each the chain of its prompt's block digests

_ROOT = chain_root("sim/model-8b", "bf16", BLOCK_TOKENS)


class _Prompts:
    """Builds prompts out of named pieces of text (system prompts, documents, turns): each piece
    is a fixed run of token ids, the same every time it is used."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._pieces: dict[tuple[str, int], list[int]] = {}

    def piece(self, kind: str, ident: int, blocks: int) -> list[int]:
        key = (kind, ident)
        tokens = self._pieces.get(key)
        if tokens is None:
            rng = random.Random(f"{self.seed}/{kind}/{ident}")
            tokens = self._pieces[key] = [rng.randrange(32000) for _ in range(blocks * BLOCK_TOKENS)]
        return tokens

    def fresh(self, rng: random.Random, blocks: int) -> list[int]:
        """Text seen once (a user's new message)."""
        return [rng.randrange(32000) for _ in range(blocks * BLOCK_TOKENS)]


def _chain(tokens: list[int]) -> list[bytes]:
    return chain_digests(tokens, BLOCK_TOKENS, root=_ROOT)


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index in 0..n-1, popular ones first (Zipf with exponent ``s``)."""
    weights = _ZIPF_CACHE.get((n, s))
    if weights is None:
        weights = _ZIPF_CACHE[(n, s)] = list(_cumulative([1 / (i + 1) ** s for i in range(n)]))
    x = rng.random() * weights[-1]
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if weights[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


_ZIPF_CACHE: dict[tuple[int, float], list[float]] = {}


def _cumulative(xs: list[float]) -> list[float]:
    total, out = 0.0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def chatbot(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """A few applications, each with a fixed 512-token system prompt, and a fresh user message."""
    return [_chain(p.piece("system", _zipf(rng, 8), 32) + p.fresh(rng, rng.randint(2, 12))) for _ in range(requests)]


def multi_turn(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """Conversations that come back turn after turn: each turn's prompt is the system prompt,
    the whole history so far and a new message; popular conversations return more often."""
    histories: dict[int, list[int]] = {}
    out = []
    for _ in range(requests):
        conv = _zipf(rng, 400, 0.9)
        history = histories.get(conv)
        if history is None or len(history) > 256 * BLOCK_TOKENS:      # a new conversation
            history = p.piece("system", conv % 4, 32)
        history = history + p.fresh(rng, rng.randint(2, 8))           # the new message
        out.append(_chain(history))
        histories[conv] = history + p.fresh(rng, rng.randint(2, 8))   # and the answer, next turn's history
    return out


def rag(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """256 tokens of shared instructions, one 2K-token document of a large corpus (a long tail
    of popularity), a fresh question."""
    return [_chain(p.piece("instructions", 0, 16) + p.piece("doc", _zipf(rng, 3000, 0.8), 128)
                   + p.fresh(rng, rng.randint(1, 4))) for _ in range(requests)]


def code_completion(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """The context of a file being edited, up to the cursor: files of a repository, hot ones
    edited more; the cursor moves, and an edit changes the text after it."""
    out = []
    versions: dict[int, int] = {}
    for _ in range(requests):
        f = _zipf(rng, 600, 1.0)
        if rng.random() < 0.3:
            versions[f] = versions.get(f, 0) + 1                   # an edit: the tail changes
        size = 30 + (f * 37) % 470
        cursor = rng.randint(size // 3, size)
        head = p.piece("file", f, size // 3)
        tail = p.piece(f"file{f}-v", versions.get(f, 0), size - size // 3)
        out.append(_chain((head + tail)[:cursor * BLOCK_TOKENS]))
    return out


def batch_summarization(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """A 64-token instruction and a different long document every time."""
    return [_chain(p.piece("instructions", 1, 4) + p.fresh(rng, rng.randint(32, 128))) for _ in range(requests)]


def random_blocks(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """Single-block prompts drawn uniformly from a large set: no structure to exploit."""
    return [_chain(p.piece("random", rng.randrange(20000), 1)) for _ in range(requests)]


def scan_mix(rng: random.Random, requests: int, p: _Prompts) -> Trace:
    """A hot chat workload (four agents, each with a long system prompt of tools and examples,
    1920 tokens) interleaved with long one-off documents, about one in five requests: the scans
    that flush an LRU cache between two uses of the same prompt."""
    out = []
    for _ in range(requests):
        if rng.random() < 0.2:
            out.append(_chain(p.fresh(rng, rng.randint(400, 800))))
        else:
            out.append(_chain(p.piece("agent", rng.randrange(4), 120) + p.fresh(rng, rng.randint(1, 3))))
    return out


#: name -> (generator, requests in a full run)
WORKLOADS: dict[str, tuple[Callable[[random.Random, int, _Prompts], Trace], int]] = {
    "chatbot": (chatbot, 4000),
    "multi_turn": (multi_turn, 3000),
    "rag": (rag, 1500),
    "code_completion": (code_completion, 1500),
    "batch_summarization": (batch_summarization, 600),
    "random": (random_blocks, 30000),
    "scan_mix": (scan_mix, 2500),
}


def make_trace(name: str, scale: float = 1.0, seed: int = 1) -> Trace:
    """The trace of workload ``name``, ``scale`` times its usual number of requests."""
    try:
        generate, requests = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    return generate(random.Random(f"{seed}/{name}"), max(1, int(requests * scale)), _Prompts(seed))
