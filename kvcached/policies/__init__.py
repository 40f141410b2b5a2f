"""Cache policies: one small ABC per decision and one registry per ABC, keyed by the config string.

Eviction policies order the resident blocks of a tier. They run on the event loop, must be O(1)
per operation and do no I/O. They name blocks by dense ids, so that their state per block is a
few bytes in arrays (kvcached.policies.links); the RAM tier hands them its record ids, and
:class:`KeyedPolicy` gives the same policies to users that have keys only (the SSD tier's order,
the simulator). The tier, not the policy, decides whether a candidate may go: a
block that is being written or read is skipped and stays where the policy keeps it.

What a policy has learned (its order, its frequency bits, its ghost lists and adaptive target)
can be taken as a :class:`PolicySnapshot` and given to a fresh instance after a restart
(kvcached.index.policy_state keeps snapshots in the index), so a restarted daemon evicts as the old
one would have.
"""

from __future__ import annotations

from kvcached.policies.arc import ArcPolicy
from kvcached.policies.base import (
    EvictionPolicy,
    PolicySettings,
    PolicySnapshot,
    SnapshotError,
    Steps,
    blob,
    finished,
    resident_keys,
    through,
)
from kvcached.policies.clock import ClockPolicy
from kvcached.policies.keyed import KeyedPolicy, PolicyState
from kvcached.policies.lru import LruPolicy
from kvcached.policies.s3fifo import S3FifoPolicy
from kvcached.policies.slru import SlruPolicy

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "KeyedPolicy", "PolicySettings", "PolicySnapshot", "PolicyState",
           "SnapshotError", "Steps", "blob", "finished", "through",
           "make_eviction_policy", "make_keyed_policy", "resident_keys"]

#: config string -> policy class ([kv] ram_policy)
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"clock": ClockPolicy, "lru": LruPolicy, "arc": ArcPolicy,
                                                      "s3fifo": S3FifoPolicy, "slru": SlruPolicy}


def make_eviction_policy(name: str, settings: PolicySettings | None = None) -> EvictionPolicy:
    """A fresh policy ``name``, with the settings of the config (defaults without one)."""
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}") from None
    return cls.configured(settings or PolicySettings())


def make_keyed_policy(name: str, settings: PolicySettings | None = None) -> KeyedPolicy:
    """The policy ``name`` over keys (see :class:`KeyedPolicy`)."""
    return KeyedPolicy(make_eviction_policy(name, settings))
