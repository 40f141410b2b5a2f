"""Policy state in the index (kvcached.index.policy_state) and the SSD tier's in-memory eviction
order ([kv] ssd_policy): real RocksDB, real SSD files, a store restarted over the same index."""

from __future__ import annotations

import logging
from typing import Callable

import pytest

from kvcached.index import BlockIndex, Tier, policy_state
from kvcached.policies import EVICTION_POLICIES, PolicySettings, PolicySnapshot, make_eviction_policy
from kvcached.policies.admission import ReuseAdmission
from kvcached.policies.arc import ArcPolicy
from kvcached.policies.lru import LruPolicy
from kvcached.store import PutItem
from kvcached.tiers.ssd_format import file_bytes
from tests.unit.conftest import KIB, Keyed, SyncStore, address, payload


def item(n: int, size: int = 16 * KIB) -> PutItem:
    return PutItem(address(n), payload(n, size), model="m")


def test_blobs_are_chunked_replaced_whole_and_incomplete_ones_ignored(index: BlockIndex,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_state, "CHUNK", 1)
    many = bytes(range(256)) * 3                                     # 768 chunks: key order = chunk order
    policy_state.save_blob(index, b"ram", many)
    assert policy_state.load_blob(index, b"ram") == many
    monkeypatch.setattr(policy_state, "CHUNK", 100)
    big = bytes(range(256)) * 3
    policy_state.save_blob(index, b"ram", big)
    assert policy_state.load_blob(index, b"ram") == big and len(index.policy_items(b"ram/")) == 8
    policy_state.save_blob(index, b"ram", b"short")
    assert policy_state.load_blob(index, b"ram") == b"short" and len(index.policy_items(b"ram/")) == 1
    assert policy_state.load_blob(index, b"ssd") is None
    policy_state.save_blob(index, b"ssd", big)
    index.write(policy=[(index.policy_items(b"ssd/")[3][0], None)])    # a chunk lost: not used half
    assert policy_state.load_blob(index, b"ssd") is None


def test_ram_state_of_another_policy_or_damaged_starts_cold(index: BlockIndex, caplog: pytest.LogCaptureFixture) -> None:
    arc = Keyed(ArcPolicy())
    for n in range(10):
        arc.insert(address(n).key)
    policy_state.save_blob(index, policy_state.RAM, arc.snapshot().encode())
    assert policy_state.restore_ram(index, Keyed(LruPolicy()), "lru") == 0, "written by arc: lru starts cold"
    fresh = Keyed(ArcPolicy())
    assert policy_state.restore_ram(index, fresh, "arc") == 10 and len(fresh.b1) == 10
    policy_state.save_blob(index, policy_state.RAM, b"KVPS1\xff\xff")
    with caplog.at_level(logging.WARNING, "kvcached.policy_state"):
        assert policy_state.restore_ram(index, Keyed(ArcPolicy()), "arc") == 0
    assert "unreadable" in caplog.text


def test_admission_state_round_trip_and_mismatched_settings(index: BlockIndex) -> None:
    gate = ReuseAdmission(threshold=2, window=1000)
    gate.admit(address(1).key)
    policy_state.write_captured(index, policy_state.capture(Keyed(LruPolicy()), None, gate))
    again = ReuseAdmission(threshold=2, window=1000)
    assert policy_state.restore_admission(index, again)
    assert again.admit(address(1).key), "the offer before the restart counts"
    assert not policy_state.restore_admission(index, ReuseAdmission(threshold=2, window=5000))


