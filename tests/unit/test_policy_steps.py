"""Policy snapshots taken in steps while the policy goes on changing (kvcached.policies: each
policy's ``snapshot_steps``, ``PolicySnapshot.encode_steps``), saved a chunk a write under a new
generation (kvcached.index.policy_state), run on the loop in slices (kvcached.host.aio)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
from array import array
from typing import Any

import pytest

from kvcached.host.aio import SliceStats, run_in_slices
from kvcached.index import BlockIndex, policy_state
from kvcached.policies import EVICTION_POLICIES, KeyedPolicy, PolicySnapshot, finished, make_eviction_policy
from kvcached.policies import links as links_module
from kvcached.policies import slru as slru_module
from kvcached.policies.admission import ReuseAdmission
from kvcached.policies.slru import SlruPolicy
from tests.unit.conftest import Keyed


@pytest.fixture
def small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 7 entries: every walk, merge and gather spans many steps."""
    monkeypatch.setattr(links_module, "STEP", 7)
    monkeypatch.setattr(slru_module, "STEP", 7)


def churn(policy: KeyedPolicy, rng: random.Random, keys: list[bytes], n: int) -> None:
    """``n`` random calls of a tier: inserts (new keys, and ids given back and handed out again),
    touches, evictions, removals."""
    for _ in range(n):
        roll = rng.random()
        if roll < 0.4 or not len(policy):
            key = os.urandom(32)
            keys.append(key)
            policy.insert(key)
        elif roll < 0.7:
            policy.touch(rng.choice(keys))
        elif roll < 0.9:
            victim = next(iter(policy.candidates()), None)
            if victim is not None:
                policy.evicted(victim)
        else:
            policy.remove(rng.choice(keys))


def as_dict(snapshot: PolicySnapshot, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"kind": snapshot.kind, "lists": {k: v for k, v in snapshot.lists.items() if k not in drop},
            "values": snapshot.values, "numbers": snapshot.numbers}


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_a_snapshot_in_steps_is_the_policy_as_it_was_when_they_began(name: str, small_steps: None) -> None:
    rng = random.Random(name)
    policy = KeyedPolicy(make_eviction_policy(name))
    keys: list[bytes] = []
    churn(policy, rng, keys, 600)
    expected = policy.snapshot()
    steps = policy.snapshot_steps()
    taken = 0
    for item in steps:                      # the tier goes on between the steps: ids reused too
        if item is not None:
            got = item
            break
        taken += 1
        churn(policy, rng, keys, 5)
    assert taken > 20, "a snapshot of hundreds of keys spans many steps of 7"
    # slru copies its ghost filter in a step of its own, later: evictions meanwhile are in it
    drop = ("ghosts",) if name == "slru" else ()
    assert as_dict(got, drop) == as_dict(expected, drop)
    assert finished(policy.snapshot_steps()).encode() == policy.snapshot().encode()


def reference_slru_order(policy: SlruPolicy) -> list[int]:
    """What slru's snapshot did before it took steps: both lists, one stable sort by last use."""
    entries = policy.probation.entries() + policy.protected.entries()
    entries.sort(key=policy._last.__getitem__)
    return entries


@pytest.mark.parametrize("ticks", ["saved", "missing"])
def test_slru_merges_its_lists_by_last_use_as_one_stable_sort_would(ticks: str, small_steps: None) -> None:
    """Ties (a restore from a snapshot without last uses gives every key the same) keep
    probation first and each list's own order."""
    rng = random.Random(ticks)
    source = KeyedPolicy(SlruPolicy(2.0))
    keys: list[bytes] = []
    churn(source, rng, keys, 500)
    snapshot = source.snapshot()
    if ticks == "missing":
        del snapshot.lists["ticks"]
    restored = KeyedPolicy(SlruPolicy(2.0))
    restored.restore(snapshot, lambda key: True)
    churn(restored, rng, keys, 100)           # some young entries after the tied ones
    policy = restored.policy
    assert isinstance(policy, SlruPolicy)
    key_of = restored._ids.key_getter
    expected = [key_of(e) for e in reference_slru_order(policy)]
    assert restored.snapshot().lists["order"] == expected
    stamps = array("q")
    stamps.frombytes(restored.snapshot().lists["ticks"][0])
    assert list(stamps) == sorted(stamps)
    if ticks == "missing":
        assert len(set(stamps)) < len(stamps), "the test has ties to break"


