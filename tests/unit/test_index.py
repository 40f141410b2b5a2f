"""kvcached.index with a real RocksDB under tmp_path."""

from __future__ import annotations

import logging
import os
import stat
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import pytest
from rocksdict import Options, Rdict

from kvcached.errors import Unavailable
from kvcached.index import (
    MAX_WAL_BYTES,
    MEMTABLE_BYTES,
    RETRY_FIRST_S,
    SCHEMA_VERSION,
    BlockIndex,
    BlockRecord,
    GoneReason,
    IndexError_,
    IndexUnwritable,
    PresenceFeed,
    Tier,
)
from kvcached.index.boot import reconcile_at_boot
from kvcached.index.format import record_model, record_tenant, split_tail, with_route
from tests.disks import fill, small_tmpfs

NOW = 1_000_000.0
TTL = 3600.0


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def record(n: int, *, tiers: Tier = Tier.RAM, model: str = "m", gone_at: float = 0.0,
           reason: GoneReason = GoneReason.NONE, t: float = NOW) -> BlockRecord:
    return BlockRecord(digest=bytes([n % 256]) * 32, layer=n, model=model, nbytes=1000 + n, checksum=bytes([7]) * 32,
                       created=t, last_seen=t + 1, tiers=tiers, gone_reason=reason, gone_at=gone_at)


def tombstone(n: int, gone_at: float, reason: GoneReason = GoneReason.EVICTED) -> BlockRecord:
    return record(n, tiers=Tier.NONE, reason=reason, gone_at=gone_at)


def raw_put(index: BlockIndex, k: bytes, value: bytes) -> None:
    """Write bytes the codec would never write (a damaged or foreign record)."""
    index._blocks[k] = value


# ---------------------------------------------------------------------------------------------
# record codec


def test_record_round_trip_with_unicode_model() -> None:
    rec = BlockRecord(digest=bytes(range(32)), layer=0xFFFFFFFF, model="Qwen/Qwen3-8B · 量子 🦙",
                      nbytes=(1 << 40) + 3, checksum=bytes(range(32, 64)), created=1.5, last_seen=2.25,
                      tiers=Tier.RAM | Tier.SSD, gone_reason=GoneReason.NONE, gone_at=0.0)
    raw = rec.encode()
    assert raw[0] == SCHEMA_VERSION
    assert BlockRecord.decode(raw) == rec
    assert BlockRecord.decode(raw).tiers == Tier.RAM | Tier.SSD


def test_record_round_trip_tombstone_and_empty_model() -> None:
    rec = tombstone(3, 42.0, GoneReason.LOST_AT_RESTART)
    rec = replace(rec, model="")
    assert BlockRecord.decode(rec.encode()) == rec
    assert not rec.present and rec.gone_reason.text.startswith("lost at restart")


def test_a_record_says_whose_block_it_is_and_old_records_are_the_default_tenants() -> None:
    plain = record(1)
    assert plain.tenant == "" and record_tenant(plain.encode()) == ""     # as every record before tenants
    for route in (b"", b"\x01keys"):
        mine = replace(plain, tenant="alice-2", model="m/ü", route=route)
        raw = mine.encode()
        assert BlockRecord.decode(raw) == mine and record_tenant(raw) == "alice-2"
        assert split_tail(raw) == (b"m/\xc3\xbc", route) and record_model(raw) == "m/ü"
        rerouted = with_route(raw, b"new")
        assert record_tenant(rerouted) == "alice-2" and BlockRecord.decode(rerouted) == replace(mine, route=b"new")
    with pytest.raises(ValueError, match="at most 255"):
        replace(plain, tenant="x" * 256).encode()


def test_gone() -> None:
    rec = record(1, tiers=Tier.RAM | Tier.SSD)
    assert rec.present
    gone = rec.gone(GoneReason.EVICTED, 77.0)
    assert (gone.tiers, gone.gone_reason, gone.gone_at, gone.present) == (Tier.NONE, GoneReason.EVICTED, 77.0, False)
    assert gone.checksum == rec.checksum and gone.nbytes == rec.nbytes
    assert GoneReason.EVICTED.text == "evicted" and GoneReason.NONE.text == "present"


@pytest.mark.parametrize("raw", [
    b"",
    b"\x01",
    record(1).encode()[:-2],                              # record shorter than the fixed part (model "m" cut)
    bytes([SCHEMA_VERSION + 1]) + record(1).encode()[1:],  # unknown version
    record(1).encode()[:2] + b"\x09" + record(1).encode()[3:],   # unknown gone reason
    record(1).encode() + b"\xff\xfe",                    # model not UTF-8
])
def test_unreadable_record_raises_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        BlockRecord.decode(raw)


