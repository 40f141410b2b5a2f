"""The cold tiers' codecs and sealing (kvcached.codecs), alone and in real SSD block files:
lossless to the bit on random KV-like data, refused where they do not pay, damaged or foreign
stored forms refused with a clear error and never served."""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
import random
from pathlib import Path
from typing import Callable, Iterator

import blake3
import numpy as np
import pytest

from kvcached.codecs import CODECS, RAW, CodecError, Sealer, SealError, StoredForm, UnpackError, codec_coded, codec_named, planes
from kvcached.codecs.planes import PLANES_ZSTD
from kvcached.index import BlockIndex
from kvcached.index.format import BlockRecord, Tier
from kvcached.store.ssd_reconcile import reconcile_ssd
from kvcached.tiers.ssd import ReadFault, SsdTier, SsdWrite
from kvcached.tiers.ssd_format import HEADER_BYTES, PAGE, BlockHeader, HeaderError, file_bytes, padded
from kvcached_agent.address import index_key


def kv_like(n: int, seed: int, scale: float = 0.5) -> bytes:
    """``n`` bytes of bf16 values drawn as KV's are (normal, small): the high bytes repeat."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n // 2) * scale).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()      # float32 -> bf16, truncated


def keys_of(tag: str) -> bytes:
    return blake3.blake3(tag.encode(), key=b"k" * 32).digest()


# -- the codec alone -------------------------------------------------------------------------------


def test_registry_names_and_codes() -> None:
    assert codec_named("none") is None and codec_named("planes-zstd") is PLANES_ZSTD
    assert codec_coded(PLANES_ZSTD.code) is PLANES_ZSTD and "planes-zstd" in CODECS
    with pytest.raises(KeyError, match="no codec called 'lz9'"):
        codec_named("lz9")
    with pytest.raises(CodecError, match="unknown"):
        codec_coded(250)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_registered_codec_is_exact_and_exact_is_the_default(name: str) -> None:
    """kv.ssd_codec takes any registered codec, and a block it stores is served to whoever asks
    (there is no lossy block to keep from anyone yet, docs/codecs.md): so every codec here must
    give back the payload bit for bit, and the default stores blocks as they are."""
    from kvcached.config import Config

    assert Config().kv.ssd_codec == "none"
    codec = CODECS[name]
    for seed, n in enumerate((2, 4098, 65536, 100_002)):
        data = kv_like(n, 100 + seed)
        stored = codec.encode(memoryview(data), 0.0)
        out = bytearray(n)
        if stored is not None:
            codec.decode(memoryview(stored), memoryview(out))
            assert bytes(out) == data


@pytest.mark.parametrize("seed", range(6))
def test_planes_are_lossless_on_kv_like_data(seed: int) -> None:
    rng = random.Random(seed)
    n = 2 * rng.randrange(1, 70_000)
    data = kv_like(n, seed, scale=rng.choice([0.01, 0.5, 4.0]))
    stored = PLANES_ZSTD.encode(memoryview(data), 0.0)
    assert stored is not None and len(stored) < n
    out = bytearray(n)
    PLANES_ZSTD.decode(memoryview(stored), memoryview(out))
    assert bytes(out) == data


def test_planes_pay_on_kv_and_not_on_noise() -> None:
    data = kv_like(1 << 20, 1)
    stored = PLANES_ZSTD.encode(memoryview(data), 0.1)
    assert stored is not None and len(data) / len(stored) > 1.25
    assert PLANES_ZSTD.encode(memoryview(os.urandom(1 << 16)), 0.1) is None       # random bytes: stored raw
    assert PLANES_ZSTD.encode(memoryview(data[:-1]), 0.0) is None                  # not whole elements
    assert PLANES_ZSTD.encode(memoryview(b""), 0.0) is None


def test_damaged_stored_forms_raise_codec_error_only() -> None:
    data = kv_like(40_000, 2)
    stored = PLANES_ZSTD.encode(memoryview(data), 0.0)
    assert stored is not None
    rng = random.Random(3)
    for _ in range(300):
        bad = bytearray(stored)
        how = rng.randrange(3)
        if how == 0:
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        elif how == 1:
            del bad[rng.randrange(len(bad)):]
        else:
            bad += os.urandom(rng.randrange(1, 9))
        out = bytearray(len(data))
        try:
            PLANES_ZSTD.decode(memoryview(bytes(bad)), memoryview(out))
        except CodecError:
            continue            # a flipped bit that still decodes is the payload checksum's to catch
    with pytest.raises(CodecError, match="not whole"):
        PLANES_ZSTD.decode(memoryview(stored), memoryview(bytearray(len(data) - 1)))
    with pytest.raises(CodecError):        # a frame claiming a huge size is refused before any allocation
        PLANES_ZSTD.decode(memoryview(stored), memoryview(bytearray(len(data) // 2)))


def test_the_compiled_planes_are_built_and_match_numpy() -> None:
    assert planes.COMPILED, "make install builds kvcached/codecs/_planes.c (gcc and Python's headers are here)"
    compiled = planes._compiled()
    assert compiled is not None
    rng = random.Random(5)
    for _ in range(200):
        width = rng.randint(1, 8)
        n = width * rng.randrange(0, 3000)
        data = os.urandom(n)
        split = compiled.split(memoryview(data), width)
        assert split == planes.reference_split(memoryview(data), width)
        size = n // width
        parts = [memoryview(split)[i * size:(i + 1) * size] for i in range(width)]
        out, ref = bytearray(n), bytearray(n)
        compiled.merge(parts, width, memoryview(out))
        planes.reference_merge(parts, width, memoryview(ref))
        assert out == ref == data
    for bad in ((b"abc", 2), (b"ab", 0), (b"ab" * 8, 9)):
        with pytest.raises(ValueError):
            compiled.split(*bad)
    with pytest.raises(ValueError):
        compiled.merge([b"ab", b"a"], 2, bytearray(4))
    with pytest.raises(ValueError):
        compiled.merge([b"ab"], 2, bytearray(4))
    with pytest.raises(TypeError):
        compiled.merge([b"ab", b"ab"], 2, b"read-only")


# -- sealing ---------------------------------------------------------------------------------------


class Buffers:
    """Grown-on-demand buffers, as the SSD tier's per-thread scratch areas."""

    def __init__(self) -> None:
        self.areas: dict[str, bytearray] = {}

    def area(self, name: str) -> Callable[[int], bytearray]:
        def get(n: int) -> bytearray:
            if len(self.areas.get(name, b"")) < n:
                self.areas[name] = bytearray(n)
            return self.areas[name]
        return get


