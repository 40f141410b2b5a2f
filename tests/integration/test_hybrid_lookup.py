"""The vLLM connector's scheduler side against a real daemon: what a hybrid model's lookup finds.

The scheduler side reads vLLM's objects by attribute only, so a request here is a plain object
with the attributes it reads; the agent, the daemon and the blocks are real. Each kind of group
is stored under its own addresses (kvcached_agent.engines.hybrid), and a hit is one every kind
can resume from: full attention all blocks before it, sliding window the window's blocks before
it, state a snapshot exactly at it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

from kvcached_agent.agent import Agent
from kvcached_agent.engines.common import TokenChain
from kvcached_agent.engines.hybrid import FULL, SLIDING, STATE, GroupKind, kind_digests, kind_root
from kvcached_agent.engines.vllm_scheduler import SchedulerSide

from .conftest import DaemonProcess
from .test_agent import agent_socket

BLOCK, MODEL, DTYPE, BYTES = 16, "hybrid/model", "bfloat16", 4096
FULL_KIND = GroupKind("full", FULL, (1,))
SWA = GroupKind("sliding40", SLIDING, (0,), window_blocks=3)        # ceil(39 / 16) blocks before a hit
STATE_KIND = GroupKind("state", STATE, (2,))
TOKENS = [(i * 7919) % 30000 + 1 for i in range(200)]                # 12 whole blocks and 8 tokens


@pytest.fixture
def agent(daemon: DaemonProcess) -> Iterator[Agent]:
    with Agent.connect(agent_socket(daemon), agent_id="scheduler", model=MODEL, dtype=DTYPE, block_tokens=BLOCK,
                       num_layers=1, layer_block_bytes=BYTES, timeout=5) as a:
        yield a


def request(tokens: list[int] = TOKENS, name: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=name, num_tokens=len(tokens), all_token_ids=tokens,
                           num_prompt_tokens=len(tokens), shared_prefix_boundary=0)


def scheduler(agent: Agent, kinds: list[GroupKind]) -> SchedulerSide:
    roots = [kind_root(MODEL, DTYPE, BLOCK, "", k) for k in kinds]
    return SchedulerSide(agent, agent.root, block_tokens=BLOCK, page_tokens=BLOCK, kinds=kinds, roots=roots)


def store(agent: Agent, kind: GroupKind, positions: list[int], tokens: list[int] = TOKENS) -> None:
    chain = TokenChain(agent.root, BLOCK).upto(tokens, len(tokens) // BLOCK)
    root = kind_root(MODEL, DTYPE, BLOCK, "", kind)
    digests = kind_digests(root, kind, chain, positions)
    saved = agent.save(agent.addresses(digests), [torch.full((BYTES,), k % 251, dtype=torch.uint8) for k in positions])
    assert saved.stored == len(positions)


def test_a_model_of_sliding_window_layers_only_hits_where_its_window_is_held(agent: Agent) -> None:
    """No full-attention chain to look up: the window's blocks are asked with Present, and a hit
    needs all of them (never the whole prompt because nothing says otherwise)."""
    s = scheduler(agent, [SWA])
    assert s.matched_tokens(request(), 0) == (0, False)
    store(agent, SWA, [9, 10, 11])                 # the window before block 12: the prompt's replay boundary
    assert s.matched_tokens(request(name="again"), 0) == (12 * BLOCK, True)
    assert s.matched_tokens(request(name="local"), 4 * BLOCK) == (8 * BLOCK, True)     # after vLLM's own 4 blocks


def test_a_hybrid_hit_is_where_every_kind_can_resume(agent: Agent) -> None:
    kinds = [SWA, FULL_KIND, STATE_KIND]
    s = scheduler(agent, kinds)
    store(agent, FULL_KIND, list(range(8)))        # full attention up to block 8
    store(agent, SWA, [5, 6, 7])                   # the window before 8
    r = request()
    assert s.matched_tokens(r, 0) == (0, False), "no state at 8"
    # The full-attention chain reaches further than the others can resume: a junction there,
    # told to vLLM's scheduler so the request keeps its window and state at it.
    assert r.shared_prefix_boundary == 8 * BLOCK
    store(agent, STATE_KIND, [7])                  # the state after block 7: at 8
    assert s.matched_tokens(request(name="r2"), 0) == (8 * BLOCK, True)
    store(agent, STATE_KIND, [10])                 # a state at 11, but no full blocks past 8
    assert s.matched_tokens(request(name="r3"), 0) == (8 * BLOCK, True)
    other = TOKENS[:5 * BLOCK] + [7] * 100         # shares 5 blocks: no window or state there
    assert s.matched_tokens(request(other, "other"), 0) == (0, False)
