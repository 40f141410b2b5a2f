"""The index's record cache (kvcached.index.record_cache): what it answers is always what
RocksDB holds, whoever writes, and it stays within its bound."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest

from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier
from kvcached.index.format import checksum_for, encode_record, tiers_for, tombstone_of
from kvcached.index.record_cache import CACHED_RECORDS, RecordCache, cached_records
from kvcached_agent.address import BlockAddress


def record(address: BlockAddress, tiers: Tier = Tier.RAM, model: str = "m", tenant: str = "") -> BlockRecord:
    return BlockRecord(address.digest, address.layer, model, 4096, bytes(32), 1.0, 1.0, tiers, tenant=tenant)


def addresses(n: int, seed: int = 0) -> list[BlockAddress]:
    rng = random.Random(seed)
    return [BlockAddress(rng.randbytes(32), 0) for _ in range(n)]


def stored(index: BlockIndex, keys: list[bytes]) -> list[bytes | None]:
    """What RocksDB itself holds for ``keys``, past the cache."""
    return index._read_many(keys)


def test_live_records_kept_tombstones_and_deletes_dropped() -> None:
    cache = RecordCache(10)
    a, b, c = (record(x).encode() for x in addresses(3))
    gone = record(addresses(1, 9)[0], Tier.NONE).encode()
    cache.written([(b"a", a), (b"b", b), (b"g", gone)])
    assert cache.get(b"a") == a and cache.get(b"b") == b and b"g" not in cache
    cache.written([(b"a", gone)], deletes=[b"b"])
    assert b"a" not in cache and b"b" not in cache
    found, missing = cache.many([b"a", b"c"])
    assert found == [None, None] and missing == [0, 1]
    cache.written([(b"c", c)])
    assert cache.many([b"x", b"c"]) == ([None, c], [0])


def test_bound_drops_the_oldest_written_first() -> None:
    cache = RecordCache(3)
    raw = record(addresses(1)[0]).encode()
    cache.written([(bytes([i]), raw) for i in range(3)])
    cache.written([(bytes([0]), raw)])            # written again: young again
    cache.written([(bytes([3]), raw), (bytes([4]), raw)])
    assert len(cache) == 3
    assert [bytes([i]) in cache for i in range(5)] == [True, False, False, True, True]
    none = RecordCache(0)
    none.written([(b"k", raw)])
    assert len(none) == 0 and none.get(b"k") is None
    with pytest.raises(ValueError):
        RecordCache(-1)


def test_sized_by_the_ram_tier() -> None:
    assert cached_records(0) == CACHED_RECORDS
    assert cached_records(64 << 30) == (64 << 30) // (16 << 10)


def test_index_answers_what_rocksdb_holds_through_random_writes(tmp_path) -> None:
    """Random puts, tier changes, tombstones and deletes through every write method: every
    read (raw, raw_many, get_many, checksums, tiers_of) equals RocksDB's own bytes, with a
    cache smaller than the keys so entries are also dropped for room."""
    index = BlockIndex(tmp_path / "index", cached_records=40)
    rng = random.Random(63)
    pool = addresses(120, seed=1)
    keys = [a.key for a in pool]
    try:
        for step in range(400):
            picked = rng.sample(range(len(pool)), rng.randint(1, 12))
            chosen = [keys[i] for i in picked]
            op = rng.randrange(6)
            if op <= 1:
                index.write([(keys[i], record(pool[i], rng.choice([Tier.RAM, Tier.SSD, Tier.RAM | Tier.SSD]),
                                              tenant=rng.choice(["", "t1"]))) for i in picked])
            elif op == 2:
                index.write(index.without_tier(chosen, rng.choice([Tier.RAM, Tier.SSD]), GoneReason.EVICTED, step))
            elif op == 3:
                index.write(index.with_tier(chosen, Tier.SSD))
            elif op == 4:
                index.write(index.with_last_seen(chosen, float(step)), watch=False)
            else:
                index.write(deletes=chosen)
            probe = rng.sample(keys, 30)
            truth = stored(index, probe)
            assert index.raw_many(probe) == truth
            assert [index.raw(k) for k in probe] == truth
            assert index.get_many(probe) == [None if r is None else BlockRecord.decode(r) for r in truth]
            assert index.checksums(probe, "t1") == [checksum_for(r, b"t1") for r in truth]
            assert index.tiers_of(probe) == [tiers_for(r, None) for r in truth]
            assert len(index.cache) <= 40
        assert index.cache.hits > 0 and index.cache.misses > 0
    finally:
        index.close()


def test_a_writer_thread_and_the_loop_never_leave_an_older_record_cached(tmp_path) -> None:
    """Two threads write the same keys as fast as they can (as the event loop and the SSD
    reconcile's worker may): afterwards every cached record is RocksDB's."""
    index = BlockIndex(tmp_path / "index")
    pool = addresses(32, seed=2)
    keys = [a.key for a in pool]

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for step in range(300):
            i = rng.randrange(len(pool))
            if rng.random() < 0.3:
                index.write(index.without_tier([keys[i]], Tier.RAM, GoneReason.EVICTED, float(step)))
            else:
                index.write([(keys[i], record(pool[i], model=f"m{seed}-{step}"))])

    threads = [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for key in keys:
            cached = index.cache.get(key)
            assert cached is None or [cached] == stored(index, [key])
    finally:
        index.close()


def test_records_written_as_bytes_are_the_records_encoded() -> None:
    """format.encode_record (an agent's saves write it) gives BlockRecord.encode's bytes, and
    format.tombstone_of the bytes of BlockRecord.gone, on random fields."""
    rng = random.Random(7)
    for _ in range(200):
        fields = dict(digest=rng.randbytes(32), layer=rng.randrange(1 << 32), model=rng.choice(["m", "llama-3-8b", "é"]),
                      nbytes=rng.randrange(1, 1 << 30), checksum=rng.randbytes(32), created=rng.random() * 1e9,
                      last_seen=rng.random() * 1e9, route=rng.choice([b"", rng.randbytes(rng.randrange(1, 40))]),
                      tenant=rng.choice(["", "t1", "team-b"]))
        rec = BlockRecord(fields["digest"], fields["layer"], fields["model"], fields["nbytes"], fields["checksum"],
                          fields["created"], fields["last_seen"], Tier.RAM, route=fields["route"], tenant=fields["tenant"])
        raw = encode_record(fields["digest"], fields["layer"], fields["model"], fields["nbytes"], fields["checksum"],
                            fields["created"], fields["last_seen"], int(Tier.RAM), fields["route"], fields["tenant"])
        assert raw == rec.encode()
        now = rng.random() * 1e9
        assert tombstone_of(raw, int(GoneReason.EVICTED), now) == rec.gone(GoneReason.EVICTED, now).encode()
        both = encode_record(fields["digest"], fields["layer"], fields["model"], fields["nbytes"], fields["checksum"],
                             fields["created"], fields["last_seen"], int(Tier.RAM | Tier.SSD), fields["route"],
                             fields["tenant"])
        assert tombstone_of(both, int(GoneReason.EVICTED), now, int(Tier.SSD)) == replace(rec, tiers=Tier.SSD).encode()