def reference_encode(snapshot: PolicySnapshot) -> bytes:
    """PolicySnapshot.encode as it was written before it took steps."""
    heads = []
    parts: list[bytes] = []
    for name, keys in snapshot.lists.items():
        size = len(keys[0]) if keys else 0
        fixed = size > 0 and all(len(k) == size for k in keys) or not keys
        values = snapshot.values.get(name)
        heads.append([name, len(keys), size if fixed else -1, values is not None])
        parts.append(b"".join(keys) if fixed else b"".join(bytes((len(k),)) + k for k in keys))
        if values is not None:
            try:
                parts.append(bytes(values))
            except ValueError:
                parts.append(bytes(min(255, max(0, int(v))) for v in values))
    head = json.dumps({"kind": snapshot.kind, "numbers": snapshot.numbers, "lists": heads}).encode()
    return b"".join([struct.pack("<5sI", b"KVPS1", len(head)), head, *parts])


@pytest.mark.parametrize("seed", range(6))
def test_the_encoding_in_parts_is_the_encoding_byte_for_byte(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.policies import base

    monkeypatch.setattr(base, "_PIECE", 5)
    rng = random.Random(seed)
    lists: dict[str, list[bytes]] = {}
    values: dict[str, list[int]] = {}
    for n, name in enumerate(["a", "b", "c", "d"]):
        count = rng.choice([0, 1, 4, 5, 6, 23])
        mixed = rng.random() < 0.3 and count > 1                 # keys of several sizes (tests' keys)
        lists[name] = [os.urandom(rng.choice([0, 3, 32]) if mixed else 32) for _ in range(count)]
        if rng.random() < 0.5:
            values[name] = [rng.choice([0, 1, 3, 255, 300, -1]) for _ in range(count)]
    snapshot = PolicySnapshot("x", lists, values, {"n": 1.5})
    parts = finished(snapshot.encode_steps())
    assert b"".join(parts) == reference_encode(snapshot) == snapshot.encode()
    assert PolicySnapshot.decode(b"".join(parts)).lists == lists


class CrashAfter:
    """An index whose writes fail after ``n`` of them (a crash mid-save, as the index sees it)."""

    def __init__(self, index: BlockIndex, n: int) -> None:
        self.index, self.left = index, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)

    def write(self, **kw: Any) -> None:
        if self.left == 0:
            raise OSError("crash")
        self.left -= 1
        self.index.write(**kw)


def chunk_keys(index: BlockIndex, name: bytes) -> list[bytes]:
    return [key for key, _ in index.policy_items(name + b"/")]


def test_a_save_is_written_a_chunk_at_a_time_and_a_crash_mid_save_keeps_the_previous(
        index: BlockIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_state, "CHUNK", 10)
    first, second, third = bytes(range(95)), bytes(range(200, 256)) * 3, b"x" * 31
    written = []
    policy_state.save_parts(index, b"ram", [first[:50], first[50:]], pause=lambda nbytes: written.append(nbytes))
    assert policy_state.load_blob(index, b"ram") == first and written == [10] * 9 + [5]
    assert len(chunk_keys(index, b"ram")) == 10
    with pytest.raises(OSError):
        policy_state.save_parts(CrashAfter(index, 7), b"ram", [second])   # type: ignore[arg-type]
    assert policy_state.load_blob(index, b"ram") == first, "the head still names the whole previous save"
    assert len(chunk_keys(index, b"ram")) == 10 + 7
    policy_state.save_parts(index, b"ram", [third])       # the same generation again: what was cut short goes
    assert policy_state.load_blob(index, b"ram") == third
    assert len(chunk_keys(index, b"ram")) == 4
    policy_state.save_parts(index, b"ram", [])
    assert policy_state.load_blob(index, b"ram") == b"" and len(chunk_keys(index, b"ram")) == 1


def test_a_blob_of_the_layout_before_generations_is_read_and_replaced(index: BlockIndex) -> None:
    old = [b"abc", b"def", b"g"]                      # name/<index> chunks, a 4-byte head of their count
    index.write(policy=[(b"ssd/" + struct.pack(">I", i), c) for i, c in enumerate(old)]
                + [(b"ssd", struct.pack(">I", len(old)))])
    assert policy_state.load_blob(index, b"ssd") == b"abcdefg"
    policy_state.save_blob(index, b"ssd", b"new")
    assert policy_state.load_blob(index, b"ssd") == b"new" and len(chunk_keys(index, b"ssd")) == 1


