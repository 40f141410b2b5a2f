"""The engine keys agents offer before a save (kvcached.store.routes), bounded in bytes in all
and per connection, gone with the connection that offered them or after their time, and kept
for a reservation until it resolves. Clock passed in."""

from __future__ import annotations

from kvcached.store.routes import ENTRY_BYTES, RouteKeys
from kvcached_agent.address import BlockAddress
from tests.unit.conftest import FakeClock, digest

KEYS = b"k" * 60_000                  # about what one block's keys weigh at worst (64 KiB allowed)
ONE = len(KEYS) + ENTRY_BYTES


def offer(routes: RouteKeys, owner: int, numbers: range, blob: bytes = KEYS) -> None:
    routes.offer([(digest(n), 0, blob) for n in numbers], owner)


def test_bounded_in_bytes_in_all_and_per_connection() -> None:
    routes = RouteKeys(max_bytes=40 * ONE, clock=FakeClock())
    offer(routes, 1, range(100))                          # one connection: a quarter of the bound
    assert routes.bytes == 10 * ONE and len(routes) == 10
    assert routes.found([BlockAddress(digest(99), 0)]), "its newest stay, its oldest went"
    offer(routes, 2, range(1000, 1010))
    offer(routes, 3, range(2000, 2010))
    offer(routes, 4, range(3000, 3010))
    offer(routes, 5, range(4000, 4010))                   # a fifth connection: the oldest of all go
    assert routes.bytes <= 40 * ONE and routes.dropped >= 90 + 9
    assert routes.found([BlockAddress(digest(4009), 0)]), "the newest connection's keys are kept"


def test_small_keys_are_bounded_by_their_count_and_entry_cost() -> None:
    routes = RouteKeys(limit=100, max_bytes=1 << 30, clock=FakeClock())
    offer(routes, 1, range(1000), b"k")
    assert len(routes) == 100 and routes.bytes == 100 * (1 + ENTRY_BYTES)


def test_a_connection_that_ends_takes_its_offered_keys_along_and_leaves_reserved_ones() -> None:
    routes = RouteKeys(max_bytes=1 << 30, clock=FakeClock())
    offer(routes, 1, range(10))
    offer(routes, 2, range(100, 105))
    routes.reserved([BlockAddress(digest(0), 0), BlockAddress(digest(100), 0)])    # saves under way
    routes.release(1)
    assert len(routes) == 1 + 5 and routes.bytes == 6 * ONE
    assert routes.take(BlockAddress(digest(0), 0)) == KEYS, "a reservation's keys stay until it is recorded"
    routes.release(2)
    routes.abandoned([BlockAddress(digest(100), 0)])
    assert len(routes) == 0 and routes.bytes == 0


def test_keys_no_save_reserves_in_time_go() -> None:
    clock = FakeClock()
    routes = RouteKeys(max_bytes=1 << 30, ttl_s=60.0, clock=clock)
    offer(routes, 1, range(10))
    clock.advance(30)
    offer(routes, 1, range(10, 12))
    routes.reserved([BlockAddress(digest(1), 0)])
    clock.advance(31)
    routes.expire(clock())
    assert len(routes) == 1 + 2 and routes.bytes == 3 * ONE, "the old offers went; the held one and the new stay"
    offer(routes, 1, range(5, 6))                        # offered again: the newest
    clock.advance(40)
    routes.expire(clock())
    assert routes.found([BlockAddress(digest(5), 0)])
