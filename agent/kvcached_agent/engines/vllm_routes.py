"""The engine's names of the blocks the vLLM connector saves and loads: route keys for KV events.

KV-aware routers index vLLM's block hashes and token ids (docs/events.md). The scheduler side
knows both for every block it plans: the request's ``block_hashes`` (one per vLLM page) and its
tokens. :class:`RouteBook` turns a planned save into :class:`~kvcached_agent.route.RouteKey`
entries and sends them to the daemon (a ``Route`` frame, before the workers' copies commit the
blocks) when the daemon publishes events, and keeps the stores and loads as events for vLLM's
own stream (``take_events``) when the engine publishes events. With neither, it does nothing.

It reads vLLM's objects by attribute only and imports nothing of vLLM: the connector passes
vLLM's hash conversion (``maybe_convert_block_hash``: integers by default, as the engine's
own events carry them).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvcached_agent.address import CROSS_LAYER
from kvcached_agent.engines.hybrid import GroupKind, kind_digests
from kvcached_agent.route import RouteKey, encode_routes

__all__ = ["RouteBook"]

MAX_ENGINE_EVENTS = 100_000     # stores and loads kept for vLLM's stream between two takes


class RouteBook:
    """``convert``: vLLM's conversion of a block hash for events; ``engine_events``: the engine
    publishes KV events (the connector's are added to them)."""

    def __init__(self, agent: Any, kinds: Sequence[GroupKind], roots: Sequence[bytes], *, block_tokens: int,
                 page_tokens: int, convert: Callable[[Any], Any] | None, engine_events: bool = False) -> None:
        self.agent = agent
        self.kinds = list(kinds)
        self.roots = list(roots)
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.per_block = block_tokens // page_tokens
        self.convert = convert
        self.engine_events = engine_events and convert is not None
        self._events: list[RouteKey] = []

    @property
    def active(self) -> bool:
        return self.convert is not None and (self.engine_events or bool(getattr(self.agent, "wants_routes", False)))

    def keys(self, request: Any, kind: int, position: int) -> list[RouteKey] | None:
        """One RouteKey per vLLM group of ``kind`` for its block at ``position``; None where the
        request's hashes are not one per page (another hash block size) or do not reach it."""
        hashes = getattr(request, "block_hashes", None)
        tokens = request.all_token_ids
        n = self.per_block
        first, end = position * n, (position + 1) * n
        if (self.convert is None or not hashes or len(hashes) < end
                or len(hashes) != len(tokens) // self.page_tokens):
            return None
        convert = self.convert
        page_hashes = [convert(h) for h in hashes[first:end]]
        parent = convert(hashes[first - 1]) if first > 0 else None
        block_tokens = list(tokens[position * self.block_tokens:(position + 1) * self.block_tokens])
        lora = getattr(request, "lora_request", None)
        group = self.kinds[kind]
        spec = None if group.kind == "full" else group.name
        return [RouteKey(page_hashes, parent, block_tokens, self.page_tokens,
                         lora_id=getattr(lora, "adapter_id", None) if lora else None,
                         lora_name=getattr(lora, "name", None) if lora else None,
                         group_idx=g, kv_cache_spec_kind=spec) for g in group.group_ids]

    def saved(self, request: Any, chain: Sequence[bytes], planned: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Blocks ``planned`` ((kind, positions) pairs) are about to be saved: tell the daemon
        their keys (it publishes them with the blocks), and keep them for the engine's stream."""
        if not self.active:
            return
        wants = bool(getattr(self.agent, "wants_routes", False))
        digests: list[bytes] = []
        blobs: list[bytes | None] = []
        for kind, positions in planned:
            keyed = [self.keys(request, kind, k) for k in positions]
            if wants:
                digests += kind_digests(self.roots[kind], self.kinds[kind], chain, positions)
                blobs += [encode_routes(keys) if keys else None for keys in keyed]
            if self.engine_events:
                self._keep([key for keys in keyed if keys for key in keys])
        if wants and any(blobs):
            self.agent.send_routes(self.agent.addresses(digests, CROSS_LAYER), blobs)

    def loaded(self, request: Any, planned: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Blocks ``planned`` are loaded from kvcached: events for the engine's stream only (the
        daemon knows its own blocks)."""
        if self.engine_events:
            self._keep([key for kind, positions in planned for k in positions
                        for key in (self.keys(request, kind, k) or ())])

    def _keep(self, keys: list[RouteKey]) -> None:
        room = MAX_ENGINE_EVENTS - len(self._events)
        self._events.extend(keys[:max(0, room)])

    def take(self) -> list[RouteKey]:
        """The stores and loads since the last take, for vLLM's event stream."""
        out, self._events = self._events, []
        return out
