"""An eviction policy over keys, for tiers that have no ids of their own.

The RAM tier names its blocks by record id and drives :class:`EvictionPolicy` directly. The SSD
tier's in-memory order ([kv] ssd_policy) and the policy simulator name blocks by key only:
:class:`KeyedPolicy` gives them the same policies with the key calls they expect, handing out the
ids itself (:class:`~kvcached.policies.links.KeyIds`: a dict entry and an int per key, about what
the OrderedDict of keys it replaced cost). :class:`PolicyState` is what kvcached.index.policy_state
needs of either: a snapshot in keys, and a restore from one.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from kvcached.policies.base import EvictionPolicy, PolicySnapshot, Steps
from kvcached.policies.links import KeyIds

__all__ = ["KeyedPolicy", "PolicyState"]


class PolicyState(Protocol):
    """What a tier's policy learned, in keys (kvcached.index.policy_state saves and restores it)."""

    def snapshot(self) -> PolicySnapshot: ...

    def snapshot_steps(self) -> Steps[PolicySnapshot]:
        """:meth:`snapshot` in steps (kvcached.policies.base.Steps): copied now, walked in the
        steps, while the tier goes on changing."""
        ...

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """Take up ``snapshot``; ``resident(key)``: whether the tier holds that key now."""


class KeyedPolicy:
    """``policy`` driven by keys: the calls of :class:`EvictionPolicy`, with a key where it
    takes an id (and no key beside it)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._ids = KeyIds()

    def insert(self, key: bytes) -> None:
        self.policy.insert(self._ids.add(key), key)

    def touch(self, key: bytes) -> None:
        entry = self._ids.get(key)
        if entry is not None:
            self.policy.touch(entry)

    def touched(self, key: bytes) -> bool:
        """:meth:`touch` if the policy holds ``key``; whether it did (one lookup, not two: the
        miniature copies of kvcached.policies.tuning and curves ask this on every use)."""
        entry = self._ids.index.get(key)
        if entry is None or entry not in self.policy:
            return False
        self.policy.touch(entry)
        return True

    def remove(self, key: bytes) -> None:
        entry = self._ids.discard(key)
        if entry is not None:
            self.policy.remove(entry)

    def evicted(self, key: bytes) -> None:
        entry = self._ids.discard(key)
        if entry is not None:
            self.policy.evicted(entry, key)

    def candidates(self) -> Iterator[bytes]:
        keys = self._ids.keys
        for entry in self.policy.candidates():
            key = keys[entry]
            assert key is not None, "the policy offered an id it was not given"
            yield key

    def __len__(self) -> int:
        return len(self.policy)

    def __iter__(self) -> Iterator[bytes]:
        return map(self._ids.key_of, self.policy)

    def __contains__(self, key: bytes) -> bool:
        entry = self._ids.get(key)
        return entry is not None and entry in self.policy

    def snapshot(self) -> PolicySnapshot:
        return self.policy.snapshot(self._ids.key_getter)

    def snapshot_steps(self) -> Steps[PolicySnapshot]:
        return self.policy.snapshot_steps(self._ids.frozen_keys())

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """See :meth:`EvictionPolicy.restore`; ids are handed out to the resident keys the
        snapshot names (and taken back from any the policy did not keep)."""
        ids = self._ids
        self.policy.restore(snapshot, lambda key: ids.add(key) if resident(key) else None)
        for key in [k for k, entry in ids.items() if entry not in self.policy]:
            ids.discard(key)