def test_unreadable_record_message() -> None:
    with pytest.raises(ValueError, match="index record of 0 bytes, version \\? is not readable"):
        BlockRecord.decode(b"")
    with pytest.raises(ValueError, match="version 02"):
        BlockRecord.decode(bytes([2]) + bytes(200))


# ---------------------------------------------------------------------------------------------
# point operations


def test_get_put_delete(index: BlockIndex) -> None:
    assert index.get(key(1)) is None
    index.write([(key(1), record(1)), (key(2), record(2))])
    assert index.get(key(1)) == record(1) and index.get(key(2)) == record(2)
    index.write(puts=[(key(1), tombstone(1, NOW))], deletes=[key(2)])
    assert index.get(key(1)) == tombstone(1, NOW)
    assert index.get(key(2)) is None
    index.write(deletes=[key(99)])                       # deleting an absent key is fine
    index.write()                                        # nothing to do


def test_memtables_and_wal_are_capped(index: BlockIndex) -> None:
    """The caps RocksDB was opened with, as it wrote them in its OPTIONS file: without the WAL
    cap the small families, which never fill a memtable, keep every WAL alive."""
    options = max(Path(index.path).glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1])).read_text()
    assert f"max_total_wal_size={MAX_WAL_BYTES}" in options.replace(" ", "")
    assert f"db_write_buffer_size={MEMTABLE_BYTES}" in options.replace(" ", "")


def test_write_is_atomic(index: BlockIndex) -> None:
    index.write([(key(1), record(1))])
    bad = replace(record(3), layer=-1)                   # does not encode (u32)

    def puts():
        yield key(2), record(2)
        yield key(3), bad

    with pytest.raises(Exception):
        index.write(puts(), deletes=[key(1)])
    assert index.get(key(1)) == record(1), "the delete of the failed batch did not happen"
    assert index.get(key(2)) is None, "the first put of the failed batch did not happen"


def test_get_many(index: BlockIndex) -> None:
    index.write([(key(n), record(n)) for n in (1, 3)])
    assert index.get_many([key(1), key(2), key(3), key(1)]) == [record(1), None, record(3), record(1)]
    assert index.get_many([]) == []


def test_checksums_read_from_the_stored_bytes(index: BlockIndex) -> None:
    index.write([(key(n), replace(record(n), checksum=bytes([n]) * 32)) for n in (1, 3)])
    assert index.checksums([key(3), key(2), key(1)]) == [bytes([3]) * 32, None, bytes([1]) * 32]
    raw_put(index, key(4), b"\x01short")
    assert index.checksums([key(4)]) == [None]


def test_owners_read_from_the_stored_bytes(index: BlockIndex) -> None:
    index.write([(key(n), replace(record(n), model=f"org/model-{n}")) for n in (1, 3)])
    assert index.owners([key(3), key(2), key(1)]) == [("org/model-3", ""), None, ("org/model-1", "")]
    raw_put(index, key(4), b"\x01short")
    assert index.owners([key(4)]) == [None]


def test_in_place_patches_match_the_codec(index: BlockIndex) -> None:
    index.write([(key(1), record(1)), (key(2), record(2, tiers=Tier.RAM | Tier.SSD)), (key(3), tombstone(3, NOW))])
    patched = dict(index.without_tier([key(1), key(2), key(3), key(9)], Tier.RAM, GoneReason.EVICTED, NOW + 5))
    assert set(patched) == {key(1), key(2)}, "absent records and records not in the tier are left out"
    assert BlockRecord.decode(patched[key(1)]) == record(1).gone(GoneReason.EVICTED, NOW + 5)
    assert BlockRecord.decode(patched[key(2)]) == record(2, tiers=Tier.SSD)
    seen = dict(index.with_last_seen([key(1), key(3)], NOW + 9))
    assert list(seen) == [key(1)], "tombstones are not touched"
    assert BlockRecord.decode(seen[key(1)]) == replace(record(1), last_seen=NOW + 9)


def test_scan_order_and_start_after(index: BlockIndex) -> None:
    ns = [50, 3, 7, 1000, 256, 8]
    index.write([(key(n), record(n)) for n in ns])
    assert [k for k, _ in index.scan()] == [key(n) for n in sorted(ns)]
    assert [r for _, r in index.scan()] == [record(n) for n in sorted(ns)]
    assert [k for k, _ in index.scan(start_after=key(8))] == [key(n) for n in (50, 256, 1000)]
    assert [k for k, _ in index.scan(start_after=key(9))] == [key(n) for n in (50, 256, 1000)], "absent key"
    assert [k for k, _ in index.scan(start_after=key(0))] == [key(n) for n in sorted(ns)]
    assert list(index.scan(start_after=key(1000))) == []
    assert list(index.scan(start_after=b"\xff" * 32)) == []


