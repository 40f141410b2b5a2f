"""The codec interface and its registry: what a block's bytes become on a cold tier.

A :class:`Codec` turns a block's payload into a stored form and back. Each has a config name
(``kv.ssd_codec``) and a one-byte code written beside the stored form (the SSD file's header,
kvcached.tiers.ssd_format), so that any node and any later version decodes a block by what the
file says, whatever its own configuration. Codes are never reused: a code names one format for
ever. No I/O here; codecs run on the SSD tier's I/O threads, never on the event loop.

Every codec here is lossless: its decoded bytes are the payload, bit for bit, so the payload's
BLAKE3 checksum guards every read after decoding as it does without a codec.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["CODECS", "RAW", "Codec", "CodecError", "codec_coded", "codec_named", "register"]

RAW = 0     # the code of the raw form: the payload as it is


class CodecError(ValueError):
    """A stored form that does not decode (the text says why): the block is damaged."""


class Codec(Protocol):
    """One way to store a payload. Implementations keep no state between calls that another
    thread could see (per-thread contexts are their own business)."""

    name: str      # the config string (kv.ssd_codec)
    code: int      # the byte on disk; 1..255, unique, never reused

    def encode(self, payload: memoryview, margin: float) -> bytes | None:
        """The stored form of ``payload``, or None when it would not be at least ``margin``
        (a fraction, 0..1) smaller than the payload: such a block is stored raw."""
        ...

    def decode(self, stored: memoryview, out: memoryview) -> None:
        """Write the payload whose stored form is ``stored`` into ``out`` (exactly the payload's
        length). Raises :class:`CodecError` when ``stored`` is not a stored form of a payload of
        that length."""
        ...


CODECS: dict[str, Codec] = {}
_BY_CODE: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add ``codec`` to the registry (its name and code must be new)."""
    if codec.name in CODECS or codec.code in _BY_CODE or not 0 < codec.code < 256:
        raise ValueError(f"codec {codec.name!r} (code {codec.code}) clashes with a registered one or has a bad code")
    CODECS[codec.name] = codec
    _BY_CODE[codec.code] = codec
    return codec


def codec_named(name: str) -> Codec | None:
    """The codec ``kv.ssd_codec`` names (None: "none", store every block raw). KeyError for a
    name no codec has."""
    if name == "none":
        return None
    try:
        return CODECS[name]
    except KeyError:
        raise KeyError(f"no codec called {name!r}; known: none, {', '.join(sorted(CODECS))}") from None


def codec_coded(code: int) -> Codec:
    """The codec a stored form's code names; CodecError for a code this version does not know
    (a file written by a newer kvcached: never served, as a damaged one)."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise CodecError(f"codec code {code} is unknown to this kvcached (written by a newer version?)") from None
