"""Block addressing: BLAKE3-256 chained block digests and 32-byte index keys.

This module is the single definition of how kvcached names a KV block. The daemon imports it
from here, so an agent and a daemon (or two daemons on two nodes) can never disagree. The exact
byte encoding, with test vectors, is specified in docs/addressing.md; change neither without
the other.

- A *chain root* covers what makes KV bytes comparable: model, dtype, block size in tokens and
  an optional namespace (cache salt, tenant, tensor-parallel rank, ...).
- Block 0's digest covers the root and its tokens; block i's digest covers block i-1's digest
  and its tokens. Only full blocks are hashed: a trailing partial block has no address.
- A BlockAddress is (digest, layer). ``CROSS_LAYER`` names a block that holds every layer in
  one contiguous unit.
- The index key hashes the layer into the digest, so one 32-byte key names one stored block.

All hashing uses BLAKE3's key-derivation mode with a distinct context string per purpose
(domain separation), so a root can never collide with a block digest or an index key.
"""

from __future__ import annotations

import re
import struct
from array import array
from typing import Iterable, Sequence

import blake3

__all__ = [
    "index_key_of_wire",
    "CROSS_LAYER",
    "DIGEST_BYTES",
    "MAX_LAYER",
    "BlockAddress",
    "chain_root",
    "addresses",
    "chain_digests",
    "index_key",
]

DIGEST_BYTES = 32
#: Reserved layer value: the block holds all layers in one contiguous unit.
CROSS_LAYER = 0xFFFFFFFF
#: Largest ordinary layer number.
MAX_LAYER = CROSS_LAYER - 1
MAX_TOKEN = 0xFFFFFFFF

ROOT_CONTEXT = "kvcached 2026-11 chain root v1"
BLOCK_CONTEXT = "kvcached 2026-11 block digest v1"
KEY_CONTEXT = "kvcached 2026-11 index key v1"

_U32 = struct.Struct("<I")
# Key derivation from a context costs a hash of its own; hashers prepared once and copied per
# use give the same output faster (~1.4 us instead of ~2.2 us per key here).
_BLOCK_HASHER = blake3.blake3(derive_key_context=BLOCK_CONTEXT)
_KEY_HASHER = blake3.blake3(derive_key_context=KEY_CONTEXT)
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_DECIMAL = re.compile(r"[0-9]{1,10}")


