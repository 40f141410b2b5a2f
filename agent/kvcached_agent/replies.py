"""The agent protocol's replies (daemon to agent); kvcached_agent.protocol has the requests, the
framing and the decoder, and re-exports these. No I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from kvcached_agent.codes import (
    _U16,
    _U32,
    MAX_BATCH,
    MAX_TEXT,
    VERSION,
    ErrorCode,
    _batch,
    _entries,
    _read_entries,
    _text,
)
from kvcached_agent.framing import BodyReader, ProtocolError

__all__ = ["FeatureSet", "Welcome", "Slots", "Committed", "LookupResult", "LoadPlan", "PresentResult", "Loaded", "Released",
           "OverlapResult", "AgentPrefix", "Error", "HELD_GPU", "HELD_RAM", "HELD_SSD", "HELD_PEER"]


@dataclass(frozen=True, slots=True)
class FeatureSet:
    """Answer to Features: flags (ROUTE_KEYS: the daemon publishes KV events, send Route)."""

    TYPE: ClassVar[int] = 0x8A
    flags: int
    ROUTE_KEYS: ClassVar[int] = 1

    def encode_body(self) -> bytes:
        return _U32.pack(self.flags)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "FeatureSet":
        return cls(r.u32())


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


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Answer to PlanLoads: load the first ``load`` blocks and recompute the rest; of those
    loaded, ``ram`` come from RAM (or this agent's GPU) and ``ssd`` from SSD, the rest from
    peers. ``held``: the chain's prefix some tier holds; ``skipped_ssd``, ``skipped_peer``: of
    it, blocks not worth loading (slower than recomputing); ``seconds``: what the plan expects,
    against loading all that is held (``load_all_s``) and recomputing everything
    (``recompute_all_s``)."""

    TYPE: ClassVar[int] = 0x89
    load: int
    held: int
    ram: int
    ssd: int
    skipped_ssd: int
    skipped_peer: int
    seconds: float
    load_all_s: float
    recompute_all_s: float
    FIXED: ClassVar[struct.Struct] = struct.Struct("<6I3d")

    def encode_body(self) -> bytes:
        return self.FIXED.pack(self.load, self.held, self.ram, self.ssd, self.skipped_ssd, self.skipped_peer,
                               self.seconds, self.load_all_s, self.recompute_all_s)

    @classmethod
    def decode_body(cls, r: BodyReader) -> "LoadPlan":
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
