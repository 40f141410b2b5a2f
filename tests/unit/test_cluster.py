"""The cluster's sans-I/O logic: registrations, the membership view, placement and location."""

from __future__ import annotations

import json
import random

import pytest

from kvcached.cluster.location import HomeRecords, LookupPlan, Publisher
from kvcached.cluster.member import Member, MemberError, member_fields, member_key, name_of_key
from kvcached.cluster.placement import Placement, member_seed, score
from kvcached.cluster.view import MembershipView
from tests.certificates import Registrar

PREFIX = "/kvcached"


def key(i: int, layer: int = 0) -> bytes:
    return i.to_bytes(32, "little") + layer.to_bytes(4, "little")


@pytest.fixture(scope="module")
def registrar(tmp_path_factory: pytest.TempPathFactory) -> Registrar:
    return Registrar(tmp_path_factory.mktemp("cluster"))


def fields(member: Member, **changed: object) -> bytes:
    """``member``'s fields as a registration value (no proof: Member.decode's part)."""
    return json.dumps({**member_fields(member), **changed}).encode()


def reference_homes(bucket: int, names: list[str], replicas: int) -> tuple[str, ...]:
    """Rendezvous by definition: every member's score, highest first (a tie: lower seed)."""
    return tuple(sorted(names, key=lambda n: (-score(bucket, member_seed(n)), member_seed(n)))[:replicas])


# -- registrations ------------------------------------------------------------------------------

def test_a_registration_round_trips_and_is_checked_against_its_key() -> None:
    m = Member("node-a", "10.0.0.5", 7400, 7401, 1 << 36, "0.1.0")
    assert Member.decode("node-a", fields(m)) == m
    assert name_of_key(PREFIX, member_key(PREFIX, "node-a")) == "node-a"
    with pytest.raises(MemberError, match="names 'node-a'"):
        Member.decode("node-b", fields(m))


@pytest.mark.parametrize("value, why", [
    (b"not json", "not JSON"),
    (b"[1]", "not a JSON object"),
    (b'{"v": 1, "name": "n"}', "format 1"),
    (b'{"v": 2, "name": "n", "host": "", "quic_port": 1, "lane_port": 1}', "host"),
    (b'{"v": 2, "name": "n", "host": "h", "quic_port": 0, "lane_port": 1}', "quic_port"),
    (b'{"v": 2, "name": "n", "host": "h", "quic_port": 1, "lane_port": true}', "lane_port"),
    (b'{"v": 2, "name": "n", "host": "h", "quic_port": 1, "lane_port": 2, "capacity_bytes": -1}', "capacity"),
    (b"x" * 20000, "over"),
])
def test_a_bad_registration_is_refused_with_its_reason(value: bytes, why: str) -> None:
    with pytest.raises(MemberError, match=why):
        Member.decode("n", value)


def test_member_names_and_keys_are_checked() -> None:
    with pytest.raises(MemberError):
        member_key(PREFIX, "a/b")
    with pytest.raises(MemberError):
        name_of_key(PREFIX, "/other/members/a")


# -- the membership view ------------------------------------------------------------------------

def test_the_view_follows_joins_updates_and_departures_in_revision_order(registrar: Registrar) -> None:
    view = MembershipView(PREFIX, registrar.verifier())
    a, b = Member("a", "h1", 1, 1), Member("b", "h2", 2, 2)
    change = view.reset([(member_key(PREFIX, "a"), registrar.value(a, PREFIX, 1), 1)], revision=5)
    assert [m.name for m in change.joined] == ["a"] and view.revision == 5
    signed_b = registrar.value(b, PREFIX, 2)
    assert not view.put(member_key(PREFIX, "b"), signed_b, 2, revision=5)       # not newer: seen already
    assert [m.name for m in view.put(member_key(PREFIX, "b"), signed_b, 2, revision=6).joined] == ["b"]
    moved = Member("b", "h3", 2, 2)
    assert view.put(member_key(PREFIX, "b"), registrar.value(moved, PREFIX, 3), 3, revision=7).updated == [moved]
    assert [m.name for m in view.delete(member_key(PREFIX, "a"), revision=8).left] == ["a"]
    assert view.names == {"b"}
    # a listing after the watch broke: whoever is not in it left
    change = view.reset([], revision=20)
    assert [m.name for m in change.left] == ["b"] and not view.members


