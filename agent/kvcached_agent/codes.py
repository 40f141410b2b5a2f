"""The agent protocol's limits, codes and body helpers, shared by its requests
(kvcached_agent.protocol) and replies (kvcached_agent.replies). No I/O.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Sequence

from kvcached_agent.framing import BodyReader, Limits, count_field, text_field

__all__ = ["VERSION", "MAX_BODY", "MAX_BATCH", "MAX_TEXT", "DIGEST", "ErrorCode", "Status", "LIMITS"]

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


