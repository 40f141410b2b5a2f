"""The QUIC server's bounds as plain state (kvcached/peers/handshakes.py), the clock moved by hand,
and the source key both servers count handshakes against."""

from __future__ import annotations

from kvcached.peers.handshakes import (
    BUDGET,
    DISPLACED,
    FULL,
    SOURCE_LIMIT,
    TIMEOUT,
    HandshakeLimits,
    HandshakeTable,
    ReplyBudget,
    source_of,
)


def table(**limits: object) -> HandshakeTable:
    return HandshakeTable(HandshakeLimits(**limits))  # type: ignore[arg-type]


def test_a_source_gets_its_share_and_no_more() -> None:
    t = table(max_handshakes=10, max_handshakes_per_source=2)
    for key in ("a1", "a2"):
        assert t.admit("10.0.0.1", True) == (None, [])
        t.add(key, "10.0.0.1", True, 0.0)
    assert t.admit("10.0.0.1", True) == (SOURCE_LIMIT, [])
    assert t.admit("10.0.0.2", True) == (None, [])       # another source is not held up
    t.verified("a1")                                      # a verified peer leaves the handshake set
    assert t.admit("10.0.0.1", True) == (None, [])
    assert t.refused == {SOURCE_LIMIT: 1}


def test_a_full_table_drops_unvalidated_handshakes_first_then_the_oldest() -> None:
    t = table(max_handshakes=3, max_handshakes_per_source=10)
    t.add("v1", "s", True, 0.0)
    t.add("u1", "s", False, 1.0)
    t.add("v2", "s", True, 2.0)
    assert t.admit("s", True) == (None, ["u1"])           # unvalidated gives way, though v1 is older
    assert t.admit("s", False) == (None, ["u1"])          # an unvalidated newcomer may take an unvalidated one's place
    t.drop("u1", DISPLACED)
    t.add("v3", "s", True, 3.0)
    assert t.admit("s", False) == (FULL, [])              # but never a validated one's
    assert t.admit("s", True) == (None, ["v1"])           # a validated newcomer: the oldest gives way
    assert t.refused == {DISPLACED: 1, FULL: 1}


def test_max_connections_counts_verified_peers_too() -> None:
    t = table(max_handshakes=10, max_connections=2)
    t.add("p1", "a", True, 0.0)
    t.verified("p1")
    t.add("h1", "b", True, 0.0)
    assert t.connections == 2 and t.handshaking == 1
    assert t.admit("c", True) == (None, ["h1"])
    t.drop("h1", DISPLACED)
    t.add("h2", "c", True, 1.0)
    t.verified("h2")
    assert t.admit("d", True) == (FULL, [])               # only verified peers: nothing gives way
    t.closed("p1")
    assert t.admit("d", True) == (None, [])


def test_handshakes_expire_oldest_first_at_the_timeout() -> None:
    t = table(handshake_timeout_s=5.0)
    assert t.next_deadline() is None
    t.add("a", "x", True, 0.0)
    t.add("b", "y", True, 2.0)
    assert t.next_deadline() == 5.0
    assert t.expired(4.9) == []
    assert t.expired(5.0) == ["a"]
    t.drop("a", TIMEOUT)
    assert t.next_deadline() == 7.0 and t.expired(100.0) == ["b"]
    t.verified("b")
    assert t.expired(100.0) == [] and t.next_deadline() is None
    assert t.refused == {TIMEOUT: 1}


def test_dropping_or_closing_frees_the_source_count() -> None:
    t = table(max_handshakes_per_source=1)
    t.add("a", "s", False, 0.0)
    t.drop("a", TIMEOUT)
    assert t.admit("s", False) == (None, [])
    t.add("b", "s", False, 0.0)
    t.closed("b")
    assert t.admit("s", False) == (None, []) and t.handshaking == 0 and t.connections == 0
    t.drop("gone", TIMEOUT)                               # unknown keys are no-ops, not counted
    assert t.refused == {TIMEOUT: 1}


def test_the_reply_budget_refills_at_its_rate_and_caps_bursts() -> None:
    budget = ReplyBudget(rate=3.0, now=0.0)
    assert [budget.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert budget.take(0.2) is False                      # 0.6 of a reply earned
    assert budget.take(0.4) is True                       # 1.2 earned, 1 spent
    assert [budget.take(100.0) for _ in range(4)] == [True, True, True, False]   # a long pause: one second's worth
    assert BUDGET == "budget"


def test_sources_are_ipv4_addresses_and_ipv6_64_prefixes() -> None:
    assert source_of(("192.0.2.7", 4433)) == "192.0.2.7"
    assert source_of(("2001:db8:1:2:aaaa::1", 4433, 0, 0)) == "2001:db8:1:2::/64"
    assert source_of(("2001:db8:1:2:ffff::9", 1)) == source_of(("2001:db8:1:2::5", 2))
    assert source_of(("2001:db8:1:3::5", 2)) != source_of(("2001:db8:1:2::5", 2))
    assert source_of(("fe80::1%eth0", 1)) == "fe80::/64"
    # A dual-stack listener reports IPv4 senders as mapped addresses: each is its own source.
    assert source_of(("::ffff:192.0.2.7", 1, 0, 0)) == "192.0.2.7"
    assert source_of(("::ffff:192.0.2.8", 1, 0, 0)) != source_of(("::ffff:192.0.2.7", 1, 0, 0))


def test_a_full_table_makes_room_at_the_source_that_holds_the_most() -> None:
    """Strangers fill the table from two addresses; a peer from a third gets in, displacing the
    oldest of the fullest source, and the strangers' refills then displace each other, never the
    peer, whose source holds the fewest."""
    t = table(max_handshakes=6, max_handshakes_per_source=4)
    for i, (key, source) in enumerate([("a1", "A"), ("a2", "A"), ("b1", "B"), ("a3", "A"), ("b2", "B"), ("b3", "B")]):
        t.add(key, source, True, float(i))
    assert t.admit("peer", True) == (None, ["a1"])          # A and B hold 3 each: the older of their oldest
    t.drop("a1", DISPLACED)
    t.add("p", "peer", True, 10.0)
    for n in range(20):                                      # refills from A and B
        source = "AB"[n % 2]
        refused, victims = t.admit(source, True)
        assert refused is None and victims and victims[0] != "p"
        t.drop(victims[0], DISPLACED)
        t.add(f"{source.lower()}{n + 10}", source, True, 11.0 + n)
    assert t.is_handshaking("p")
    refused, victims = t.admit("peer", True)              # a second from the peer: a stranger gives way
    assert refused is None and victims != ["p"]


def test_a_newcomer_whose_source_holds_the_most_displaces_its_own_oldest() -> None:
    t = table(max_handshakes=3, max_handshakes_per_source=10)
    t.add("x1", "X", True, 0.0)
    t.add("y1", "Y", True, 1.0)
    t.add("x2", "X", True, 2.0)
    assert t.admit("X", True) == (None, ["x1"])             # X would hold 3, Y 1
    assert t.admit("Y", True) == (None, ["x1"])             # Y would hold 2, X holds 2: the older of x1, y1
    assert t.admit("Z", True) == (None, ["x1"])             # X holds the most
