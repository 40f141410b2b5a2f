"""Block addresses of a whole request in one call: the index keys' BLAKE3, compiled.

Every Allocate and Load an agent sends names its blocks by (digest, layer), and the daemon
stores them under the index key, a BLAKE3 of the two (kvcached_agent.address.index_key). Through
the blake3 package each key is a call of its own, most of it the call's overhead.
:func:`addresses` hashes a request's keys in one call of the daemon's C extension
(kvcached/host/_short_hash.c, built by ``make install``) and makes the addresses from them:
bench/bench_node.py prints what a 64-block request's addresses cost a block both ways, in the
same run (about 0.57x of one BlockAddress each here).

The extension is optional: where it was not built (no C compiler), :data:`COMPILED` is False
and the same keys come from the blake3 package (:func:`reference_index_keys`), which
tests/unit/test_short_hash.py checks the extension against on random inputs.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Sequence

from kvcached_agent.address import KEY_CONTEXT, BlockAddress

__all__ = ["COMPILED", "addresses", "index_keys", "reference_index_keys"]


def _compiled() -> ModuleType | None:
    try:
        return importlib.import_module("kvcached.host._short_hash")
    except ImportError:          # not built: the blake3 package does the same, slower
        return None


_short_hash = _compiled()
COMPILED = _short_hash is not None
_CONTEXT = KEY_CONTEXT.encode()


def reference_index_keys(digests: Sequence[bytes], layers: int | Sequence[int]) -> list[bytes]:
    """The index keys of ``digests`` at ``layers`` (one layer, or one per digest) as
    BlockAddress makes them (its checks, then the agent's index_key): the reference the
    compiled keys are checked against."""
    if isinstance(layers, int):
        layers = [layers] * len(digests)
    if len(layers) != len(digests):
        raise ValueError("as many layers as digests")
    return [BlockAddress(d, layer).key for d, layer in zip(digests, layers)]


def index_keys(digests: Sequence[bytes], layers: int | Sequence[int]) -> list[bytes]:
    """What :func:`reference_index_keys` gives, in one compiled call where the extension is
    built. ValueError for a digest that is not 32 bytes or a layer outside 0..2**32-1."""
    if _short_hash is None:
        return reference_index_keys(digests, layers)
    keys: list[bytes] = _short_hash.index_keys(_CONTEXT, digests, layers)
    return keys


def addresses(digests: Sequence[bytes], layers: Sequence[int]) -> list[BlockAddress]:
    """``BlockAddress(d, layer)`` of each pair, their keys hashed in one call."""
    keys = index_keys(digests, layers)
    known = BlockAddress.with_key
    return [known(d, layer, key) for d, layer, key in zip(digests, layers, keys)]
