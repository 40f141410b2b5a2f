"""Block addressing (kvcached_agent.address) against its specification, docs/addressing.md.

Three things are checked:

- the test vectors of docs/addressing.md section 10, hard-coded here as hex literals, against the
  library and against an independent re-implementation (``spec_*`` below). That
  re-implementation is written from the document with ``struct`` and ``blake3`` only, and uses
  nothing from the library;
- the chained-hash properties, the validation rules and the text form;
- that every vector hard-coded here appears verbatim in docs/addressing.md, so the document and
  the tests cannot drift apart.
"""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path

import blake3
import pytest

from kvcached_agent.address import (
    CROSS_LAYER,
    DIGEST_BYTES,
    MAX_LAYER,
    BlockAddress,
    chain_digests,
    chain_root,
    index_key,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "addressing.md"

# --------------------------------------------------------------------------------------------
# Independent re-implementation, written from docs/addressing.md (do not import the library's
# internals here: the point is that the two agree).
# --------------------------------------------------------------------------------------------

SPEC_ROOT_CONTEXT = "kvcached 2026-11 chain root v1"
SPEC_BLOCK_CONTEXT = "kvcached 2026-11 block digest v1"
SPEC_KEY_CONTEXT = "kvcached 2026-11 index key v1"
SPEC_CROSS_LAYER = 0xFFFFFFFF


def spec_u32(n: int) -> bytes:
    return struct.pack("<I", n)


def spec_field(s: str) -> bytes:
    b = s.encode("utf-8")
    return spec_u32(len(b)) + b


def spec_kdf(context: str, material: bytes) -> bytes:
    return blake3.blake3(material, derive_key_context=context).digest()


def spec_root_material(model: str, dtype: str, block_tokens: int, namespace: str = "") -> bytes:
    return spec_field(model) + spec_field(dtype) + spec_u32(block_tokens) + spec_field(namespace)


def spec_root(model: str, dtype: str, block_tokens: int, namespace: str = "") -> bytes:
    return spec_kdf(SPEC_ROOT_CONTEXT, spec_root_material(model, dtype, block_tokens, namespace))


def spec_block_material(prev: bytes, block: list[int]) -> bytes:
    return prev + b"".join(spec_u32(t) for t in block)


def spec_chain(prev: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    out = []
    for i in range(len(tokens) // block_tokens):
        prev = spec_kdf(SPEC_BLOCK_CONTEXT,
                        spec_block_material(prev, tokens[i * block_tokens:(i + 1) * block_tokens]))
        out.append(prev)
    return out


def spec_index_key(digest: bytes, layer: int) -> bytes:
    return spec_kdf(SPEC_KEY_CONTEXT, digest + spec_u32(layer))


# --------------------------------------------------------------------------------------------
# Test vectors (docs/addressing.md section 10)
# --------------------------------------------------------------------------------------------

MODEL = "meta-llama/Llama-3.1-8B"
DTYPE = "bfloat16"
BT = 16
TOKENS = list(range(48))
TOKENS_CHANGED = TOKENS[:20] + [0xFFFFFFFF] + TOKENS[21:]

# Official BLAKE3 derive_key vector (test_vectors.json, empty input): pins down the mode.
BLAKE3_TEST_CONTEXT = "BLAKE3 2019-12-27 16:29:52 test vectors context"
BLAKE3_DERIVE_KEY_EMPTY = "2cc39783c223154fea8dfb7c1b1660f2ac2dcbd1c1de8277b0b0dd39b7e50d7d"

# Vector 1: empty namespace, tokens 0..47
V1_ROOT_MATERIAL = (
    "170000006d6574612d6c6c616d612f4c6c616d612d332e312d3842"
    "0800000062666c6f61743136"
    "10000000"
    "00000000"
)
V1_ROOT = "b4753846c27f3cfc6a759f318bf3e62aa8d075f4f03b7dd8560719d417c5bde2"
V1_BLOCK0_MATERIAL = (
    "b4753846c27f3cfc6a759f318bf3e62aa8d075f4f03b7dd8560719d417c5bde2"
    "00000000010000000200000003000000040000000500000006000000070000000800000009000000"
    "0a0000000b0000000c0000000d0000000e0000000f000000"
)
V1_DIGESTS = [
    "4356b9aeb16b8dc204365cb9df0b512303a522db7748ba6326ac614dbcc5971f",
    "7df508bdcf0036a075bb341b728b7e0919685073b7f763d13192821d237c7bdc",
    "16faabe9b208ec2ca822fd553b836d27cfd82b3ce6140b7a3a4674ad00d48323",
]

# Vector 2: namespace "tenant-a/tp0", tokens 0..47
V2_NAMESPACE = "tenant-a/tp0"
V2_ROOT = "63fce29ea5c988a979110f3d341b96e658329ad44d18ee0a32debc0ff1c1539b"
V2_DIGESTS = [
    "cf0e597c62852b73bcd7fe01baa80926a3dfcdd37db0dfd8ca28d7826cb3d1f0",
    "7c87ceff6a8efbf19f0fbfb978439458c2d93b7c51361bc4c68c04308ceb4579",
    "5eb147df59aee24bd4950526bc56df3e0ebb08acee3856d93988ed843f0ce429",
]

# Vector 3: empty namespace, token 20 (block 1) replaced by 4294967295
V3_DIGESTS = [
    "4356b9aeb16b8dc204365cb9df0b512303a522db7748ba6326ac614dbcc5971f",
    "585b00c5e8da250c772ffd88ce77b5154e8b38ea3ce208eb4254abd185bc01ba",
    "dffdc5adc573b427c1ff85257e49f308a58dc9e7c6aad8902b1d107260fd90fb",
]

# Vector 4: other roots, as (model, dtype, block_tokens, namespace) -> root
V4_ROOTS = {
    (MODEL, DTYPE, 8, ""): "1eb80a36b79c9a5edb4c07d97a2873c76deda8acc0bfaabc57aa5dc7237b0c02",
    (MODEL, "float16", 16, ""): "881b75d5593b7f9073eadc6424a0b1827c9172beaf45df2da0e7811b4c1776c0",
    (MODEL, DTYPE, 16, "café"): "04f09439149fdd7576de9c8889b34640b950cf3bd546856de3d72d86fa0242bc",
}
V4_CAFE_ROOT_MATERIAL = (
    "170000006d6574612d6c6c616d612f4c6c616d612d332e312d3842"
    "0800000062666c6f61743136"
    "10000000"
    "05000000636166c3a9"
)

# Vector 5: index keys of V1 digest_0
V5_KEYS = {
    0: "9ca7c69a8bbfc0e45854c0bdbb753fe1b53688bdb69466dd24825b44bd882b14",
    31: "6850b0ee7fde2348dd73f28868c96e5ff2abff9896e43f85d95ac80d396bc87a",
    CROSS_LAYER: "6aa88350194e13330cd172219334dca95fc8ec44fb694258c5e05b1017e5900f",
}
V5_TEXT = {
    0: V1_DIGESTS[0] + ":0",
    31: V1_DIGESTS[0] + ":31",
    CROSS_LAYER: V1_DIGESTS[0] + ":x",
}

ALL_VECTORS = [
    BLAKE3_DERIVE_KEY_EMPTY, V1_ROOT_MATERIAL, V1_ROOT, V1_BLOCK0_MATERIAL, *V1_DIGESTS,
    V2_ROOT, *V2_DIGESTS, *V3_DIGESTS, *V4_ROOTS.values(), V4_CAFE_ROOT_MATERIAL,
    *V5_KEYS.values(), *V5_TEXT.values(),
]


def hexes(digests: list[bytes]) -> list[str]:
    return [d.hex() for d in digests]


# --- the vectors ------------------------------------------------------------------------------


def test_blake3_package_derive_key_matches_official_vector() -> None:
    assert spec_kdf(BLAKE3_TEST_CONTEXT, b"").hex() == BLAKE3_DERIVE_KEY_EMPTY


def test_vector1_encoding() -> None:
    assert spec_root_material(MODEL, DTYPE, BT).hex() == V1_ROOT_MATERIAL
    assert spec_block_material(bytes.fromhex(V1_ROOT), TOKENS[:16]).hex() == V1_BLOCK0_MATERIAL
    assert spec_root_material(MODEL, DTYPE, BT, "café").hex() == V4_CAFE_ROOT_MATERIAL


def test_vector1_library() -> None:
    assert chain_root(MODEL, DTYPE, BT).hex() == V1_ROOT
    assert hexes(chain_digests(TOKENS, BT, model=MODEL, dtype=DTYPE)) == V1_DIGESTS
    assert hexes(chain_digests(TOKENS, BT, root=bytes.fromhex(V1_ROOT))) == V1_DIGESTS


def test_vector1_spec() -> None:
    assert spec_kdf(SPEC_ROOT_CONTEXT, bytes.fromhex(V1_ROOT_MATERIAL)).hex() == V1_ROOT
    assert spec_kdf(SPEC_BLOCK_CONTEXT, bytes.fromhex(V1_BLOCK0_MATERIAL)).hex() == V1_DIGESTS[0]
    assert hexes(spec_chain(spec_root(MODEL, DTYPE, BT), TOKENS, BT)) == V1_DIGESTS


def test_vector2_namespace() -> None:
    assert chain_root(MODEL, DTYPE, BT, V2_NAMESPACE).hex() == V2_ROOT
    assert hexes(chain_digests(TOKENS, BT, model=MODEL, dtype=DTYPE, namespace=V2_NAMESPACE)) == V2_DIGESTS
    assert spec_root(MODEL, DTYPE, BT, V2_NAMESPACE).hex() == V2_ROOT
    assert hexes(spec_chain(bytes.fromhex(V2_ROOT), TOKENS, BT)) == V2_DIGESTS


def test_vector3_one_token_changed() -> None:
    assert hexes(chain_digests(TOKENS_CHANGED, BT, model=MODEL, dtype=DTYPE)) == V3_DIGESTS
    assert hexes(spec_chain(bytes.fromhex(V1_ROOT), TOKENS_CHANGED, BT)) == V3_DIGESTS
    assert V3_DIGESTS[0] == V1_DIGESTS[0]
    assert V3_DIGESTS[1] != V1_DIGESTS[1] and V3_DIGESTS[2] != V1_DIGESTS[2]


@pytest.mark.parametrize("params", list(V4_ROOTS))
def test_vector4_roots(params: tuple[str, str, int, str]) -> None:
    assert chain_root(*params).hex() == V4_ROOTS[params]
    assert spec_root(*params).hex() == V4_ROOTS[params]


@pytest.mark.parametrize("layer", list(V5_KEYS))
def test_vector5_index_keys(layer: int) -> None:
    digest = bytes.fromhex(V1_DIGESTS[0])
    assert index_key(digest, layer).hex() == V5_KEYS[layer]
    assert BlockAddress(digest, layer).key.hex() == V5_KEYS[layer]
    assert spec_index_key(digest, layer).hex() == V5_KEYS[layer]
    assert str(BlockAddress(digest, layer)) == V5_TEXT[layer]
    assert BlockAddress.parse(V5_TEXT[layer]) == BlockAddress(digest, layer)


def test_cli_hash_prints_vectors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcached.cli import main

    args = ["hash", "--model", MODEL, "--dtype", DTYPE, "--block-tokens", str(BT)]
    assert main([*args, *map(str, TOKENS)]) == 0
    assert capsys.readouterr().out.split() == V1_DIGESTS
    assert main([*args, "--namespace", V2_NAMESPACE, *map(str, TOKENS)]) == 0
    assert capsys.readouterr().out.split() == V2_DIGESTS


# --- document and tests cannot drift ------------------------------------------------------------


def test_doc_contains_every_vector() -> None:
    doc = DOC.read_text(encoding="utf-8")
    # Long materials may be wrapped differently in the doc; compare without whitespace.
    flat = re.sub(r"\s+", "", doc)
    missing = [v for v in ALL_VECTORS if v not in flat]
    assert not missing, f"vectors missing from {DOC}: {missing}"


def test_doc_has_no_untested_digest() -> None:
    doc = DOC.read_text(encoding="utf-8")
    in_doc = set(re.findall(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])", doc))
    tested = {v[:64] for v in ALL_VECTORS if len(v) >= 64}
    assert in_doc - tested == set()


def test_doc_states_the_context_strings() -> None:
    doc = DOC.read_text(encoding="utf-8")
    for context in (SPEC_ROOT_CONTEXT, SPEC_BLOCK_CONTEXT, SPEC_KEY_CONTEXT):
        assert f"`{context}`" in doc


# --- the re-implementation agrees with the library on random inputs ------------------------------


def _random_text(rng: random.Random, min_len: int) -> str:
    alphabet = "abcXYZ019-_/.:é✓漢𝄞 "
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, 12)))


