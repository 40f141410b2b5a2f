"""The daemon's KV event stream without I/O: tier changes become vLLM-schema events
(:class:`EventMaker`), events become numbered batches kept for replay (:class:`EventLog`), and
sequence numbers survive restarts (:class:`SequenceLease`). kvcached.events.publisher moves the
bytes; everything it decides is decided here, with the clock passed in.

Replay follows vLLM's ``ZmqEventPublisher``: a request is one frame, the first sequence number
wanted as 8 bytes big-endian; the answer is every batch kept from there, each as ``(topic, seq,
payload)``, then the end marker ``(b"", -1 as 8 signed bytes, b"")``. kvcached puts a reason in
the end marker's payload (vLLM's is empty and its subscribers ignore it) when the request was
malformed or asked for batches that are not kept.
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

__all__ = ["END_SEQ", "EventLog", "EventMaker", "EventNaming", "Replay", "SequenceLease"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
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


@dataclass(slots=True)
class Replay:
    """What one replay request gets: ``frames`` to send to its client, in order (each a
    multipart message after the client's identity and the empty delimiter)."""

    frames: list[tuple[bytes, ...]]
    reason: str = ""          # why the request was not answered in full ("": it was)


class EventLog:
    """Numbers batches and keeps the last of them for replay: at most ``max_batches`` and
    ``max_bytes`` of payloads (the oldest go first). Batches hold at most ``max_events`` events
    (a longer list is split), so one message stays small whatever a tick gathered."""

    def __init__(self, first_seq: int, *, max_batches: int, max_bytes: int, max_events: int = 1024,
                 data_parallel_rank: int | None = None) -> None:
        self.next_seq = first_seq
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.rank = data_parallel_rank
        self._kept: deque[tuple[int, bytes, bytes]] = deque()      # (seq, topic, payload)
        self._kept_bytes = 0
        self.events = 0             # events numbered so far (this process)
        self.batches = 0

    def add(self, topic: str, events: Sequence[KVCacheEvent], ts: float,
            take_seq: Callable[[], int] | None = None) -> list[tuple[bytes, bytes, bytes]]:
        """``events`` as numbered batches ``(topic, seq as 8 bytes big-endian, payload)``, kept
        for replay. ``take_seq`` hands out sequence numbers (a :class:`SequenceLease`'s, which
        persists them); without it they count from ``first_seq``."""
        out = []
        topic_bytes = topic.encode()
        for start in range(0, len(events), self.max_events):
            part = list(events[start:start + self.max_events])
            payload = encode_batch(EventBatch(ts, part, self.rank))
            seq = take_seq() if take_seq is not None else self.next_seq
            self.next_seq = seq + 1
            self._keep(seq, topic_bytes, payload)
            out.append((topic_bytes, seq.to_bytes(8, "big"), payload))
            self.events += len(part)
            self.batches += 1
        return out

    def _keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        kept = self._kept
        kept.append((seq, topic, payload))
        self._kept_bytes += len(payload) + len(topic)
        while kept and (len(kept) > self.max_batches or self._kept_bytes > self.max_bytes):
            _, old_topic, old = kept.popleft()
            self._kept_bytes -= len(old) + len(old_topic)

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def oldest_kept(self) -> int | None:
        return self._kept[0][0] if self._kept else None

    def replay(self, request: Sequence[bytes], *, max_frames: int | None = None) -> Replay:
        """The answer to one replay request (the frames after the client's identity and the
        empty delimiter): the batches kept from the sequence number asked, then the end marker.
        A request that is not one 8-byte frame, or asks for what is not kept, is told so in the
        end marker's payload."""
        if len(request) != 1 or len(request[0]) != 8:
            reason = (f"malformed replay request: {len(request)} frames of {[len(f) for f in request][:4]} bytes; "
                      "send one frame, the first sequence number wanted as 8 bytes big-endian")
            return Replay([(b"", END_SEQ, reason.encode())], reason)
        start = int.from_bytes(request[0], "big", signed=True)
        frames: list[tuple[bytes, ...]] = []
        for seq, topic, payload in self._batches_from(start):
            if max_frames is not None and len(frames) >= max_frames:
                reason = f"cut after {max_frames} batches: ask again from {seq}"
                frames.append((b"", END_SEQ, reason.encode()))
                return Replay(frames, reason)
            frames.append((topic, seq.to_bytes(8, "big"), payload))
        oldest = self.oldest_kept
        reason = ""
        if start < 0:
            reason = f"sequence number {start} does not exist (they start at 0)"
        elif start > self.next_seq:
            reason = f"sequence number {start} is not published yet (the next is {self.next_seq})"
        elif start < (oldest if oldest is not None else self.next_seq):
            oldest = oldest if oldest is not None else self.next_seq      # none kept yet (a new process)
            reason = (f"batches {start}..{oldest - 1} are no longer kept (the oldest kept is {oldest}): "
                      "keep what you knew of this node and follow what comes next")
        frames.append((b"", END_SEQ, reason.encode()))
        return Replay(frames, reason)

    def _batches_from(self, start: int) -> Iterable[tuple[int, bytes, bytes]]:
        """The kept batches from ``start`` on (kept sequence numbers are consecutive: one
        process hands them out one by one)."""
        kept = self._kept
        if not kept or start > kept[-1][0]:
            return ()
        first = max(0, start - kept[0][0])
        return (kept[i] for i in range(first, len(kept)))


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
