"""The NIXL lane's leases (kvcached.peers.nixl_leases): every pin released exactly once, by
NixlDone, by time or with the session; what one peer can make the holder keep is bounded."""

from __future__ import annotations

import pytest

from kvcached.peers.nixl_leases import NixlLeases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pins:
    """Release callbacks that count how often each was called."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def make(self, n: int, start: int = 0) -> list:  # type: ignore[type-arg]
        return [lambda i=i: self.calls.__setitem__(i, self.calls.get(i, 0) + 1) for i in range(start, start + n)]


def test_done_releases_once_and_only_for_the_peer_that_got_it() -> None:
    clock, pins, session = Clock(), Pins(), object()
    leases = NixlLeases(2.0, 4, clock)
    lease = leases.grant("b", session, pins.make(3))
    assert lease and len(leases) == 1 and pins.calls == {}
    assert not leases.done("c", lease) and pins.calls == {}          # another peer's lease: ignored
    assert not leases.done("b", lease ^ 1)
    assert leases.done("b", lease) and pins.calls == {0: 1, 1: 1, 2: 1}
    assert not leases.done("b", lease) and pins.calls == {0: 1, 1: 1, 2: 1}   # a second NixlDone: nothing
    assert leases.counters.done == 1 and len(leases) == 0


def test_leases_expire_by_the_clock() -> None:
    clock, pins = Clock(), Pins()
    leases = NixlLeases(2.0, 4, clock)
    first = leases.grant("b", object(), pins.make(1))
    clock.now += 1.0
    leases.grant("b", object(), pins.make(1, start=1))
    assert leases.next_expiry() == 102.0 and leases.expire() == 0
    clock.now += 1.0
    assert leases.expire() == 1 and pins.calls == {0: 1} and leases.next_expiry() == 103.0
    assert not leases.done("b", first)                                  # expired: gone
    clock.now += 5.0
    assert leases.expire() == 1 and pins.calls == {0: 1, 1: 1} and leases.next_expiry() is None
    assert leases.counters.expired == 2


def test_a_session_that_ends_takes_its_leases_with_it() -> None:
    clock, pins = Clock(), Pins()
    leases = NixlLeases(60.0, 8, clock)
    one, other = object(), object()
    leases.grant("b", one, pins.make(2))
    leases.grant("b", one, pins.make(1, start=2))
    kept = leases.grant("b", other, pins.make(1, start=3))
    assert leases.end_session(one) == 2 and pins.calls == {0: 1, 1: 1, 2: 1}
    assert leases.done("b", kept) and pins.calls[3] == 1
    leases.grant("c", other, pins.make(1, start=4))
    leases.close()
    assert pins.calls[4] == 1 and len(leases) == 0


def test_a_peer_holds_at_most_max_per_peer_leases() -> None:
    clock, pins = Clock(), Pins()
    leases = NixlLeases(60.0, 2, clock)
    granted = [leases.grant("b", object(), pins.make(1, start=i)) for i in range(2)]
    assert all(granted) and len(set(granted)) == 2 and not leases.room("b")
    assert leases.grant("b", object(), pins.make(1, start=7)) == 0 and pins.calls == {7: 1}   # released at once
    assert leases.room("c") and leases.grant("c", object(), pins.make(1, start=8))          # others unaffected
    assert leases.done("b", granted[0]) and leases.room("b")
    assert leases.counters.refused == 1 and leases.grant("b", object(), []) == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        NixlLeases(0.0, 1, Clock())
    with pytest.raises(ValueError):
        NixlLeases(1.0, 0, Clock())