def test_random_inputs_agree_with_spec() -> None:
    rng = random.Random(20261101)
    for _ in range(40):
        model, dtype = _random_text(rng, 1), _random_text(rng, 1)
        namespace = _random_text(rng, 0)
        bt = rng.choice([1, 2, 3, 7, 16, 32])
        n = rng.randint(0, 5 * bt + bt - 1)
        tokens = [rng.choice([0, 1, 0xFFFFFFFF, rng.randrange(2**32), rng.randrange(200_000)])
                  for _ in range(n)]
        root = chain_root(model, dtype, bt, namespace)
        assert root == spec_root(model, dtype, bt, namespace)
        want = spec_chain(root, tokens, bt)
        assert len(want) == n // bt
        assert chain_digests(tokens, bt, model=model, dtype=dtype, namespace=namespace) == want
        assert chain_digests(tokens, bt, root=root) == want
        for d in want[:2]:
            layer = rng.choice([0, 1, rng.randrange(MAX_LAYER + 1), MAX_LAYER, CROSS_LAYER])
            assert index_key(d, layer) == spec_index_key(d, layer)


# --- chained-hash properties --------------------------------------------------------------------

ROOT = chain_root(MODEL, DTYPE, 4)


def test_same_prefix_same_digests() -> None:
    a = chain_digests(list(range(12)) + [100, 101, 102, 103], 4, root=ROOT)
    b = chain_digests(list(range(12)) + [200, 201, 202, 203, 204, 205, 206, 207], 4, root=ROOT)
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    assert len(a) == 4 and len(b) == 5