def _open(sealer: Sealer, tenant: str, nonce: bytes, tag: bytes, sealed: bytes, identity: bytes) -> bytes:
    out = bytearray(len(sealed))
    sealer.open_into(tenant, nonce, tag, sealed, identity, out)
    return bytes(out[:len(sealed)])


def test_seal_opens_only_for_its_tenant_and_identity() -> None:
    sealer = Sealer(keys_of)
    data = b"secret bytes" * 100
    out = bytearray(len(data))
    nonce, tag = sealer.seal_into("alice", data, b"id-1", out)
    sealed = bytes(out[:len(data)])
    assert b"secret bytes" not in sealed and len(tag) == 16
    assert _open(sealer, "alice", nonce, tag, sealed, b"id-1") == data
    with pytest.raises(SealError, match="another tenant"):
        _open(sealer, "bob", nonce, tag, sealed, b"id-1")
    with pytest.raises(SealError):
        _open(sealer, "alice", nonce, tag, sealed, b"id-2")            # moved under another block's name
    flipped = bytearray(sealed)
    flipped[7] ^= 0x01
    with pytest.raises(SealError):
        _open(sealer, "alice", nonce, tag, bytes(flipped), b"id-1")
    with pytest.raises(SealError):
        _open(sealer, "alice", nonce, bytes(16), sealed, b"id-1")
    with pytest.raises(SealError, match="missing"):
        _open(sealer, "alice", nonce, b"", sealed, b"id-1")
    with pytest.raises(SealError):             # another salt: another file's key
        _open(sealer, "alice", bytes(16) + nonce[16:], tag, sealed, b"id-1")
    assert len(nonce) == 28
    again = bytearray(len(data))
    assert sealer.seal_into("alice", data, b"id-1", again)[0] != nonce and again[:len(data)] != out[:len(data)]


