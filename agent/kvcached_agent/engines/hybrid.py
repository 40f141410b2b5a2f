"""A block model for hybrid models: one kind of kvcached block per kind of KV cache group.

vLLM's hybrid KV cache manager keeps one KV cache group per kind of layer, each with its own
block table (one page per ``page_tokens`` tokens, page ids from one pool). What a group needs to
resume a request at a position differs by kind, and so does what kvcached stores for it:

- **full** attention (and MLA's latent cache): every block before the position. Stored as
  today: one block per position, chained over the tokens (a prefix lookup finds them).
- **sliding** window: only the ``window_blocks`` blocks before the position (vLLM frees the
  others and gives the group placeholder pages for them). Stored per position, but only for
  the blocks that some resume point needs (its window tail), never for every position: a
  sliding-window group stores no more than its window per resume point.
- **state** (Mamba and other linear-attention layers): one state snapshot taken exactly at the
  position (vLLM's ``align`` mode writes the state after ``(k + 1) * page_tokens`` tokens into
  the group's page ``k``). Stored per resume point.

A block of a kind holds, for each vLLM group of that kind, each layer's page at that position,
group after group. Its address is the kind's own: a full block's digest is the token chain's;
the other kinds derive theirs from the chain digest at that position and a root of their own
(the kind is part of what a block is). The resume points follow vLLM's own prefix cache, so a
kvcached hit is never longer than vLLM's would be for the same blocks: the prompt's replay
boundary (its last whole block before the final token) and a shared-prefix junction (where the
full-attention chain reaches further than the other kinds can resume).

:func:`hit_length` is vLLM's hybrid ``find_longest_cache_hit`` over what the daemon holds:
each kind shortens the candidate until all agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvcached_agent.address import chain_root
from kvcached_agent.engines.common import key_digests

__all__ = ["FULL", "PRIMARY", "SLIDING", "STATE", "GroupKind", "hit_length", "kind_digests", "kind_root",
           "resume_points"]

FULL, SLIDING, STATE = "full", "sliding", "state"


@dataclass(frozen=True)
class GroupKind:
    """The vLLM groups that share one kind of block (same spec), and what a hit needs of them."""

    name: str                              # part of the kind's address root: "full", "sliding128", "state"
    kind: str                              # FULL, SLIDING or STATE
    group_ids: tuple[int, ...]             # vLLM's KV cache groups of this kind, in order
    window_blocks: int = 0                 # SLIDING: blocks a hit needs before its end

    def needs(self, end: int) -> range:
        """The block positions a hit ending at block ``end`` needs of this kind."""
        if self.kind == FULL:
            return range(0, end)
        if self.kind == SLIDING:
            return range(max(0, end - self.window_blocks), end)
        return range(end - 1, end) if end > 0 else range(0)


PRIMARY = "full"          # the name of the first full-attention kind: its blocks are the token chain's own


def kind_root(model: str, dtype: str, block_tokens: int, namespace: str, kind: GroupKind) -> bytes:
    """The address root of a kind's blocks: the agent's root for the first full-attention kind
    (a model with full-attention layers only keeps its addresses), one of its own for the others."""
    suffix = "" if kind.name == PRIMARY else f"|{kind.name}"
    return chain_root(model, dtype, block_tokens, namespace + suffix)


def kind_digests(root: bytes, kind: GroupKind, chain: Sequence[bytes], positions: Sequence[int]) -> list[bytes]:
    """The digests of a kind's blocks at ``positions``, from the token chain's digests: a block
    of the first full-attention kind is the chain's own; the others are BLAKE3(root, the chain
    digest there)."""
    picked = [chain[k] for k in positions]
    return picked if kind.name == PRIMARY else key_digests(root, picked)


def resume_points(num_prompt_tokens: int, block_tokens: int, junction: int = 0) -> list[int]:
    """Block positions a later request can resume this one at (vLLM's retention of sliding-
    window and state groups): the prompt's replay boundary, its last whole block before the
    final token (a resend of the same prompt recomputes that token), and a junction (a block
    position, 0 for none) where another prompt shares this one's prefix."""
    points = {(num_prompt_tokens - 1) // block_tokens}
    if junction:
        points.add(junction)
    return sorted(p for p in points if p > 0)


def hit_length(kinds: Sequence[GroupKind], limit: int, full_prefix: int,
               held: Callable[[GroupKind, int], bool]) -> int:
    """The longest hit, in blocks, that every kind can resume from at once: vLLM's hybrid
    ``find_longest_cache_hit`` (each kind either accepts the candidate or shortens it, until
    none does), over what is held.

    ``limit``: the most blocks a hit may have; ``full_prefix``: how many blocks from the start
    every full-attention kind holds (their hit for any candidate is the candidate capped by it);
    ``held(kind, position)``: whether a block of a sliding or state kind is held (at a
    position, or for a state kind at the end of block ``position``)."""
    candidate = min(limit, full_prefix) if any(k.kind == FULL for k in kinds) else limit
    while candidate > 0:
        shortened = candidate
        for kind in kinds:
            if kind.kind == FULL:
                continue
            shortened = _kind_hit(kind, shortened, held)
        if shortened == candidate:
            return candidate
        candidate = shortened
    return 0


def _kind_hit(kind: GroupKind, candidate: int, held: Callable[[GroupKind, int], bool]) -> int:
    """The longest hit of one sliding or state kind no longer than ``candidate``."""
    if kind.kind == STATE:
        for end in range(candidate, 0, -1):
            if held(kind, end - 1):
                return end
        return 0
    # Sliding (vLLM's SlidingWindowManager): scanning right to left, the first run of held
    # blocks as long as the window is a hit ending there; else the run from block 0, if any.
    run = 0
    for k in range(candidate - 1, -1, -1):
        if held(kind, k):
            run += 1
            if run >= kind.window_blocks:
                return k + run
        else:
            run = 0
    return run
