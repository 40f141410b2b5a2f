"""The framing both kvcached wire protocols share (sans-I/O): the agent protocol
(kvcached_agent.protocol) and the daemons' peer protocol (kvcached.peers.protocol).

Each protocol keeps its own version, message types, error codes and limits; what they share is
how a frame is laid out and how a body is read and written:

- every frame is a 12-byte header, then a body::

      u32 body length | u8 version | u8 type | u16 flags (0) | u32 request id

  little-endian (:data:`HEADER`); a header is checked (:func:`header_problem`) before any byte
  of the body it announces is buffered;
- a body is read field by field by a :class:`BodyReader`, which refuses every shortfall,
  overrun, count over the batch limit and text over the text limit, before allocating for it;
- the writers (:func:`text_field`, :func:`count_field`, :func:`frame`) refuse what the reader
  would refuse, with ValueError (a sender's bug, not the peer's).

Errors are :class:`ProtocolError`, whose ``code`` is a member of the protocol's own error
enumeration: codes 1-4 mean the same in both (:data:`SHARED_CODES`), so the reader raises them
through the protocol's :class:`Limits`. This module lives in the agent package because the agent
imports nothing of the daemon; the daemon imports it from here, as it does the addressing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

__all__ = ["HEADER", "SHARED_CODES", "Frame", "Limits", "ProtocolError", "BodyReader", "header_problem",
           "text_field", "count_field", "frame"]

HEADER = struct.Struct("<IBBHI")
SHARED_CODES = ("MALFORMED", "UNSUPPORTED_VERSION", "UNKNOWN_TYPE", "TOO_LARGE")   # 1-4, in every protocol

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class ProtocolError(Exception):
    """Bytes this side cannot accept. ``code``: the protocol's error code; ``fatal``: the framing
    is lost (answer, then end the stream); ``request_id``: the request it concerns, where the
    header was read."""

    def __init__(self, code: IntEnum, message: str, *, fatal: bool = False, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class Frame:
    """A whole frame: its type, request id and body."""

    type: int
    request_id: int
    body: bytes


@dataclass(frozen=True)
class Limits:
    """One protocol's framing: its version, limits, and error codes (an IntEnum with at least
    the members named in :data:`SHARED_CODES`, numbered 1-4 in that order)."""

    version: int
    max_body: int
    max_batch: int
    max_text: int
    codes: type[IntEnum]

    def error(self, name: str, message: str, **kw: Any) -> ProtocolError:
        return ProtocolError(self.codes[name], message, **kw)


def header_problem(limits: Limits, length: int, version: int, flags: int, request_id: int,
                   max_body: int | None = None) -> ProtocolError | None:
    """What is wrong with a frame header (a fatal error: the framing is lost), or None.
    ``max_body``: the receiver's own body limit, when lower than the protocol's."""
    if version != limits.version:
        return limits.error("UNSUPPORTED_VERSION", f"frame version {version}; this side speaks version "
                            f"{limits.version}", fatal=True, request_id=request_id)
    if flags:
        return limits.error("MALFORMED", f"frame flags 0x{flags:04x} are not defined in version {limits.version}",
                            fatal=True, request_id=request_id)
    most = limits.max_body if max_body is None else max_body
    if length > most:
        return limits.error("TOO_LARGE", f"frame body of {length} bytes is over the limit of {most}",
                            fatal=True, request_id=request_id)
    return None


class BodyReader:
    """Fields off one body, in order; every shortfall or overrun is MALFORMED, a count over the
    batch limit or a text over the text limit TOO_LARGE (``what`` names the message)."""

    __slots__ = ("body", "pos", "what", "limits")

    def __init__(self, body: bytes, what: str, limits: Limits) -> None:
        self.body, self.pos, self.what, self.limits = body, 0, what, limits

    def _short(self) -> ProtocolError:
        return self.limits.error("MALFORMED", f"{self.what}: body ends early ({len(self.body)} bytes)")

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.body):
            raise self._short()
        out = self.body[self.pos:end]
        self.pos = end
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        if self.pos + fmt.size > len(self.body):
            raise self._short()
        out = fmt.unpack_from(self.body, self.pos)
        self.pos += fmt.size
        return out

    def u16(self) -> int:
        return int(self.unpack(_U16)[0])

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def u64(self) -> int:
        return int(self.unpack(_U64)[0])

    def raw(self, name: str) -> bytes:
        """A u16-length-prefixed byte string of at most the text limit."""
        n = self.u16()
        if n > self.limits.max_text:
            raise self.limits.error("TOO_LARGE", f"{self.what}: {name} is {n} bytes, over {self.limits.max_text}")
        return self.take(n)

    def text(self, name: str) -> str:
        """A u16-length-prefixed UTF-8 text of at most the text limit."""
        try:
            return self.raw(name).decode("utf-8")
        except UnicodeDecodeError:
            raise self.limits.error("MALFORMED", f"{self.what}: {name} is not UTF-8") from None

    def count(self, entry: int) -> int:
        """A u32 entry count, checked against the batch limit and against the bytes that remain
        (the entries, ``entry`` bytes each, must be all of them)."""
        n = self.u32()
        limits = self.limits
        if n > limits.max_batch:
            raise limits.error("TOO_LARGE", f"{self.what}: {n} entries, over the limit of {limits.max_batch}")
        left = len(self.body) - self.pos
        if n * entry != left:
            raise limits.error("MALFORMED", f"{self.what}: {n} entries of {entry} bytes need {n * entry} bytes, "
                               f"the body has {left}")
        return n

    def entries(self, fmt: struct.Struct) -> list[tuple[Any, ...]]:
        """A counted batch of ``fmt`` entries: the rest of the body."""
        n = self.count(fmt.size)
        end = self.pos + n * fmt.size
        out = list(fmt.iter_unpack(self.body[self.pos:end])) if n else []
        self.pos = end
        return out

    def end(self) -> None:
        if self.pos != len(self.body):
            raise self.limits.error("MALFORMED", f"{self.what}: {len(self.body) - self.pos} bytes left over")


def text_field(value: str | bytes, name: str, limits: Limits) -> bytes:
    """``value`` as a u16-length-prefixed field (text as UTF-8); ValueError past the text limit."""
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if len(raw) > limits.max_text:
        raise ValueError(f"{name} is {len(raw)} bytes, over {limits.max_text}")
    return _U16.pack(len(raw)) + raw


def count_field(n: int, what: str, limits: Limits) -> bytes:
    """A batch's u32 entry count; ValueError past the batch limit."""
    if n > limits.max_batch:
        raise ValueError(f"{what}: {n} entries, over the limit of {limits.max_batch} (split the batch)")
    return _U32.pack(n)


def frame(limits: Limits, type_: int, request_id: int, body: bytes, what: str) -> bytes:
    """The frame of a ``type_`` message with ``body``; ValueError past the body limit."""
    if len(body) > limits.max_body:
        raise ValueError(f"{what}: body of {len(body)} bytes is over {limits.max_body} (split the batch)")
    return HEADER.pack(len(body), limits.version, type_, 0, request_id & 0xFFFFFFFF) + body