@pytest.mark.parametrize("position", [0, 3, 4, 9, 15])
def test_one_token_changed_changes_that_block_and_later(position: int) -> None:
    tokens = list(range(16))
    changed = list(tokens)
    changed[position] += 1000
    a = chain_digests(tokens, 4, root=ROOT)
    b = chain_digests(changed, 4, root=ROOT)
    block = position // 4
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:]))


def test_blocks_with_equal_tokens_at_different_positions_differ() -> None:
    digests = chain_digests([7] * 12, 4, root=ROOT)
    assert len(set(digests)) == 3


def test_partial_trailing_block_not_hashed() -> None:
    full = chain_digests(list(range(8)), 4, root=ROOT)
    assert len(full) == 2
    for extra in ([8], [8, 9], [8, 9, 10]):
        assert chain_digests(list(range(8)) + extra, 4, root=ROOT) == full
    assert chain_digests([1, 2, 3], 4, root=ROOT) == []
    assert chain_digests([], 4, root=ROOT) == []


@pytest.mark.parametrize("split_blocks", [0, 1, 2, 3])
def test_parent_continues_the_chain(split_blocks: int) -> None:
    tokens = list(range(100, 114))  # 3 full blocks of 4, and 2 trailing tokens
    whole = chain_digests(tokens, 4, root=ROOT)
    head = chain_digests(tokens[:split_blocks * 4], 4, root=ROOT)
    parent = head[-1] if head else None
    tail = chain_digests(tokens[split_blocks * 4:], 4, root=ROOT, parent=parent)
    assert head + tail == whole
    # parent takes precedence over root/model
    if parent is not None:
        assert chain_digests(tokens[split_blocks * 4:], 4, parent=parent, model="other",
                             dtype="other") == tail