def test_the_view_refuses_bad_registrations_and_uses_nothing_of_them(registrar: Registrar) -> None:
    view = MembershipView(PREFIX, registrar.verifier())
    view.reset([(member_key(PREFIX, "a"), registrar.value(Member("a", "h", 1, 1), PREFIX, 1), 1)], revision=1)
    # a registration under a's key naming someone else: a is no longer used
    change = view.put(member_key(PREFIX, "a"), registrar.value(Member("z", "h", 1, 1), PREFIX, 1), 1, revision=2)
    assert [m.name for m in change.left] == ["a"] and not view.members
    assert view.refused == 1 and "names 'z'" in view.refusals[member_key(PREFIX, "a")]
    view.put(PREFIX + "/members/", b"{}", 1, revision=3)             # not a member key at all
    assert view.refused == 2 and not view.members


# -- placement ------------------------------------------------------------------------------------

@pytest.mark.parametrize("members, replicas", [(1, 2), (2, 2), (5, 2), (7, 3), (40, 3)])
def test_placement_is_rendezvous_hashing_and_independent_of_join_order(members: int, replicas: int) -> None:
    names = [f"node-{i}" for i in range(members)]
    p, q = Placement(replicas, bits=9), Placement(replicas, bits=9)
    p.set_members(names)
    for name in reversed(names):            # one at a time, the other way round
        q.join(name)
    for bucket in range(p.buckets):
        assert p.homes_of(bucket) == q.homes_of(bucket) == reference_homes(bucket, names, replicas)


def test_a_leave_moves_only_the_buckets_the_member_homed_and_a_join_only_those_it_takes() -> None:
    names = [f"node-{i}" for i in range(12)]
    p = Placement(2, bits=10)
    p.set_members(names)
    had = set(p.buckets_of("node-3").tolist())
    moves = p.leave("node-3")
    assert {m.bucket for m in moves} == had
    assert all("node-3" in m.old and "node-3" not in m.new for m in moves)
    names.remove("node-3")
    assert all(p.homes_of(b) == reference_homes(b, names, 2) for b in range(p.buckets))
    moves = p.join("node-new")
    assert moves and {m.bucket for m in moves} == set(p.buckets_of("node-new").tolist())
    assert all("node-new" in m.new for m in moves)


def test_placement_spreads_buckets_evenly() -> None:
    p = Placement(2, bits=16)
    names = [f"n{i}" for i in range(100)]
    p.set_members(names)
    counts = [p.buckets_of(n).size for n in names]
    mean = p.buckets * 2 / 100
    assert sum(counts) == p.buckets * 2
    assert max(counts) < 1.25 * mean and min(counts) > 0.75 * mean


def test_placement_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        Placement(0)
    with pytest.raises(ValueError):
        Placement(2, bits=30)


# -- location --------------------------------------------------------------------------------------

def test_home_records_keep_holders_per_block_and_forget_a_member_that_left() -> None:
    home = HomeRecords(lambda k: 0)
    home.gained("a", [key(1), key(2)])
    home.gained("b", [key(2), key(3)])
    home.gained("b", [key(2)])                      # twice is once
    assert home.locate([key(1), key(2), key(3), key(4)]) == [("a",), ("a", "b"), ("b",), ()]
    home.dropped("a", [key(2)])
    assert home.holders(key(2)) == ("b",)
    assert home.forget("b") == 2 and home.forgotten == 2
    assert home.locate([key(2), key(3)]) == [(), ()] and len(home) == 1
    home.dropped("nobody", [key(1)])                # an unknown holder changes nothing
    assert home.holders(key(1)) == ("a",)


def test_a_listing_replaces_what_was_known_of_its_holder_once_complete() -> None:
    home = HomeRecords(lambda k: 0)
    home.gained("a", [key(1), key(2)])
    home.gained("b", [key(1)])
    assert home.listing("a", 7, 0, False, [key(2)])
    assert home.holders(key(1)) == ("a", "b")       # parts before the last are not used yet
    assert home.listing("a", 7, 1, True, [key(5)])
    assert sorted(home.keys_of("a")) == [key(2), key(5)]
    assert home.holders(key(1)) == ("b",)
    # a part out of order abandons the listing
    assert home.listing("a", 8, 0, False, [key(9)])
    assert not home.listing("a", 8, 2, True, [key(9)])
    assert home.holders(key(9)) == ()


