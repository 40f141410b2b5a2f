"""The pull messages of the peer protocol (sans-I/O): the requests that ask for blocks (Pull,
TenantPull, CodedPull) and the answers that carry them (Block, Blocks, CodedBlocks, Miss).

Their bytes are specified in docs/peer-protocol.md, as the rest of kvcached.peers.protocol's
(which re-exports everything here: callers import the protocol, not this module). A coded pull
(issue 64) asks the holder to send each block through a codec of kvcached.codecs where that
shrinks it: the head then says which codec and how many bytes are on the wire, while its
``payload_length`` and checksum stay those of the block itself, so the puller checks the
decoded bytes exactly as it checks a raw payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Sequence, Union

from kvcached.peers.frames import (
    ADDRESS,
    MAX_BATCH,
    MAX_PAYLOAD,
    U32,
    ErrorCode,
    addresses_body,
    count_body,
    digest_body,
    text_body,
)
from kvcached_agent.address import DIGEST_BYTES
from kvcached_agent.framing import BodyReader, ProtocolError
from kvcached_agent.integrity import CHECKSUM_BYTES, payload_checksum

__all__ = ["Pull", "TenantPull", "CodedPull", "AnyPull", "pull_of", "Block", "Blocks", "CodedBlocks", "Miss"]


# -- requests --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Pull:
    """Send these blocks: (digest, layer), the default tenant's. Answered entry by entry, in
    this order, by one Block or one Miss each (or by an Error that ends the request); a block
    that is another tenant's is a Miss (NOT_FOUND). Idempotent. :func:`pull_of` gives the Pull
    for any tenant: a :class:`TenantPull` names one."""

    TYPE: ClassVar[int] = 0x01
    addresses: Sequence[tuple[bytes, int]]
    max_payload: int = MAX_PAYLOAD      # larger payloads are answered Miss(TOO_LARGE)
    FIXED: ClassVar[struct.Struct] = struct.Struct("<Q")

    @property
    def tenant(self) -> str:
        """Whose blocks these are (a tenant's name; "": the default tenant's)."""
        return ""

    def part(self, addresses: Sequence[tuple[bytes, int]]) -> "Pull":
        """The same request for ``addresses`` (a part of it)."""
        return Pull(addresses, self.max_payload)

    def encode_body(self) -> bytes:
        if not 0 < self.max_payload <= MAX_PAYLOAD:
            raise ValueError(f"Pull: max_payload {self.max_payload} is outside 1..{MAX_PAYLOAD}")
        return self.FIXED.pack(self.max_payload) + addresses_body(self.addresses, "Pull")

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Pull":
        (max_payload,) = r.unpack(cls.FIXED)
        if not 0 < max_payload <= MAX_PAYLOAD:
            raise ProtocolError(ErrorCode.MALFORMED, f"Pull: max_payload {max_payload} is outside 1..{MAX_PAYLOAD}")
        return cls(r.entries(ADDRESS), max_payload)


@dataclass(frozen=True, slots=True)
class TenantPull:
    """A Pull of one tenant's blocks (docs/security.md): the tenant's name, then a Pull's body.
    The holder answers a block whose record names another tenant as it answers a block never
    stored. A type of its own, so the default tenant's Pull is the same bytes as before tenants,
    and a daemon that predates them refuses a tenant's (UNKNOWN_TYPE) instead of serving it."""

    TYPE: ClassVar[int] = 0x05
    addresses: Sequence[tuple[bytes, int]]
    max_payload: int = MAX_PAYLOAD
    tenant: str = ""

    def part(self, addresses: Sequence[tuple[bytes, int]]) -> "TenantPull":
        return TenantPull(addresses, self.max_payload, self.tenant)

    def encode_body(self) -> bytes:
        if not self.tenant:
            raise ValueError("TenantPull: no tenant (the default tenant's blocks go in a Pull)")
        return text_body(self.tenant, "tenant") + Pull(self.addresses, self.max_payload).encode_body()

    @classmethod
    def decode_body(cls, r: BodyReader) -> "TenantPull":
        tenant = r.text("tenant")
        if not tenant:
            raise ProtocolError(ErrorCode.MALFORMED, "TenantPull: no tenant")
        pull = Pull.decode_body(r)
        return cls(pull.addresses, pull.max_payload, tenant)


