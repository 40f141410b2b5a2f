"""Route keys: what a block is called by the engine that computed it, so KV-aware routers can
match kvcached's blocks to the engine's own (docs/events.md).

Routers (llm-d's KV-cache indexer, Dynamo's router, vLLM's production stack) index vLLM's block
hashes and token ids, not kvcached's BLAKE3 digests. An agent that knows them passes, with each
block it saves, one :class:`RouteKey` per engine KV cache group the block holds; the daemon keeps
them beside the block's record and publishes them in its KV events (vLLM's ``BlockStored`` and
``BlockRemoved`` fields of the same names). The agent sends them only when the daemon publishes
events (``FeatureSet.ROUTE_KEYS``): otherwise they cost nothing.

Encoding: msgpack (msgspec), a list of RouteKey, each an array in field order. No I/O here.
Cost per block: about 40 bytes per engine block hash (bytes hashes), 1 to 5 bytes per token id,
and a few bytes of small fields (docs/events.md gives the sums).
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

__all__ = ["MAX_ROUTE_BYTES", "RouteKey", "decode_routes", "encode_routes"]

MAX_ROUTE_BYTES = 64 << 10      # the encoded keys of one block; more is refused


class RouteKey(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One engine group's name for a kvcached block: the fields of vLLM's ``BlockStored`` that
    say which block it is (the engine's pages of it, in order, and the page before them)."""

    block_hashes: list[bytes | int]          # the engine's hash of each of its pages in the block
    parent_block_hash: bytes | int | None    # the engine's hash of the page before (None: the first)
    token_ids: list[int]                     # the block's tokens
    block_size: int                          # tokens per engine page
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None      # per page, as vLLM publishes them
    group_idx: int | None = None             # the engine's KV cache group
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[RouteKey])


def encode_routes(keys: Sequence[RouteKey]) -> bytes:
    """The bytes of one block's route keys; ValueError past :data:`MAX_ROUTE_BYTES`."""
    blob = _ENCODER.encode(list(keys))
    if len(blob) > MAX_ROUTE_BYTES:
        raise ValueError(f"route keys of {len(blob)} bytes; at most {MAX_ROUTE_BYTES}")
    return blob


def decode_routes(blob: bytes) -> list[RouteKey]:
    """The route keys of one block; ValueError saying what is wrong for bytes that are not."""
    if len(blob) > MAX_ROUTE_BYTES:
        raise ValueError(f"route keys of {len(blob)} bytes; at most {MAX_ROUTE_BYTES}")
    try:
        keys = _DECODER.decode(blob)
    except msgspec.DecodeError as exc:
        raise ValueError(f"route keys do not decode: {exc}") from None
    for key in keys:
        if key.block_size <= 0 or not key.block_hashes:
            raise ValueError("route keys need a positive block_size and at least one block hash")
    return keys
