"""Admission (always, reuse with an aging count-min sketch), the SSD write budget and the write
policies (write_back, write_through, write_through_selective): the policy classes alone, then
through a real store with a real SSD tier and index."""

from __future__ import annotations

import random
from typing import Callable

import pytest

from kvcached.index import BlockIndex, Tier
from kvcached.policies.admission import DAY_S, AlwaysAdmit, CountMinSketch, ReuseAdmission, SsdWriteBudget, make_admission_policy
from kvcached.store import PutItem
from kvcached.tiers.ssd_format import file_bytes
from tests.unit.conftest import KIB, SLAB, FakeClock, SyncStore, address, payload


def key(n: int) -> bytes:
    return address(n).key


# -- the sketch and the reuse gate ---------------------------------------------------------------


def test_sketch_never_undercounts_and_ages() -> None:
    sketch = CountMinSketch(width=4096, window=1_000_000)
    counts = {n: random.Random(n).randint(1, 9) for n in range(500)}
    for n, c in counts.items():
        for _ in range(c):
            sketch.add(key(n))
    assert all(sketch.estimate(key(n)) >= c for n, c in counts.items())
    assert sum(sketch.estimate(key(n)) == c for n, c in counts.items()) >= 490      # nearly all exact
    sketch.age()
    assert all(sketch.estimate(key(n)) >= c // 2 for n, c in counts.items())
    assert sketch.estimate(key(7)) <= (counts[7] + 1) // 2 + 1


def test_sketch_saturates_and_ages_by_itself_after_its_window() -> None:
    sketch = CountMinSketch(width=64, window=1000)
    for _ in range(300):
        sketch.add(key(1))
    assert sketch.estimate(key(1)) == 255                  # saturates, never wraps
    for _ in range(700):                                    # the 1000th add halves everything
        sketch.add(key(1))
    assert sketch.added == 0 and sketch.estimate(key(1)) == 127


def test_sketch_state_round_trip_and_mismatch() -> None:
    a = CountMinSketch(width=1000, window=5000)
    for n in range(300):
        a.add(key(n % 37))
    b = CountMinSketch(width=1000, window=5000)
    b.restore(a.state())
    assert [b.estimate(key(n)) for n in range(40)] == [a.estimate(key(n)) for n in range(40)]
    assert b.added == a.added
    with pytest.raises(ValueError, match="does not fit"):
        CountMinSketch(width=999, window=5000).restore(a.state())


def test_reuse_stores_a_block_only_on_its_nth_offer() -> None:
    gate = ReuseAdmission(threshold=3, window=100_000)
    once = [key(n) for n in range(5000)]
    twice = [key(n) for n in range(5000, 6000)]
    assert not any(gate.admit(k) for k in once)
    assert not any(gate.admit(k) for k in twice) and not any(gate.admit(k) for k in twice)
    assert not any(gate.admit(k) for k in once), "offered twice: still below 3"
    assert all(gate.admit(k) for k in twice), "the third offer is taken"
    assert AlwaysAdmit().admit(key(1)) and make_admission_policy("always").admit(key(2))
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_admission_policy("sometimes")


def test_reuse_forgets_offers_older_than_its_window() -> None:
    gate = ReuseAdmission(threshold=2, window=1000)
    gate.admit(key(1))
    for n in range(2, 2002):          # two windows of other offers: the count of key 1 halved to 0
        gate.admit(key(n))
    assert not gate.admit(key(1)), "an offer long ago does not count"
    assert gate.admit(key(1))


# -- the SSD write budget ------------------------------------------------------------------------


def test_write_budget_is_never_exceeded_in_any_day() -> None:
    budget = SsdWriteBudget(10 << 20)
    rng = random.Random(8)
    now = 1_000_000.0
    taken: list[tuple[float, int]] = []
    refused = 0
    for _ in range(6000):                       # about 3.5 days of writes, bursts and lulls
        now += rng.expovariate(1 / 50.0)
        nbytes = rng.randint(1, 600) * KIB
        if budget.take(nbytes, now):
            taken.append((now, nbytes))
        else:
            refused += 1
    assert refused > 0 and len(taken) > 100
    start = 0
    window = 0
    for t, n in taken:                          # every 24-hour window ending at a write
        window += n
        while taken[start][0] <= t - DAY_S:
            window -= taken[start][1]
            start += 1
        assert window <= 10 << 20
    assert not budget.take((10 << 20) + 1, now)


def test_write_budget_remaining_changes_nothing() -> None:
    """The metrics thread reads ``remaining`` while the event loop takes: a read never expires
    ledger entries itself."""
    budget = SsdWriteBudget(1 << 20)
    budget.take(1000, 1000.0)
    ledger = budget.minutes()
    assert budget.remaining(1000.0 + 3 * DAY_S) == 1 << 20
    assert budget.minutes() == ledger and budget._total == 1000


def test_write_budget_ledger_survives_a_reload() -> None:
    budget = SsdWriteBudget(1 << 20)
    assert budget.take(700 * KIB, 1000.0) and budget.take(200 * KIB, 1100.0)
    again = SsdWriteBudget(1 << 20)
    again.load(budget.minutes(), 1200.0)
    assert again.used(1200.0) == 900 * KIB and not again.take(200 * KIB, 1200.0)
    assert again.take(200 * KIB, 1000.0 + DAY_S + 120), "a day later the old minutes are gone"
    assert SsdWriteBudget(0).take(1 << 40, 0.0), "0: no budget"


# -- through a store with an SSD tier -------------------------------------------------------------


def item(n: int, size: int = 16 * KIB) -> PutItem:
    return PutItem(address(n), payload(n, size), model="m")


def test_a_block_offered_fewer_times_than_the_threshold_is_never_stored(policy_store: Callable[..., SyncStore],
                                                                        index: BlockIndex) -> None:
    store = policy_store(admission="reuse", threshold=3, ssd=False)
    for _ in range(2):
        result = store.put([item(1), item(2), item(2)])         # a repeat within one batch is one offer
        assert (result.stored, result.declined) == (0, 3)
    assert address(1).key not in store.ram and index.get(address(1).key) is None
    assert store.lookup([address(1).digest], 0).longest == 0
    result = store.put([item(1), item(3)])
    assert (result.stored, result.declined) == (1, 1) and address(1).key in store.ram
    assert store.counters.declined == 7
    assert store.put([item(1)]).present == 1, "once stored, an offer is a re-put"


def test_a_damaged_block_is_refused_before_admission_counts_it(policy_store: Callable[..., SyncStore]) -> None:
    from kvcached.errors import DataLoss
    store = policy_store(admission="reuse", threshold=2, ssd=False)
    bad = PutItem(address(1), payload(1, 4 * KIB), model="m", checksum=b"\0" * 32)
    for _ in range(2):
        with pytest.raises(DataLoss):
            store.put([bad])
    assert store.counters.declined == 0
    assert store.put([item(1, 4 * KIB)]).declined == 1, "the damaged offers did not count"


def test_agent_reservations_go_through_admission(policy_store: Callable[..., SyncStore]) -> None:
    store = policy_store(admission="reuse", threshold=2, ssd=False)
    assert store.reserve([(address(5), 4 * KIB)]) == ["declined"]
    [block] = store.reserve([(address(5), 4 * KIB)])
    assert not isinstance(block, str)
    store.abort_reserved(block, address(5))


def test_write_back_respects_the_ssd_write_budget(policy_store: Callable[..., SyncStore], index: BlockIndex,
                                                  clock: FakeClock) -> None:
    per_block = file_bytes(16 * KIB)
    store = policy_store(budget=5 * per_block + 100)
    store.put([item(n) for n in range(8)])
    while store.ram.dirty:
        store.demote()
    on_ssd = [n for n in range(8) if index.get(address(n).key).tiers & Tier.SSD]
    assert on_ssd == [0, 1, 2, 3, 4], "oldest first, until the budget is spent"
    assert store.ssd.counters.file_bytes_written <= 5 * per_block + 100
    assert store.counters.ssd_budget_declined == 3
    assert all(store.ram.get(address(n).key).clean for n in (5, 6, 7)), "refused: kept in RAM only, not retried"
    assert store.stats()["ssd_budget_remaining_bytes"] == 100
    clock.advance(DAY_S + 120)                  # a day later the budget has room again
    store.put([item(20)])
    store.demote()
    assert index.get(address(20).key).tiers & Tier.SSD


def test_the_budget_ledger_is_persisted_before_the_write(policy_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    per_block = file_bytes(16 * KIB)
    store = policy_store(budget=3 * per_block)
    store.put([item(n) for n in range(2)])
    store.demote()
    again = policy_store(budget=3 * per_block)     # a restart: same index, fresh store
    again.load_budget()
    assert again.ssd_budget.used(again.clock()) == 2 * per_block
    again.put([item(n) for n in range(10, 12)])
    again.demote()
    assert sum(bool(index.get(address(n).key).tiers & Tier.SSD) for n in (10, 11)) == 1


def test_write_through_declines_what_the_budget_refuses(policy_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = policy_store("write_through", budget=2 * file_bytes(16 * KIB))
    result = store.put([item(n) for n in range(3)])
    assert (result.stored, result.declined) == (2, 1)
    assert index.get(address(2).key) is None and address(2).key not in store.ram, "not on SSD: not kept"
    assert all(index.get(address(n).key).tiers & Tier.SSD for n in (0, 1))


def test_write_through_keeps_an_earlier_block_the_budget_refuses(policy_store: Callable[..., SyncStore],
                                                                 index: BlockIndex) -> None:
    """A block stored under write_back, not yet on SSD, put again under write_through with the
    day's budget spent: it was acknowledged before, so it stays (RAM only) and counts as present."""
    from kvcached.policies.admission import SsdWriteBudget
    store = policy_store("write_back")
    store.put([item(1)])
    store.write_policy = "write_through"
    store.ssd_budget = SsdWriteBudget(1)
    result = store.put([item(1)])
    assert (result.stored, result.present, result.declined) == (0, 1, 0)
    assert address(1).key in store.ram and index.get(address(1).key).tiers == Tier.RAM
    assert store.ram.get(address(1).key).clean, "kept in RAM only, not retried"


def test_write_through_selective_writes_a_block_once_its_hits_pass_the_threshold(
        policy_store: Callable[..., SyncStore], index: BlockIndex) -> None:
    store = policy_store("write_through_selective", threshold=2)
    store.put([item(1), item(2)])
    assert store.demote() == 0 and store.ram.dirty_bytes == 0, "new blocks wait in RAM"
    store.get([address(1)])
    assert store.demote() == 0, "one hit of two"
    store.pin([address(1)], allow_partial=True)        # a pin (stream, agent load) is a hit too
    assert store.demote() == 1
    assert index.get(address(1).key).tiers == Tier.RAM | Tier.SSD
    assert index.get(address(2).key).tiers == Tier.RAM, "never hit: never written"
    assert store.counters.held_written == 1
    for _ in range(3):                                 # published: later hits write nothing more
        store.get([address(1)])
    assert store.demote() == 0


def test_write_through_selective_never_writes_one_off_blocks(policy_store: Callable[..., SyncStore]) -> None:
    store = policy_store("write_through_selective", threshold=1, arena_bytes=4 * SLAB)
    for n in range(40):                                # a scan through a small RAM tier
        store.put([item(n, 60 * KIB)])
        store.demote()
    assert store.ssd.counters.writes == 0 and store.ram.dirty_evictions == 0