@dataclass(frozen=True, slots=True)
class CodedPull:
    """A Pull of ``tenant``'s blocks ("": the default tenant's) whose answers may come coded with
    ``codec`` (a kvcached.codecs code, never 0: raw), one the puller decodes. The holder codes
    each block where that shrinks it and sends it raw where it does not; the answer is
    CodedBlocks frames (each head says how its payload came) and Misses, entry by entry as a
    Pull's. Lane only (a QUIC stream answers Error UNEXPECTED): the puller asks for it where
    the link to the holder is slow enough that coding pays (kvcached.peers.link_coding). A
    holder that predates it answers Error UNKNOWN_TYPE, and the puller pulls raw instead."""

    TYPE: ClassVar[int] = 0x09
    addresses: Sequence[tuple[bytes, int]]
    max_payload: int = MAX_PAYLOAD
    tenant: str = ""
    codec: int = 1
    FIXED: ClassVar[struct.Struct] = struct.Struct("<B")

    def part(self, addresses: Sequence[tuple[bytes, int]]) -> "CodedPull":
        return CodedPull(addresses, self.max_payload, self.tenant, self.codec)

    def encode_body(self) -> bytes:
        if not 0 < self.codec < 256:
            raise ValueError(f"CodedPull: codec {self.codec} is outside 1..255")
        return (self.FIXED.pack(self.codec) + text_body(self.tenant, "tenant")
                + Pull(self.addresses, self.max_payload).encode_body())

    @classmethod
    def decode_body(cls, r: BodyReader) -> "CodedPull":
        (codec,) = r.unpack(cls.FIXED)
        if codec == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "CodedPull: codec 0 (a raw pull is a Pull)")
        tenant = r.text("tenant")
        pull = Pull.decode_body(r)
        return cls(pull.addresses, pull.max_payload, tenant, codec)


AnyPull = Union[Pull, TenantPull, CodedPull]


def pull_of(addresses: Sequence[tuple[bytes, int]], max_payload: int = MAX_PAYLOAD, tenant: str = "",
            codec: int = 0) -> AnyPull:
    """The request for ``tenant``'s blocks at ``addresses``: with ``codec``, a CodedPull; else a
    Pull for the default tenant, a TenantPull for any other."""
    if codec:
        return CodedPull(addresses, max_payload, tenant, codec)
    return TenantPull(addresses, max_payload, tenant) if tenant else Pull(addresses, max_payload)


# -- answers ---------------------------------------------------------------------------------



@dataclass(frozen=True, slots=True)
class Block:
    """One pulled block's head; exactly ``payload_length`` raw payload bytes follow the frame's
    body on the stream. :func:`encode` gives the head only: the sender writes the payload after
    it as it is (no copy into a frame), the receiver gets it through :class:`FrameDecoder`."""

    TYPE: ClassVar[int] = 0x81
    digest: bytes
    layer: int
    model: str
    payload_length: int
    checksum: bytes                 # BLAKE3-256 of the payload (kvcached_agent.integrity)
    codec: int = 0                  # how the payload is on the wire (kvcached.codecs; 0: raw); CodedBlocks only
    wire_length: int = 0            # the bytes on the wire where coded (0: payload_length)
    FIXED: ClassVar[struct.Struct] = struct.Struct(f"<{DIGEST_BYTES}sIQ{CHECKSUM_BYTES}s")

    @property
    def wire(self) -> int:
        """The payload bytes that follow the head on the stream (coded or not)."""
        return self.wire_length or self.payload_length

    @classmethod
    def of(cls, digest: bytes, layer: int, model: str, payload: bytes | bytearray | memoryview) -> "Block":
        """The head for ``payload`` (its length and checksum computed here)."""
        return cls(digest, layer, model, len(payload), payload_checksum(payload))

    def verify(self, payload: bytes | bytearray | memoryview) -> bool:
        """Whether ``payload`` is the one this head announces (length and checksum)."""
        return len(payload) == self.payload_length and payload_checksum(payload) == self.checksum

    def encode_body(self) -> bytes:
        if not 0 < self.payload_length <= MAX_PAYLOAD:
            raise ValueError(f"Block: payload_length {self.payload_length} is outside 1..{MAX_PAYLOAD}")
        if len(self.checksum) != CHECKSUM_BYTES:
            raise ValueError(f"Block: the checksum is {len(self.checksum)} bytes, not {CHECKSUM_BYTES}")
        return (self.FIXED.pack(digest_body(self.digest, "Block"), self.layer, self.payload_length, self.checksum)
                + text_body(self.model, "model"))

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Block":
        digest, layer, length, checksum = r.unpack(cls.FIXED)
        if not 0 < length <= MAX_PAYLOAD:
            code = ErrorCode.MALFORMED if length == 0 else ErrorCode.TOO_LARGE
            raise ProtocolError(code, f"Block: payload_length {length} is outside 1..{MAX_PAYLOAD}")
        return cls(digest, layer, r.text("model"), length, checksum)


