"""Byte planes, then zstd: the lossless codec for 16-bit KV (bf16, fp16).

A 16-bit float's high byte (sign and most of the exponent) takes few values across a block of
KV, while its low byte (the mantissa's low bits) is close to random. Interleaved, the two defeat
a general compressor; split into a plane of high bytes and a plane of low bytes, the high plane
compresses well and the low plane is left as it is. Each plane is compressed with zstd (level 1:
its higher levels cost more time and, measured on KV, win little) and stored raw when zstd does
not shrink it; a sample of the plane is tried first, so a near-random plane costs little.

Stored form (little-endian)::

    u8 width (2) | per plane: u8 mode (0 raw, 1 zstd) | u32 stored bytes | then the planes

Plane ``i`` holds byte ``i`` of every element (little-endian: plane 1 is the high bytes). The
decoded bytes are the payload bit for bit. A payload whose length is not a whole number of
elements is not encoded (stored raw).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from kvcached.codecs.base import CodecError, register

__all__ = ["BytePlanes", "PLANES_ZSTD"]

_HEAD = struct.Struct("<B")
_PLANE = struct.Struct("<BI")
RAW_PLANE, ZSTD_PLANE = 0, 1
SAMPLE_BYTES = 8192          # of a plane, compressed first: a plane that does not pay is not compressed whole
ZSTD_LEVEL = 1


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per I/O thread. numpy and zstandard are
    imported with the first block coded: a daemon whose SSD tier stores blocks raw never
    imports them (tests/unit/test_startup_imports.py)."""

    def __init__(self) -> None:
        import numpy
        import zstandard

        self.np: Any = numpy
        self.zstd: Any = zstandard
        self.compress = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompress = zstandard.ZstdDecompressor()


class BytePlanes:
    """The codec of the module, for elements of ``width`` bytes."""

    def __init__(self, name: str, code: int, width: int = 2) -> None:
        self.name = name
        self.code = code
        self.width = width
        self._local: _Contexts | None = None       # made with the first block coded (see _Contexts)

    @property
    def _contexts(self) -> _Contexts:
        local = self._local
        if local is None:
            local = self._local = _Contexts()
        return local

    def encode(self, payload: memoryview, margin: float) -> bytes | None:
        n, width = len(payload), self.width
        if n == 0 or n % width:
            return None
        ctx = self._contexts
        np = ctx.np
        planes = np.frombuffer(payload, np.uint8).reshape(-1, width).T
        zstd = ctx.compress
        heads, bodies = [_HEAD.pack(width)], []
        for i in range(width):
            plane = np.ascontiguousarray(planes[i])
            packed = zstd.compress(plane) if self._pays(plane, margin) else None
            if packed is not None and len(packed) < plane.nbytes:
                heads.append(_PLANE.pack(ZSTD_PLANE, len(packed)))
                bodies.append(packed)
            else:
                heads.append(_PLANE.pack(RAW_PLANE, plane.nbytes))
                bodies.append(plane.tobytes())
        stored = b"".join(heads + bodies)
        return stored if len(stored) <= n * (1.0 - margin) else None

    def _pays(self, plane: Any, margin: float) -> bool:
        """Whether a sample of ``plane`` shrinks by ``margin`` under zstd (a small plane is tried whole)."""
        sample = plane[:SAMPLE_BYTES]
        return len(self._contexts.compress.compress(sample)) <= sample.nbytes * (1.0 - margin)

    def decode(self, stored: memoryview, out: memoryview) -> None:
        n, width = len(out), self.width
        if n % width:
            raise CodecError(f"a payload of {n} bytes is not whole {width}-byte elements")
        table = _HEAD.size + width * _PLANE.size
        if len(stored) < table or stored[0] != width:
            raise CodecError(f"stored form does not start with a {width}-plane table")
        elements = n // width
        ctx = self._contexts
        np, zstandard = ctx.np, ctx.zstd
        dest = np.frombuffer(out, np.uint8).reshape(-1, width)
        at = table
        for i in range(width):
            mode, size = _PLANE.unpack_from(stored, _HEAD.size + i * _PLANE.size)
            body = stored[at:at + size]
            if len(body) != size:
                raise CodecError(f"plane {i} runs past the stored form ({size} bytes at {at} of {len(stored)})")
            at += size
            if mode == RAW_PLANE:
                plane = body
            elif mode == ZSTD_PLANE:
                try:      # the frame's own size first: a forged one must not make us allocate it
                    if zstandard.frame_content_size(body) not in (elements, -1):
                        raise CodecError(f"plane {i} says it holds {zstandard.frame_content_size(body)} bytes, not {elements}")
                    plane = memoryview(ctx.decompress.decompress(body, max_output_size=elements))
                except zstandard.ZstdError as exc:
                    raise CodecError(f"plane {i} does not decompress: {exc}") from None
            else:
                raise CodecError(f"plane {i} has unknown mode {mode}")
            if len(plane) != elements:
                raise CodecError(f"plane {i} holds {len(plane)} bytes, not {elements}")
            dest[:, i] = np.frombuffer(plane, np.uint8)
        if at != len(stored):
            raise CodecError(f"{len(stored) - at} bytes past the last plane")


PLANES_ZSTD = register(BytePlanes("planes-zstd", 1, 2))