@pytest.mark.parametrize("codec", [None, PLANES_ZSTD])
@pytest.mark.parametrize("sealed", [False, True])
def test_stored_form_round_trip(codec: object, sealed: bool) -> None:
    form = StoredForm(codec, 0.1, Sealer(keys_of) if sealed else None)       # type: ignore[arg-type]
    data = kv_like(65536, 4)
    bufs = Buffers()
    packed = form.pack(memoryview(data), "alice", b"identity", bufs.area("stored"))
    if codec is None and not sealed:
        assert packed is None and form.plain and not bufs.areas
        return
    assert packed is not None and packed.codec == (RAW if codec is None else PLANES_ZSTD.code)
    assert bool(packed.nonce) == sealed
    stored = bytes(bufs.areas["stored"][:packed.length])
    out = bytearray(len(data))
    form.unpack(packed.codec, packed.nonce, packed.tag, memoryview(stored), memoryview(out), "alice", b"identity",
                bufs.area("plain"))
    assert bytes(out) == data
    if sealed:
        assert packed.length == (len(data) if codec is None else len(PLANES_ZSTD.encode(memoryview(data), 0.1) or b""))
        out[:] = bytes(len(out))
        with pytest.raises(UnpackError):
            form.unpack(packed.codec, packed.nonce, packed.tag, memoryview(stored), memoryview(out), "bob", b"identity",
                        bufs.area("plain"))
        assert data[:4096] not in bytes(out), "another tenant's key opens nothing of the block"
        with pytest.raises(SealError, match="no sealing key"):
            StoredForm(codec).unpack(packed.codec, packed.nonce, packed.tag, memoryview(stored),  # type: ignore[arg-type]
                                     memoryview(out), "alice", b"identity", bufs.area("plain"))
        # opened where it lies: the stored form and the payload's slot the same memory
        slot = bytearray(max(len(stored), len(data)))
        slot[:len(stored)] = stored
        view = memoryview(slot)
        form.unpack(packed.codec, packed.nonce, packed.tag, view[:len(stored)], view[:len(data)], "alice", b"identity",
                    bufs.area("plain"))
        assert bytes(slot[:len(data)]) == data


def test_stored_form_refuses_a_bad_margin() -> None:
    with pytest.raises(ValueError, match="margin"):
        StoredForm(PLANES_ZSTD, 1.0)
    with pytest.raises(ValueError, match="sealer"):
        StoredForm(None, 0.1, None, seal=True)


def test_a_saving_that_padding_gives_back_is_stored_raw() -> None:
    """4 KiB of KV codes to less in bytes, but not in whole pages: stored raw, no decode to pay."""
    data = kv_like(4096, 6)
    assert PLANES_ZSTD.encode(memoryview(data), 0.1) is not None
    paged = StoredForm(PLANES_ZSTD, 0.1, granule=4096)
    assert paged.pack(memoryview(data), "", b"id", bytearray) is None
    assert StoredForm(PLANES_ZSTD, 0.1).pack(memoryview(data), "", b"id", bytearray) is not None


def test_turning_sealing_off_still_opens_what_was_sealed() -> None:
    data = kv_like(65536, 7)
    sealer = Sealer(keys_of)
    area = bytearray(len(data))
    packed = StoredForm(None, 0.1, sealer, seal=True).pack(memoryview(data), "", b"id", lambda n: area)
    assert packed is not None and packed.nonce
    off = StoredForm(None, 0.1, sealer, seal=False)
    assert off.plain and off.pack(memoryview(data), "", b"id", bytearray) is None     # new blocks plain
    out = bytearray(len(data))
    off.unpack(packed.codec, packed.nonce, packed.tag, memoryview(area), memoryview(out), "", b"id", bytearray)
    assert bytes(out) == data


# -- the header ------------------------------------------------------------------------------------


def test_plain_blocks_keep_version_1_and_stored_ones_round_trip() -> None:
    plain = BlockHeader(b"\x01" * 32, 7, 12345, b"\x02" * 32, 5.0)
    assert plain.plain and plain.encode()[8] == 1 and plain.file_size == file_bytes(12345)
    coded = BlockHeader(b"\x01" * 32, 7, 12345, b"\x02" * 32, 5.0, PLANES_ZSTD.code, 6000, b"\x09" * 28, b"\x07" * 16)
    page = coded.encode()
    assert page[8] == 2 and BlockHeader.decode(page) == coded and not coded.plain
    assert coded.file_size == HEADER_BYTES + padded(6000)
    for offset in (96, 97, 104, 112, 127, 130, 143, 150, 159, 165):
        bad = bytearray(page)
        bad[offset] ^= 0x04
        with pytest.raises(HeaderError):
            BlockHeader.decode(bad)
    forged = BlockHeader(b"\x01" * 32, 7, 12345, b"\x02" * 32, 5.0, PLANES_ZSTD.code, 1 << 40)
    with pytest.raises(HeaderError, match="more than the payload"):      # a forged size never sizes a read
        BlockHeader.decode(forged.encode())


# -- real block files ------------------------------------------------------------------------------


