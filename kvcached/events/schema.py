"""KV events in vLLM's schema (``vllm/distributed/kv_events.py``), field for field, so a consumer
written for vLLM's events (llm-d's KV-cache indexer, Dynamo's router) decodes kvcached's with no
change. No I/O.

A batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event a msgpack map tagged
with its class name (``"type": "BlockStored"``), fields at their defaults left out. The one
addition: :class:`AllBlocksCleared` may carry ``medium``, the tier it clears (vLLM's has no
fields; its decoder ignores ones it does not know).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent", "KVEventBatch",
           "encode_batch", "decode_batch"]

BlockHash = Union[bytes, int]        # vLLM's ExternalBlockHash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    medium: str | None = None        # kvcached: the tier cleared (None: every tier of this publisher)


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published batch read back (tests, the example subscriber); msgspec.DecodeError if not one."""
    return _DECODER.decode(payload)
