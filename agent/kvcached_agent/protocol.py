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

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, Iterator, Protocol, Sequence, Union

from kvcached_agent.framing import HEADER, BodyReader, Frame, Limits, ProtocolError, count_field, header_problem, text_field
from kvcached_agent.framing import frame as frame_bytes

__all__ = [
    "VERSION", "HEADER", "MAX_BODY", "MAX_BATCH", "MAX_TEXT", "ErrorCode", "Status", "ProtocolError", "Frame",
    "FrameDecoder", "encode", "decode", "Message",
    "Hello", "Allocate", "Commit", "Lookup", "Present", "Load", "Release", "Overlap", "Pinned", "Evicted",
    "Heartbeat", "Welcome", "Slots", "Committed", "LookupResult", "PresentResult", "Loaded", "Released",
    "OverlapResult", "AgentPrefix", "Error", "HELD_GPU", "HELD_RAM", "HELD_SSD", "HELD_PEER",
]

VERSION = 1
MAX_BODY = 8 << 20          # bytes after the header
MAX_BATCH = 65536           # entries in one request or reply
MAX_TEXT = 1024             # bytes of one text field (UTF-8)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
DIGEST = 32


class ErrorCode(IntEnum):
    """Why a request (or the whole connection) failed; carried by :class:`Error`."""

    MALFORMED = 1            # the body does not parse (counts, lengths, text)
    UNSUPPORTED_VERSION = 2  # header version or Hello version this side does not speak
    UNKNOWN_TYPE = 3         # a message type this side does not know
    TOO_LARGE = 4            # body over MAX_BODY, batch over MAX_BATCH, text over MAX_TEXT
    HANDSHAKE = 5            # a request before Hello, or a second Hello
    INVALID_ARGUMENT = 6
    RESOURCE_EXHAUSTED = 7
    UNAVAILABLE = 8
    NOT_FOUND = 9
    FAILED_PRECONDITION = 10
    DATA_LOSS = 11
    INTERNAL = 12


class Status(IntEnum):
    """Outcome of one entry of a batch (Slots, Committed, Loaded)."""

    OK = 0
    PRESENT = 1         # Allocate: the daemon has this block already; nothing to copy
    BUSY = 2            # Allocate: another writer is writing it right now
    FULL = 3            # no room: every block that could make room is in use
    MISS = 4            # Load: no tier of this daemon holds it
    INVALID = 5         # the entry itself is wrong (size outside the limits, ...)
    FAILED = 6          # Commit under write_through: it could not be made durable; not kept
    UNKNOWN_HANDLE = 7  # Commit/Release: not a handle of this connection (or used up)
    DECLINED = 8        # Allocate: the admission policy does not store this block yet (nothing to copy);
                        # Commit under write_through: the SSD write budget refused it (not kept)


LIMITS = Limits(VERSION, MAX_BODY, MAX_BATCH, MAX_TEXT, ErrorCode)


# -- body helpers ----------------------------------------------------------------------------

def _text(value: str | bytes, name: str) -> bytes:
    return text_field(value, name, LIMITS)


def _batch(n: int, what: str) -> bytes:
    return count_field(n, what, LIMITS)


def _digests_body(digests: Sequence[bytes], what: str) -> bytes:
    for d in digests:
        if len(d) != DIGEST:
            raise ValueError(f"{what}: a digest is {len(d)} bytes, not {DIGEST}")
    return _batch(len(digests), what) + b"".join(digests)


def _read_digests(r: BodyReader) -> list[bytes]:
    n = r.count(DIGEST)
    body, pos = r.body, r.pos
    r.pos = end = pos + n * DIGEST
    return [body[i:i + DIGEST] for i in range(pos, end, DIGEST)]


def _entries(fmt: struct.Struct, rows: Sequence[tuple[int | bytes, ...]], what: str) -> bytes:
    return _batch(len(rows), what) + b"".join(fmt.pack(*row) for row in rows)


def _read_entries(r: BodyReader, fmt: struct.Struct) -> list[tuple[int | bytes, ...]]:
    n = r.count(fmt.size)
    out = list(fmt.iter_unpack(r.body[r.pos:r.pos + n * fmt.size])) if n else []
    r.pos += n * fmt.size
    return out


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


# -- replies (daemon -> agent) ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Welcome:
    """Answer to Hello; the frame carries the arena's file descriptor (SCM_RIGHTS)."""

    TYPE: ClassVar[int] = 0x81
    session: int
    arena_bytes: int
    max_block_bytes: int
    heartbeat_ms: int
    daemon_version: str
    version: int = VERSION
    FIXED: ClassVar[struct.Struct] = struct.Struct("<HQQQI")

    def encode_body(self) -> bytes:
        return (self.FIXED.pack(self.version, self.session, self.arena_bytes, self.max_block_bytes, self.heartbeat_ms)
                + _text(self.daemon_version, "daemon_version"))

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Welcome":
        version, session, arena, max_block, heartbeat = r.unpack(cls.FIXED)
        return cls(session, arena, max_block, heartbeat, r.text("daemon_version"), version)


