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
from kvcached.policies import EVICTION_POLICIES, make_eviction_policy
from kvcached.policies.admission import SsdWriteBudget, make_admission_policy
from kvcached.policies.clock import ClockPolicy
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


@pytest.fixture
def evicted() -> list[list[RamBlock]]:
    """What ``on_evict`` of the ``ram`` fixture received, one list per call."""
    return []


@pytest.fixture(params=sorted(EVICTION_POLICIES))
def ram(request: pytest.FixtureRequest, arena: SharedArena, evicted: list[list[RamBlock]]) -> RamTier:
    """A RAM tier with each eviction policy in turn: the tier's rules (a block in use is never
    evicted, an eviction that cannot free enough changes nothing) hold whatever the policy."""
    return RamTier(arena, SLAB, make_eviction_policy(request.param), on_evict=evicted.append)


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
             ssd_policy: str = "lru") -> SyncStore:
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
                         ssd_order=make_eviction_policy(ssd_policy) if ssd and ssd_policy != "lru" else None)
        store = event_loop_for_store.run_until_complete(build())
        store.ssd_reconciled = True
        return SyncStore(store, event_loop_for_store)

    yield make
    for tier, arena in made:
        if tier is not None:
            event_loop_for_store.run_until_complete(tier.close())
        arena.close()