def test_ssd_policy_orders_capacity_eviction(policy_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    """S3-FIFO and slru on the SSD tier: blocks used again survive a scan of one-off blocks
    that the index's LRU queue would let flush them (slru with a fixed ratio: a tier of six
    blocks is too small for its tuner, which then keeps LRU's order)."""
    per_block = file_bytes(16 * KIB)
    survivors = {}
    for i, ssd_policy in enumerate(("lru", "s3fifo", "slru")):
        store = policy_store(ssd_policy=ssd_policy, ssd_capacity=6 * per_block, arena_bytes=64 * 64 * KIB,
                             settings=PolicySettings(slru_ratio=32))
        base = 100 * i
        hot = [base + 1, base + 2]
        store.put([item(n) for n in hot])
        store.demote()
        for _ in range(2):
            store.get([address(n) for n in hot])
            store.clock.advance(1)
            store.flush_last_seen()
        for n in range(base + 10, base + 20):            # the scan
            store.clock.advance(1)
            store.put([item(n)])
            store.demote()
            store.evict_ssd()
        assert store.ssd.used_bytes <= 6 * per_block
        survivors[ssd_policy] = [n - base for n in hot if index.get(address(n).key).tiers & Tier.SSD]
        store.delete([address(n) for n in range(base, base + 20)])
    assert survivors == {"lru": [], "s3fifo": [1, 2], "slru": [1, 2]}


def test_ssd_order_forgets_blocks_that_left_the_ssd_by_another_way(policy_store: Callable[..., SyncStore],
                                                                   index: BlockIndex) -> None:
    per_block = file_bytes(16 * KIB)
    store = policy_store(ssd_policy="arc", ssd_capacity=3 * per_block)
    store.put([item(n) for n in range(3)])
    store.demote()
    store.delete([address(0)])                       # gone from SSD: the policy forgets it
    assert address(0).key not in store.ssd_order and len(store.ssd_order) == 2
    store.ssd_order.insert(address(0).key)           # as if a removal had been missed: oldest in T1
    Keyed.of(store.ssd_order).t1.move_to_end(address(0).key, last=False)
    store.put([item(3), item(4)])
    store.demote()
    store.evict_ssd()
    assert address(0).key not in store.ssd_order and store.ssd.used_bytes <= 3 * per_block
    assert index.get(address(4).key).tiers & Tier.SSD


def test_ssd_order_is_rebuilt_after_a_restart_from_state_then_queue(policy_store: Callable[..., SyncStore],
                                                                    index: BlockIndex) -> None:
    store = policy_store(ssd_policy="lru")
    for n in range(6):                               # under the index's own LRU: no saved order
        store.clock.advance(1)
        store.put([item(n)])
        store.demote()
    built = policy_state.build_ssd_order(index, "arc")
    assert set(built) == {address(n).key for n in range(6)}
    assert next(iter(built.candidates())) == address(0).key, "the queue's order: oldest first"
    order = Keyed(ArcPolicy())
    for n in (5, 4, 3, 2, 1, 0, 99):                 # a saved order (99: no longer on SSD)
        order.insert(address(n).key)
    order.touch(address(5).key)
    policy_state.save_blob(index, policy_state.SSD, order.snapshot().encode())
    rebuilt = policy_state.build_ssd_order(index, "arc")
    assert address(99).key not in rebuilt and address(5).key in Keyed.of(rebuilt).t2
    assert next(iter(rebuilt.candidates())) == address(4).key
    assert isinstance(PolicySnapshot.decode(policy_state.load_blob(index, policy_state.SSD) or b""), PolicySnapshot)


@pytest.mark.parametrize("settings", [PolicySettings(), PolicySettings(slru_ratio=4.0)], ids=["tuned", "fixed"])
@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("history", ["never_used", "emptied"])
def test_every_policy_at_zero_blocks_round_trips(index: BlockIndex, caplog: pytest.LogCaptureFixture, name: str,
                                                 settings: PolicySettings, history: str) -> None:
    """An idle daemon's stop saves its RAM policy with nothing resident; the next start reads it
    back without a word (an idle slru once saved a state its own decoder called truncated)."""
    policy = Keyed(make_eviction_policy(name, settings))
    if history == "emptied":                     # used, then every block went: ghosts, nothing resident
        for n in range(20):
            policy.insert(address(n).key)
        for n in range(20):
            policy.remove(address(n).key)
    assert len(policy) == 0
    captured = policy_state.capture(policy, None, ReuseAdmission(threshold=2, window=100))
    policy_state.write_captured(index, captured)
    fresh = Keyed(make_eviction_policy(name, settings))
    with caplog.at_level(logging.INFO, "kvcached.policy_state"):
        policy_state.restore_ram(index, fresh, name)
    assert caplog.records == [] and len(fresh) == 0
    assert PolicySnapshot.decode(PolicySnapshot.decode(policy_state.load_blob(index, policy_state.RAM)).encode())