def test_captured_in_steps_and_written_in_parts_restores_as_a_capture_in_one_go(index: BlockIndex,
                                                                               small_steps: None) -> None:
    rng = random.Random(3)
    ram = Keyed(make_eviction_policy("slru"))
    ssd = Keyed(make_eviction_policy("s3fifo"))
    gate = ReuseAdmission(threshold=2, window=1000)
    keys: list[bytes] = []
    churn(ram, rng, keys, 300)
    churn(ssd, rng, keys, 300)
    gate.admit(keys[0])
    captured = finished(policy_state.capture_steps(ram, ssd, gate))
    assert [name for name, _ in captured] == [policy_state.RAM, policy_state.SSD, policy_state.ADMISSION]
    assert policy_state.write_parts(index, captured) == sum(len(b"".join(parts)) for _, parts in captured)
    assert policy_state.load_blob(index, policy_state.RAM) == ram.snapshot().encode()
    assert policy_state.load_blob(index, policy_state.SSD) == ssd.snapshot().encode()
    again = ReuseAdmission(threshold=2, window=1000)
    assert policy_state.restore_admission(index, again) and again.admit(keys[0])


def test_steps_run_in_slices_with_rests_between_them() -> None:
    now = [0.0]

    def steps() -> Any:
        for _ in range(10):
            now[0] += 0.4                     # each step takes 0.4 (of the fake clock)
            yield None
        yield "done"

    async def body() -> tuple[str, SliceStats, int]:
        rests = 0
        stats = SliceStats()

        async def count_rests() -> None:
            nonlocal rests
            while True:
                await asyncio.sleep(0)
                rests += 1

        counter = asyncio.create_task(count_rests())
        result = await run_in_slices(steps(), slice_s=1.0, rest_s=0.0, stats=stats, clock=lambda: now[0])
        counter.cancel()
        return result, stats, rests

    result, stats, rests = asyncio.run(body())
    assert result == "done"
    assert stats.slices == 4 and stats.longest_s == pytest.approx(1.2) and stats.busy_s == pytest.approx(4.0)
    assert rests >= 2, "the loop ran other tasks between slices (the counter counts from its second turn)"


def test_a_ghost_filter_copied_in_steps_is_the_filter_after_the_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.policies import ghosts as ghosts_module
    from kvcached.policies.ghosts import GhostFilter

    monkeypatch.setattr(ghosts_module, "_SLICE", 64)
    ghosts = GhostFilter(capacity=2000)               # 24,000 bytes of cells: 375 steps
    for _ in range(150):
        ghosts.add(os.urandom(32), limit=1000)
    for crossing in (False, True):
        generation = ghosts.generation
        for n, item in enumerate(ghosts.state_steps()):
            if item is not None:
                copy = item
                break
            if n < 40:                      # keys added between the steps are in the copy too
                ghosts.add(os.urandom(32), limit=1000)
            if crossing and n == 50:        # a new generation meanwhile: the copy begins again
                for _ in range(1000):
                    ghosts.add(os.urandom(32), limit=1000)
        assert (ghosts.generation != generation) == crossing
        assert bytes(copy) == ghosts.state() and not ghosts._copying
    fresh = GhostFilter()
    assert fresh.restore(copy) and fresh.state() == ghosts.state()


def test_frozen_keys_name_the_ids_in_use_when_taken_after_they_are_given_back_and_handed_out_again() -> None:
    from kvcached.policies.links import KeyIds

    ids = KeyIds()
    keys = [os.urandom(32) for _ in range(10)]
    for key in keys:
        ids.add(key)
    frozen = ids.frozen_keys()
    ids.discard(keys[3])
    assert ids.add(b"n" * 32) == 3, "id 3 handed out again"
    ids.discard(keys[5])
    ids.discard(b"n" * 32)                            # given back twice: the first key is kept
    out: list[bytes] = []
    frozen.many(array("i", range(10)), out)
    assert out == keys and [frozen(i) for i in range(10)] == keys
    assert len(ids._watches) == 1
    del frozen                                        # freed: the table stops keeping keys aside
    assert ids._watches == []
