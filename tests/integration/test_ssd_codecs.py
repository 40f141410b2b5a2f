"""What SSD blocks become on disk, through real daemons (docs/codecs.md): coded with
kv.ssd_codec and sealed per tenant with tenants.seal_ssd, served bit-exact after a restart, and
never served when the file does not open: another tenant key, a flipped byte."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import blake3
import grpc
import numpy as np
import pytest

from kvcached.tiers.ssd_format import HEADER_BYTES, BlockHeader, file_bytes
from kvcached_agent.address import BlockAddress

from .conftest import wait_for
from .test_ssd import SMALL_RAM, _free_port, file_of, put_all, ssd_stats

KIB = 1 << 10
CODED = ('kv.write_policy="write_through"', 'kv.ssd_codec="planes-zstd"', "tenants.seal_ssd=true")


def kv_blocks(n: int, size: int = 64 * KIB, seed: int = 0) -> dict[BlockAddress, bytes]:
    """Blocks of bf16 values drawn as KV's are (small normal values: their high bytes repeat)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        values = (rng.standard_normal(size // 2) * 0.5).astype(np.float32)
        out[BlockAddress(blake3.blake3(b"kv-%d-%d" % (seed, i)).digest())] = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return out


def test_coded_sealed_blocks_are_smaller_unreadable_on_disk_and_exact_after_restarts(make_daemon, tmp_path: Path) -> None:
    port = _free_port()
    d = make_daemon(*SMALL_RAM, *CODED, f'metrics.listen="127.0.0.1:{port}"')
    data = kv_blocks(40)
    with d.client() as c:
        put_all(c, data)
        assert ssd_stats(c).blocks == len(data)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "kvcached_ssd_coded_writes_total 40.0" in text and "kvcached_ssd_sealed_writes_total 40.0" in text
    files = {a: file_of(tmp_path, a).read_bytes() for a in data}
    for a, raw in files.items():
        header = BlockHeader.decode(raw[:HEADER_BYTES])
        assert header.codec != 0 and header.nonce and len(raw) < file_bytes(len(data[a]))
        assert data[a][:4096] not in raw and data[a][-4096:] not in raw       # sealed: no run of the payload shows
    on_disk = sum(len(raw) for raw in files.values())
    assert sum(file_bytes(len(v)) for v in data.values()) / on_disk >= 1.25
    for sig in (signal.SIGTERM, signal.SIGKILL):
        d.stop(sig)
        d.start()
        with d.client() as c:
            found, _ = c.get(list(data))
            assert {f.address: f.payload for f in found} == data
            wait_for(lambda: c.stats().ssd_reconciled, text="reconcile")
            assert ssd_stats(c).blocks == len(data)
    # Neither coded nor sealed from now on: the files still read (a file says how it is
    # stored, and the tenant key opens what was sealed whatever tenants.seal_ssd says now).
    d.stop()
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"')
    with d.client() as c:
        found, _ = c.get(list(data))
        assert {f.address: f.payload for f in found} == data
        assert c.stats().ssd_corrupt == 0
    assert "Traceback" not in d.log()


def test_another_tenant_key_or_a_flipped_byte_reads_nothing(make_daemon, tmp_path: Path) -> None:
    d = make_daemon(*SMALL_RAM, *CODED)
    data = kv_blocks(12, seed=1)
    addrs = list(data)
    with d.client() as c:
        put_all(c, data)
    d.stop()
    flipped = file_of(tmp_path, addrs[0])
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    flipped.write_bytes(raw)
    d.start()
    with d.client() as c:
        with pytest.raises(grpc.RpcError) as err:
            c.get([addrs[0]])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "corrupt" in err.value.details()
        found, _ = c.get(addrs[1:])
        assert {f.address: f.payload for f in found} == {a: data[a] for a in addrs[1:]}
        assert c.stats().ssd_corrupt == 1
    d.stop()
    key_file = tmp_path / "index" / "tenants.key"       # a disk read with another key: nothing opens
    key_file.unlink()
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    d.start()
    with d.client() as c:
        found, misses = c.get(addrs[1:], allow_partial=True)
        assert found == [] and len(misses) == len(addrs) - 1
        assert all("corrupt" in m.reason for m in misses)
        assert c.stats().ssd_corrupt == len(addrs) - 1
    assert len(os.listdir(tmp_path / "ssd" / "quarantine")) == len(addrs)
    assert "Traceback" not in d.log()


def test_the_same_ssd_bytes_hold_more_blocks_coded(make_daemon, tmp_path: Path) -> None:
    """kv.ssd_gib counts files at their real size: with the codec on, the capacity eviction
    keeps as many more blocks as the codec saves (at least 1.25x on KV-like blocks)."""
    capacity = 8 << 20
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"', 'kv.ssd_codec="planes-zstd"',
                    f"kv.ssd_gib={capacity / (1 << 30)}")
    data = kv_blocks(240, seed=2)
    raw_fit = capacity // file_bytes(64 * KIB)
    with d.client() as c:
        wait_for(lambda: c.stats().ssd_reconciled, text="reconcile")
        put_all(c, data)
        wait_for(lambda: ssd_stats(c).reserved_bytes <= capacity, text="the tier back within its capacity")
        held = ssd_stats(c).blocks
    files = list((tmp_path / "ssd" / "blocks").rglob("*.kvb"))
    assert len(files) == held and sum(f.stat().st_size for f in files) <= capacity
    assert held >= 1.25 * raw_fit, f"{held} coded blocks in {capacity} bytes; {raw_fit} raw ones fit"


def test_auto_measures_what_coding_saves_and_serves_exact(make_daemon, tmp_path: Path) -> None:
    """kv.ssd_codec = "auto": the first blocks are coded (the probe), the reads and writes of
    the tier measure the disk, and the gauge says what coding saves against what it costs;
    whichever way it decides, every block comes back exact."""
    port = _free_port()
    d = make_daemon(*SMALL_RAM, 'kv.write_policy="write_through"', 'kv.ssd_codec="auto"',
                    f'metrics.listen="127.0.0.1:{port}"')
    data = kv_blocks(60, seed=3)
    with d.client() as c:
        put_all(c, data)
        d.stop()
    d.start()                    # an empty RAM tier: every block read from its file
    with d.client() as c:
        found, _ = c.get(list(data))
        assert {f.address: f.payload for f in found} == data
    d.stop()
    d.start()                    # the choice starts afresh: the first writes are coded again
    with d.client() as c:
        put_all(c, kv_blocks(8, seed=4))
        found, _ = c.get(list(data)[:8])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    coded = [line for line in text.splitlines() if line.startswith("kvcached_ssd_coded_writes_total")]
    assert coded and float(coded[0].split()[-1]) >= 1, "the probe codes the first block"
    assert "kvcached_ssd_codec_saving_ratio" in text
    assert "Traceback" not in d.log()
