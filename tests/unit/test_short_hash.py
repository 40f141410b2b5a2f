"""The daemon's C extension (kvcached/host/_short_hash.c) against its Python reference, the
blake3 package, on random inputs; and the addresses it makes against BlockAddress's own."""

from __future__ import annotations

import random

import blake3
import pytest

from kvcached.host import short_hash
from kvcached_agent.address import CROSS_LAYER, KEY_CONTEXT, BlockAddress, index_key

compiled = pytest.importorskip("kvcached.host._short_hash", reason="the C extension is not built")


def test_make_install_built_the_extension() -> None:
    """setup.py marks the extension optional (a machine without a compiler still runs the
    daemon); this machine has gcc and Python's headers, so a build that failed quietly fails here."""
    assert short_hash.COMPILED


def test_blake3_of_every_mode_and_length_matches_the_package() -> None:
    rng = random.Random(63)
    for length in [0, 1, 31, 32, 33, 36, 63, 64, 65, 127, 128, 129, 512, 1000, 1023, 1024] + \
            [rng.randrange(1025) for _ in range(200)]:
        data = rng.randbytes(length)
        key = rng.randbytes(32)
        context = rng.randbytes(rng.randrange(200))
        assert compiled.hash(data) == blake3.blake3(data).digest()
        assert compiled.hash(data, key=key) == blake3.blake3(data, key=key).digest()
        # the package takes a context as str; the same bytes as UTF-8 give the same key
        text = context.decode("latin-1")
        assert compiled.hash(data, context=text.encode()) == blake3.blake3(data, derive_key_context=text).digest()


def test_index_keys_match_the_reference_at_one_and_many_layers() -> None:
    rng = random.Random(7)
    for n in (0, 1, 64, 1000):
        digests = [rng.randbytes(32) for _ in range(n)]
        layers = [rng.choice([0, 1, 31, rng.randrange(1 << 32), CROSS_LAYER]) for _ in range(n)]
        assert short_hash.index_keys(digests, layers) == short_hash.reference_index_keys(digests, layers)
        assert short_hash.index_keys(digests, 5) == [index_key(d, 5) for d in digests]
        assert compiled.index_keys(KEY_CONTEXT.encode(), digests, layers) == \
            [blake3.blake3(d + layer.to_bytes(4, "little"), derive_key_context=KEY_CONTEXT).digest()
             for d, layer in zip(digests, layers)]


def test_addresses_are_blockaddresses_with_the_same_keys() -> None:
    rng = random.Random(8)
    digests = [rng.randbytes(32) for _ in range(100)]
    layers = [rng.randrange(1 << 32) for _ in range(100)]
    made = short_hash.addresses(digests, layers)
    assert made == [BlockAddress(d, layer) for d, layer in zip(digests, layers)]
    assert [a.key for a in made] == [BlockAddress(d, layer).key for d, layer in zip(digests, layers)]


@pytest.mark.parametrize("digests, layers, what", [
    ([b"\x01" * 31], 0, "entry 0: a digest is 32 bytes"),
    ([b"\x01" * 32, b"\x01" * 33], [0, 0], "entry 1: a digest is 32 bytes"),
    ([bytearray(32)], 0, "entry 0: a digest is 32 bytes"),
    (["x" * 32], 0, "entry 0: a digest is 32 bytes"),
    ([b"\x01" * 32], -1, "layer must be in"),
    ([b"\x01" * 32], 1 << 32, "layer must be in"),
    ([b"\x01" * 32], [True], "entry 0: a layer is an integer"),
    ([b"\x01" * 32], True, "layer must be in"),
    ([b"\x01" * 32, b"\x02" * 32], [0, 1 << 40], "entry 1: layer must be in"),
    ([b"\x01" * 32], [0, 1], "as many layers as digests"),
])
def test_what_is_not_an_address_is_refused(digests: list, layers: object, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        compiled.index_keys(KEY_CONTEXT.encode(), digests, layers)
    with pytest.raises(ValueError):
        short_hash.reference_index_keys(digests, layers)  # type: ignore[arg-type]


def test_inputs_past_one_chunk_and_bad_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 1024"):
        compiled.hash(bytes(1025))
    with pytest.raises(ValueError, match="32 bytes"):
        compiled.hash(b"x", key=bytes(31))
    with pytest.raises(ValueError, match="not both"):
        compiled.hash(b"x", key=bytes(32), context=b"c")
    with pytest.raises(ValueError, match="at most 1024"):
        compiled.index_keys(bytes(1025), [bytes(32)], 0)
    with pytest.raises(TypeError):
        compiled.index_keys(KEY_CONTEXT.encode(), 5, 0)


def test_with_key_checks_what_the_constructor_checks() -> None:
    key = index_key(bytes(32), 3)
    assert BlockAddress.with_key(bytes(32), 3, key) == BlockAddress(bytes(32), 3)
    for digest, layer, k in ((bytes(31), 3, key), (bytes(32), -1, key), (bytes(32), True, key), (bytes(32), 3, b"k")):
        with pytest.raises(ValueError):
            BlockAddress.with_key(digest, layer, k)


def test_without_the_extension_the_same_keys_come_from_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where setup.py could not build it, short_hash falls back to the blake3 package."""
    rng = random.Random(9)
    digests = [rng.randbytes(32) for _ in range(50)]
    layers = [rng.randrange(1 << 32) for _ in range(50)]
    fast = short_hash.addresses(digests, layers)
    monkeypatch.setattr(short_hash, "_short_hash", None)
    assert short_hash.index_keys(digests, layers) == [a.key for a in fast]
    assert short_hash.addresses(digests, layers) == fast
    with pytest.raises(ValueError):
        short_hash.index_keys([bytes(31)], 0)
