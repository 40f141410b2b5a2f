"""An agent session without sockets: handles are private, and closing gives everything back."""

from __future__ import annotations

import asyncio
import time

from kvcached.api.agent_session import AgentSession, PeerCredentials
from kvcached_agent import protocol as p
from tests.unit.conftest import KIB, SyncStore, address, digest, payload

HELLO = p.Hello("unit", "m", "float16", 16, 1, 64 * KIB)


def session(store: SyncStore, number: int = 1) -> AgentSession:
    return AgentSession(store._store, number, HELLO, PeerCredentials(123, 0, 0))


def run(store: SyncStore, coroutine: object) -> p.Message:
    return store._loop.run_until_complete(coroutine)  # type: ignore[arg-type]


def allocate(store: SyncStore, s: AgentSession, ns: list[int], size: int = 8 * KIB) -> p.Slots:
    answer = run(store, s.handle_waiting(p.Allocate([(digest(n), 0, size) for n in ns])))
    assert isinstance(answer, p.Slots)
    return answer


def test_save_load_release_through_a_session(store: SyncStore) -> None:
    s = session(store)
    slots = allocate(store, s, [1, 2])
    for n, (status, handle, offset) in zip((1, 2), slots.entries):
        assert status == p.Status.OK
        store.ram.arenas.get(0).write(offset, payload(n, 8 * KIB))
    committed = run(store, s.handle_waiting(p.Commit([h for _, h, _ in slots.entries] + [999])))
    assert isinstance(committed, p.Committed)
    assert list(committed.statuses) == [p.Status.OK, p.Status.OK, p.Status.UNKNOWN_HANDLE]
    loaded = run(store, s.handle_waiting(p.Load([(digest(1), 0), (digest(5), 0)])))
    assert isinstance(loaded, p.Loaded)
    (status, handle, offset, length), miss = loaded.entries
    assert status == p.Status.OK and miss[0] == p.Status.MISS
    assert store.ram.arenas.get(0).read(offset, length) == payload(1, 8 * KIB)
    assert store.pinned_bytes == 8 * KIB and s.held == (0, 1)
    assert s.handle(p.Release([handle, handle, 77])) == p.Released(1, 2)      # twice: the second is unknown
    assert store.pinned_bytes == 0


def test_handles_are_private_to_their_session(store: SyncStore) -> None:
    a, b = session(store, 1), session(store, 2)
    (status, handle, _), = allocate(store, a, [1]).entries
    assert b.handle(p.Release([handle])) == p.Released(0, 1)
    committed = run(store, b.handle_waiting(p.Commit([handle])))
    assert isinstance(committed, p.Committed) and list(committed.statuses) == [p.Status.UNKNOWN_HANDLE]
    assert a.held == (1, 0)


def test_close_gives_everything_back(store: SyncStore) -> None:
    keep = session(store, 1)
    s = session(store, 2)
    allocate(store, keep, [9])
    allocate(store, s, [1, 2])
    loaded = run(store, s.handle_waiting(p.Load([(digest(9), 0)])))     # not committed: a miss
    assert isinstance(loaded, p.Loaded) and loaded.entries[0][0] == p.Status.MISS
    assert s.handle(p.Pinned([digest(1), digest(2)])) is None
    held_before = store.pinned_bytes
    assert s.close() == (2, 0, 2)
    assert s.close() == (0, 0, 0)
    assert store.pinned_bytes == held_before - 16 * KIB
    assert address(1).key not in store.ram and store.ram.busy_reason(address(1).key) is None
    assert [i.session for i in store.gpu.agents()] == [1]
    assert keep.held == (1, 0)


def test_an_allocate_that_outlives_its_connection_reserves_nothing(store: SyncStore) -> None:
    s = session(store)

    async def allocate_then_close() -> p.Message:
        task = asyncio.ensure_future(s.handle_waiting(p.Allocate([(digest(1), 0, 4 * KIB)])))
        s.close()                 # the connection ends before the Allocate's first step runs
        return await task

    answer = run(store, allocate_then_close())
    assert isinstance(answer, p.Error) and answer.code == p.ErrorCode.UNAVAILABLE
    assert store.pinned_bytes == 0 and len(store.ram) == 0


def test_requests_an_agent_may_not_send(store: SyncStore) -> None:
    s = session(store)
    for message, code in ((HELLO, p.ErrorCode.HANDSHAKE), (p.Welcome(1, 1, 1, 1, "x"), p.ErrorCode.UNKNOWN_TYPE)):
        answer = s.handle(message)
        assert isinstance(answer, p.Error) and answer.code == code


def test_present_answers_each_block_on_its_own(store: SyncStore) -> None:
    """Present, unlike Lookup, is not a prefix: a block after a missing one is still found, and
    the asking agent's own GPU blocks are flagged as such."""
    s = session(store)
    slots = allocate(store, s, [2, 4])
    for n, (_, _, offset) in zip((2, 4), slots.entries):
        store.ram.arenas.get(0).write(offset, payload(n, 8 * KIB))
    run(store, s.handle_waiting(p.Commit([h for _, h, _ in slots.entries])))
    run(store, asyncio.sleep(0.05))              # the commit's index write ends
    s.handle(p.Pinned([digest(3)]))
    answer = s.handle(p.Present(0, [digest(n) for n in range(1, 6)]))
    assert answer == p.PresentResult(bytes([0, p.HELD_RAM, p.HELD_GPU, p.HELD_RAM, 0]))
    assert s.handle(p.Lookup(0, [digest(n) for n in range(1, 6)])).longest == 0      # type: ignore[union-attr]
    bad = s.handle(p.Present(0, [b"short"]))
    assert isinstance(bad, p.Error) and "32 bytes" in bad.message


def test_engine_keys_keep_to_the_connections_pace_however_they_are_framed(store: SyncStore) -> None:
    """Route frames of 8 KiB each (under the slice: checked inline while the pace allows) go
    the waiting path once a connection has sent its second's worth (where the pace makes it
    wait: tests/unit/test_pace.py); a long frame waits from the start."""
    from kvcached.api import agent_session
    from kvcached.index.presence import TierFeed
    from kvcached_agent.route import RouteKey, encode_routes
    store.index.tier_feed = TierFeed()                   # events on: keys are kept
    s = session(store)
    blob = encode_routes([RouteKey([1], None, [7] * 4000, 16)])
    frame = p.Route([(digest(n), 0, blob) for n in range(1)])
    assert 4000 < agent_session.route_bytes(frame) <= agent_session.ROUTE_SLICE_BYTES
    sent, began = 0, time.monotonic()
    while not s.waits(frame, asks_homes=False):           # inline, charged to the pace
        assert s.handle(frame) is None
        sent += agent_session.route_bytes(frame)
    refilled = (time.monotonic() - began) * agent_session.ROUTE_BYTES_PER_S      # the clock ran meanwhile
    assert agent_session.ROUTE_BYTES_PER_S - agent_session.route_bytes(frame) < sent
    assert sent <= agent_session.ROUTE_BYTES_PER_S + refilled
    assert run(store, s.handle_waiting(frame)) is None   # the waiting path owes the pace its time (test_pace), then keeps them
    long = p.Route([(digest(n), 0, blob) for n in range(10)])
    assert s.waits(long, asks_homes=False)
    assert len(store.routes) >= 1
