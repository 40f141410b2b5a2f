"""The eviction policy ABC, what a policy snapshot holds, and the helpers policies share (see the
package's docstring for the contract)."""


from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator, Optional, Protocol, TypeVar, cast

__all__ = ["EvictionPolicy", "PolicySettings", "PolicySnapshot", "SettingTuner", "SnapshotError", "Steps", "blob", "finished",
           "resident_keys", "through"]

_MAGIC = b"KVPS1"
_HEAD = struct.Struct("<5sI")
_PIECE = 2048           # keys joined (or values packed) in one step of an encoding
T = TypeVar("T")

#: Work done in steps, so that a caller on the event loop can let requests run between them:
#: the iterator yields None after each step (a few thousand entries: well under a millisecond),
#: then the result, last. :func:`finished` runs it all at once; kvcached.host.aio.run_in_slices
#: runs it on the loop a slice at a time.
Steps = Iterator[Optional[T]]


def blob(view: memoryview) -> bytes:
    """``view`` where a snapshot's list takes a key: the big ones (slru's last uses, a ghost
    filter's cells: tens of MB at a million entries) are built a slice at a time in memory of
    their own rather than as one ``bytes``, whose allocation alone faults in all its pages at
    once (some 17 ms for 36 MB here). Read-only, and bytes-like for all a snapshot does with
    its keys (len, slicing, indexing, comparison with bytes, joining, encoding); not hashable."""
    return cast(bytes, view.toreadonly())


def finished(steps: Iterator[T | None]) -> T:
    """Run ``steps`` (see :data:`Steps`) to the end now; their result."""
    for item in steps:
        if item is not None:
            return item
    raise ValueError("the steps ended without a result")


def through(steps: Iterator[T | None]) -> Generator[None, None, T]:
    """``result = yield from through(steps)`` in steps of one's own: their Nones passed on,
    their result returned."""
    for item in steps:
        if item is None:
            yield None
        else:
            return item
    raise ValueError("the steps ended without a result")


class SnapshotError(ValueError):
    """A stored snapshot cannot be read (damaged, or written by another policy)."""


@dataclass
class PolicySnapshot:
    """What a policy knows, as plain data: named lists of keys in the policy's own order (oldest
    first), a small number (0..255) per key for the lists that keep one (``values``: CLOCK's
    reference bits, S3-FIFO's frequencies), and named numbers. ``kind`` names the policy that
    wrote it. Lists are built by walking the policy's id queues on the event loop
    (bench_policies measures the cost per million keys)."""

    kind: str
    lists: dict[str, list[bytes]] = field(default_factory=dict)
    values: dict[str, list[int]] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)

    def items(self, name: str) -> Iterable[tuple[bytes, int]]:
        """(key, value) of list ``name``, oldest first (value 0 where the list keeps none)."""
        keys = self.lists.get(name, [])
        values = self.values.get(name)
        return zip(keys, values) if values is not None else ((key, 0) for key in keys)

    def encode(self) -> bytes:
        """Magic, a JSON head (kind, numbers, per list its name, length, key size and whether
        it has values), then per list its keys back to back and its values, one byte each.
        Keys of one list share a size (BLAKE3 index keys are 32 bytes); a list whose keys do
        not (tests) stores one length byte before each key."""
        return b"".join(finished(self.encode_steps()))

    def encode_steps(self) -> Steps[list[bytes]]:
        """:meth:`encode` in steps (:data:`Steps`), each joining a few thousand keys or values
        (a million keys joined at once hold the interpreter some 40 ms); the result is the
        encoding in parts, whose concatenation is :meth:`encode`'s bytes."""
        heads = []
        parts: list[bytes] = []
        for name, keys in self.lists.items():
            size = len(keys[0]) if keys else 0
            # Fixed-size only for keys of one size above 0: a list of empty keys (an idle slru's
            # one empty tick string) is not "no keys", so it keeps its length bytes.
            fixed = size > 0 or not keys
            for start in range(0, len(keys) if fixed else 0, _PIECE):
                if set(map(len, keys[start:start + _PIECE])) != {size}:
                    fixed = False
                    break
                yield None
            values = self.values.get(name)
            heads.append([name, len(keys), size if fixed else -1, values is not None])
            for start in range(0, len(keys), _PIECE):
                piece = keys[start:start + _PIECE]
                if fixed and len(piece) == 1:       # as it is: a big blob is not copied (see blob)
                    parts.append(piece[0])
                else:
                    parts.append(b"".join(piece) if fixed else b"".join(bytes((len(k),)) + k for k in piece))
                yield None
            for start in range(0, len(values) if values is not None else 0, _PIECE):
                assert values is not None
                piece_values = values[start:start + _PIECE]
                try:
                    parts.append(bytes(piece_values))    # small ints and bools: one C-level pass
                except ValueError:
                    parts.append(bytes(min(255, max(0, int(v))) for v in piece_values))
                yield None
        head = json.dumps({"kind": self.kind, "numbers": self.numbers, "lists": heads}).encode()
        yield [_HEAD.pack(_MAGIC, len(head)), head, *parts]

    @classmethod
    def decode(cls, raw: bytes) -> "PolicySnapshot":
        try:
            magic, n = _HEAD.unpack_from(raw)
            if magic != _MAGIC:
                raise SnapshotError("not a policy snapshot")
            head = json.loads(raw[_HEAD.size:_HEAD.size + n])
            pos = _HEAD.size + n
            snapshot = cls(str(head["kind"]), numbers={k: float(v) for k, v in head["numbers"].items()})
            for name, count, size, has_values in head["lists"]:
                if count == 0:
                    keys = []
                elif size > 0:
                    end = pos + count * size
                    if end > len(raw):
                        raise SnapshotError("truncated")
                    keys = [raw[i:i + size] for i in range(pos, end, size)]
                    pos = end
                else:
                    keys = []
                    for _ in range(count):
                        length = raw[pos]
                        keys.append(raw[pos + 1:pos + 1 + length])
                        pos += length + 1
                snapshot.lists[name] = keys
                if has_values:
                    if pos + count > len(raw):
                        raise SnapshotError("truncated")
                    snapshot.values[name] = list(raw[pos:pos + count])
                    pos += count
            if pos != len(raw):
                raise SnapshotError(f"{len(raw) - pos} bytes left over")
            return snapshot
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise SnapshotError(f"damaged policy snapshot: {exc}") from None


