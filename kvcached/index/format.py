"""The index's record format: what one block's record holds and how it is laid out in bytes.

Record layout (little-endian, version 1)::

    u8 version | u8 tiers | u8 gone_reason | u8 flags | u32 layer | u64 nbytes |
    f64 created | f64 last_seen | f64 gone_at | 32 B checksum | 32 B digest | tail

The tail is the model (UTF-8, the rest of the record), or, with flag ``ROUTED``, ``u16 model
length | model | route keys`` (the engine's keys of the block, kvcached_agent.route, encoded):
a record carries its route keys so that every change the index feeds to the KV event publisher
names the block as the engine does with no second read (kvcached.events). With flag
``TENANTED`` the tail starts with ``u8 length | tenant name``: the block is that tenant's
(kvcached.tenants); without it, the default tenant's. Records written before flags existed have
a zero there, so they read unchanged: every block stored before tenants is the default's.

The index (kvcached.index) patches ``tiers``, ``gone_reason``, ``last_seen`` and ``gone_at`` in
place at the offsets below (the tail is left as it is); the SSD eviction queue's entries are the big-endian microsecond time
a block was last used, then its key, so the queue sorts oldest first. No I/O here.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, replace

__all__ = [
    "AGE", "CHECKSUM_AT", "DIGEST_AT", "F64", "FLAGS_AT", "FOREIGN", "GONE_AT_AT", "LAST_SEEN_AT", "LAYER_AT", "NBYTES_AT",
    "RECORD", "REASON_AT", "ROUTED", "SCHEMA_VERSION", "TENANTED", "TIERS_AT", "U64", "BlockRecord", "GoneReason",
    "Tier", "checksum_for", "encode_record", "is_expired_tombstone", "is_present", "owned_by", "queue_entry", "queue_time", "raw_ssd_view",
    "record_model", "record_route", "record_tenant", "split_tail", "tiers_for", "tombstone_of", "wire_key_of",
    "with_route", "writable_tiers_for"
]

SCHEMA_VERSION = 1
RECORD = struct.Struct("<BBBBIQddd32s32s")
F64 = struct.Struct("<d")
# byte offsets of the fields that change in place (see the layout above)
TIERS_AT, REASON_AT, LAST_SEEN_AT, GONE_AT_AT, CHECKSUM_AT = 1, 2, 24, 32, 40
FLAGS_AT, LAYER_AT, NBYTES_AT, DIGEST_AT = 3, 4, 8, 72
ROUTED = 1                     # flags: the tail holds route keys after the model
TENANTED = 2                   # flags: the tail starts with the tenant's name
FOREIGN = b""                  # checksum_for: a block of another tenant than the reader's
U64 = struct.Struct("<Q")
U16 = struct.Struct("<H")
AGE = struct.Struct(">Q")      # big-endian microseconds: the queue sorts oldest first


def is_expired_tombstone(raw: bytes | None, now: float, gone_ttl: float) -> bool:
    return (raw is not None and len(raw) >= RECORD.size and raw[0] == SCHEMA_VERSION and raw[TIERS_AT] == 0
            and now - F64.unpack_from(raw, GONE_AT_AT)[0] > gone_ttl)


class Tier(enum.IntFlag):
    """Where a block's bytes are (a set: a block can be in several tiers at once)."""

    NONE = 0
    RAM = 1
    SSD = 2


class GoneReason(enum.IntEnum):
    NONE = 0
    EVICTED = 1           # dropped from the last tier that held it
    LOST_AT_RESTART = 2   # lived only in RAM when the daemon stopped
    CORRUPT = 3           # its SSD file failed verification and was quarantined
    FILE_MISSING = 4      # its SSD file was gone (or did not match) at a read or the boot reconcile

    @property
    def text(self) -> str:
        return _REASON_TEXT[self.value]


_REASON_TEXT = {0: "present", 1: "evicted", 2: "lost at restart (it lived only in RAM)",
                3: "its SSD copy was corrupt (quarantined)", 4: "its SSD file was missing or did not match"}