def test_root_changes_with_every_field() -> None:
    base = chain_root("m", "d", 4, "")
    variants = [
        chain_root("m2", "d", 4, ""),
        chain_root("m", "d2", 4, ""),
        chain_root("m", "d", 5, ""),
        chain_root("m", "d", 4, "n"),
    ]
    assert len({base, *variants}) == 5
    digests = {r: chain_digests([1, 2, 3, 4], 4, root=r)[0] for r in (base, *variants)}
    assert len(set(digests.values())) == 5


def test_root_fields_are_length_prefixed() -> None:
    # Without length prefixes these would all hash "abc".
    assert len({chain_root("ab", "c", 4), chain_root("a", "bc", 4)}) == 2
    assert len({chain_root("m", "ab", 4, "c"), chain_root("m", "a", 4, "bc")}) == 2


def test_namespace_str_and_bytes_and_default() -> None:
    assert chain_root("m", "d", 4) == chain_root("m", "d", 4, "") == chain_root("m", "d", 4, b"")
    assert chain_root("m", "d", 4, "café") == chain_root("m", "d", 4, "café".encode())


def test_domain_separation() -> None:
    # With block_tokens=1 a block's material (digest || u32 token) has the same shape as an index
    # key's material (digest || u32 layer); the contexts must keep them apart.
    d = bytes.fromhex(V1_DIGESTS[0])
    assert chain_digests([31], 1, parent=d)[0] != index_key(d, 31)


