"""A full SSD disk on a real daemon (issue 20, parts 2 and 3).

The SSD tier lives on a real 8 MiB tmpfs, written through (a Put returns once its blocks are
published), as the tester ran it. What must hold:

- a block bigger than the disk is refused RESOURCE_EXHAUSTED, with the sizes, before anything
  is evicted: every block on SSD stays and is served;
- a foreign file that fills the disk makes a block that even an empty tier could not take a
  refusal too, nothing evicted;
- a write that meets the full disk evicts about what it needs (the oldest blocks), at most twice
  that, and counts as no error once it succeeded; when evicting frees nothing (another process
  holds the files open) the Put fails after that bound and the rest of the tier stays;
- Lookup's ``ssd`` column counts blocks held in RAM and on SSD, whether or not the chain goes
  past RAM.
"""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path
from typing import Iterator

import blake3
import grpc
import pytest

from kvcached.tiers.ssd_format import block_dir, block_name, file_bytes
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress, index_key
from tests.disks import fill, small_tmpfs
from tests.integration.conftest import DaemonProcess, wait_for

from .conftest import report

KIB, MIB = 1 << 10, 1 << 20
DISK = 8 * MIB
BLOCK = 60 * KIB                  # a 64 KiB file
FILLED = 100                      # blocks put before each test: 6.25 MiB of the 8 MiB


@pytest.fixture
def ssd_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", DISK) as mnt:
        yield mnt


