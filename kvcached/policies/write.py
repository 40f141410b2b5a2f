"""Write policies: when a new block's bytes go from RAM to the SSD tier (SGLang HiCache's write
policies, ../shared/seeds/002).

- ``write_back`` (default): a background demoter publishes new blocks soon after they are
  stored, oldest first; a Put returns once the block is in RAM.
- ``write_through``: a Put (or an agent's commit) returns only once its new blocks are
  published on SSD; a block that cannot be is not kept.
- ``write_through_selective``: a new block stays in RAM only until it has been hit
  ``threshold`` times; then it heads for SSD like a write-back block. One-off blocks never
  cost an SSD write (endurance, bandwidth); blocks that proved themselves survive RAM evictions
  and restarts.

The store reads two facts off the policy: whether a write waits for the SSD (``synchronous``)
and how many hits a new block needs before it is written (``hits_before_ssd``, 0: at once).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WritePolicy", "WRITE_POLICIES", "make_write_policy"]


@dataclass(frozen=True, slots=True)
class WritePolicy:
    name: str
    synchronous: bool = False
    hits_before_ssd: int = 0


#: config string -> the policy with its default threshold ([kv] write_policy)
WRITE_POLICIES: dict[str, WritePolicy] = {
    "write_back": WritePolicy("write_back"),
    "write_through": WritePolicy("write_through", synchronous=True),
    "write_through_selective": WritePolicy("write_through_selective", hits_before_ssd=2),
}


def make_write_policy(name: str, threshold: int = 2) -> WritePolicy:
    """The policy named ``name``; ``threshold`` is write_through_selective's hit count."""
    if name not in WRITE_POLICIES:
        raise ValueError(f"unknown write policy {name!r}; known: {', '.join(WRITE_POLICIES)}")
    if threshold < 1:
        raise ValueError(f"the hit threshold must be at least 1, got {threshold}")
    policy = WRITE_POLICIES[name]
    return WritePolicy(name, policy.synchronous, threshold) if policy.hits_before_ssd else policy