def test_scan_empty(index: BlockIndex) -> None:
    assert list(index.scan()) == [] and index.count_estimate() == 0


# ---------------------------------------------------------------------------------------------
# boot reconciliation


def test_reconcile_at_boot(index: BlockIndex) -> None:
    index.write([
        (key(1), record(1, tiers=Tier.RAM)),                       # RAM only: lost at restart
        (key(2), record(2, tiers=Tier.RAM | Tier.SSD)),            # RAM+SSD: SSD only
        (key(3), record(3, tiers=Tier.SSD)),                       # SSD: kept as is
        (key(4), tombstone(4, NOW - TTL - 1)),                     # old tombstone: pruned
        (key(5), tombstone(5, NOW - TTL + 1)),                     # young tombstone: kept
        (key(6), tombstone(6, NOW - TTL)),                         # exactly gone_ttl old: kept
    ])
    raw_put(index, key(7), b"\x63garbage")                          # unreadable: deleted
    raw_put(index, key(8), record(8).encode() + b"\xff")            # bad UTF-8: deleted
    counts = reconcile_at_boot(index, NOW, TTL)
    assert counts == {"seen": 8, "kept": 4, "lost_at_restart": 1, "pruned": 1, "unreadable": 2}
    assert index.get(key(1)) == record(1).gone(GoneReason.LOST_AT_RESTART, NOW)
    assert index.get(key(2)) == record(2, tiers=Tier.SSD)
    assert index.get(key(3)) == record(3, tiers=Tier.SSD)
    assert index.get(key(4)) is None
    assert index.get(key(5)) == tombstone(5, NOW - TTL + 1)
    assert index.get(key(7)) is None and index.get(key(8)) is None
    assert [k for k, _ in index.scan()] == [key(n) for n in (1, 2, 3, 5, 6)]


def test_reconcile_is_idempotent(index: BlockIndex) -> None:
    index.write([(key(1), record(1)), (key(2), record(2, tiers=Tier.SSD))])
    reconcile_at_boot(index, NOW, TTL)
    snapshot = list(index.scan())
    assert reconcile_at_boot(index, NOW, TTL) == {"seen": 2, "kept": 2, "lost_at_restart": 0, "pruned": 0,
                                                 "unreadable": 0}
    assert list(index.scan()) == snapshot
    counts = reconcile_at_boot(index, NOW + TTL + 1, TTL)
    assert counts["pruned"] == 1 and index.get(key(1)) is None


def test_reconcile_progress_and_small_batches(index: BlockIndex) -> None:
    index.write([(key(n), record(n)) for n in range(10)])
    index.write([(key(n), tombstone(n, 0.0)) for n in range(10, 17)])
    seen: list[int] = []
    counts = reconcile_at_boot(index, NOW, TTL, progress=seen.append, batch=3)
    assert seen == [3, 6, 9, 12, 15]
    assert counts == {"seen": 17, "kept": 0, "lost_at_restart": 10, "pruned": 7, "unreadable": 0}
    assert [k for k, _ in index.scan()] == [key(n) for n in range(10)]
    assert all(not r.present and r.gone_reason == GoneReason.LOST_AT_RESTART for _, r in index.scan())


def test_reconcile_empty(index: BlockIndex) -> None:
    called: list[int] = []
    assert reconcile_at_boot(index, NOW, TTL, progress=called.append)["seen"] == 0
    assert called == []


# ---------------------------------------------------------------------------------------------
# tombstone expiry


def test_expired_tombstones_and_delete_expired(index: BlockIndex) -> None:
    index.write([
        (key(1), tombstone(1, NOW - 2 * TTL)),
        (key(2), tombstone(2, NOW - 2 * TTL)),
        (key(3), tombstone(3, NOW)),
        (key(4), record(4)),
        (key(5), tombstone(5, NOW - 2 * TTL)),
    ])
    doomed = index.expired_tombstones(NOW, TTL)
    assert doomed == [key(1), key(2), key(5)]
    # between the worker's scan and the owner's delete: block 2 comes back, block 5 goes again
    # (a fresh tombstone), block 1 is deleted by someone else
    index.write([(key(2), record(2)), (key(5), tombstone(5, NOW))], deletes=[key(1)])
    assert index.delete_expired(doomed, NOW, TTL) == 0
    assert index.get(key(2)) == record(2) and index.get(key(5)) == tombstone(5, NOW)
    assert index.expired_tombstones(NOW + 2 * TTL, TTL) == [key(3), key(5)]
    assert index.delete_expired([key(3), key(5), key(4)], NOW + 2 * TTL, TTL) == 2
    assert [k for k, _ in index.scan()] == [key(2), key(4)]
    assert index.delete_expired([], NOW, TTL) == 0