def blocks(n: int, size: int = BLOCK, seed: int = 0) -> dict[BlockAddress, bytes]:
    return {BlockAddress(blake3.blake3(b"ssd-full %d %d" % (seed, i)).digest()):
            blake3.blake3(b"payload %d %d" % (seed, i)).digest(length=size) for i in range(n)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


def ssd_tier(c) -> pb.TierStats:  # type: ignore[no-untyped-def]
    (ssd,) = [t for t in c.stats().tiers if t.tier == pb.TIER_SSD]
    return ssd


def refusal(c, data: dict[BlockAddress, bytes]) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        c.put(list(data.items()))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    return err.value


def assert_served(c, data: dict[BlockAddress, bytes]) -> None:  # type: ignore[no-untyped-def]
    items = list(data)
    for i in range(0, len(items), 25):
        found, misses = c.get(items[i:i + 25], allow_partial=True)
        assert not misses, f"{len(misses)} blocks missing: {misses[0]}"
        assert {f.address: f.payload for f in found} == {a: data[a] for a in items[i:i + 25]}


class FullDisk:
    """A write-through daemon whose SSD tier is the 8 MiB tmpfs, with ``FILLED`` blocks on it."""

    def __init__(self, make_daemon, disk: Path) -> None:  # type: ignore[no-untyped-def]
        self.disk = disk
        self.port = free_port()
        self.daemon: DaemonProcess = make_daemon(
            f'kv.ssd_dir="{disk / "ssd"}"', 'kv.write_policy="write_through"', "kv.max_block_mib=16",
            f'metrics.listen="127.0.0.1:{self.port}"')
        self.data = blocks(FILLED)
        with self.daemon.client() as c:
            wait_for(lambda: c.stats().ssd_reconciled, text="the boot reconcile (the tier's size is known)")
            items = list(self.data.items())
            for i in range(0, len(items), 10):
                c.put(items[i:i + 10])
            assert ssd_tier(c).blocks == FILLED

    def metric(self, name: str) -> float:
        return metric(self.port, name)

    def files(self) -> list[Path]:
        return [self.disk / "ssd" / "blocks" / block_dir(index_key(a.digest, a.layer)) / block_name(a.digest, a.layer)
                for a in self.data]

    def assert_nothing_evicted(self, c) -> None:  # type: ignore[no-untyped-def]
        tier = ssd_tier(c)
        assert (tier.blocks, tier.evictions) == (FILLED, 0), "the refused Put evicted SSD blocks"
        assert all(f.exists() for f in self.files())
        assert_served(c, self.data)
        assert c.lookup([a.digest for a in self.data]).ssd == FILLED
        assert not [p for p in self.disk.rglob("*") if ".tmp-" in p.name], "a partial file was left"


@pytest.fixture
def full_disk(make_daemon, ssd_disk: Path) -> FullDisk:  # type: ignore[no-untyped-def]
    return FullDisk(make_daemon, ssd_disk)


def test_a_block_bigger_than_the_disk_is_refused_before_anything_is_evicted(full_disk: FullDisk) -> None:
    """The tester's first case: a 12 MiB write-through Put on the 8 MiB disk holding 100 blocks."""
    big = blocks(1, size=12 * MIB, seed=1)
    with full_disk.daemon.client() as c:
        err = refusal(c, big)
        assert f"{12 * MIB} bytes" in err.details() and f"{DISK} bytes" in err.details(), err.details()
        assert "nothing was evicted" in err.details() and "nothing was stored" in err.details()
        full_disk.assert_nothing_evicted(c)
        assert c.lookup([a.digest for a in big]).longest == 0
    assert full_disk.metric("kvcached_ssd_write_errors_total") == 0
    assert full_disk.metric("kvcached_ssd_full_disk_evictions_total") == 0


def test_a_foreign_file_holding_the_disk_costs_the_tier_nothing(full_disk: FullDisk) -> None:
    """The tester's second case: a foreign file holds the rest of the disk. A 16 MiB Put can
    never fit; a 7 MiB one would fit on the disk, but not even with the whole tier (6.25 MiB)
    evicted: both are refused and no block is evicted."""
    hog = fill(full_disk.disk)
    with full_disk.daemon.client() as c:
        err = refusal(c, blocks(1, size=16 * MIB, seed=2))
        assert f"{16 * MIB} bytes" in err.details() and "can ever hold" in err.details(), err.details()
        err = refusal(c, blocks(1, size=7 * MIB, seed=3))
        assert "is full" in err.details() and "something else fills the disk" in err.details(), err.details()
        assert "nothing was evicted" in err.details()
        full_disk.assert_nothing_evicted(c)
        hog.unlink()
        later = blocks(1, size=7 * MIB, seed=3)   # with the foreign file gone, eviction makes room
        c.put(list(later.items()))
        evicted = ssd_tier(c).evictions
        needed = file_bytes(7 * MIB) - (DISK - FILLED * file_bytes(BLOCK))
        assert needed // file_bytes(BLOCK) <= evicted <= needed // file_bytes(BLOCK) + 2, evicted
        assert_served(c, later)
    assert full_disk.metric("kvcached_ssd_write_errors_total") == 0
    report("foreign file", refused=2, evicted_after_it_went=evicted)


def test_a_put_that_needs_a_little_room_evicts_about_what_it_needs(full_disk: FullDisk) -> None:
    """A foreign file fills the free rest: a Put of 4 blocks meets the full disk, the 4 oldest
    blocks are evicted, it succeeds, and is counted as no write error."""
    fill(full_disk.disk)
    more = blocks(4, seed=4)
    with full_disk.daemon.client() as c:
        c.put(list(more.items()))
        tier = ssd_tier(c)
        assert tier.evictions in (4, 5) and tier.blocks == FILLED + 4 - tier.evictions, tier
        assert c.stats().ssd_write_errors == 0
        # The evicted blocks' RAM copies stay: RAM holds the whole chain, SSD all but those.
        on_ssd = {info.address.digest for info in c.list_blocks(tier=pb.TIER_SSD)}
        chain = sorted(full_disk.data, key=lambda a: a.digest not in on_ssd)    # on SSD first
        r = c.lookup([a.digest for a in chain])
        assert (r.longest, r.ram, r.ssd) == (FILLED, FILLED, FILLED - tier.evictions), r
        r = c.lookup([a.digest for a in reversed(chain)])
        assert (r.longest, r.ram, r.ssd) == (FILLED, FILLED, 0), r
        assert_served(c, full_disk.data | more)
    assert full_disk.metric("kvcached_ssd_write_errors_total") == 0
    assert full_disk.metric("kvcached_ssd_no_space_total") == 4
    assert full_disk.metric("kvcached_ssd_full_disk_evictions_total") == tier.evictions


def test_a_forced_eviction_that_frees_nothing_stops_at_its_bound(full_disk: FullDisk) -> None:
    """Another process holds every block file open (unlinking one frees no space) and a foreign
    file fills the rest: a Put of 4 blocks evicts at most twice what it needs, then fails; the
    other blocks stay on SSD."""
    held = [open(f, "rb") for f in full_disk.files()]
    more = blocks(4, seed=5)
    try:
        fill(full_disk.disk)
        with full_disk.daemon.client() as c:
            err = refusal(c, more)
            assert "even after evicting" in err.details() and "stored 0 of 4" in err.details(), err.details()
            tier = ssd_tier(c)
            assert tier.evictions in (8, 9), f"twice the 4 blocks' files (the last may pass it): {tier}"
            assert tier.blocks == FILLED - tier.evictions
            assert c.stats().ssd_write_errors == 4
    finally:
        for f in held:
            f.close()
    with full_disk.daemon.client() as c:
        c.put(list(more.items()))              # the evicted files' space is free now: no more eviction
        assert ssd_tier(c).evictions == tier.evictions
        assert_served(c, full_disk.data | more)
    assert full_disk.metric("kvcached_ssd_full_disk_evictions_total") == tier.evictions
    report("bounded forced eviction", blocks=FILLED, evicted=tier.evictions)


def test_lookup_counts_blocks_in_ram_and_on_ssd_under_write_back(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Write-back: once the blocks are written back they are in RAM and on SSD, and a Lookup of
    the whole chain, all in RAM, says so in both columns."""
    d = make_daemon()
    chain = list(blocks(16, size=4096, seed=6).items())
    with d.client() as c:
        c.put(chain)
        digests = [a.digest for a, _ in chain]
        wait_for(lambda: ssd_tier(c).blocks == len(chain), text="write-back")
        r = c.lookup(digests)
        assert (r.longest, r.ram, r.ssd) == (16, 16, 16), r
        r = c.lookup(digests + [blocks(1, seed=7).popitem()[0].digest])
        assert (r.longest, r.ram, r.ssd) == (16, 16, 16), r
