"""The NIXL lane's control messages (sans-I/O; docs/peer-protocol.md, "The NIXL lane").

On the NIXL lane the payload moves by NIXL (a READ by the puller, straight from the holder's
arena into the slot the puller reserved), and everything that says what to read and what it must
be goes over the authenticated QUIC session, in these messages:

- :class:`NixlOpen` -> :class:`NixlAgent`: the holder's NIXL agent metadata (what NIXL needs to
  reach its registered arenas) and where the arenas lie (one per tenant, read as one run of
  offsets). Only over the verified
  session: NIXL's metadata carries the keys that let a reader into the arena.
- :class:`NixlPull` -> :class:`NixlSpans`: a Pull of ``tenant``'s blocks, answered not with
  payloads but, row by row in order, with where each block lies in the holder's arena, its
  length, its BLAKE3 checksum and model, or why it is missing. The found blocks stay pinned
  under one lease for at most ``hold_ms``.
- :class:`NixlDone`: the puller has read what it wanted of a lease: the holder unpins it. No
  answer; a lease nobody ends expires.

The puller checks every payload it read against the checksum of NixlSpans before it publishes
it: the bytes come over a path that is neither encrypted nor authenticated, and a holder's slot
could change after it answered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Sequence, Union

from kvcached.peers.frames import (
    ADDRESS,
    MAX_PAYLOAD,
    U32,
    U64,
    ErrorCode,
    MissReason,
    addresses_body,
    text_body,
)
from kvcached_agent.framing import BodyReader, ProtocolError
from kvcached_agent.integrity import CHECKSUM_BYTES

__all__ = ["MAX_METADATA", "MAX_ROWS", "NixlOpen", "NixlAgent", "NixlPull", "NixlSpan", "NixlSpans", "NixlDone",
           "NIXL_MESSAGES"]

MAX_METADATA = 1 << 20       # bytes of one NIXL agent's metadata (UCX's worker address and keys: a few KiB)
MAX_ROWS = 1024              # blocks one NixlPull asks for (a fetch asks in batches of 64)


@dataclass(frozen=True, slots=True)
class NixlOpen:
    """How may I read your arena over NIXL? Answered by NixlAgent, or by Error UNAVAILABLE where
    the receiver runs no NIXL lane. Over a verified session only, never as 0-RTT early data."""

    TYPE: ClassVar[int] = 0x06

    def encode_body(self) -> bytes:
        return b""

    @classmethod
    def decode_body(cls, r: BodyReader) -> "NixlOpen":
        return cls()


@dataclass(frozen=True, slots=True)
class NixlAgent:
    """Answer to NixlOpen: where the holder's registered arenas lie, and the holder's NIXL
    agent metadata (NIXL's own bytes, handed to ``add_remote_agent``). The arenas (one per
    tenant, all of one size) are read as one run of ``size`` bytes: offset ``o`` lies in arena
    ``o // (size / len(bases))`` at ``bases[i] + o % (size / len(bases))``; one arena's holder
    sends ``base`` alone (``bases`` empty: ``(base,)``), as before tenants had arenas."""

    TYPE: ClassVar[int] = 0x87

    base: int
    size: int
    metadata: bytes
    bases: tuple[int, ...] = ()

    FIXED: ClassVar[struct.Struct] = struct.Struct("<QQI")
    MAX_REGIONS: ClassVar[int] = 256

    @property
    def regions(self) -> tuple[int, ...]:
        return self.bases or (self.base,)

    def encode_body(self) -> bytes:
        if not 0 < len(self.metadata) <= MAX_METADATA:
            raise ValueError(f"NixlAgent: {len(self.metadata)} bytes of metadata, outside 1..{MAX_METADATA}")
        if self.size <= 0:
            raise ValueError("NixlAgent: an empty region")
        if len(self.bases) > self.MAX_REGIONS or self.size % len(self.regions):
            raise ValueError(f"NixlAgent: {len(self.bases)} regions do not split {self.size} bytes")
        tail = b"" if len(self.bases) <= 1 else U32.pack(len(self.bases)) + b"".join(U64.pack(b) for b in self.bases)
        return self.FIXED.pack(self.base, self.size, len(self.metadata)) + self.metadata + tail

    @classmethod
    def decode_body(cls, r: BodyReader) -> "NixlAgent":
        base, size, n = r.unpack(cls.FIXED)
        if n == 0 or size == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "NixlAgent: no metadata, or an empty region")
        if n > MAX_METADATA:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"NixlAgent: {n} bytes of metadata, over {MAX_METADATA}")
        metadata = r.take(n)
        if r.pos == len(r.body):
            return cls(base, size, metadata)
        (count,) = r.unpack(U32)
        if not 1 < count <= cls.MAX_REGIONS or size % count:
            raise ProtocolError(ErrorCode.MALFORMED, f"NixlAgent: {count} regions of {size} bytes")
        return cls(base, size, metadata, tuple(r.unpack(U64)[0] for _ in range(count)))


@dataclass(frozen=True, slots=True)
class NixlPull:
    """Pin these blocks of ``tenant`` ("": the default tenant) and say where they lie: a Pull
    whose payloads the puller reads itself over NIXL. Answered by NixlSpans, or an Error. Not
    idempotent (it pins), so never taken as early data."""

    TYPE: ClassVar[int] = 0x07
    addresses: Sequence[tuple[bytes, int]]
    max_payload: int = MAX_PAYLOAD      # larger payloads are answered as missing (TOO_LARGE)
    tenant: str = ""

    def encode_body(self) -> bytes:
        if not 0 < self.max_payload <= MAX_PAYLOAD:
            raise ValueError(f"NixlPull: max_payload {self.max_payload} is outside 1..{MAX_PAYLOAD}")
        if len(self.addresses) > MAX_ROWS:
            raise ValueError(f"NixlPull: {len(self.addresses)} blocks, over {MAX_ROWS}")
        return text_body(self.tenant, "tenant") + U64.pack(self.max_payload) + addresses_body(self.addresses, "NixlPull")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "NixlPull":
        tenant = r.text("tenant")
        (max_payload,) = r.unpack(U64)
        if not 0 < max_payload <= MAX_PAYLOAD:
            raise ProtocolError(ErrorCode.MALFORMED, f"NixlPull: max_payload {max_payload} is outside 1..{MAX_PAYLOAD}")
        rows = r.entries(ADDRESS)
        if len(rows) > MAX_ROWS:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"NixlPull: {len(rows)} blocks, over {MAX_ROWS}")
        return cls(rows, max_payload, tenant)


@dataclass(frozen=True, slots=True)
class NixlSpan:
    """Where one pulled block lies in the holder's arena (``offset`` from its base), its length,
    its BLAKE3 checksum and its model; or, with ``missing`` a MissReason, why it is not there."""

    offset: int = 0
    length: int = 0
    checksum: bytes = b""
    model: str = ""
    missing: int = 0
    FIXED: ClassVar[struct.Struct] = struct.Struct(f"<QI{CHECKSUM_BYTES}s")

    @property
    def found(self) -> bool:
        return not self.missing

    def encode(self) -> bytes:
        if self.missing:
            return bytes((self.missing,))
        if not 0 < self.length <= MAX_PAYLOAD:
            raise ValueError(f"NixlSpan: length {self.length} is outside 1..{MAX_PAYLOAD}")
        if len(self.checksum) != CHECKSUM_BYTES:
            raise ValueError(f"NixlSpan: the checksum is {len(self.checksum)} bytes, not {CHECKSUM_BYTES}")
        return b"\0" + self.FIXED.pack(self.offset, self.length, self.checksum) + text_body(self.model, "model")

    @classmethod
    def decode(cls, r: BodyReader) -> "NixlSpan":
        (missing,) = r.take(1)
        if missing:
            try:
                return cls(missing=MissReason(missing))
            except ValueError:
                raise ProtocolError(ErrorCode.MALFORMED, f"NixlSpans: unknown miss reason {missing}") from None
        offset, length, checksum = r.unpack(cls.FIXED)
        if not 0 < length <= MAX_PAYLOAD:
            raise ProtocolError(ErrorCode.MALFORMED, f"NixlSpans: length {length} is outside 1..{MAX_PAYLOAD}")
        return cls(offset, length, checksum, r.text("model"))


@dataclass(frozen=True, slots=True)
class NixlSpans:
    """Answer to NixlPull: one span per asked block, in the order asked; the found ones pinned
    under ``lease`` (0: none found) for at most ``hold_ms`` milliseconds, or until NixlDone."""

    TYPE: ClassVar[int] = 0x88
    lease: int
    hold_ms: int
    spans: Sequence[NixlSpan]
    FIXED: ClassVar[struct.Struct] = struct.Struct("<QII")

    def encode_body(self) -> bytes:
        if len(self.spans) > MAX_ROWS:
            raise ValueError(f"NixlSpans: {len(self.spans)} spans, over {MAX_ROWS}")
        return self.FIXED.pack(self.lease, self.hold_ms, len(self.spans)) + b"".join(s.encode() for s in self.spans)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "NixlSpans":
        lease, hold_ms, n = r.unpack(cls.FIXED)
        if n > MAX_ROWS:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"NixlSpans: {n} spans, over {MAX_ROWS}")
        return cls(lease, hold_ms, tuple(NixlSpan.decode(r) for _ in range(n)))


@dataclass(frozen=True, slots=True)
class NixlDone:
    """The puller is done with ``lease``: its blocks are unpinned. No answer (an unknown or
    expired lease is ignored); never taken as early data."""

    TYPE: ClassVar[int] = 0x08
    lease: int

    def encode_body(self) -> bytes:
        return U64.pack(self.lease)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "NixlDone":
        return cls(*r.unpack(U64))


NixlMessage = Union[NixlOpen, NixlAgent, NixlPull, NixlSpans, NixlDone]
NIXL_MESSAGES = (NixlOpen, NixlAgent, NixlPull, NixlSpans, NixlDone)
