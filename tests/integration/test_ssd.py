"""The SSD tier through real daemons: restart survival, damaged files, a full disk, eviction.

Each test runs real daemon processes on a state directory under tmp_path (index, SSD files);
the ENOSPC test mounts a small tmpfs (root) so the disk is really full.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import blake3
import grpc
import pytest

from kvcached.tiers.ssd_format import HEADER_BYTES, block_dir, block_name
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress, index_key
from tests.disks import small_tmpfs

from .conftest import wait_for

KIB = 1 << 10
SMALL_RAM = ("kv.ram_gib=0.0078125", "kv.max_block_mib=1")   # 8 MiB arena: most blocks live on SSD only


def blocks(n: int, size: int = 100 * KIB, seed: int = 0) -> dict[BlockAddress, bytes]:
    return {BlockAddress(blake3.blake3(b"%d-%d" % (seed, i)).digest()): blake3.blake3(b"p%d-%d" % (seed, i)).digest(length=size + i)
            for i in range(n)}


def file_of(state: Path, address: BlockAddress) -> Path:
    key = index_key(address.digest, address.layer)
    return state / "ssd" / "blocks" / block_dir(key) / block_name(address.digest, address.layer)


def ssd_stats(c) -> pb.TierStats:  # type: ignore[no-untyped-def]
    (ssd,) = [t for t in c.stats().tiers if t.tier == pb.TIER_SSD]
    return ssd



def put_all(c, data: dict[BlockAddress, bytes], batch: int = 8) -> None:  # type: ignore[no-untyped-def]
    items = list(data.items())
    for i in range(0, len(items), batch):
        c.put(items[i:i + batch])


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_blocks_come_back_after_a_restart(make_daemon, tmp_path: Path, direct_io: str) -> None:
    """Write-back: blocks reach SSD soon after the Put; after a clean stop and a SIGKILL they
    are served bit-exact from SSD."""
    d = make_daemon(*SMALL_RAM, f'kv.ssd_direct_io="{direct_io}"')
    data = blocks(120)
    with d.client() as c:
        put_all(c, data)
        wait_for(lambda: ssd_stats(c).blocks == len(data), text="write-back of every block")
    assert d.stop() == 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        d.start()
        with d.client() as c:
            found, _ = c.get(list(data)[:60])
            found += c.get(list(data)[60:])[0]
            assert {f.address: f.payload for f in found} == data
            r = c.lookup([a.digest for a in data])
            assert r.ssd == len(data)
            wait_for(lambda: c.stats().ssd_reconciled, text="reconcile")   # the tier's size is known from then on
            assert ssd_stats(c).blocks == len(data)
        d.stop(sig)
    assert "Traceback" not in d.log()


def test_write_through_acknowledges_only_published_blocks(make_daemon, tmp_path: Path) -> None:
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"', 'kv.ssd_durability="always"')
    data = blocks(20, seed=1)
    with d.client() as c:
        put_all(c, data)
        assert ssd_stats(c).blocks == 20, "each Put returned after its blocks were on SSD"
    assert all(file_of(tmp_path, a).exists() for a in data)
    d.stop(signal.SIGKILL)
    d.start()
    with d.client() as c:
        found, _ = c.get(list(data))
        assert {f.address: f.payload for f in found} == data


def test_damaged_files_are_never_served(make_daemon, tmp_path: Path) -> None:
    """Truncated files, flipped header and payload bits, stray temporary files, files without
    a record and records without a file: each detected, cleaned up, counted; the rest served."""
    port = _free_port()
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"', f'metrics.listen="127.0.0.1:{port}"')
    data = blocks(12, seed=2)
    addrs = list(data)
    with d.client() as c:
        put_all(c, data)
    d.stop()
    truncated, header_bad, payload_bad, gone = (file_of(tmp_path, a) for a in addrs[:4])
    os.truncate(truncated, HEADER_BYTES + 1000)
    _flip(header_bad, 70)
    _flip(payload_bad, HEADER_BYTES + 50_000)
    gone.unlink()
    stray = truncated.parent / (truncated.name + ".tmp-0badbeef")
    stray.write_bytes(b"half a write")
    orphan = tmp_path / "ssd" / "blocks" / "00" / "0" / "0000000000000000-ffffffff.kvb"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(file_of(tmp_path, addrs[5]).read_bytes())   # a good file under a name no record has
    d.start()
    wait_for(lambda: "SSD tier reconciled" in d.log(), text="reconcile")
    assert not stray.exists() and not orphan.exists() and not truncated.exists() and not header_bad.exists()
    assert payload_bad.exists(), "the reconcile reads headers only; the payload is checked at read"
    with d.client() as c:
        found, misses = c.get(addrs, allow_partial=True)
        assert {f.address: f.payload for f in found} == {a: data[a] for a in addrs[4:]}
        reasons = {m.address.digest: m.reason for m in misses}
        assert "corrupt" in reasons[addrs[2].digest]
        for a in (addrs[0], addrs[1], addrs[3]):
            assert "missing or did not match" in reasons[a.digest]
        with pytest.raises(grpc.RpcError) as err:
            c.get([addrs[2]])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "corrupt" in err.value.details()
        assert ssd_stats(c).blocks == 8
        s = c.stats()
        assert s.ssd_corrupt == 1 and s.ssd_reconciled and s.promotions >= 8
    assert not payload_bad.exists() and len(os.listdir(tmp_path / "ssd" / "quarantine")) == 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvcached_integrity_failures_total{tier="ssd"} 1.0' in text and 'kvcached_blocks{tier="ssd"} 8.0' in text
    assert "corrupt SSD block quarantined" in d.log()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "4m") as mnt:
        yield mnt


def test_full_disk(make_daemon, tmp_path: Path, small_disk: Path) -> None:
    """A 4 MiB filesystem: puts beyond it evict the oldest SSD blocks and succeed; when nothing
    can be evicted, a Put is refused with RESOURCE_EXHAUSTED, nothing partial is left and reads
    go on."""
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"', f'kv.ssd_dir="{small_disk / "ssd"}"')
    data = blocks(60, size=100 * KIB, seed=3)    # about 6.5 MiB of files
    with d.client() as c:
        put_all(c, data, batch=4)
        s = c.stats()
        assert ssd_stats(c).evictions > 0
        last = list(data)[-4:]
        found, _ = c.get(last)
        assert [f.payload for f in found] == [data[a] for a in last]
        c.delete(list(data))                     # the SSD tier is empty: nothing left to evict ...
        hog = small_disk / "hog"                 # ... and someone else fills the disk
        with open(hog, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        with pytest.raises(grpc.RpcError) as err:
            c.put(list(blocks(1, seed=4).items()))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "SSD" in err.value.details() and "full" in err.value.details()
        assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]
        assert c.lookup([a.digest for a in blocks(1, seed=4)]).longest == 0
        hog.unlink()
        c.put(list(blocks(1, seed=4).items()))
        assert s.puts >= 60


def test_ttl_and_capacity_eviction_under_puts(make_daemon, tmp_path: Path) -> None:
    """ssd_gib caps the tier under a stream of puts; ssd_ttl empties it of unused blocks."""
    cap = 2 << 20
    d = make_daemon(*SMALL_RAM, f"kv.ssd_gib={cap / (1 << 30)}", 'kv.ssd_ttl="3s"')
    with d.client() as c:
        for seed in range(6):
            put_all(c, blocks(10, seed=10 + seed))
            time.sleep(0.2)
        wait_for(lambda: c.stats().tiers[0].bytes == 0 or ssd_stats(c).evictions > 0, text="capacity eviction")
        wait_for(lambda: ssd_stats(c).reserved_bytes <= cap, text="tier back under capacity")
        wait_for(lambda: ssd_stats(c).blocks == 0, timeout=15, text="TTL eviction")
    assert "SSD blocks evicted" in d.log()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