# ---------------------------------------------------------------------------------------------
# open and close


def test_reopen_keeps_data(index_factory: Callable[..., BlockIndex]) -> None:
    first = index_factory("db")
    first.write([(key(n), record(n, model="ü")) for n in range(5)])
    first.write(deletes=[key(2)])
    first.close()
    second = index_factory("db")
    assert [r for _, r in second.scan()] == [record(n, model="ü") for n in (0, 1, 3, 4)]
    assert second.count_estimate() >= 1


def test_second_open_of_the_same_dir_raises(index_factory: Callable[..., BlockIndex], tmp_path: Path) -> None:
    first = index_factory("db")
    first.write([(key(1), record(1))])
    with pytest.raises(IndexError_, match="in use by another process") as info:
        BlockIndex(tmp_path / "db")
    assert str(tmp_path / "db") in str(info.value)
    assert first.get(key(1)) == record(1), "the first one still works"
    first.close()
    again = index_factory("db")                          # the lock went with close()
    assert again.get(key(1)) == record(1)


def test_wrong_schema_version(index_factory: Callable[..., BlockIndex], tmp_path: Path) -> None:
    index_factory("db").close()
    path = str(tmp_path / "db")
    families = ("blocks", "meta", "ssd_age", "policy")
    db = Rdict(path, Options(raw_mode=True), column_families={n: Options(raw_mode=True) for n in families})
    meta = db.get_column_family("meta")
    meta[b"schema_version"] = struct.pack("<I", SCHEMA_VERSION + 1)
    del meta
    db.close()
    with pytest.raises(IndexError_, match=f"schema version {SCHEMA_VERSION + 1}, this kvcached reads {SCHEMA_VERSION}"):
        BlockIndex(path)


def test_an_index_with_a_retired_family_opens_and_loses_only_that(index_factory: Callable[..., BlockIndex],
                                                                    tmp_path: Path) -> None:
    """The first KV events build kept engine keys in a "routes" family; they live in the records
    now. Its index opens, keeps every record, and drops the family."""
    index = index_factory("db")
    index.write([(b"k" * 36, BlockRecord(b"d" * 32, 0, "m", 10, b"c" * 32, 1.0, 1.0))])
    index.close()
    path = str(tmp_path / "db")
    opts = Options(raw_mode=True)
    db = Rdict(path, opts, column_families={n: Options(raw_mode=True) for n in Rdict.list_cf(path, opts)})
    db.create_column_family("routes", Options(raw_mode=True))[b"k" * 36] = b"old keys"
    db.close()
    assert "routes" in Rdict.list_cf(path, opts)
    again = BlockIndex(path)
    assert again.get(b"k" * 36) == BlockRecord(b"d" * 32, 0, "m", 10, b"c" * 32, 1.0, 1.0)
    again.close()
    assert "routes" not in Rdict.list_cf(path, opts)