@dataclass(frozen=True)
class PolicySettings:
    """The config's settings of the eviction policies (``[kv]``); each policy takes what it
    uses. ``slru_ratio``: slru's fixed age ratio, 0 to tune it online."""

    slru_ratio: float = 0.0


class SettingTuner(Protocol):
    """What tunes a policy's setting online (kvcached.policies.tuning.RatioTuner): it sees each
    use of a key with the size of the cache in entries, and says the setting to use, once it has
    chosen (``decided``: the rounds it chose in)."""

    ratio: float
    decided: int

    def access(self, key: bytes, capacity: int) -> None: ...


class Shadow(Protocol):
    """A policy run over keys alone with room for ``capacity`` of them, as a miniature copy
    (kvcached.policies.tuning's tuners, kvcached.policies.curves): touch on a hit; on a miss,
    evict the policy's first candidates until there is room, then insert. ``hits`` counts
    the hits of :meth:`access`; ``size`` the keys it holds."""

    hits: int
    size: int

    @property
    def capacity(self) -> int: ...

    @capacity.setter
    def capacity(self, entries: int) -> None: ...

    def access(self, key: bytes) -> bool: ...

    def remove(self, key: bytes) -> None: ...

    def follow(self, tier: "EvictionPolicy") -> None: ...

    def tuned_to(self, value: float) -> None: ...

    def __contains__(self, key: bytes) -> bool: ...


class ShadowBase:
    """What every :class:`Shadow` shares: its room (``capacity``; made smaller, it calls
    :meth:`shrunk`, as a copy whose sampling rate fell tells its policy), its counts, and no
    setting to follow or tune unless the subclass has one."""

    def __init__(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self.size = 0
        self.hits = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, entries: int) -> None:
        entries = max(1, entries)
        if entries < self._capacity:
            self.shrunk(entries)
        self._capacity = entries

    def shrunk(self, entries: int) -> None:
        """The copy holds at most ``entries`` from now on, fewer than before."""

    def follow(self, tier: "EvictionPolicy") -> None:
        """Take the setting ``tier`` has tuned to, where the policy has one."""

    def tuned_to(self, value: float) -> None:
        """Use ``value`` for the setting a tuner tunes, where the policy has one."""