def _field(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return _U32.pack(len(raw)) + raw


def chain_root(model: str, dtype: str, block_tokens: int, namespace: str | bytes = b"") -> bytes:
    """The 32-byte root every chain of this (model, dtype, block size, namespace) starts from."""
    if not model:
        raise ValueError("model must not be empty")
    if not dtype:
        raise ValueError("dtype must not be empty")
    if not 0 < block_tokens <= MAX_TOKEN:
        raise ValueError(f"block_tokens must be in 1..{MAX_TOKEN}, got {block_tokens}")
    data = _field(model) + _field(dtype) + _U32.pack(block_tokens) + _field(namespace)
    return blake3.blake3(data, derive_key_context=ROOT_CONTEXT).digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in 0..{MAX_TOKEN}: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has another size
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if struct.pack("=I", 1) != _U32.pack(1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def chain_digests(
    tokens: Sequence[int],
    block_tokens: int,
    *,
    root: bytes | None = None,
    model: str = "",
    dtype: str = "",
    namespace: str | bytes = b"",
    parent: bytes | None = None,
) -> list[bytes]:
    """Digests of every full block of ``tokens``, in order.

    Give either ``root`` (from :func:`chain_root`) or ``model``/``dtype``/``namespace``. Give
    ``parent`` (the digest of the block before ``tokens[0]``) to continue an existing chain.
    A trailing partial block is not hashed.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 0 < block_tokens <= MAX_TOKEN:
        raise ValueError(f"block_tokens must be an integer in 1..{MAX_TOKEN}, got {block_tokens!r}")
    if parent is not None:
        prev = parent
    elif root is not None:
        prev = root
    else:
        prev = chain_root(model, dtype, block_tokens, namespace)
    if len(prev) != DIGEST_BYTES:
        raise ValueError(f"parent/root must be {DIGEST_BYTES} bytes, got {len(prev)}")
    raw = _tokens_bytes(tokens)
    step = block_tokens * 4
    out: list[bytes] = []
    for start in range(0, (len(tokens) // block_tokens) * step, step):
        hasher = _BLOCK_HASHER.copy()
        hasher.update(prev)
        hasher.update(raw[start:start + step])
        prev = hasher.digest()
        out.append(prev)
    return out


def index_key(digest: bytes, layer: int) -> bytes:
    """The 32-byte key under which the block (digest, layer) is stored."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    if not 0 <= layer <= CROSS_LAYER:
        raise ValueError(f"layer must be in 0..{CROSS_LAYER}, got {layer}")
    hasher = _KEY_HASHER.copy()
    hasher.update(digest + _U32.pack(layer))
    return hasher.digest()


def index_key_of_wire(wire: bytes) -> bytes:
    """The index key of a block from its 36-byte wire address (``digest | u32 layer``,
    little-endian, as the peer protocol writes it): the same bytes :func:`index_key` hashes,
    so no split and repack (the cluster's placement hashes one per block it places)."""
    if len(wire) != DIGEST_BYTES + 4:
        raise ValueError(f"a wire address is {DIGEST_BYTES + 4} bytes, got {len(wire)}")
    hasher = _KEY_HASHER.copy()
    hasher.update(wire)
    return hasher.digest()


class BlockAddress:
    """Where a KV block lives in the cache: its chained digest and its layer. Immutable; equal
    (and hashed) by digest and layer.

    Made for every block of every request an agent sends (a daemon answering eight engines makes
    hundreds of thousands a second), so it is a plain slotted class, not a frozen dataclass,
    whose init and checks cost more; most of what remains is the key's BLAKE3 call, which the
    daemon makes for a whole request at once (:meth:`with_key`)."""

    __slots__ = ("digest", "layer", "key")
    digest: bytes
    layer: int
    #: The 32-byte index key (layer hashed into the digest), computed once.
    key: bytes

    def __init__(self, digest: bytes, layer: int = CROSS_LAYER) -> None:
        if type(digest) is not bytes or len(digest) != DIGEST_BYTES or type(layer) is not int \
                or not 0 <= layer <= CROSS_LAYER:
            _check_address(digest, layer)       # raises, but for subclasses of bytes and int
        hasher = _KEY_HASHER.copy()
        hasher.update(digest + _U32.pack(layer))
        init = object.__setattr__
        init(self, "digest", digest)
        init(self, "layer", layer)
        init(self, "key", hasher.digest())

    @classmethod
    def with_key(cls, digest: bytes, layer: int, key: bytes) -> BlockAddress:
        """The address of (``digest``, ``layer``) whose index key the caller has computed by
        the same derivation (:func:`index_key`): the daemon hashes a whole request's keys in one
        call (kvcached.host.short_hash). The digest and layer are checked as by the
        constructor; the key is taken as given (32 bytes)."""
        if type(digest) is not bytes or len(digest) != DIGEST_BYTES or type(layer) is not int \
                or not 0 <= layer <= CROSS_LAYER:
            _check_address(digest, layer)
        if len(key) != DIGEST_BYTES:
            raise ValueError(f"an index key is {DIGEST_BYTES} bytes, got {len(key)}")
        self = object.__new__(cls)
        init = object.__setattr__
        init(self, "digest", digest)
        init(self, "layer", layer)
        init(self, "key", key)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a BlockAddress cannot be changed (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a BlockAddress cannot be changed (tried to delete {name!r})")

    def __reduce__(self) -> tuple[type[BlockAddress], tuple[bytes, int]]:
        return BlockAddress, (self.digest, self.layer)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not BlockAddress:
            return NotImplemented
        assert isinstance(other, BlockAddress)
        return self.digest == other.digest and self.layer == other.layer

    def __hash__(self) -> int:
        return hash((self.digest, self.layer))

    def __repr__(self) -> str:
        return f"BlockAddress(digest={self.digest!r}, layer={self.layer!r})"

    @property
    def is_cross_layer(self) -> bool:
        return self.layer == CROSS_LAYER

    def __str__(self) -> str:
        layer = "x" if self.layer == CROSS_LAYER else str(self.layer)
        return f"{self.digest.hex()}:{layer}"

    @classmethod
    def parse(cls, text: str) -> "BlockAddress":
        """Parse ``HEX`` or ``HEX:LAYER`` (64 hex digits; LAYER decimal, or ``x`` for cross-layer)."""
        hexpart, colon, layer = text.strip().partition(":")
        if not _HEX64.fullmatch(hexpart):
            raise ValueError(f"expected {2 * DIGEST_BYTES} hex digits, got {hexpart!r}")
        digest = bytes.fromhex(hexpart)
        if not colon or layer in ("x", "X"):
            return cls(digest)
        if not _DECIMAL.fullmatch(layer):
            raise ValueError(f"layer must be a decimal number or 'x', got {layer!r}")
        return cls(digest, int(layer))


def _check_address(digest: object, layer: object) -> None:
    """Raise ValueError for what cannot be a block address (a subclass of bytes or int that is
    one passes)."""
    if not isinstance(digest, bytes):
        raise ValueError(f"digest must be bytes, got {type(digest).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"layer must be an integer, got {layer!r}")
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    if not 0 <= layer <= CROSS_LAYER:
        raise ValueError(f"layer must be in 0..{CROSS_LAYER}, got {layer}")


def addresses(digests: Iterable[bytes], layer: int = CROSS_LAYER) -> list[BlockAddress]:
    """The addresses of ``digests`` at one layer."""
    return [BlockAddress(d, layer) for d in digests]
