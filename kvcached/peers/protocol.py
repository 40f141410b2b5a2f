"""The peer protocol: frames between two kvcached daemons (sans-I/O).

Plain classes, no sockets: :func:`encode` turns a message into bytes, :class:`FrameDecoder`
turns an ordered byte stream into events, :func:`decode` turns a frame into a message. Any
ordered byte stream carries it: one QUIC stream per request, or one bulk-lane connection (TCP,
kvcached.peers.lane) for many requests in turn (request ids, not streams, pair answers with requests).
The pull messages (Pull, TenantPull, CodedPull; Block, Blocks, CodedBlocks, Miss) are
kvcached.peers.protocol_pulls', the NIXL lane's kvcached.peers.protocol_nixl's: this module
re-exports both and holds the registry of every message type.
docs/peer-protocol.md specifies the same bytes; the unit tests pin them byte for byte. This
protocol is versioned apart from the agent protocol (kvcached_agent.protocol): they share the
addressing, the payload checksum and the framing (kvcached_agent.framing), never a message type,
an error code past the four shared ones, or a version number.

Every frame is a 12-byte header then a body::

    u32 body length | u8 version | u8 type | u16 flags (0) | u32 request id

little-endian: the framing shared with the agent protocol (kvcached_agent.framing). A Block
frame's body is followed by its raw payload (the length is in the body): the decoder hands out
the Block's head as soon as it is in, then the payload as chunks of what was fed, or straight
into a buffer the caller gives (an arena slot), never gathering it into a body. Limits (body
length, payload length, entries per batch, text length) are checked before anything is
allocated.

A header that is wrong (version, flags, length), or a Block head that is wrong, loses the
framing: fatal, the receiver answers an Error and ends the stream. Any other body that is
wrong, or a type the receiver does not know, loses only that request: an Error answers it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, Union

from kvcached.peers.frames import (
    ADDRESS,
    DIGEST,
    LIMITS,
    MAX_BATCH,
    MAX_BODY,
    MAX_HOLDERS,
    MAX_NAMES,
    MAX_PAYLOAD,
    MAX_TEXT,
    U16,
    U32,
    VERSION,
    ErrorCode,
    MissReason,
    addresses_body,
    count_body,
    digest_body,
    text_body,
)
from kvcached.peers.protocol_nixl import NixlAgent, NixlDone, NixlOpen, NixlPull, NixlSpan, NixlSpans
from kvcached.peers.protocol_pulls import (
    AnyPull,
    Block,
    Blocks,
    CodedBlocks,
    CodedPull,
    Miss,
    Pull,
    TenantPull,
    pull_of,
)
from kvcached_agent.framing import HEADER, BodyReader, Frame, ProtocolError
from kvcached_agent.framing import frame as frame_bytes

__all__ = [
    "VERSION", "HEADER", "MAX_BODY", "MAX_BATCH", "MAX_TEXT", "MAX_PAYLOAD", "ErrorCode", "MissReason",
    "ProtocolError", "encode", "decode", "Message", "Frame",
    "Pull", "TenantPull", "CodedPull", "AnyPull", "pull_of", "Exists", "LaneOpen", "Locate", "Announce", "Drop", "Snapshot", "Block",
    "Blocks", "CodedBlocks", "Miss", "ExistsResult",
    "Located", "LaneKey", "MAX_HOLDERS", "MAX_NAMES",
    "Seal", "Error", "NixlOpen", "NixlAgent", "NixlPull", "NixlSpan", "NixlSpans", "NixlDone",
    "REQUESTS", "EVENTS", "EARLY_DATA_TYPES", "STATE_CHANGING", "allowed_as_early_data",
]


# -- requests --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Exists:
    """How long a prefix of this chain (one layer) the receiver holds, counting from the first
    digest and stopping at the first miss (as Lookup). Answered by ExistsResult. Idempotent."""

    TYPE: ClassVar[int] = 0x02
    layer: int
    digests: Sequence[bytes]

    def encode_body(self) -> bytes:
        return U32.pack(self.layer) + count_body(len(self.digests), "Exists") + b"".join(
            digest_body(d, "Exists") for d in self.digests)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Exists":
        (layer,) = r.unpack(U32)
        return cls(layer, [d for (d,) in r.entries(DIGEST)])


@dataclass(frozen=True, slots=True)
class LaneOpen:
    """Grant me a key for ``mac`` bulk lanes (kvcached.peers.lane_mac). Answered by LaneKey, or by
    Error UNAVAILABLE where the receiver runs no ``mac`` lane. Sent over QUIC only, never as 0-RTT
    early data: the key lives as long as this QUIC connection (its mutual TLS is what makes it a
    secret of these two daemons)."""

    TYPE: ClassVar[int] = 0x03

    def encode_body(self) -> bytes:
        return b""

    @classmethod
    def decode_body(cls, r: BodyReader) -> "LaneOpen":
        return cls()


@dataclass(frozen=True, slots=True)
class Locate:
    """Who holds these blocks: asked of a block's home node (kvcached.cluster.location), which
    answers Located, entry for entry. Idempotent. The receiver answers from the location records
    it keeps as a home; a block it keeps no record of has no holders in the answer."""

    TYPE: ClassVar[int] = 0x04
    addresses: Sequence[tuple[bytes, int]]

    def encode_body(self) -> bytes:
        return addresses_body(self.addresses, "Locate")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Locate":
        return cls(r.entries(ADDRESS))


@dataclass(frozen=True, slots=True)
class _Addresses:
    addresses: Sequence[tuple[bytes, int]]

    def encode_body(self) -> bytes:
        return addresses_body(self.addresses, type(self).__name__)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "_Addresses":
        return cls(r.entries(ADDRESS))


@dataclass(frozen=True, slots=True)
class Announce(_Addresses):
    """Event (no reply): the sender now holds these blocks and will serve them. Changes state."""

    TYPE: ClassVar[int] = 0x10


@dataclass(frozen=True, slots=True)
class Drop(_Addresses):
    """Event (no reply): the sender no longer holds these blocks. Changes state."""

    TYPE: ClassVar[int] = 0x11


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Event (no reply): part of a full listing of what the sender holds, sent on (re)connect.
    The parts of one listing share a request id and count up from 0; the one with ``last``
    ends it, and the listing then replaces all the receiver knew of the sender. Changes state."""

    TYPE: ClassVar[int] = 0x12
    part: int
    last: bool
    addresses: Sequence[tuple[bytes, int]]
    FIXED: ClassVar[struct.Struct] = struct.Struct("<IB")

    def encode_body(self) -> bytes:
        return self.FIXED.pack(self.part, 1 if self.last else 0) + addresses_body(self.addresses, "Snapshot")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Snapshot":
        part, last = r.unpack(cls.FIXED)
        if last not in (0, 1):
            raise ProtocolError(ErrorCode.MALFORMED, f"Snapshot: last is {last}, not 0 or 1")
        return cls(part, last == 1, r.entries(ADDRESS))