class EvictionPolicy(ABC):
    """Orders the resident entries of one tier for eviction.

    Entries are named by *ids*: small dense ints the tier hands out (the RAM tier's record
    numbers; :class:`~kvcached.policies.keyed.KeyedPolicy` hands them out for tiers that name
    blocks by key only), so a policy keeps its per-entry state in array columns indexed by id
    (kvcached.policies.links: a few bytes an entry) rather than in a dict of keys (some 90). An
    id names one entry from :meth:`insert` to :meth:`remove` or :meth:`evicted`; then the tier
    may give it to another. The entry's key comes along where a policy remembers entries past
    their eviction (ghost lists hold keys: the id is gone by then).
    """

    @classmethod
    def configured(cls, settings: PolicySettings) -> "EvictionPolicy":
        """A fresh instance with the settings of the config; by default the class takes none."""
        return cls()

    def miniature(self) -> "EvictionPolicy":
        """A fresh, empty policy to run beside this one at another size on a sample of the keys
        (kvcached.policies.curves): its settings as they are now, a tuned one fixed where it is
        (no tuner of its own: :meth:`follow` keeps it where this one's is, or
        :meth:`miniature_tuner`'s choice is given to it). By default the class takes no
        settings."""
        return type(self)()

    def follow(self, tier: "EvictionPolicy") -> None:
        """Take the settings ``tier``, the policy this one is a miniature of, has tuned to now.
        By default there are none."""

    def miniature_tuner(self) -> "SettingTuner | None":
        """For a miniature of this policy run at another size (kvcached.policies.curves): the
        tuner a tier of that size would run, fed the miniature's keys (a sample already, so it
        takes them all), whose choice the miniature takes (:meth:`tuned_to`) instead of
        following this one's, tuned for its own size. None (the default): nothing is tuned, or
        a fixed setting was configured."""
        return None

    def tuned_to(self, value: float) -> None:
        """Use ``value`` for the setting :meth:`miniature_tuner`'s tuner tunes. By default there
        is none."""

    def shadow(self, capacity: int) -> Shadow | None:
        """This policy, fresh, as a :class:`Shadow` of its own: the same decisions, hit for hit,
        over keys in plain dicts, where the id columns a tier needs cost most of a miniature
        copy's time (tests/unit/test_shadows.py checks each against the generic one). None (the
        default): kvcached.policies.tuning.ShadowCache runs the policy itself."""
        return None

    def resized(self, entries: int) -> None:
        """The cache holds at most ``entries`` from now on, fewer than it may have held (a
        miniature copy whose sampling rate fell, kvcached.policies.curves and tuning): a policy
        whose state is sized by the most entries it ever held (slru's ghosts, ARC's target)
        sizes it by ``entries`` instead, as a cache that size would. By default nothing
        happens."""

    def size_for(self, capacity: int) -> None:
        """The tier hands out ids below ``capacity`` only: the policy may lay out its per-id
        columns for that many now (kvcached.policies.links.column: pages cost RAM once used)
        instead of growing them. By default nothing happens."""

    @abstractmethod
    def insert(self, entry: int, key: bytes) -> None:
        """``entry`` (whose key is ``key``) became resident."""

    @abstractmethod
    def touch(self, entry: int) -> None:
        """``entry`` was used (hit). Entries the policy does not hold are ignored."""

    @abstractmethod
    def remove(self, entry: int) -> None:
        """``entry`` left the tier because it was deleted. Entries not held are ignored."""

    def evicted(self, entry: int, key: bytes) -> None:
        """``entry`` (key ``key``) left the tier because the tier evicted it (a policy with
        ghost lists remembers the key); by default the same as :meth:`remove`."""
        self.remove(entry)

    @abstractmethod
    def candidates(self) -> Iterator[int]:
        """Entries in the order the policy would evict them.

        The iterator ends after a bounded number of steps (a policy with second chances yields
        each entry at least once within two passes). The caller removes what it evicts with
        :meth:`evicted` or :meth:`remove`; an entry it skips stays resident.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """The resident entries, in no promised order (the order is :meth:`candidates`')."""

    @abstractmethod
    def __contains__(self, entry: int) -> bool:
        """``entry`` is resident as far as the policy knows."""

    @abstractmethod
    def snapshot(self, key_of: Callable[[int], bytes]) -> PolicySnapshot:
        """Everything the policy has learned, resident order and ghosts included, in keys
        (``key_of`` names a resident entry's key)."""

    def snapshot_steps(self, key_of: Callable[[int], bytes]) -> Steps[PolicySnapshot]:
        """:meth:`snapshot` in steps (:data:`Steps`), for a snapshot taken while the tier
        serves: what the policy knows is copied now, in this call (bulk copies of its columns,
        a few milliseconds for a million entries), and the copy is walked in the steps, so the
        policy may change between them. ``key_of`` must name the entries as they were at this
        call until the steps end (kvcached.policies.links.KeyIds.frozen_keys, taken together
        with this call). By default one step, taken now: :meth:`snapshot` (the in-tree policies
        walk in steps of kvcached.policies.links.STEP)."""
        return iter((self.snapshot(key_of),))

    @abstractmethod
    def restore(self, snapshot: PolicySnapshot, entry_of: Callable[[bytes], int | None]) -> None:
        """Take up ``snapshot`` (of this same kind) in a fresh instance. ``entry_of`` gives the
        id of a key of the snapshot's resident lists that is resident in the tier now, None for
        one that is not (RAM is empty after a restart): a policy with ghost lists remembers
        those there, one without forgets them. The caller then inserts resident entries the
        snapshot lacked."""


def resident_keys(items: Iterable[tuple[bytes, int]], entry_of: Callable[[bytes], int | None]) -> tuple[
        list[tuple[int, int]], list[bytes]]:
    """Split a snapshot list (:meth:`PolicySnapshot.items`) into the (id, value) of the keys
    still resident and the keys that are not."""
    kept: list[tuple[int, int]] = []
    gone: list[bytes] = []
    for key, value in items:
        entry = entry_of(key)
        if entry is not None:
            kept.append((entry, value))
        else:
            gone.append(key)
    return kept, gone