@pytest.fixture
def source() -> Iterator[memoryview]:
    m = mmap.mmap(-1, 8 << 20)
    view = memoryview(m)
    yield view
    gc.collect()
    view.release()
    m.close()


def _writes(source: memoryview, sizes: list[int], tenant: str = "") -> list[SsdWrite]:
    out = []
    for i, n in enumerate(sizes):
        data = kv_like(n, 10 + i) if i % 3 else os.urandom(n)       # some blocks no codec can shrink
        off = i << 20
        source[off:off + n] = data
        header = BlockHeader(blake3.blake3(b"d%d" % i).digest(), i, n, blake3.blake3(data).digest(), 1.5)
        out.append(SsdWrite(blake3.blake3(b"k%d" % i).digest(), header, source[off:off + n], tenant))
    return out


SIZES = [2, 4094, 4096, 4098, 65536, 100_000, 1 << 20]


def _tier(path: Path, form: StoredForm, direct: str = "auto") -> SsdTier:
    tier = SsdTier(str(path), 1 << 30, durability="batch", direct_io=direct, threads=4, form=form)  # type: ignore[arg-type]
    tier.open()
    return tier


def _read_all(tier: SsdTier, ws: list[SsdWrite], tenant: str) -> list[tuple[object, bytes]]:
    async def go() -> list[tuple[object, bytes]]:
        out = []
        for w in ws:
            m = mmap.mmap(-1, max(PAGE, padded(w.header.length)))
            view = memoryview(m)
            problem = await tier.read_into(w.key, w.header, view, tenant)
            out.append((problem, bytes(m[:w.header.length])))
            view.release()
            m.close()
        return out
    return asyncio.run(go())


@pytest.mark.parametrize("direct", ["auto", "off"])
@pytest.mark.parametrize("sealed", [False, True])
def test_coded_and_sealed_files_read_back_exact_and_count_their_own_size(tmp_path: Path, source: memoryview,
                                                                        direct: str, sealed: bool) -> None:
    sealer = Sealer(keys_of) if sealed else None
    tier = _tier(tmp_path / "ssd", StoredForm(PLANES_ZSTD, 0.1, sealer), direct)
    ws = _writes(source, SIZES, "alice")

    async def write() -> list[object]:
        try:
            return await tier.write_many(ws)      # type: ignore[return-value]
        finally:
            await tier.close()
    assert asyncio.run(write()) == [None] * len(ws)
    sizes = [os.path.getsize(tier.path_of(w.key, w.header.digest, w.header.layer)) for w in ws]
    assert tier.used_bytes == sum(sizes) and tier.payload_bytes == sum(SIZES)
    assert sum(sizes) < sum(file_bytes(n) for n in SIZES)         # the KV-like blocks shrank
    for i, w in enumerate(ws):       # what is on disk says how it is stored; a sealed file shows none of its bytes
        raw = Path(tier.path_of(w.key, w.header.digest, w.header.layer)).read_bytes()
        found = BlockHeader.decode(raw[:HEADER_BYTES])
        assert bool(found.nonce) == sealed
        if i % 3 == 0:         # random bytes: stored raw, and a seal adds nothing to the file
            assert found.codec == 0 and len(raw) == file_bytes(w.header.length)
        if sealed and w.header.length >= 64:
            assert bytes(w.payload[:64]) not in raw
    reader = _tier(tmp_path / "ssd", StoredForm(None, 0.1, sealer), direct)   # reads by the header, whatever its own codec
    for (problem, data), w in zip(_read_all(reader, ws, "alice"), ws):
        assert problem is None and data == bytes(w.payload)
    if sealed:
        for problem, _ in _read_all(reader, ws, "bob"):          # another tenant's key: refused, never served
            assert problem is not None and problem.fault is ReadFault.DAMAGED
        keyless = _tier(tmp_path / "ssd", StoredForm(PLANES_ZSTD), direct)
        for problem, _ in _read_all(keyless, ws, "alice"):
            assert problem is not None and "no sealing key" in problem

    async def remove() -> int:
        return await reader.remove_many([(w.key, w.header, "alice") for w in ws])
    assert asyncio.run(remove()) == len(ws)
    assert reader.used_bytes == 0 and reader.blocks == 0