# -- answers ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ExistsResult:
    """Answer to Exists: how many blocks from the start of the chain the sender holds."""

    TYPE: ClassVar[int] = 0x83
    count: int

    def encode_body(self) -> bytes:
        return U32.pack(self.count)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "ExistsResult":
        return cls(*r.unpack(U32))


@dataclass(frozen=True, slots=True)
class Located:
    """Answer to Locate: per address asked, in order, the members that hold it (names, by
    index into one table of names: ``u16 count | (u8 length | UTF-8) x count``, then
    ``u32 entries | (u8 holders | u16 name index x holders) x entries``). At most
    MAX_HOLDERS holders an entry and MAX_NAMES names a frame."""

    TYPE: ClassVar[int] = 0x86
    holders: Sequence[Sequence[str]]
    _U8: ClassVar[struct.Struct] = struct.Struct("<B")

    def encode_body(self) -> bytes:
        index: dict[str, int] = {}
        rows = []
        for entry in self.holders:
            if len(entry) > MAX_HOLDERS:
                raise ValueError(f"Located: {len(entry)} holders of one block, over {MAX_HOLDERS}")
            rows.append([index.setdefault(name, len(index)) for name in entry])
        if len(index) > MAX_NAMES:
            raise ValueError(f"Located: {len(index)} names, over {MAX_NAMES} (split the batch)")
        names = []
        for name in index:
            raw = name.encode("utf-8")
            if not 0 < len(raw) <= 255:
                raise ValueError(f"Located: a name of {len(raw)} bytes (1..255)")
            names.append(self._U8.pack(len(raw)) + raw)
        return (U16.pack(len(index)) + b"".join(names) + count_body(len(rows), "Located")
                + b"".join(self._U8.pack(len(row)) + struct.pack(f"<{len(row)}H", *row) for row in rows))

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Located":
        (count,) = r.unpack(U16)
        if count > MAX_NAMES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"Located: {count} names, over {MAX_NAMES}")
        names = []
        for _ in range(count):
            (n,) = r.unpack(cls._U8)
            raw = r.body[r.pos:r.pos + n]
            if n == 0 or len(raw) != n:
                raise ProtocolError(ErrorCode.MALFORMED, "Located: a name is empty or cut short")
            r.pos += n
            try:
                names.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise ProtocolError(ErrorCode.MALFORMED, "Located: a name is not UTF-8") from None
        (entries,) = r.unpack(U32)
        if entries > MAX_BATCH:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"Located: {entries} entries, over the limit of {MAX_BATCH}")
        holders: list[tuple[str, ...]] = []
        for _ in range(entries):
            (k,) = r.unpack(cls._U8)
            if k > MAX_HOLDERS:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"Located: {k} holders of one block, over {MAX_HOLDERS}")
            ids = r.unpack(struct.Struct(f"<{k}H")) if k else ()
            if any(i >= count for i in ids):
                raise ProtocolError(ErrorCode.MALFORMED, f"Located: a name index past the {count} names")
            holders.append(tuple(names[i] for i in ids))
        r.end()
        return cls(holders)


