"""Cache policies: one small ABC per decision and one registry per ABC, keyed by the config string.

Eviction policies order the resident blocks of a tier. They run on the event loop, must be O(1)
per operation and do no I/O. The tier, not the policy, decides whether a candidate may go: a
block that is being written or read is skipped and stays where the policy keeps it.

What a policy has learned (its order, its frequency bits, its ghost lists and adaptive target)
can be taken as a :class:`PolicySnapshot` and given to a fresh instance after a restart
(kvcached.policy_state keeps snapshots in the index), so a restarted daemon evicts as the old
one would have.
"""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

__all__ = ["EvictionPolicy", "EVICTION_POLICIES", "PolicySnapshot", "SnapshotError", "make_eviction_policy"]

_MAGIC = b"KVPS1"
_HEAD = struct.Struct("<5sI")


class SnapshotError(ValueError):
    """A stored snapshot cannot be read (damaged, or written by another policy)."""


@dataclass
class PolicySnapshot:
    """What a policy knows, as plain data: named lists of (key, small number) in the policy's
    own order (oldest first), and named numbers. ``kind`` names the policy that wrote it."""

    kind: str
    lists: dict[str, list[tuple[bytes, int]]] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)

    def encode(self) -> bytes:
        """Magic, a JSON head (kind, numbers, list names and lengths), then per entry one byte
        of key length, the key and one byte of value."""
        head = json.dumps({"kind": self.kind, "numbers": self.numbers,
                           "lists": [[name, len(items)] for name, items in self.lists.items()]}).encode()
        parts = [_HEAD.pack(_MAGIC, len(head)), head]
        for items in self.lists.values():
            parts.extend(bytes((len(key),)) + key + bytes((min(255, value),)) for key, value in items)
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes) -> "PolicySnapshot":
        try:
            magic, n = _HEAD.unpack_from(raw)
            if magic != _MAGIC:
                raise SnapshotError("not a policy snapshot")
            head = json.loads(raw[_HEAD.size:_HEAD.size + n])
            pos = _HEAD.size + n
            lists: dict[str, list[tuple[bytes, int]]] = {}
            for name, count in head["lists"]:
                items = lists[name] = []
                for _ in range(count):
                    length = raw[pos]
                    items.append((raw[pos + 1:pos + 1 + length], raw[pos + 1 + length]))
                    pos += length + 2
            if pos != len(raw):
                raise SnapshotError(f"{len(raw) - pos} bytes left over")
            return cls(str(head["kind"]), lists, {k: float(v) for k, v in head["numbers"].items()})
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise SnapshotError(f"damaged policy snapshot: {exc}") from None


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

    @abstractmethod
    def __iter__(self) -> Iterator[bytes]:
        """The resident keys, in no promised order (the order is :meth:`candidates`')."""

    @abstractmethod
    def __contains__(self, key: bytes) -> bool:
        """``key`` is resident as far as the policy knows (ghosts are not)."""

    @abstractmethod
    def snapshot(self) -> PolicySnapshot:
        """Everything the policy has learned, resident order and ghosts included."""

    @abstractmethod
    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        """Take up ``snapshot`` (of this same kind) in a fresh instance. Keys of the snapshot's
        resident lists for which ``resident(key)`` is false are not resident in this tier now
        (RAM is empty after a restart): a policy with ghost lists remembers them there, one
        without forgets them. The caller then inserts resident keys the snapshot lacked."""


def resident_keys(items: Iterable[tuple[bytes, int]], resident: Callable[[bytes], bool]) -> tuple[
        list[tuple[bytes, int]], list[bytes]]:
    """Split a snapshot list into the entries still resident and the keys that are not."""
    kept: list[tuple[bytes, int]] = []
    gone: list[bytes] = []
    for key, value in items:
        if resident(key):
            kept.append((key, value))
        else:
            gone.append(key)
    return kept, gone


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