def queue_entry(last_seen: float, key: bytes) -> bytes:
    """The SSD queue entry of ``key`` used last at ``last_seen``."""
    return AGE.pack(max(0, int(last_seen * 1e6))) + key


def queue_time(entry: bytes) -> float:
    return AGE.unpack_from(entry)[0] / 1e6


def raw_ssd_view(raw: bytes) -> tuple[Tier, int, float, bytes, bytes, int] | None:
    """(tiers, nbytes, last_seen, checksum, digest, layer) of a raw record, or None if unreadable."""
    if len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION:
        return None
    _, tiers, _, _, layer, nbytes, _, last_seen, _, checksum, digest = RECORD.unpack_from(raw)
    return Tier(tiers), nbytes, last_seen, checksum, digest, layer


def _tenant_end(raw: bytes) -> int:
    """Where a readable raw record's tail goes on past its tenant's name."""
    return RECORD.size + 1 + raw[RECORD.size] if raw[FLAGS_AT] & TENANTED else RECORD.size


def split_tail(raw: bytes) -> tuple[bytes, bytes]:
    """(model, route keys) of a readable raw record, as stored (b"": no route keys). With
    :func:`record_tenant`, the one place that reads the tail's layout (see the module): the
    event publisher calls it for every change of every block."""
    start = _tenant_end(raw)
    if raw[FLAGS_AT] & ROUTED:
        model_at = start + U16.size
        end = model_at + (raw[start] | raw[start + 1] << 8)
        return raw[model_at:end], raw[end:]
    return raw[start:], b""


def record_tenant(raw: bytes) -> str:
    """The tenant whose block a readable raw record is ("": the default tenant's)."""
    if not raw[FLAGS_AT] & TENANTED:
        return ""
    return raw[RECORD.size + 1:_tenant_end(raw)].decode("utf-8", "replace")


def owned_by(raw: bytes, tenant: bytes) -> bool:
    """Whether a readable raw record is the block of ``tenant`` (a Tenant.tag, encoded; b"":
    the default tenant's), compared in place: every read checks it for every block it serves."""
    if not raw[FLAGS_AT] & TENANTED:
        return not tenant
    size = raw[RECORD.size]
    return size == len(tenant) and raw[RECORD.size + 1:RECORD.size + 1 + size] == tenant


# What one reader may know of a raw record (None: absent or unreadable), ``tenant`` the reader's
# (a Tenant.tag, encoded; None: the operator's, who may know every block).

def checksum_for(raw: bytes | None, tenant: bytes | None) -> bytes | None:
    """The record's payload checksum; :data:`FOREIGN` for a block of another tenant."""
    if raw is None or len(raw) < RECORD.size:
        return None
    return raw[CHECKSUM_AT:CHECKSUM_AT + 32] if tenant is None or owned_by(raw, tenant) else FOREIGN


def tiers_for(raw: bytes | None, tenant: bytes | None) -> Tier:
    """The record's tier set; NONE (absent) for a block of another tenant."""
    if raw is None or len(raw) < RECORD.size or (tenant is not None and not owned_by(raw, tenant)):
        return Tier.NONE
    return Tier(raw[TIERS_AT])


def writable_tiers_for(raw: bytes | None, tenant: bytes) -> Tier | None:
    """For a writer: the record's tier set (NONE: absent or a tombstone), or None where a block
    of another tenant is stored, which the writer may neither replace nor be told of."""
    if raw is None or len(raw) < RECORD.size:
        return Tier.NONE
    if owned_by(raw, tenant):
        return Tier(raw[TIERS_AT])
    return None if raw[TIERS_AT] else Tier.NONE


def record_model(raw: bytes) -> str:
    """The model of a readable raw record (invalid UTF-8 replaced: this names, never decides)."""
    return split_tail(raw)[0].decode("utf-8", "replace")


def record_route(raw: bytes) -> bytes | None:
    """The encoded route keys a readable raw record carries (None: it has none)."""
    return split_tail(raw)[1] or None


