"""kv.ssd_codec = "auto": coding where the read time it saves beats its decoding
(kvcached.codecs.choice), decided from measured rates, with hysteresis and sampling."""

from __future__ import annotations

import pytest

from kvcached.codecs import AUTO, CodecChoice, stored_form
from kvcached.codecs.choice import HYSTERESIS, SAMPLE_EVERY
from kvcached.codecs.planes import PLANES_ZSTD


def measured(io_per_byte: float, code_per_byte: float, ratio: float) -> CodecChoice:
    """A choice that measured the disk at ``io_per_byte`` both ways and the codec at
    ``code_per_byte`` both ways."""
    choice = CodecChoice()
    for _ in range(200):
        choice.read(1 << 20, io_per_byte * (1 << 20))
        choice.wrote(1 << 20, io_per_byte * (1 << 20))
        choice.decoded(1 << 20, code_per_byte * (1 << 20))
        choice.encoded(1 << 20, int((1 << 20) / ratio), code_per_byte * (1 << 20))
    return choice


def test_codes_until_measured() -> None:
    choice = CodecChoice()
    assert choice.saving_over_cost() is None and all(choice.code_next() for _ in range(100))


def test_a_tier_never_read_decides_by_its_writes() -> None:
    """No coded block read back yet: the write's terms alone decide (a write-heavy tier on a
    fast disk stops coding; on a slow one it keeps on)."""
    fast, slow = CodecChoice(), CodecChoice()
    for _ in range(200):
        fast.wrote(1 << 20, (1 << 20) / 6e9)
        slow.wrote(1 << 20, (1 << 20) / 0.1e9)
        for choice in (fast, slow):
            choice.encoded(1 << 20, int((1 << 20) / 1.46), (1 << 20) / 0.6e9)
    assert fast.decode_per_byte is None and fast.saving_over_cost() is not None
    fast.code_next()
    slow.code_next()
    assert not fast.coding and slow.coding


@pytest.mark.parametrize("disk_gbs, codec_gbs, ratio, pays", [
    (0.5, 1.5, 1.46, True),      # a slow disk: saving a third of 2 ms/MiB beats 0.7 ms/MiB of coding
    (6.0, 1.5, 1.46, False),     # a fast NVMe drive: the disk is cheaper than the codec
    (0.5, 1.5, 1.0, False),      # nothing shrinks: nothing saved
])
def test_decides_by_saving_against_cost(disk_gbs: float, codec_gbs: float, ratio: float, pays: bool) -> None:
    choice = measured(1 / (disk_gbs * 1e9), 1 / (codec_gbs * 1e9), ratio)
    decisions = [choice.code_next() for _ in range(SAMPLE_EVERY * 4)]
    if pays:
        assert all(decisions)
    else:       # one block in SAMPLE_EVERY still coded: the rates stay measured
        assert sum(decisions) == 4


def test_flips_only_past_the_hysteresis_and_comes_back_when_the_disk_slows() -> None:
    choice = measured(1 / 6e9, 1 / 1.5e9, 1.46)
    choice.code_next()
    assert not choice.coding
    # near break-even (saving/cost between 1/H and H): stays as it is
    decode = 1 / 1.5e9
    io_even = decode / (1 - 1 / 1.46)
    choice = measured(io_even, decode, 1.46)
    choice.coding = False
    choice.code_next()
    assert not choice.coding
    for _ in range(400):             # the disk gets slow: coding pays again
        choice.read(1 << 20, io_even * HYSTERESIS * 2 * (1 << 20))
        choice.wrote(1 << 20, io_even * HYSTERESIS * 2 * (1 << 20))
    choice.code_next()
    assert choice.coding


def test_auto_form_codes_and_reports_its_costs() -> None:
    form = stored_form(AUTO, 0.1, None)
    assert form.codec is PLANES_ZSTD and form.choice is not None
    import numpy as np
    values = (np.random.default_rng(0).standard_normal(1 << 15) * 0.5).astype(np.float32)
    data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    area = bytearray(len(data))
    packed = form.pack(memoryview(data), "", b"id", lambda n: area)
    assert packed is not None and form.choice.ratio is not None and form.choice.ratio > 1.25
    out = bytearray(len(data))
    form.unpack(packed.codec, packed.nonce, packed.tag, memoryview(area)[:packed.length], memoryview(out), "", b"id",
                bytearray)
    assert bytes(out) == data and form.choice.decode_per_byte is not None
    form.read(1 << 20, 0.001)
    form.wrote(1 << 20, 0.002)
    assert form.choice.read_per_byte is not None and form.choice.write_per_byte is not None
    assert form.choice.encode_per_byte is not None and form.choice.saving_over_cost() is not None
    with pytest.raises(KeyError):
        stored_form("zip", 0.1, None)