@dataclass(frozen=True, slots=True)
class Miss:
    """One entry of a Pull that is not sent, and why (a :class:`MissReason`)."""

    TYPE: ClassVar[int] = 0x82
    digest: bytes
    layer: int
    reason: int
    FIXED: ClassVar[struct.Struct] = struct.Struct(f"<{DIGEST_BYTES}sIB")

    def encode_body(self) -> bytes:
        return self.FIXED.pack(digest_body(self.digest, "Miss"), self.layer, self.reason)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Miss":
        return cls(*r.unpack(cls.FIXED))


@dataclass(frozen=True, slots=True)
class Blocks:
    """The heads of several pulled blocks in one frame (consecutive answers of one Pull); their
    payloads follow the frame's body back to back, in the order of the heads, each exactly its
    head's ``payload_length`` bytes. What a Block frame is for one block, for a run of them: a
    sender answering many hits at once sends (and a ``mac`` lane seals) one frame, not one per
    block. :func:`encode` gives the heads only; the sender writes the payloads after them."""

    TYPE: ClassVar[int] = 0x85
    heads: Sequence[Block]

    def encode_body(self) -> bytes:
        if not self.heads:
            raise ValueError("Blocks: at least one head")
        return count_body(len(self.heads), "Blocks") + b"".join(head.encode_body() for head in self.heads)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "Blocks":
        return cls(tuple(Block.decode_body(r) for _ in range(_head_count(r, "Blocks"))))


def _head_count(r: BodyReader, what: str) -> int:
    """A run's count of heads: 1..MAX_BATCH."""
    (n,) = r.unpack(U32)
    if n == 0:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: no heads")
    if n > MAX_BATCH:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what}: {n} heads, over the limit of {MAX_BATCH}")
    return n


@dataclass(frozen=True, slots=True)
class CodedBlocks:
    """The answer to a CodedPull: a Blocks frame whose heads each say how their payload came:
    a u8 codec (0: raw) and a u64 wire length before the head as a Block lays it out. A raw
    payload is ``payload_length`` bytes; a coded one is 1..``payload_length`` bytes (a coding
    that does not shrink a block is never sent) and decodes to ``payload_length`` bytes, whose
    checksum is the head's. The payloads follow back to back, in order, as a Blocks frame's."""

    TYPE: ClassVar[int] = 0x89
    heads: Sequence[Block]
    CODING: ClassVar[struct.Struct] = struct.Struct("<BQ")

    def encode_body(self) -> bytes:
        if not self.heads:
            raise ValueError("CodedBlocks: at least one head")
        return count_body(len(self.heads), "CodedBlocks") + b"".join(
            self.CODING.pack(head.codec, head.wire) + head.encode_body() for head in self.heads)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "CodedBlocks":
        heads = []
        for _ in range(_head_count(r, "CodedBlocks")):
            codec, wire = r.unpack(cls.CODING)
            head = Block.decode_body(r)
            if (wire != head.payload_length) if codec == 0 else not 0 < wire <= head.payload_length:
                raise ProtocolError(ErrorCode.MALFORMED, f"CodedBlocks: {wire} bytes on the wire for a payload of "
                                    f"{head.payload_length} with codec {codec}")
            heads.append(Block(head.digest, head.layer, head.model, head.payload_length, head.checksum,
                               codec, wire if codec else 0))
        return cls(tuple(heads))