@dataclass(frozen=True, slots=True)
class LaneKey:
    """Answer to LaneOpen: a key id (named in a lane's hello) and the 32-byte key itself."""

    TYPE: ClassVar[int] = 0x84
    key_id: bytes
    key: bytes
    FIXED: ClassVar[struct.Struct] = struct.Struct("<16s32s")

    def encode_body(self) -> bytes:
        if len(self.key_id) != 16 or len(self.key) != 32:
            raise ValueError("LaneKey: the key id is 16 bytes and the key 32")
        return self.FIXED.pack(self.key_id, self.key)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "LaneKey":
        return cls(*r.unpack(cls.FIXED))


@dataclass(frozen=True, slots=True)
class Seal:
    """On a ``mac`` lane only: the keyed BLAKE3 tag of the frame that comes next (its header and
    body; a Block's payload is bound through the checksum in its head). Neither a request nor an
    answer: the lane checks it and takes it off the stream (kvcached.peers.lane_mac)."""

    TYPE: ClassVar[int] = 0x20
    tag: bytes
    FIXED: ClassVar[struct.Struct] = struct.Struct("<32s")

    def encode_body(self) -> bytes:
        if len(self.tag) != 32:
            raise ValueError(f"Seal: the tag is {len(self.tag)} bytes, not 32")
        return self.FIXED.pack(self.tag)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Seal":
        return cls(*r.unpack(cls.FIXED))