# --- index keys and BlockAddress ----------------------------------------------------------------


def test_index_key_differs_per_layer() -> None:
    d = bytes.fromhex(V1_DIGESTS[1])
    layers = [0, 1, 2, 31, 80, MAX_LAYER, CROSS_LAYER]
    keys = [index_key(d, layer) for layer in layers]
    assert len(set(keys)) == len(layers)
    assert all(len(k) == DIGEST_BYTES for k in keys)
    assert keys == [spec_index_key(d, layer) for layer in layers]
    assert d not in keys
    assert index_key(bytes.fromhex(V1_DIGESTS[2]), 0) != keys[0]


def test_constants() -> None:
    assert DIGEST_BYTES == 32
    assert CROSS_LAYER == SPEC_CROSS_LAYER == 2**32 - 1
    assert MAX_LAYER == 2**32 - 2


def test_block_address_defaults_and_key() -> None:
    d = bytes.fromhex(V1_DIGESTS[0])
    a = BlockAddress(d)
    assert a.layer == CROSS_LAYER and a.is_cross_layer
    assert not BlockAddress(d, 0).is_cross_layer
    assert not BlockAddress(d, MAX_LAYER).is_cross_layer
    assert a.key == index_key(d, CROSS_LAYER)
    assert BlockAddress(d, 3) != BlockAddress(d, 4)
    assert len({BlockAddress(d, 3), BlockAddress(d, 3)}) == 1


def test_block_address_is_immutable_and_survives_copies() -> None:
    """A plain slotted class (it is made per block on the hot paths): frozen, pickled and
    copied as itself, equal by digest and layer only, and it takes subclasses of bytes and int
    as the dataclass it replaced did, refusing what that refused."""
    import copy
    import pickle

    class Digest(bytes):
        pass

    class Layer(int):
        pass

    d = bytes(range(32))
    a = BlockAddress(d, 7)
    for change in (lambda: setattr(a, "layer", 8), lambda: setattr(a, "key", b""), lambda: delattr(a, "digest")):
        with pytest.raises(AttributeError):
            change()
    for twin in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a), BlockAddress(Digest(d), Layer(7))):
        assert twin == a and hash(twin) == hash(a) and twin.key == a.key == index_key(d, 7)
    assert a != (d, 7) and a != BlockAddress(d, 8) and a != BlockAddress(bytes(32), 7)
    assert repr(a) == f"BlockAddress(digest={d!r}, layer=7)"
    for digest, layer in ((bytearray(d), 7), ("x" * 32, 7), (d, True), (d, 7.0), (d, "7")):
        with pytest.raises(ValueError):
            BlockAddress(digest, layer)     # type: ignore[arg-type]


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_block_address_rejects_digest_length(length: int) -> None:
    with pytest.raises(ValueError):
        BlockAddress(b"\x01" * length, 0)
    with pytest.raises(ValueError):
        index_key(b"\x01" * length, 0)


@pytest.mark.parametrize("layer", [-1, 2**32, 2**40])
def test_block_address_rejects_layer(layer: int) -> None:
    with pytest.raises(ValueError):
        BlockAddress(b"\x01" * 32, layer)
    with pytest.raises(ValueError):
        index_key(b"\x01" * 32, layer)