@pytest.mark.parametrize("offset", [HEADER_BYTES + 3, HEADER_BYTES + 2000, -1])
def test_a_damaged_coded_or_sealed_file_is_refused(tmp_path: Path, source: memoryview, offset: int) -> None:
    for sealer in (None, Sealer(keys_of)):
        tier = _tier(tmp_path / f"ssd{sealer is None}", StoredForm(PLANES_ZSTD, 0.0, sealer))
        ws = _writes(source, [65536, 65536])[1:]           # a KV-like block: coded

        async def write() -> None:
            assert await tier.write_many(ws) == [None]
            await tier.close()
        asyncio.run(write())
        path = tier.path_of(ws[0].key, ws[0].header.digest, ws[0].header.layer)
        raw = bytearray(Path(path).read_bytes())
        stored = BlockHeader.decode(raw[:HEADER_BYTES]).stored_length
        at = offset if offset > 0 else HEADER_BYTES + stored - 1
        raw[at] ^= 0x40
        Path(path).write_bytes(raw)
        ((problem, _),) = _read_all(_tier(tmp_path / f"ssd{sealer is None}", tier.form), ws, "")
        assert problem is not None and problem.fault is ReadFault.DAMAGED


def test_truncated_coded_file_is_refused(tmp_path: Path, source: memoryview) -> None:
    tier = _tier(tmp_path / "ssd", StoredForm(PLANES_ZSTD, 0.0))
    ws = _writes(source, [65536, 65536])[1:]

    async def write() -> None:
        assert await tier.write_many(ws) == [None]
        await tier.close()
    asyncio.run(write())
    path = tier.path_of(ws[0].key, ws[0].header.digest, ws[0].header.layer)
    os.truncate(path, os.path.getsize(path) - PAGE)
    ((problem, _),) = _read_all(_tier(tmp_path / "ssd", tier.form), ws, "")
    assert problem is not None and "truncated" in problem


def test_boot_reconcile_adopts_coded_files_at_their_own_size(tmp_path: Path, source: memoryview) -> None:
    tier = _tier(tmp_path / "ssd", StoredForm(PLANES_ZSTD, 0.0, Sealer(keys_of)))
    ws = _writes(source, [65536, 100_000, 4096])
    ws = [SsdWrite(index_key(w.header.digest, w.header.layer), w.header, w.payload, "") for w in ws]

    async def write() -> None:
        assert await tier.write_many(ws) == [None] * 3
        await tier.close()
    asyncio.run(write())
    index = BlockIndex(str(tmp_path / "index"))
    try:
        index.write(puts=[(w.key, BlockRecord(w.header.digest, w.header.layer, "m", w.header.length, w.header.checksum,
                                              1.0, 1.0, Tier.SSD)) for w in ws])
        fresh = _tier(tmp_path / "ssd", StoredForm())
        report = reconcile_ssd(index, fresh)
        assert report.adopted == 3 and report.bad_files == 0 and report.orphans == 0
        files = sum(os.path.getsize(fresh.path_of(w.key, w.header.digest, w.header.layer)) for w in ws)
        assert report.adopted_file_bytes == files and report.on_ssd_file_bytes == files
    finally:
        index.close()


class _FailsOnZeros:
    """planes-zstd, except that it fails (as a bug in a codec would) on a block of zeros."""

    name, code = "test-fails", PLANES_ZSTD.code

    def encode(self, payload: memoryview, margin: float) -> bytes | None:
        if not any(payload[:64]):
            raise RuntimeError("codec bug")
        return PLANES_ZSTD.encode(payload, margin)

    def decode(self, stored: memoryview, out: memoryview) -> None:
        PLANES_ZSTD.decode(stored, out)


def test_a_block_whose_coding_fails_fails_alone(tmp_path: Path, source: memoryview) -> None:
    tier = _tier(tmp_path / "ssd", StoredForm(_FailsOnZeros(), 0.1))       # type: ignore[arg-type]
    ws = _writes(source, [65536, 65536, 65536])
    source[(1 << 20):(1 << 20) + 65536] = bytes(65536)                    # block 1: zeros
    ws[1] = SsdWrite(ws[1].key, BlockHeader(ws[1].header.digest, 1, 65536, blake3.blake3(bytes(65536)).digest(), 1.5),
                     ws[1].payload)

    async def write() -> list[object]:
        try:
            return await tier.write_many(ws)      # type: ignore[return-value]
        finally:
            await tier.close()
    results = asyncio.run(write())
    assert results[0] is None and results[2] is None and "codec bug" in str(results[1])
    assert tier.blocks == 2 and tier.counters.write_errors == 1 and tier.counters.coded == 1
    assert not [p for p in (tmp_path / "ssd" / "blocks").rglob("*") if ".tmp-" in p.name]
    for w in ws:           # the logged traceback holds the failed write's frames, and so its view
        w.payload.release()
