"""Cache policies: one small ABC per decision and one registry per ABC, keyed by the config string.

Eviction policies order the resident blocks of a tier. They run on the event loop, must be O(1)
per operation and do no I/O. The tier, not the policy, decides whether a candidate may go: a
block that is being written or read is skipped and stays where the policy keeps it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

__all__ = ["EvictionPolicy", "EVICTION_POLICIES", "make_eviction_policy"]


class EvictionPolicy(ABC):
    """Orders the keys resident in one tier for eviction."""

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """``key`` became resident."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` was used (hit)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """``key`` left the tier because it was deleted. Unknown keys are ignored."""

    def evicted(self, key: bytes) -> None:
        """``key`` left the tier because the tier evicted it (a policy with ghost lists
        remembers it); by default the same as :meth:`remove`."""
        self.remove(key)

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Keys in the order the policy would evict them.

        The iterator ends after a bounded number of steps (a policy with second chances yields
        each key at least once within two passes). The caller removes what it evicts with
        :meth:`remove`; a key it skips stays resident.
        """

    @abstractmethod
    def __len__(self) -> int: ...


def _registry() -> dict[str, type[EvictionPolicy]]:
    from kvcached.policies.arc import ArcPolicy
    from kvcached.policies.clock import ClockPolicy
    from kvcached.policies.lru import LruPolicy
    from kvcached.policies.s3fifo import S3FifoPolicy

    return {"clock": ClockPolicy, "lru": LruPolicy, "arc": ArcPolicy, "s3fifo": S3FifoPolicy}


#: config string -> policy class ([kv] ram_policy)
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = _registry()


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}") from None