def test_a_home_drops_the_records_of_buckets_it_no_longer_homes() -> None:
    home = HomeRecords(lambda k: k[0] % 2)
    home.gained("a", [key(1), key(2), key(3)])
    assert home.keep_buckets(lambda bucket: bucket == 1) == 1
    assert home.holders(key(2)) == () and home.holders(key(1)) == ("a",)


def test_the_publisher_batches_per_home_and_republishes_moved_buckets() -> None:
    p = Placement(2, bits=8)
    p.set_members(["a", "b", "c", "d"])
    pub = Publisher("a", p)
    keys = [key(i) for i in range(200)]
    pub.changed({k: True for k in keys})
    pub.changed({keys[0]: False})
    sent = {home: pub.take(home) for home in list(pub.due())}
    for k in keys:
        homes = p.homes_of(p.bucket_of_key(k))
        assert all(k in sent[h] for h in homes) and sum(k in batch for batch in sent.values()) == len(homes)
    assert all(batch[keys[0]] is False for h, batch in sent.items() if keys[0] in batch)
    assert not pub.due()
    moves = p.join("e")
    queued = pub.moved(moves, keys)
    assert queued == sum(1 for k in keys if "e" in p.homes_of(p.bucket_of_key(k)))
    assert set(pub.due()) == ({"e"} if queued else set())


def test_a_lookup_plan_asks_one_home_per_key_and_the_old_home_during_a_move() -> None:
    p = Placement(2, bits=8)
    p.set_members(["a", "b", "c"])
    plan = LookupPlan(p, grace_s=10)
    keys = [key(i) for i in range(100)]
    asks = plan.plan(keys, lambda name: True, now=0)
    assert sum(map(len, asks.values())) == len(keys)
    for home, ks in asks.items():
        assert all(p.homes_of(p.bucket_of_key(k))[0] == home for k in ks)
    down = plan.plan(keys, lambda name: name != "a", now=0)         # a down: its keys go to the next home
    assert "a" not in down and sum(map(len, down.values())) == len(keys)
    moves = p.join("d")
    plan.moved(moves, now=100)
    old_homes = {m.bucket: m.old for m in moves}
    during = plan.plan(keys, lambda name: True, now=105)
    for k in keys:
        bucket = p.bucket_of_key(k)
        first = p.homes_of(bucket)[0]
        expected = {first} | ({next(h for h in old_homes[bucket] if h != first)} if bucket in old_homes else set())
        assert {home for home, ks in during.items() if k in ks} == expected
    assert any(len(ks) for home, ks in during.items() if home != "d")
    assert plan.expire(now=111) and not plan.moving
    assert sum(map(len, plan.plan(keys, lambda name: True, now=111).values())) == len(keys)


def test_location_end_to_end_over_many_members_in_memory() -> None:
    """Holders publish to homes, askers plan and ask, a holder leaves, the homes forget it."""
    rng = random.Random(5)
    names = [f"n{i}" for i in range(20)]
    p = Placement(2, bits=10)
    p.set_members(names)
    homes = {n: HomeRecords(p.bucket_of_key) for n in names}
    held = {n: {key(rng.randrange(1000)) for _ in range(50)} for n in names}
    for n in names:
        pub = Publisher(n, p)
        pub.changed({k: True for k in held[n]})
        for home in pub.due():
            batch = pub.take(home)
            homes[home].gained(n, [k for k, v in batch.items() if v])
    plan = LookupPlan(p)
    wanted = [key(i) for i in range(1000)]
    found: dict[bytes, set[str]] = {}
    for home, ks in plan.plan(wanted, lambda name: True, now=0).items():
        for k, holders in zip(ks, homes[home].locate(ks)):
            found.setdefault(k, set()).update(holders)
    truth: dict[bytes, set[str]] = {}
    for n, ks in held.items():
        for k in ks:
            truth.setdefault(k, set()).add(n)
    assert {k: v for k, v in found.items() if v} == truth
    for records in homes.values():
        records.forget("n7")
    assert all("n7" not in records.holders(k) for records in homes.values() for k in held["n7"])
    total = sum(len(r) for r in homes.values())
    assert total == sum(len(p.homes_of(p.bucket_of_key(k))) for k in truth if truth[k] - {"n7"})


