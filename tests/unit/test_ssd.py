"""SsdTier and the block-file format on real files: O_DIRECT and buffered, every durability mode,
damaged files detected, failed writes leave nothing behind."""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
from pathlib import Path
from typing import Iterator

import blake3
import pytest

from kvcached.tiers.ssd import SsdFull, SsdTier, SsdWrite
from kvcached.tiers.ssd_format import HEADER_BYTES, PAGE, BlockHeader, HeaderError, block_name, file_bytes, padded, parse_name
from tests.unit.conftest import payload

SIZES = [1, 4095, 4096, 4097, 65536, 100_000]


@pytest.fixture
def source() -> Iterator[memoryview]:
    """A page-aligned buffer, like the arena: block i at offset i MiB."""
    m = mmap.mmap(-1, 8 << 20)
    view = memoryview(m)
    yield view
    gc.collect()      # slices held by finished tasks' reference cycles
    view.release()
    m.close()


def writes(source: memoryview, sizes: list[int] = SIZES) -> list[SsdWrite]:
    out = []
    for i, n in enumerate(sizes):
        data = payload(i, n)
        off = i << 20
        source[off:off + n] = data
        header = BlockHeader(blake3.blake3(b"d%d" % i).digest(), i, n, blake3.blake3(data).digest(), 1.5)
        out.append(SsdWrite(blake3.blake3(b"k%d" % i).digest(), header, source[off:off + n]))
    return out


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def dest_for(n: int) -> tuple[mmap.mmap, memoryview]:
    m = mmap.mmap(-1, max(PAGE, padded(n)))
    return m, memoryview(m)


# -- format -------------------------------------------------------------------------------------


def test_header_round_trip_and_layout() -> None:
    h = BlockHeader(b"\x01" * 32, 7, 12345, b"\x02" * 32, 1700000000.25)
    page = h.encode()
    assert len(page) == HEADER_BYTES and page[:8] == b"KVCBLK\r\n" and page[112:] == bytes(HEADER_BYTES - 112)
    assert BlockHeader.decode(page) == h
    assert h.disagreement(b"\x01" * 32, 7, 12345, b"\x02" * 32) is None
    assert "another block" in h.disagreement(b"\x03" * 32, 7, 12345, b"\x02" * 32)
    assert "length" in h.disagreement(b"\x01" * 32, 7, 1, b"\x02" * 32)
    assert "checksum" in h.disagreement(b"\x01" * 32, 7, 12345, b"\x04" * 32)


@pytest.mark.parametrize("offset", [0, 8, 12, 16, 40, 70, 100])
def test_any_flipped_header_bit_is_detected(offset: int) -> None:
    page = bytearray(BlockHeader(b"\x01" * 32, 7, 12345, b"\x02" * 32, 1.0).encode())
    page[offset] ^= 0x10
    with pytest.raises(HeaderError):
        BlockHeader.decode(page)


def test_names_and_sizes() -> None:
    name = block_name(bytes(range(32)), 0xFFFFFFFF)
    assert name == "0001020304050607-ffffffff.kvb"
    assert parse_name(name) == (bytes(range(8)), 0xFFFFFFFF)
    assert parse_name("junk.kvb") is None and parse_name(name + ".tmp-1234") is None
    assert file_bytes(1) == 2 * PAGE and file_bytes(PAGE) == 2 * PAGE and file_bytes(PAGE + 1) == 3 * PAGE


# -- the tier on real files ---------------------------------------------------------------------------


@pytest.mark.parametrize("durability", ["always", "batch", "none"])
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_write_then_read_every_mode(tmp_path: Path, source: memoryview, durability: str, direct_io: str) -> None:
    async def main() -> None:
        ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability=durability, direct_io=direct_io,  # type: ignore[arg-type]
                      commit_s=0.002, threads=4)
        ssd.open()
        assert ssd.direct == (direct_io == "auto")   # tmp_path is on a filesystem with O_DIRECT here
        ws = writes(source)
        assert await ssd.write_many(ws) == [None] * len(ws)
        assert ssd.blocks == len(ws) and ssd.used_bytes == sum(file_bytes(n) for n in SIZES)
        assert (ssd.counters.group_commits >= 1) == (durability == "batch")
        for w in ws:
            path = ssd.path_of(w.key, w.header.digest, w.header.layer)
            assert os.path.getsize(path) == file_bytes(w.header.length)
            assert os.stat(path).st_mode & 0o777 == 0o600
            m, dest = dest_for(w.header.length)
            assert await ssd.read_into(w.key, w.header, dest) is None
            assert dest[:w.header.length] == w.payload
            with open(path, "rb") as f:   # the padding is zeros, never stale arena bytes
                f.seek(HEADER_BYTES + w.header.length)
                assert set(f.read()) <= {0}
            dest.release()
            m.close()
        leftovers = [p for p in (tmp_path / "ssd").rglob("*") if ".tmp-" in p.name]
        assert leftovers == []
        await ssd.close()

    run(main())