@dataclass(frozen=True, slots=True)
class Slots:
    """Answer to Allocate, entry by entry: (status, handle, arena offset); handle and offset
    are 0 unless the status is OK."""

    TYPE: ClassVar[int] = 0x82
    entries: Sequence[tuple[int, int, int]]
    _ENTRY: ClassVar[struct.Struct] = struct.Struct("<BQQ")

    def encode_body(self) -> bytes:
        return _entries(self._ENTRY, self.entries, "Slots")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Slots":
        return cls(_read_entries(r, cls._ENTRY))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Committed:
    """Answer to Commit: one status per handle."""

    TYPE: ClassVar[int] = 0x83
    statuses: Sequence[int]

    def encode_body(self) -> bytes:
        return _batch(len(self.statuses), "Committed") + bytes(self.statuses)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Committed":
        n = r.count(1)
        out = list(r.take(n))
        return cls(out)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Answer to Lookup: blocks from the start held per tier, and ``longest`` where each block
    is in some tier (this agent's GPU included)."""

    TYPE: ClassVar[int] = 0x84
    longest: int
    gpu: int
    ram: int
    ssd: int
    peer: int
    FIXED: ClassVar[struct.Struct] = struct.Struct("<5I")

    def encode_body(self) -> bytes:
        return self.FIXED.pack(self.longest, self.gpu, self.ram, self.ssd, self.peer)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "LookupResult":
        return cls(*r.unpack(cls.FIXED))


# PresentResult's flags: where a block is held (several may be set).
HELD_GPU, HELD_RAM, HELD_SSD, HELD_PEER = 1, 2, 4, 8


@dataclass(frozen=True, slots=True)
class PresentResult:
    """Answer to Present: per digest, in order, the HELD_* flags of the tiers holding it (0:
    nowhere). HELD_GPU is the asking agent's own GPU."""

    TYPE: ClassVar[int] = 0x88
    held: bytes

    def encode_body(self) -> bytes:
        return _batch(len(self.held), "PresentResult") + bytes(self.held)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "PresentResult":
        n = r.count(1)
        return cls(bytes(r.take(n)))


@dataclass(frozen=True, slots=True)
class Loaded:
    """Answer to Load, entry by entry: (status, handle, arena offset, length)."""

    TYPE: ClassVar[int] = 0x85
    entries: Sequence[tuple[int, int, int, int]]
    _ENTRY: ClassVar[struct.Struct] = struct.Struct("<BQQI")

    def encode_body(self) -> bytes:
        return _entries(self._ENTRY, self.entries, "Loaded")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Loaded":
        return cls(_read_entries(r, cls._ENTRY))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Released:
    """Answer to Release: how many handles were released, how many were not this connection's."""

    TYPE: ClassVar[int] = 0x86
    released: int
    unknown: int
    FIXED: ClassVar[struct.Struct] = struct.Struct("<II")

    def encode_body(self) -> bytes:
        return self.FIXED.pack(self.released, self.unknown)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Released":
        return cls(*r.unpack(cls.FIXED))


@dataclass(frozen=True, slots=True)
class AgentPrefix:
    session: int
    pid: int
    prefix: int
    agent_id: str


@dataclass(frozen=True, slots=True)
class OverlapResult:
    """Answer to Overlap: every connected agent with the prefix it holds, longest first."""

    TYPE: ClassVar[int] = 0x87
    agents: Sequence[AgentPrefix] = field(default_factory=list)
    _ENTRY: ClassVar[struct.Struct] = struct.Struct("<QII")

    def encode_body(self) -> bytes:
        return _batch(len(self.agents), "OverlapResult") + b"".join(
            self._ENTRY.pack(a.session, a.pid, a.prefix) + _text(a.agent_id, "agent_id") for a in self.agents)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "OverlapResult":
        n = r.u32()
        if n > MAX_BATCH:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"OverlapResult: {n} entries, over the limit of {MAX_BATCH}")
        out = []
        for _ in range(n):
            session, pid, prefix = r.unpack(cls._ENTRY)
            out.append(AgentPrefix(session, pid, prefix, r.text("agent_id")))
        return cls(out)


@dataclass(frozen=True, slots=True)
class Error:
    """A request (or the connection) failed; the request id says which request."""

    TYPE: ClassVar[int] = 0xFF
    code: int
    message: str

    def encode_body(self) -> bytes:
        raw = self.message.encode("utf-8")[:MAX_TEXT].decode("utf-8", "ignore")   # long messages are cut, not refused
        return _U16.pack(self.code) + _text(raw, "message")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Error":
        return cls(r.u16(), r.text("message"))


Message = Union[Hello, Allocate, Commit, Lookup, Present, Load, Release, Overlap, Pinned, Evicted, Heartbeat,
                Welcome, Slots, Committed, LookupResult, PresentResult, Loaded, Released, OverlapResult, Error]

class _Decodable(Protocol):
    """A message class as the decoder sees it: its type byte and how its body is read."""

    TYPE: ClassVar[int]

    @classmethod
    def decode_body(cls, r: BodyReader) -> Any: ...                  # a Message (subclasses return their own type)


MESSAGES: dict[int, type[_Decodable]] = {cls.TYPE: cls for cls in (
    Hello, Allocate, Commit, Lookup, Present, Load, Release, Overlap, Pinned, Evicted, Heartbeat,
    Welcome, Slots, Committed, LookupResult, PresentResult, Loaded, Released, OverlapResult, Error)}
EVENTS = frozenset({Pinned.TYPE, Evicted.TYPE, Heartbeat.TYPE})   # requests that get no reply (unless an Error)


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
