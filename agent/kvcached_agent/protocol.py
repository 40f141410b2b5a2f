"""The agent protocol: frames between an engine-side agent and its node's daemon (sans-I/O).

Plain classes, no sockets: :func:`encode` turns a message into bytes, :class:`FrameDecoder`
turns bytes into frames, :func:`decode` turns a frame into a message. Both ends (the daemon's
asyncio endpoint and the agent's blocking client) use this one module, so they cannot disagree;
docs/agent-protocol.md specifies the same bytes, and the unit tests pin them byte for byte.

Every frame is a 12-byte header then a body::

    u32 body length | u8 version | u8 type | u16 flags (0) | u32 request id

little-endian: the framing shared with the peer protocol (kvcached_agent.framing). Limits (body
length, entries per batch, text length) are checked before anything is allocated. A header that
is wrong (version, flags, length) loses the framing: the receiver answers an Error frame and
closes. A body that is wrong, or a type it does not know,
loses only that request: an Error frame answers it and the connection goes on.

Block bytes never travel in frames: they live in the daemon's shared arena, which the Welcome
frame hands over as a file descriptor (SCM_RIGHTS); frames carry addresses, slot offsets and
handles only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Protocol, Sequence, Union

from kvcached_agent.codes import (
    _U16,
    _U32,
    DIGEST,
    LIMITS,
    MAX_BATCH,
    MAX_BODY,
    MAX_TEXT,
    VERSION,
    ErrorCode,
    Status,
    _batch,
    _digests_body,
    _entries,
    _read_digests,
    _read_entries,
    _text,
)
from kvcached_agent.framing import HEADER, BodyReader, Frame, ProtocolError, header_problem
from kvcached_agent.framing import frame as frame_bytes
from kvcached_agent.replies import (
    HELD_GPU,
    HELD_PEER,
    HELD_RAM,
    HELD_SSD,
    AgentPrefix,
    Committed,
    Error,
    FeatureSet,
    Loaded,
    LoadPlan,
    LookupResult,
    OverlapResult,
    PresentResult,
    Released,
    Slots,
    Welcome,
)

__all__ = [
    "VERSION", "HEADER", "MAX_BODY", "MAX_BATCH", "MAX_RECOMPUTE_S", "MAX_TEXT", "is_recompute_s", "ErrorCode", "Status",
    "ProtocolError", "Frame",
    "FrameDecoder", "encode", "decode", "Message",
    "Hello", "Allocate", "Commit", "Lookup", "Present", "PlanLoads", "Load", "Release", "Overlap", "Pinned", "Evicted",
    "Heartbeat", "Route", "Features", "FeatureSet", "Welcome", "Slots", "Committed", "LookupResult", "PresentResult",
    "LoadPlan", "Loaded", "Released",
    "OverlapResult", "AgentPrefix", "Error", "HELD_GPU", "HELD_RAM", "HELD_SSD", "HELD_PEER",
]

# -- requests (agent -> daemon) --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello:
    """First frame of a connection: who the agent is and the shape of its blocks."""

    TYPE: ClassVar[int] = 0x01
    agent_id: str
    model: str
    dtype: str
    block_tokens: int
    num_layers: int
    layer_block_bytes: int          # bytes of one block of one layer (a cross-layer block: times num_layers)
    namespace: bytes = b""
    version: int = VERSION
    FIXED: ClassVar[struct.Struct] = struct.Struct("<IIQ")

    def encode_body(self) -> bytes:
        return (_U16.pack(self.version) + _text(self.agent_id, "agent_id") + _text(self.model, "model")
                + _text(self.dtype, "dtype") + _text(self.namespace, "namespace")
                + self.FIXED.pack(self.block_tokens, self.num_layers, self.layer_block_bytes))

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Hello":
        version = r.u16()
        agent_id, model, dtype = r.text("agent_id"), r.text("model"), r.text("dtype")
        namespace = r.raw("namespace")
        block_tokens, num_layers, layer_block_bytes = r.unpack(cls.FIXED)
        return cls(agent_id, model, dtype, block_tokens, num_layers, layer_block_bytes, namespace, version)


@dataclass(frozen=True, slots=True)
class Allocate:
    """Reserve arena slots for blocks the agent is about to write: (digest, layer, length)."""

    TYPE: ClassVar[int] = 0x02
    entries: Sequence[tuple[bytes, int, int]]
    _ENTRY: ClassVar[struct.Struct] = struct.Struct("<32sII")

    def encode_body(self) -> bytes:
        for digest, _, _ in self.entries:
            if len(digest) != DIGEST:
                raise ValueError(f"Allocate: a digest is {len(digest)} bytes, not {DIGEST}")
        return _entries(self._ENTRY, self.entries, "Allocate")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Allocate":
        return cls(_read_entries(r, cls._ENTRY))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Handles:
    handles: Sequence[int]

    def encode_body(self) -> bytes:
        return _batch(len(self.handles), type(self).__name__) + struct.pack(f"<{len(self.handles)}Q", *self.handles)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "_Handles":
        n = r.count(8)
        out = list(struct.unpack_from(f"<{n}Q", r.body, r.pos))
        r.pos += 8 * n
        return cls(out)


@dataclass(frozen=True, slots=True)
class Commit(_Handles):
    """The slots of these handles hold their blocks now: record them (the daemon checksums them)."""

    TYPE: ClassVar[int] = 0x03


@dataclass(frozen=True, slots=True)
class Release(_Handles):
    """Done with these handles: unpin loaded blocks; give back slots allocated but not committed."""

    TYPE: ClassVar[int] = 0x06


@dataclass(frozen=True, slots=True)
class _LayerDigests:
    layer: int
    digests: Sequence[bytes]

    def encode_body(self) -> bytes:
        return _U32.pack(self.layer) + _digests_body(self.digests, type(self).__name__)

    @classmethod
    def decode_body(cls, r: BodyReader) -> Any:
        layer = r.u32()
        return cls(layer, _read_digests(r))


@dataclass(frozen=True, slots=True)
class Lookup(_LayerDigests):
    """Longest prefix of a chain held per tier (this agent's GPU, RAM, SSD, peers)."""

    TYPE: ClassVar[int] = 0x04


@dataclass(frozen=True, slots=True)
class Present(_LayerDigests):
    """Which of these blocks are held, each on its own rather than as a chain's prefix: for
    blocks that only some positions have, such as a hybrid model's sliding-window blocks and
    state snapshots (kvcached_agent.engines.hybrid). Answered by PresentResult."""

    TYPE: ClassVar[int] = 0x08


@dataclass(frozen=True, slots=True)
class PlanLoads:
    """Of a chain, how many blocks are worth loading rather than recomputing (issue 42, "loads
    that pay"): recomputing a block costs ``recompute_s`` (its tokens over the engine's prefill
    rate) and a block is ``block_bytes``. Answered by LoadPlan. A daemon older than this
    request answers UNKNOWN_TYPE: then load what Lookup finds."""

    TYPE: ClassVar[int] = 0x09
    layer: int
    recompute_s: float
    block_bytes: int
    digests: Sequence[bytes]
    FIXED: ClassVar[struct.Struct] = struct.Struct("<IdQ")

    def encode_body(self) -> bytes:
        if not is_recompute_s(self.recompute_s) or self.block_bytes < 0:
            raise ValueError(f"PlanLoads: recompute_s {self.recompute_s} must be 0 to {MAX_RECOMPUTE_S:g} s and "
                             f"block_bytes {self.block_bytes} >= 0")
        return self.FIXED.pack(self.layer, self.recompute_s, self.block_bytes) + _digests_body(self.digests, "PlanLoads")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "PlanLoads":
        layer, recompute_s, block_bytes = r.unpack(cls.FIXED)
        if not is_recompute_s(recompute_s):
            raise ProtocolError(ErrorCode.MALFORMED, f"PlanLoads: recompute_s {recompute_s} is not a duration of 0 to "
                                f"{MAX_RECOMPUTE_S:g} s")
        return cls(layer, recompute_s, block_bytes, _read_digests(r))


MAX_RECOMPUTE_S = 3600.0     # one block's recompute: an hour is past any engine; more is a wrong unit


def is_recompute_s(value: float) -> bool:
    """A block's recompute time as PlanLoads takes it: 0 to MAX_RECOMPUTE_S seconds, and not
    -0.0 (a sign carried through a plan's sums; no engine measures a negative zero)."""
    return 0.0 <= value <= MAX_RECOMPUTE_S and math.copysign(1.0, value) > 0


@dataclass(frozen=True, slots=True)
class Load:
    """Make these blocks resident in the arena and pin them: (digest, layer)."""

    TYPE: ClassVar[int] = 0x05
    entries: Sequence[tuple[bytes, int]]
    _ENTRY: ClassVar[struct.Struct] = struct.Struct("<32sI")

    def encode_body(self) -> bytes:
        for digest, _ in self.entries:
            if len(digest) != DIGEST:
                raise ValueError(f"Load: a digest is {len(digest)} bytes, not {DIGEST}")
        return _entries(self._ENTRY, self.entries, "Load")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Load":
        return cls(_read_entries(r, cls._ENTRY))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Digests:
    digests: Sequence[bytes]

    def encode_body(self) -> bytes:
        return _digests_body(self.digests, type(self).__name__)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "_Digests":
        return cls(_read_digests(r))


@dataclass(frozen=True, slots=True)
class Overlap(_Digests):
    """How long a prefix of this chain each connected agent holds on its GPU."""

    TYPE: ClassVar[int] = 0x07


@dataclass(frozen=True, slots=True)
class Pinned(_Digests):
    """Event (no reply): these blocks are now resident on the agent's GPU."""

    TYPE: ClassVar[int] = 0x10


@dataclass(frozen=True, slots=True)
class Evicted(_Digests):
    """Event (no reply): these blocks left the agent's GPU."""

    TYPE: ClassVar[int] = 0x11


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Event (no reply): the agent is alive (sent when it has been idle for a while)."""

    TYPE: ClassVar[int] = 0x12

    def encode_body(self) -> bytes:
        return b""

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Heartbeat":
        return cls()


@dataclass(frozen=True, slots=True)
class Route:
    """Event (no reply): the engine's keys of blocks about to be saved (kvcached_agent.route), as
    (digest, layer, encoded route keys); sent before their Allocate, only to a daemon whose
    FeatureSet asks for them."""

    TYPE: ClassVar[int] = 0x13
    entries: Sequence[tuple[bytes, int, bytes]]
    _HEAD: ClassVar[struct.Struct] = struct.Struct("<32sII")

    def encode_body(self) -> bytes:
        parts = [_batch(len(self.entries), "Route")]
        for digest, layer, blob in self.entries:
            if len(digest) != DIGEST:
                raise ValueError(f"Route: a digest is {len(digest)} bytes, not {DIGEST}")
            parts.append(self._HEAD.pack(digest, layer, len(blob)))
            parts.append(blob)
        return b"".join(parts)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Route":
        n = r.u32()
        if n > MAX_BATCH or n * cls._HEAD.size > len(r.body) - r.pos:
            raise ProtocolError(ErrorCode.TOO_LARGE if n > MAX_BATCH else ErrorCode.MALFORMED,
                                f"Route: {n} entries do not fit its {len(r.body)} bytes or the limit of {MAX_BATCH}")
        entries = []
        for _ in range(n):
            digest, layer, size = r.unpack(cls._HEAD)
            entries.append((digest, layer, r.take(size)))
        return cls(entries)


@dataclass(frozen=True, slots=True)
class Features:
    """What the daemon wants of this agent beyond the base protocol (answered by FeatureSet; a
    daemon older than this request answers UNKNOWN_TYPE, which means none)."""

    TYPE: ClassVar[int] = 0x0A

    def encode_body(self) -> bytes:
        return b""

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Features":
        return cls()


Message = Union[Hello, Allocate, Commit, Lookup, Present, PlanLoads, Load, Release, Overlap, Pinned, Evicted, Heartbeat, Route,
                Features, FeatureSet, Welcome, Slots, Committed, LookupResult, PresentResult, LoadPlan, Loaded, Released,
                OverlapResult, Error]


class _Decodable(Protocol):
    """A message class as the decoder sees it: its type byte and how its body is read."""

    TYPE: ClassVar[int]

    @classmethod
    def decode_body(cls, r: BodyReader) -> Any: ...                  # a Message (subclasses return their own type)


MESSAGES: dict[int, type[_Decodable]] = {cls.TYPE: cls for cls in (
    Hello, Allocate, Commit, Lookup, Present, PlanLoads, Load, Release, Overlap, Pinned, Evicted, Heartbeat, Route, Features,
    FeatureSet, Welcome, Slots, Committed, LookupResult, PresentResult, LoadPlan, Loaded, Released, OverlapResult, Error)}
EVENTS = frozenset({Pinned.TYPE, Evicted.TYPE, Heartbeat.TYPE, Route.TYPE})   # requests that get no reply (unless an Error)


# -- framing ---------------------------------------------------------------------------------

def encode(message: Message, request_id: int = 0) -> bytes:
    """The frame of ``message``: header and body. ValueError if it breaks a limit."""
    return frame_bytes(LIMITS, message.TYPE, request_id, message.encode_body(), type(message).__name__)


_LOOKUP_HEAD = struct.Struct("<II")


def decode(frame: Frame) -> Message:
    """The message of ``frame``. ProtocolError (not fatal) for an unknown type or a bad body."""
    body = frame.body
    # Fast paths for the lookup round trip (the agent's hot path); anything unusual about
    # them falls through to the checked general path below, which says what is wrong.
    if frame.type == Lookup.TYPE and len(body) >= 8:
        layer, n = _LOOKUP_HEAD.unpack_from(body)
        if n <= MAX_BATCH and len(body) == 8 + n * DIGEST:
            return Lookup(layer, [body[i:i + DIGEST] for i in range(8, len(body), DIGEST)])
    elif frame.type == LookupResult.TYPE and len(body) == 20:
        return LookupResult(*LookupResult.FIXED.unpack(body))
    cls = MESSAGES.get(frame.type)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type 0x{frame.type:02x}")
    reader = BodyReader(frame.body, cls.__name__, LIMITS)
    message = cls.decode_body(reader)
    reader.end()
    return message


class FrameDecoder:
    """Cuts a byte stream into frames. Feed it what arrives; take the frames that are whole.

    A bad header raises a fatal ProtocolError (nothing after it can be trusted); the decoder
    then refuses further input. The body of a frame is never buffered past ``max_body``: the
    length is checked as soon as the header is in."""

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self.max_body = max_body
        self._buf = bytearray()
        self._broken: ProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken is None:
            self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def __iter__(self) -> Iterator[Frame]:
        return self

    def __next__(self) -> Frame:
        frame = self.next_frame()
        if frame is None:
            raise StopIteration
        return frame

    def next_frame(self) -> Frame | None:
        """The next whole frame, or None until more bytes arrive."""
        if self._broken is not None:
            raise self._broken
        buf = self._buf
        if len(buf) < HEADER.size:
            return None
        length, version, type_, flags, request_id = HEADER.unpack_from(buf)
        problem = header_problem(LIMITS, length, version, flags, request_id, self.max_body)
        if problem is not None:
            self._broken = problem
            self._buf = bytearray()
            raise problem
        end = HEADER.size + length
        if len(buf) < end:
            return None
        body = bytes(buf[HEADER.size:end])
        del buf[:end]
        return Frame(type_, request_id, body)