def test_damage_is_detected_never_served(tmp_path: Path, source: memoryview) -> None:
    async def main() -> None:
        ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="none")
        ssd.open()
        ws = writes(source, [65536] * 6)
        await ssd.write_many(ws)
        paths = [ssd.path_of(w.key, w.header.digest, w.header.layer) for w in ws]
        with open(paths[0], "r+b") as f:       # a bit flipped in the payload
            f.seek(HEADER_BYTES + 1000)
            b = f.read(1)
            f.seek(HEADER_BYTES + 1000)
            f.write(bytes([b[0] ^ 1]))
        with open(paths[1], "r+b") as f:       # a bit flipped in the header
            f.seek(20)
            b = f.read(1)
            f.seek(20)
            f.write(bytes([b[0] ^ 4]))
        os.truncate(paths[2], HEADER_BYTES + 100)   # torn
        os.unlink(paths[3])                          # gone
        wrong = writes(source, [65536] * 6)[5]       # another block's file under block 4's name
        os.replace(paths[5], paths[4])
        problems = []
        for w in ws[:5]:
            m, dest = dest_for(65536)
            problems.append(await ssd.read_into(w.key, w.header, dest))
            dest.release()
            m.close()
        assert "checksum" in problems[0]
        assert "header" in problems[1]
        assert "truncated" in problems[2]
        assert problems[3] == "missing"
        assert "another block" in problems[4] and wrong.header.layer == 5
        assert ssd.counters.corrupt == 4 and ssd.counters.missing == 1 and ssd.counters.reads == 0
        await ssd.quarantine(ws[0].key, ws[0].header, "test")
        assert not os.path.exists(paths[0])
        assert len(os.listdir(ssd.quarantine_dir)) == 1
        await ssd.close()

    run(main())


def test_failed_write_leaves_nothing(tmp_path: Path, source: memoryview) -> None:
    """A write into a directory that cannot take it fails cleanly: no temporary file, not counted."""
    async def main() -> None:
        ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="batch", commit_s=0.001)
        ssd.open()
        ws = writes(source, [8192, 8192])
        leaf = os.path.dirname(ssd.path_of(ws[0].key, ws[0].header.digest, ws[0].header.layer))
        os.makedirs(os.path.dirname(leaf), exist_ok=True)
        Path(leaf).write_bytes(b"not a directory")    # the leaf directory cannot exist
        errors = await ssd.write_many(ws)
        assert errors[0] is not None and "SSD write failed" in str(errors[0]) and errors[1] is None
        assert ssd.blocks == 1 and ssd.counters.write_errors == 1
        await ssd.close()

    run(main())


def test_no_space_is_its_own_error(tmp_path: Path, source: memoryview) -> None:
    """On a real full filesystem (a 1 MiB tmpfs) writes fail with SsdFull and leave no file."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        async def main() -> None:
            ssd = SsdTier(str(mnt / "ssd"), 1 << 30, durability="batch", direct_io="off", commit_s=0.001)
            ssd.open()
            errors = await ssd.write_many(writes(source, [300_000, 300_000, 300_000, 300_000]))
            assert any(isinstance(e, SsdFull) for e in errors)
            assert ssd.blocks == sum(e is None for e in errors)
            files = [p for p in (mnt / "ssd").rglob("*") if p.is_file()]
            assert len(files) == ssd.blocks, "a failed write leaves no partial or temporary file"
            await ssd.close()

        run(main())
    finally:
        os.system(f"umount {mnt}")


def test_direct_io_on_where_refused_is_an_error(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        ssd = SsdTier(str(mnt / "ssd"), 1 << 30, direct_io="on")
        ssd.open()     # this kernel's tmpfs accepts O_DIRECT; "on" then simply uses it
        assert ssd.direct
    finally:
        os.system(f"umount {mnt}")


def test_stale_temporary_files_are_recognised(tmp_path: Path) -> None:
    ssd = SsdTier(str(tmp_path / "ssd"), 1 << 30)
    assert ssd.is_stale_tmp("x.kvb.tmp-deadbeef") != (ssd.boot_token == "deadbeef")
    assert not ssd.is_stale_tmp(f"x.kvb.tmp-{ssd.boot_token}")
    assert not ssd.is_stale_tmp(f"x.kvb.tmp-{ssd.boot_token}-17")
    assert ssd.is_stale_tmp("x.kvb.tmp-0badbeef-3") != (ssd.boot_token == "0badbeef")
    assert not ssd.is_stale_tmp("x.kvb")