@pytest.mark.parametrize("layer", [0, 1, 31, 12345, MAX_LAYER, CROSS_LAYER])
def test_str_parse_round_trip(layer: int) -> None:
    a = BlockAddress(bytes(range(32)), layer)
    text = str(a)
    hexpart, _, layer_text = text.partition(":")
    assert hexpart == bytes(range(32)).hex()
    assert layer_text == ("x" if layer == CROSS_LAYER else str(layer))
    assert BlockAddress.parse(text) == a


def test_parse_accepted_forms() -> None:
    d = bytes.fromhex(V1_DIGESTS[0])
    h = V1_DIGESTS[0]
    cross = BlockAddress(d)
    for text in (h, h + ":x", h + ":X", h.upper() + ":x", f"  {h}:x\n", h + ":4294967295"):
        assert BlockAddress.parse(text) == cross, text
    assert BlockAddress.parse(h + ":7") == BlockAddress(d, 7)
    assert BlockAddress.parse(h + ":007") == BlockAddress(d, 7)
    assert BlockAddress.parse(h + ":4294967294") == BlockAddress(d, MAX_LAYER)


@pytest.mark.parametrize("text", [
    "",
    ":x",
    "zz" * 32,
    V1_DIGESTS[0][:-2],                 # 31 bytes
    V1_DIGESTS[0] + "00",               # 33 bytes
    V1_DIGESTS[0][:-1],                 # odd number of hex digits
    V1_DIGESTS[0] + ":-1",
    V1_DIGESTS[0] + ":+1",
    V1_DIGESTS[0] + ":1.0",
    V1_DIGESTS[0] + ":y",
    V1_DIGESTS[0] + ":1:2",
    V1_DIGESTS[0] + ":4294967296",
    V1_DIGESTS[0] + ":",                # empty layer
    V1_DIGESTS[0][:32] + " " + V1_DIGESTS[0][32:],   # whitespace inside the hex
    V1_DIGESTS[0] + ":\u0663",          # non-ASCII digit
])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        BlockAddress.parse(text)


# --- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [
    [-1],
    [1, 2, 3, -5],
    [2**32],
    [0, 2**32 + 7, 0, 0],
    [0, 1, 2, 3, 2**32],  # also in the partial trailing block
])
def test_bad_tokens(tokens: list[int]) -> None:
    with pytest.raises(ValueError):
        chain_digests(tokens, 4, model="m", dtype="d")
    with pytest.raises(ValueError):
        chain_digests(tokens, 4, root=ROOT)


@pytest.mark.parametrize("kwargs", [
    dict(model="", dtype="d", block_tokens=4),
    dict(model="m", dtype="", block_tokens=4),
    dict(model="m", dtype="d", block_tokens=0),
    dict(model="m", dtype="d", block_tokens=-1),
    dict(model="m", dtype="d", block_tokens=2**32),
])
def test_bad_root_inputs(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        chain_root(kwargs["model"], kwargs["dtype"], kwargs["block_tokens"])
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], kwargs["block_tokens"], model=kwargs["model"], dtype=kwargs["dtype"])


def test_chain_digests_without_model_is_rejected() -> None:
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], 4)


@pytest.mark.parametrize("length", [0, 31, 33])
def test_bad_root_or_parent_length(length: int) -> None:
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], 4, root=b"\x00" * length)
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], 4, parent=b"\x00" * length)


@pytest.mark.parametrize("block_tokens", [0, -4, True, 2.0])
def test_block_tokens_checked_with_root_or_parent(block_tokens) -> None:
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], block_tokens, root=ROOT)
    with pytest.raises(ValueError):
        chain_digests([1, 2, 3, 4], block_tokens, parent=ROOT)


@pytest.mark.parametrize("digest, layer", [("a" * 32, 0), (b"\0" * 32, True), (b"\0" * 32, 1.5)])
def test_block_address_rejects_wrong_types(digest, layer) -> None:
    with pytest.raises(ValueError):
        BlockAddress(digest, layer)


def test_the_index_key_of_a_wire_address_is_the_index_key() -> None:
    from kvcached_agent.address import index_key, index_key_of_wire

    digest = bytes(range(32))
    for layer in (0, 7, 0xFFFFFFFF):
        assert index_key_of_wire(digest + layer.to_bytes(4, "little")) == index_key(digest, layer)
    with pytest.raises(ValueError, match="36 bytes"):
        index_key_of_wire(digest)