def test_open_creates_the_directory(tmp_path: Path) -> None:
    old = os.umask(0)                     # what a daemon started by hand under umask 000 would have
    try:
        index = BlockIndex(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    try:
        assert (tmp_path / "a" / "b").is_dir()
        for made in (tmp_path / "a", tmp_path / "a" / "b"):
            assert stat.S_IMODE(made.stat().st_mode) == 0o700, "the index and its new parents are private"
    finally:
        index.close()


def test_cannot_open_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises((IndexError_, OSError)):
        BlockIndex(tmp_path / "file")


# ---------------------------------------------------------------------------------------------
# a full disk: writes refused, reads go on, recovery without a restart (a real 4 MiB tmpfs)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "4m") as mnt:
        yield mnt


def write_until_refused(index: BlockIndex, first: int) -> int:
    """Put records first, first+1, ... until the index refuses one; returns how many it took."""
    n = first
    with pytest.raises(IndexUnwritable) as refused:
        while True:
            index.write([(key(n), record(n))])
            n += 1
    assert "No space left on device" in str(refused.value)
    assert isinstance(refused.value, Unavailable), "the API answers UNAVAILABLE"
    return n - first


def recover_within(index: BlockIndex, seconds: float, now: Callable[[], float] = time.monotonic) -> None:
    deadline = time.monotonic() + seconds
    while not index.recover(now()):
        assert time.monotonic() < deadline, f"not writable after {seconds} s: {index.unwritable_reason}"
        time.sleep(0.05)


def test_a_full_disk_refuses_writes_keeps_reads_and_recovers(small_disk: Path) -> None:
    index = BlockIndex(small_disk / "index")
    index.write([(key(n), record(n)) for n in range(100)])
    hog = fill(small_disk)
    accepted = write_until_refused(index, 100)         # the page cache takes a few more
    acked = 100 + accepted
    assert not index.writable and index.write_failures == 1
    with pytest.raises(IndexUnwritable, match="takes no writes until it recovers by itself"):
        index.write([(key(9999), record(9999))])        # refused at once, RocksDB not asked
    assert index.write_failures == 2
    assert [index.get(key(n)) for n in range(acked)] == [record(n) for n in range(acked)], "reads go on"
    assert not index.recover(time.monotonic()), "nothing is tried while the disk is full"
    assert [index.get(key(n)) for n in range(acked)] == [record(n) for n in range(acked)]

    hog.unlink()
    recover_within(index, 10)
    assert index.writable and index.recoveries == 1
    index.write([(key(n), record(n)) for n in range(acked, acked + 10)])
    assert [index.get(key(n)) for n in range(acked + 10)] == [record(n) for n in range(acked + 10)]
    index.close()
    again = BlockIndex(small_disk / "index")            # what a restart reads: nothing acknowledged lost
    try:
        assert [again.get(key(n)) for n in range(acked + 10)] == [record(n) for n in range(acked + 10)]
        assert again.get(key(9999)) is None, "the refused write never happened"
    finally:
        again.close()


def test_recovery_waits_for_a_reader_of_the_old_instance_and_backs_off(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A scan in progress on a worker thread keeps the failed RocksDB instance alive: the reopen
    cannot take its lock. Reads go on from a read-only view; the next try waits RETRY_FIRST_S."""
    index = BlockIndex(small_disk / "index")
    index.write([(key(n), record(n)) for n in range(50)])
    scan = index.scan()
    assert next(scan)[0] == key(0)                      # an iterator on the writer, held
    hog = fill(small_disk)
    acked = 50 + write_until_refused(index, 50)
    hog.unlink()
    caplog.set_level(logging.WARNING, logger="kvcached.index")
    t = 100.0                                           # the backoff's clock, moved by hand
    deadline = time.monotonic() + 10
    while "still not writable" not in caplog.text:
        assert not index.recover(t)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "lock" in index.unwritable_reason
    assert [index.get(key(n)) for n in range(acked)] == [record(n) for n in range(acked)], "read from the view"
    with pytest.raises(IndexUnwritable):
        index.write([(key(9999), record(9999))])
    caplog.clear()
    assert not index.recover(t + RETRY_FIRST_S / 2) and not caplog.text, "no new try within the backoff"
    assert list(scan)[-1][0] == key(49), "the scan went on over the old instance (as of its start)"
    del scan                                             # it lets the old instance go
    recover_within(index, 10, lambda: t + RETRY_FIRST_S)
    assert index.recoveries == 1
    index.write([(key(9999), record(9999))])
    assert index.get(key(9999)) == record(9999)
    assert [index.get(key(n)) for n in range(acked)] == [record(n) for n in range(acked)]
    index.close()


def test_presence_changes_are_recorded_in_the_feed(index: BlockIndex) -> None:
    """Writes that make a block present or not present any more are recorded, in order, as
    (wire key, present); writes that change no presence are not; with no feed nothing is."""
    def wire(n: int) -> bytes:
        return bytes([n % 256]) * 32 + n.to_bytes(4, "little")

    index.write([(key(9), record(9))])                               # no feed yet: nothing kept
    feed = PresenceFeed()
    index.presence = feed
    index.write([(key(1), record(1)), (key(2), record(2))])
    index.write([(key(1), record(1, tiers=Tier.RAM | Tier.SSD))])    # still present
    index.write([(key(1), record(1))], watch=False)
    index.write(deletes=[key(2)])
    index.write([(key(9), tombstone(9, NOW))])
    assert feed.take() == [(wire(1), True), (wire(2), True), (wire(2), False), (wire(9), False)]
    assert feed.take() == [] and len(feed) == 0
