"""Shared fixtures of the unit tests: small real components, a clock moved by hand.

No sockets and no mocks: the arena is a real memfd (a few hundred KiB), the index a real
RocksDB under tmp_path. Time is a :class:`FakeClock` passed in where the code takes a clock.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

import blake3
import pytest

from kvcached.index import BlockIndex
from kvcached.policies import EVICTION_POLICIES, EvictionPolicy, KeyedPolicy, PolicySettings, make_eviction_policy, make_keyed_policy
from kvcached.policies.admission import SsdWriteBudget, make_admission_policy
from kvcached.policies.clock import ClockPolicy
from kvcached.policies.links import IdQueue, KeyIds
from kvcached.policies.write import make_write_policy
from kvcached.store import Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamBlock, RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached_agent.address import BlockAddress

KIB = 1 << 10
MIB = 1 << 20

#: slab (= largest block) of the test RAM tiers
SLAB = 64 * KIB
#: arena of the test RAM tiers: 4 slabs
ARENA = 4 * SLAB


class FakeClock:
    """A clock that moves only when told to (``clock()`` -> seconds)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def digest(n: int) -> bytes:
    """A distinct 32-byte digest for ``n`` (readable in failures)."""
    return n.to_bytes(4, "big") * 8


def address(n: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(digest(n), layer)


def payload(n: int, size: int) -> bytes:
    """``size`` pseudo-random bytes, different for every ``n`` (catches offset mix-ups)."""
    return blake3.blake3(n.to_bytes(8, "little")).digest(length=size)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    a = SharedArena(ARENA, name="kvcached-unit-test")
    yield a
    a.close()


class EvictionLog(list[list[RamBlock]]):
    """What a RAM tier evicted, one list per eviction, taken from its outbox
    (``RamTier.take_evicted``) whenever the test looks."""

    def __init__(self, ram: RamTier) -> None:
        super().__init__()
        self.ram = ram

    def _take(self) -> None:
        super().extend(self.ram.take_evicted())

    def __iter__(self) -> Iterator[list[RamBlock]]:
        self._take()
        return super().__iter__()

    def __len__(self) -> int:
        self._take()
        return super().__len__()

    def __getitem__(self, index: Any) -> Any:
        self._take()
        return super().__getitem__(index)

    def __eq__(self, other: object) -> bool:
        self._take()
        return list(super().__iter__()) == other

    def flat(self) -> list[RamBlock]:
        return [block for batch in self for block in batch]


@pytest.fixture
def evicted(ram: RamTier) -> EvictionLog:
    """What the ``ram`` fixture evicted, one list per eviction."""
    return EvictionLog(ram)


@pytest.fixture(params=sorted(EVICTION_POLICIES))
def ram(request: pytest.FixtureRequest, arena: SharedArena) -> RamTier:
    """A RAM tier with each eviction policy in turn: the tier's rules (a block in use is never
    evicted, an eviction that cannot free enough changes nothing) hold whatever the policy."""
    return RamTier(arena, SLAB, make_eviction_policy(request.param))


@pytest.fixture
def index_factory(tmp_path: Path) -> Iterator[Callable[..., BlockIndex]]:
    """Opens BlockIndex objects under tmp_path and closes the ones still open at the end."""
    opened: list[BlockIndex] = []

    def open_index(name: str = "index") -> BlockIndex:
        idx = BlockIndex(tmp_path / name)
        opened.append(idx)
        return idx

    yield open_index
    for idx in opened:
        if hasattr(idx, "_blocks"):   # close() was not called yet
            idx.close()


@pytest.fixture
def index(index_factory: Callable[..., BlockIndex]) -> BlockIndex:
    return index_factory()


class SyncStore:
    """A Store whose coroutine methods run to completion on a private event loop, so tests of
    its synchronous logic read as plain calls. Every other attribute is the store's own."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **kw: self._loop.run_until_complete(attr(*a, **kw))
        return attr

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)


@pytest.fixture
def event_loop_for_store() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture
def store(ram: RamTier, index: BlockIndex, clock: FakeClock, event_loop_for_store: asyncio.AbstractEventLoop) -> SyncStore:
    loop = event_loop_for_store
    made = loop.run_until_complete(_make(lambda: Store(ram, index, gone_ttl=3600.0, clock=clock)))
    return SyncStore(made, loop)


async def _make(factory: Callable[[], Any]) -> Any:
    """Build inside the loop (a Store makes asyncio objects)."""
    return factory()


@pytest.fixture
def policy_store(index: BlockIndex, clock: FakeClock, tmp_path: Path,
               event_loop_for_store: asyncio.AbstractEventLoop) -> Iterator[Callable[..., SyncStore]]:
    made: list[tuple[SsdTier, SharedArena]] = []

    """Stores over one index and SSD directory, with the policies given by name (the RAM tier
    uses CLOCK): a second call is the same node after a restart."""

    def make(write_policy: str = "write_back", *, admission: str = "always", threshold: int = 2,
             budget: int = 0, ssd: bool = True, arena_bytes: int = 16 * SLAB, ssd_capacity: int = 1 << 30,
             ssd_policy: str = "lru", settings: PolicySettings | None = None) -> SyncStore:
        arena = SharedArena(arena_bytes, name="kvcached-policy-test")
        tier = SsdTier(str(tmp_path / "ssd"), ssd_capacity, durability="none", threads=2) if ssd else None
        if tier is not None:
            tier.open()
        made.append((tier, arena))  # type: ignore[arg-type]

        async def build() -> Store:
            return Store(RamTier(arena, SLAB, ClockPolicy()), index, ssd=tier,
                         write_policy=make_write_policy(write_policy, threshold), clock=clock,
                         admission=make_admission_policy(admission, threshold, 10_000),
                         ssd_budget=SsdWriteBudget(budget),
                         ssd_order=make_keyed_policy(ssd_policy, settings) if ssd and ssd_policy != "lru" else None)
        store = event_loop_for_store.run_until_complete(build())
        store.ssd_reconciled = True
        return SyncStore(store, event_loop_for_store)

    yield make
    for tier, arena in made:
        if tier is not None:
            event_loop_for_store.run_until_complete(tier.close())
        arena.close()


# -- policies looked into by key -----------------------------------------------------------------


class QueueView:
    """One id queue of a keyed policy, read and written by key as the OrderedDicts the policies
    kept before they took ids (the policy tests look inside policies)."""

    def __init__(self, ids: KeyIds, queue: IdQueue) -> None:
        self.ids, self.queue = ids, queue

    def _entry(self, key: bytes) -> int | None:
        entry = self.ids.get(key)
        return entry if entry is not None and entry in self.queue else None

    def __iter__(self) -> Iterator[bytes]:
        return iter([self.ids.key_of(e) for e in self.queue])

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __contains__(self, key: bytes) -> bool:
        return self._entry(key) is not None

    def __getitem__(self, key: bytes) -> int:
        entry = self._entry(key)
        if entry is None:
            raise KeyError(key)
        return self.queue.links.value[entry]

    def __setitem__(self, key: bytes, value: int | None) -> None:
        entry = self.ids.add(key)
        if entry in self.queue:
            self.queue.links.value[entry] = value or 0
        else:
            self.queue.push(entry, value or 0)

    def move_to_end(self, key: bytes, last: bool = True) -> None:
        entry = self._entry(key)
        if entry is None:
            raise KeyError(key)
        if last:
            self.queue.move_to_back(entry)
            return
        values = self.queue.links.value
        order = [(e, values[e]) for e in self.queue]
        for e, _ in order:
            self.queue.remove(e)
        for e, value in sorted(order, key=lambda item: item[0] != entry):
            self.queue.push(e, value)


class Keyed(KeyedPolicy):
    """A :class:`KeyedPolicy` whose queues (T1, S, the CLOCK ring...) read as :class:`QueueView`
    and whose other attributes (ghost lists, ARC's target) are the policy's own."""

    def __init__(self, policy: EvictionPolicy, ids: KeyIds | None = None) -> None:
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "_ids", ids if ids is not None else KeyIds())

    @classmethod
    def of(cls, keyed: KeyedPolicy) -> "Keyed":
        """A view of ``keyed`` (the same policy and ids)."""
        return cls(keyed.policy, keyed._ids)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.policy, name)
        return QueueView(self._ids, value) if isinstance(value, IdQueue) else value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.policy, name, value)
