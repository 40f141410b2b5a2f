"""The daemon's KV event stream without I/O: tier changes become vLLM-schema events
(:class:`EventMaker`), events become numbered batches kept for replay (:class:`EventLog`), and
sequence numbers survive restarts (:class:`SequenceLease`). Answering replay requests from the
log is kvcached.events.replay's; kvcached.events.publisher moves the bytes. Everything decided
is decided without I/O, with the clock passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import msgspec

from kvcached.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent, encode_batch
from kvcached.index.format import DIGEST_AT, LAYER_AT, Tier, split_tail
from kvcached.index.presence import TierChange
from kvcached_agent.route import RouteKey

__all__ = ["END_SEQ", "MAX_BATCH_BYTES", "EventLog", "EventMaker", "EventNaming", "SequenceLease"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_BYTES = 64 << 10      # a batch's payload, unless one event alone is larger
_RAM, _SSD = int(Tier.RAM), int(Tier.SSD)
DIGEST_MARK = "kvcached-digest"       # extra_keys of an event that names a block by kvcached's digest
_ROUTES = msgspec.msgpack.Decoder(list[RouteKey])


@dataclass(frozen=True, slots=True)
class EventNaming:
    """How this daemon's events name where a block is: ``media`` per tier (vLLM's ``medium``),
    ``ownership`` (vLLM's secondary-tier identifier: this daemon and node), ``locality``, and the
    ``topic`` (``{node}`` and ``{model}`` filled in: llm-d reads ``kv@<pod>@<model>``)."""

    ram_medium: str = "CPU"
    ssd_medium: str = "STORAGE"
    ownership: str = "kvcached"
    locality: str = "LOCAL"
    topic: str = "kv@{node}@{model}"
    node: str = ""

    def medium(self, tier: Tier) -> str:
        return self.ram_medium if tier == Tier.RAM else self.ssd_medium

    def topic_of(self, model: str) -> str:
        return self.topic.format(node=self.node, model=model)


class EventMaker:
    """Makes the events of the index's tier changes, grouped by topic, in the order the changes
    came: for each change, RAM's first, a BlockStored per engine group for each tier gained and a
    BlockRemoved for each tier lost. Each block's keys come from its record
    (kvcached.index.format.split_tail): the feed hands the record over, so nothing is read
    again. A block whose record carries none (the agent gave none, or it came from a peer or the
    gRPC API) is named by its kvcached digest, marked so in ``extra_keys``. Consecutive events that a vLLM engine would
    have sent as one are sent as one: removals of the same tier, and stores of the same tier
    whose blocks chain (each block's parent is the previous block's last hash, as a request's
    pages do), their hashes and tokens joined. Order is kept where it matters: an event only
    ever joins the one just before it in its topic. Tier sets are plain ints (this runs for every
    change: IntFlag arithmetic cost more than the rest)."""

    MAX_TOPICS = 1024          # models named by agents; the topic cache starts over past this

    def __init__(self, naming: EventNaming) -> None:
        self.naming = naming
        self._topics: dict[bytes, str] = {}

    def events(self, changes: Iterable[TierChange]) -> dict[str, list[KVCacheEvent]]:
        by_topic: dict[str, list[KVCacheEvent]] = {}
        naming = self.naming
        ram, ssd = naming.ram_medium, naming.ssd_medium
        topics = self._topics
        decode = _ROUTES.decode
        for record, before, after in changes:       # every change of every block: kept inline
            keys: list[RouteKey] | None = None
            model, route = split_tail(record)
            if route:
                try:        # checked when they came in; a record damaged since is named by digest
                    keys = decode(route)
                except msgspec.DecodeError:
                    pass
            out = by_topic.get(topics.get(model) or self._new_topic(model))
            if out is None:
                out = by_topic[topics[model]] = []
            if not keys:
                keys = [_digest_key(record)]
            gained, lost = after & ~before, before & ~after
            if gained & _RAM:
                _add_stored(out, keys, ram, naming)
            elif lost & _RAM:
                _add_removed(out, keys, ram, naming)
            if gained & _SSD:
                _add_stored(out, keys, ssd, naming)
            elif lost & _SSD:
                _add_removed(out, keys, ssd, naming)
        return by_topic

    def _new_topic(self, model: bytes) -> str:
        if len(self._topics) >= self.MAX_TOPICS:
            self._topics.clear()
        topic = self._topics[model] = self.naming.topic_of(model.decode("utf-8", "replace"))
        return topic


def _add_stored(out: list[KVCacheEvent], keys: list[RouteKey], medium: str, naming: EventNaming) -> None:
    """A BlockStored per key, or the key's hashes and tokens joined to the event before it
    where that event is a store on ``medium`` the key's block chains from."""
    for key in keys:
        last = out[-1] if out else None
        if (type(last) is BlockStored and key.parent_block_hash is not None and last.block_hashes
                and key.parent_block_hash == last.block_hashes[-1] and last.medium == medium
                and key.block_size and last.block_size == key.block_size and key.block_hashes
                and last.extra_keys is None and key.extra_keys is None and last.group_idx == key.group_idx
                and last.lora_id == key.lora_id and last.lora_name == key.lora_name
                and last.kv_cache_spec_kind == key.kv_cache_spec_kind
                and last.kv_cache_spec_sliding_window == key.kv_cache_spec_sliding_window):
            last.block_hashes.extend(key.block_hashes)
            last.token_ids.extend(key.token_ids)
            continue
        out.append(BlockStored(
            block_hashes=list(key.block_hashes), parent_block_hash=key.parent_block_hash, token_ids=list(key.token_ids),
            block_size=key.block_size, lora_id=key.lora_id, medium=medium, lora_name=key.lora_name,
            extra_keys=key.extra_keys, group_idx=key.group_idx, kv_cache_spec_kind=key.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=key.kv_cache_spec_sliding_window, locality=naming.locality,
            ownership=naming.ownership))


def _add_removed(out: list[KVCacheEvent], keys: list[RouteKey], medium: str, naming: EventNaming) -> None:
    """A BlockRemoved per key, or the key's hashes joined to the event before it where that
    event is a removal from ``medium`` in the key's group."""
    for key in keys:
        last = out[-1] if out else None
        if type(last) is BlockRemoved and last.medium == medium and last.group_idx == key.group_idx:
            last.block_hashes.extend(key.block_hashes)
            continue
        out.append(BlockRemoved(block_hashes=list(key.block_hashes), medium=medium, group_idx=key.group_idx,
                                locality=naming.locality, ownership=naming.ownership))


def _digest_key(record: bytes) -> RouteKey:
    """A block named by its digest, as vLLM's OffloadingConnector names blocks it has no tokens
    of (no tokens, block size 0, no parent); the hash an integer (the digest's last 8 bytes, as
    vLLM makes integers of its hashes: Dynamo reads integers only), the whole digest and layer in
    ``extra_keys``."""
    digest = bytes(record[DIGEST_AT:DIGEST_AT + 32])
    layer = int.from_bytes(record[LAYER_AT:LAYER_AT + 4], "little")
    return RouteKey([int.from_bytes(digest[-8:], "big")], None, [], 0, extra_keys=[[DIGEST_MARK, digest.hex(), layer]])


def clear_event(naming: EventNaming, tier: Tier | None) -> AllBlocksCleared:
    """The clear of one tier (a daemon that starts without its RAM tier), or of all."""
    return AllBlocksCleared(medium=naming.medium(tier) if tier is not None else None)


class EventLog:
    """Numbers batches and keeps the last of them for replay: at most ``max_batches`` and
    ``max_bytes`` of payloads (the oldest go first; :attr:`on_drop` hears of each). A batch
    holds at most ``max_events`` events and, unless one event alone is larger, at most
    ``max_batch_bytes`` of payload (a longer list is split), so one message stays small
    whatever a tick gathered: a subscriber or replay client that stops reading holds a few
    small messages, never one the size of a tick."""

    def __init__(self, first_seq: int, *, max_batches: int, max_bytes: int, max_events: int = 1024,
                 max_batch_bytes: int = MAX_BATCH_BYTES, data_parallel_rank: int | None = None) -> None:
        self.next_seq = first_seq
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.max_batch_bytes = max_batch_bytes
        self.rank = data_parallel_rank
        self._kept: deque[tuple[int, bytes, bytes]] = deque()      # (seq, topic, payload), consecutive seqs
        self._kept_bytes = 0
        self.events = 0             # events numbered so far (this process)
        self.batches = 0
        #: Called with (seq, payload bytes) for each batch the log stops keeping.
        self.on_drop: Callable[[int, int], None] | None = None

    def add(self, topic: str, events: Sequence[KVCacheEvent], ts: float,
            take_seq: Callable[[], int] | None = None) -> list[tuple[bytes, bytes, bytes]]:
        """``events`` as numbered batches ``(topic, seq as 8 bytes big-endian, payload)``, kept
        for replay. ``take_seq`` hands out sequence numbers (a :class:`SequenceLease`'s, which
        persists them); without it they count from ``first_seq``."""
        out = []
        topic_bytes = topic.encode()
        for start in range(0, len(events), self.max_events):
            for part, payload in self._encoded(list(events[start:start + self.max_events]), ts):
                seq = take_seq() if take_seq is not None else self.next_seq
                self.next_seq = seq + 1
                self._keep(seq, topic_bytes, payload)
                out.append((topic_bytes, seq.to_bytes(8, "big"), payload))
                self.events += len(part)
                self.batches += 1
        return out

    def _encoded(self, part: list[KVCacheEvent], ts: float) -> list[tuple[list[KVCacheEvent], bytes]]:
        """``part`` encoded, halved until each payload fits ``max_batch_bytes`` (one encoding
        when it fits, as nearly every tick's does)."""
        payload = encode_batch(EventBatch(ts, part, self.rank))
        if len(payload) <= self.max_batch_bytes or len(part) == 1:
            return [(part, payload)]
        half = len(part) // 2
        return self._encoded(part[:half], ts) + self._encoded(part[half:], ts)

    def _keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        kept = self._kept
        kept.append((seq, topic, payload))
        self._kept_bytes += len(payload) + len(topic)
        while kept and (len(kept) > self.max_batches or self._kept_bytes > self.max_bytes):
            old_seq, old_topic, old = kept.popleft()
            self._kept_bytes -= len(old) + len(old_topic)
            if self.on_drop is not None:
                self.on_drop(old_seq, len(old) + len(old_topic))

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def oldest_kept(self) -> int | None:
        return self._kept[0][0] if self._kept else None

    def batch(self, seq: int) -> tuple[bytes, bytes] | None:
        """(topic, payload) of batch ``seq`` while it is kept, else None."""
        kept = self._kept
        if not kept or not kept[0][0] <= seq <= kept[-1][0]:
            return None
        _, topic, payload = kept[seq - kept[0][0]]
        return topic, payload


class SequenceLease:
    """Sequence numbers that never go backwards across restarts: before a number past the last
    one persisted is handed out, a ceiling ``lease`` further is persisted (``persist``); a daemon
    that starts again begins at the ceiling it finds, so a crash skips at most ``lease`` numbers
    and repeats none. A clean stop persists the next number itself, so an upgrade continues with
    no gap."""

    def __init__(self, stored: int, persist: Callable[[int], None], lease: int = 1 << 16) -> None:
        self.next = stored
        self.lease = lease
        self._persist = persist
        self._ceiling = stored

    def take(self) -> int:
        seq = self.next
        if seq >= self._ceiling:
            self._ceiling = seq + self.lease
            self._persist(self._ceiling)
        self.next = seq + 1
        return seq

    def close(self) -> None:
        """A clean stop: the next number is the one to start from."""
        self._persist(self.next)
        self._ceiling = self.next