def with_route(raw: bytes, route: bytes) -> bytes:
    """A readable raw record with ``route`` as its route keys (replacing any it had)."""
    model = split_tail(raw)[0]
    head = bytearray(raw[:_tenant_end(raw)])
    head[FLAGS_AT] |= ROUTED
    return bytes(head) + U16.pack(len(model)) + model + route


def _tail(model: str, route: bytes, tenant: str) -> tuple[int, bytes]:
    encoded = model.encode()
    flags, tail = (ROUTED, U16.pack(len(encoded)) + encoded + route) if route else (0, encoded)
    if not tenant:
        return flags, tail
    name = tenant.encode()
    if len(name) > 255:
        raise ValueError(f"tenant name of {len(name)} bytes; at most 255")
    return flags | TENANTED, bytes([len(name)]) + name + tail


def encode_record(digest: bytes, layer: int, model: str, nbytes: int, checksum: bytes, created: float,
                  last_seen: float, tiers: int = 1, route: bytes = b"", tenant: str = "", gone_reason: int = 0,
                  gone_at: float = 0.0) -> bytes:
    """The bytes of a record of these fields (what BlockRecord(...).encode() gives), without
    making the record: the hot paths that store a block write its record straight away."""
    flags, tail = _tail(model, route, tenant)
    return RECORD.pack(SCHEMA_VERSION, tiers, gone_reason, flags, layer, nbytes, created, last_seen, gone_at, checksum,
                       digest) + tail


def tombstone_of(raw: bytes, reason: int, now: float, keep_tiers: int = 0) -> bytes:
    """``raw`` (a readable record) with its tiers masked by ``keep_tiers``: left in none, it
    becomes a tombstone, gone for ``reason`` at ``now``."""
    patched = bytearray(raw)
    patched[TIERS_AT] &= keep_tiers
    if not patched[TIERS_AT]:
        patched[REASON_AT] = reason
        F64.pack_into(patched, GONE_AT_AT, now)
    return bytes(patched)


@dataclass(frozen=True, slots=True)
class BlockRecord:
    digest: bytes
    layer: int
    model: str
    nbytes: int
    checksum: bytes
    created: float
    last_seen: float
    tiers: Tier = Tier.RAM
    gone_reason: GoneReason = GoneReason.NONE
    gone_at: float = 0.0
    route: bytes = b""          # the engine's keys of the block (kvcached_agent.route), if given
    tenant: str = ""            # whose block it is (kvcached.tenants); "": the default tenant's

    @property
    def present(self) -> bool:
        return self.tiers != Tier.NONE

    def encode(self) -> bytes:
        return encode_record(self.digest, self.layer, self.model, self.nbytes, self.checksum, self.created,
                             self.last_seen, int(self.tiers), self.route, self.tenant, int(self.gone_reason), self.gone_at)

    @classmethod
    def decode(cls, raw: bytes) -> "BlockRecord":
        if len(raw) < RECORD.size or raw[0] != SCHEMA_VERSION:
            raise ValueError(f"index record of {len(raw)} bytes, version {raw[:1].hex() or '?'} is not readable")
        (_, tiers, reason, _, layer, nbytes, created, last_seen, gone_at, checksum, digest) = RECORD.unpack_from(raw)
        model, route = split_tail(raw)
        return cls(digest, layer, model.decode(), nbytes, checksum, created, last_seen, Tier(tiers), GoneReason(reason),
                   gone_at, bytes(route), record_tenant(raw))

    def gone(self, reason: GoneReason, now: float) -> "BlockRecord":
        return replace(self, tiers=Tier.NONE, gone_reason=reason, gone_at=now)


def is_present(raw: bytes | None) -> bool:
    return raw is not None and len(raw) >= RECORD.size and raw[0] == SCHEMA_VERSION and raw[TIERS_AT] != 0


def wire_key_of(raw: bytes) -> bytes:
    """The block's address as the peer protocol writes it: digest, then u32 layer."""
    return raw[DIGEST_AT:DIGEST_AT + 32] + raw[LAYER_AT:LAYER_AT + 4]