@dataclass(frozen=True, slots=True)
class Error:
    """A request (or the stream) failed; the request id says which request."""

    TYPE: ClassVar[int] = 0xFF
    code: int
    message: str

    def encode_body(self) -> bytes:
        cut = self.message.encode("utf-8")[:MAX_TEXT].decode("utf-8", "ignore")   # long messages are cut, not refused
        return U16.pack(self.code) + text_body(cut, "message")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Error":
        (code,) = r.unpack(U16)
        return cls(code, r.text("message"))


Message = Union[Pull, TenantPull, CodedPull, Exists, LaneOpen, Locate, Announce, Drop, Snapshot, Block, Blocks, CodedBlocks, Miss,
                ExistsResult, Located, LaneKey, Seal, Error, NixlOpen, NixlAgent, NixlPull, NixlSpans, NixlDone]


class _Decodable(Protocol):
    """A message class as the decoder sees it: its type byte and how its body is read."""

    TYPE: ClassVar[int]

    @classmethod
    def decode_body(cls, r: BodyReader) -> Any: ...                  # a Message (subclasses return their own type)


MESSAGES: dict[int, type[_Decodable]] = {cls.TYPE: cls for cls in (
    Pull, TenantPull, CodedPull, Exists, LaneOpen, Locate, Announce, Drop, Snapshot, Block, Blocks, CodedBlocks, Miss, ExistsResult,
    Located, LaneKey, Seal, Error, NixlOpen, NixlAgent, NixlPull, NixlSpans, NixlDone)}
#: What one daemon sends another unasked; the rest are answers (and Seal, which is neither).
REQUESTS = frozenset({Pull.TYPE, TenantPull.TYPE, CodedPull.TYPE, Exists.TYPE, LaneOpen.TYPE, Locate.TYPE, Announce.TYPE,
                      Drop.TYPE, Snapshot.TYPE,
                      NixlOpen.TYPE, NixlPull.TYPE, NixlDone.TYPE})
#: Requests that get no answer (unless an Error).
EVENTS = frozenset({Announce.TYPE, Drop.TYPE, Snapshot.TYPE, NixlDone.TYPE})
#: Requests that may arrive as 0-RTT early data. Early data can be replayed by anyone who
#: recorded it (RFC 8446 section 8, RFC 9001 section 9.2), so only requests that change
#: nothing (idempotent: a replay costs bytes, not correctness) are taken from it.
EARLY_DATA_TYPES = frozenset({Pull.TYPE, TenantPull.TYPE, CodedPull.TYPE, Exists.TYPE, Locate.TYPE})
#: Requests that change state at the receiver (what it believes the sender holds, the lane keys
#: it granted): never taken as early data.
STATE_CHANGING = frozenset({LaneOpen.TYPE, Announce.TYPE, Drop.TYPE, Snapshot.TYPE, NixlOpen.TYPE, NixlPull.TYPE,
                            NixlDone.TYPE})


def allowed_as_early_data(type_: int) -> bool:
    """Whether a frame of this type may be acted on when it arrived as 0-RTT early data. Anything
    not known to be idempotent (events, answers, unknown types) is refused: Error EARLY_DATA."""
    return type_ in EARLY_DATA_TYPES


# -- framing ---------------------------------------------------------------------------------

def encode(message: Message, request_id: int = 0) -> bytes:
    """The frame of ``message``: header and body (for a Block, its head: the payload follows
    as raw bytes, written by the caller). ValueError if it breaks a limit."""
    return frame_bytes(LIMITS, message.TYPE, request_id, message.encode_body(), type(message).__name__)


def decode(frame: Frame) -> Message:
    """The message of ``frame``. ProtocolError (not fatal) for an unknown type or a bad body."""
    cls = MESSAGES.get(frame.type)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type 0x{frame.type:02x}",
                            request_id=frame.request_id)
    reader = BodyReader(frame.body, cls.__name__, LIMITS)
    try:
        message = cls.decode_body(reader)
        reader.end()
    except ProtocolError as err:
        err.request_id = frame.request_id
        raise
    return message