def test_a_retry_asks_each_key_of_the_homes_not_asked_for_it_yet() -> None:
    p = Placement(2, bits=8)
    p.set_members(["a", "b", "c"])
    plan = LookupPlan(p)
    keys = [key(i) for i in range(60)]
    asked: dict[bytes, set[str]] = {}
    first = plan.plan(keys, lambda n: True, now=0, asked=asked)
    assert all(asked[k] == {p.homes_of(p.bucket_of_key(k))[0]} for k in keys)
    second = plan.plan(keys, lambda n: True, now=0, asked=asked)        # the hedge: each key's second home
    for home, ks in second.items():
        assert all(p.homes_of(p.bucket_of_key(k))[1] == home for k in ks)
    assert sum(map(len, second.values())) == len(keys) and sum(map(len, first.values())) == len(keys)
    assert plan.plan(keys, lambda n: True, now=0, asked=asked) == {}     # both homes asked: none left


def test_a_block_many_hold_keeps_every_holder_and_names_at_most_max_holders() -> None:
    from kvcached.cluster.location import MAX_HOLDERS
    from kvcached.peers import protocol as p

    assert MAX_HOLDERS == p.MAX_HOLDERS               # what a home names is what one Located may
    home = HomeRecords(lambda k: 0)
    names = [f"n{i}" for i in range(MAX_HOLDERS + 10)]
    for name in names:
        home.gained(name, [key(1)])
    assert len(home.holders(key(1))) == MAX_HOLDERS
    for name in names[:MAX_HOLDERS]:                  # the first 64 drop it: the other 10 are still named
        home.dropped(name, [key(1)])
    assert sorted(home.holders(key(1))) == sorted(names[MAX_HOLDERS:])
    for name in names[MAX_HOLDERS:-1]:
        home.dropped(name, [key(1)])
    assert home.holders(key(1)) == (names[-1],)
    home.dropped(names[-1], [key(1)])
    assert home.holders(key(1)) == () and len(home) == 0
    home.gained("x", [key(2)])
    for i in range(20):
        home.gained(f"m{i}", [key(2)])
    assert home.forget("x") == 1 and "x" not in home.holders(key(2)) and len(home.holders(key(2))) == 20


def test_a_bucket_moved_again_within_the_grace_is_asked_of_all_its_old_homes_until_the_last_move_expires() -> None:
    p = Placement(1, bits=4)
    p.set_members(["a"])
    plan = LookupPlan(p, grace_s=10)
    first = p.join("b")
    plan.moved(first, now=0)
    second = p.join("c")
    plan.moved(second, now=5)
    twice = {m.bucket for m in first} & {m.bucket for m in second}
    assert twice
    for bucket in twice:
        assert set(plan.old_homes(bucket, now=6)) == {"a", "b"}          # the latest move's old home first
        assert plan.old_homes(bucket, now=6)[0] == "b"
    assert plan.expire(now=10) == len(first)                             # the first move is over
    for bucket in twice:
        assert plan.old_homes(bucket, now=10) == ("b",)
    assert plan.expire(now=15) == len(second) and not plan.moving
    assert all(plan.old_homes(m.bucket, now=15) == () for m in second)


# -- listings in parts ----------------------------------------------------------------------------

def test_a_listing_in_parts_is_whole_only_at_its_last_part_and_a_part_out_of_order_abandons_it() -> None:
    from kvcached.cluster.listing import OUT_OF_ORDER, PartedListings

    listings = PartedListings()
    assert listings.part("a", 7, 0, False, [b"1"]) is None
    assert listings.part("b", 3, 0, True, [b"x"]) == {b"x"}             # one part: whole at once
    assert listings.part("a", 7, 1, False, [b"2"]) is None
    assert listings.part("a", 7, 2, True, [b"3"]) == {b"1", b"2", b"3"}
    assert listings.part("a", 7, 3, True, []) is OUT_OF_ORDER           # nothing open any more
    assert listings.part("a", 8, 0, False, [b"4"]) is None
    assert listings.part("a", 9, 1, True, [b"5"]) is OUT_OF_ORDER       # another listing's part: abandoned
    assert listings.part("a", 8, 1, True, [b"5"]) is OUT_OF_ORDER
    assert listings.part("a", 10, 0, False, []) is None
    listings.forget("a")
    assert listings.part("a", 10, 1, True, []) is OUT_OF_ORDER
