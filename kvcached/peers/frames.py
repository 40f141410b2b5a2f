"""The peer protocol's ground (sans-I/O): its version and limits, its error and miss codes, and
the helpers every message body is built with. kvcached.peers.protocol holds the messages of the
QUIC session and the lanes; kvcached.peers.protocol_nixl those of the NIXL lane. Both build on
this module only, so neither imports the other's messages to know the limits.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Sequence

from kvcached_agent.address import DIGEST_BYTES
from kvcached_agent.framing import Limits, count_field, text_field

__all__ = [
    "VERSION", "MAX_BODY", "MAX_BATCH", "MAX_TEXT", "MAX_PAYLOAD", "MAX_HOLDERS", "MAX_NAMES", "LIMITS",
    "ErrorCode", "MissReason", "U16", "U32", "U64", "ADDRESS", "DIGEST",
    "text_body", "digest_body", "count_body", "addresses_body",
]

VERSION = 1
MAX_BODY = 4 << 20          # bytes after the header (a Block's payload not counted)
MAX_BATCH = 65536           # entries in one frame: a full batch of addresses is 2.25 MiB
MAX_TEXT = 1024             # bytes of one text field (UTF-8)
MAX_PAYLOAD = 1 << 30       # the protocol's ceiling on one payload; a daemon sets its own, lower
MAX_HOLDERS = 64            # holders of one block in a Located answer (a home names at most these)
MAX_NAMES = 4096            # member names in one Located frame

U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
ADDRESS = struct.Struct(f"<{DIGEST_BYTES}sI")      # (digest, layer)
DIGEST = struct.Struct(f"<{DIGEST_BYTES}s")


class ErrorCode(IntEnum):
    """Why a request (or the whole stream) failed; carried by :class:`Error`. 1-4 and 6-8 mean
    what they mean in the agent protocol; the two lists are separate all the same."""

    MALFORMED = 1            # the body does not parse (counts, lengths, text, flags)
    UNSUPPORTED_VERSION = 2  # a header version this side does not speak
    UNKNOWN_TYPE = 3         # a message type this side does not know
    TOO_LARGE = 4            # body over the limit, batch over MAX_BATCH, text over MAX_TEXT, payload over the limit
    EARLY_DATA = 5           # a message that changes state arrived as 0-RTT early data: send it again after the handshake
    INVALID_ARGUMENT = 6
    RESOURCE_EXHAUSTED = 7
    UNAVAILABLE = 8
    UNEXPECTED = 9           # a message this side does not take here (an answer as a request, a Snapshot part out of order)
    INTERNAL = 10


class MissReason(IntEnum):
    """Why a pulled block is not sent; carried by :class:`Miss`. Any Miss is a miss to the puller;
    the reason says whether asking another peer (or later) can help."""

    NOT_FOUND = 1    # no tier here holds it (dropped since it was announced)
    DAMAGED = 2      # the copy here failed its checksum: quarantined, never served
    BUSY = 3         # being written, or it cannot be pinned right now
    OVERLOADED = 4   # too many pulls in flight here
    TOO_LARGE = 5    # its payload is over the Pull's max_payload


LIMITS = Limits(VERSION, MAX_BODY, MAX_BATCH, MAX_TEXT, ErrorCode)


# -- body helpers ----------------------------------------------------------------------------

def text_body(value: str, name: str) -> bytes:
    return text_field(value, name, LIMITS)


def digest_body(value: bytes, what: str) -> bytes:
    if len(value) != DIGEST_BYTES:
        raise ValueError(f"{what}: a digest is {len(value)} bytes, not {DIGEST_BYTES}")
    return value


def count_body(n: int, what: str) -> bytes:
    return count_field(n, what, LIMITS)


def addresses_body(rows: Sequence[tuple[bytes, int]], what: str) -> bytes:
    return count_body(len(rows), what) + b"".join(ADDRESS.pack(digest_body(d, what), layer) for d, layer in rows)
