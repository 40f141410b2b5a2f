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

Splitting and merging the planes is a strided copy that numpy does at a few hundred MB/s; the
daemon's C extension kvcached/codecs/_planes.c (built by ``make install``, optional) does it at
memory speed, and :func:`reference_split` and :func:`reference_merge` (numpy) are what it is
tested against and what runs where it was not built.
"""

from __future__ import annotations

import importlib
import struct
import threading
from types import ModuleType
from typing import Any, Sequence

from kvcached.codecs.base import CodecError, register

__all__ = ["BytePlanes", "COMPILED", "PLANES_ZSTD", "reference_merge", "reference_split"]


def _compiled() -> ModuleType | None:
    try:
        return importlib.import_module("kvcached.codecs._planes")
    except ImportError:          # not built: numpy does the same, slower
        return None


_planes = _compiled()
COMPILED = _planes is not None


def reference_split(payload: memoryview, width: int) -> bytes:
    """The planes of ``payload`` (whole ``width``-byte elements), plane 0 first, by numpy."""
    import numpy as np

    return np.ascontiguousarray(np.frombuffer(payload, np.uint8).reshape(-1, width).T).tobytes()


def reference_merge(planes: Sequence[bytes | memoryview], width: int, out: memoryview) -> None:
    """Interleave ``planes`` (each len(out) / width bytes) into ``out``, by numpy."""
    import numpy as np

    dest = np.frombuffer(out, np.uint8).reshape(-1, width)
    for i, plane in enumerate(planes):
        dest[:, i] = np.frombuffer(plane, np.uint8)


_split = _planes.split if _planes is not None else reference_split
_merge = _planes.merge if _planes is not None else reference_merge

_HEAD = struct.Struct("<B")
_PLANE = struct.Struct("<BI")
RAW_PLANE, ZSTD_PLANE = 0, 1
SAMPLE_BYTES = 8192          # of a plane, compressed first: a plane that does not pay is not compressed whole
# zstd's fast strategy with a 64-entry match table and matches of 7 bytes at least: a plane of KV
# bytes is literals under a skewed distribution (an exponent byte takes a few values often), with
# few repeats worth a match, so what shrinks it is zstd's entropy coding of literals, and match
# search is mostly wasted. bench_codecs figure 3 compares the two on the same planes of real KV
# (docs/codecs.md has the figures). Any zstd frame decodes alike, so blocks coded under level 1
# read back unchanged.
ZSTD_PARAMETERS = {"strategy": "fast", "hash_log": 6, "min_match": 7, "search_log": 1, "chain_log": 6,
                   "target_length": 0, "compression_level": 1}


def zstd_compressor(level: int | None = None) -> Any:
    """A zstandard compressor with the codec's settings (:data:`ZSTD_PARAMETERS`), or at a plain
    ``level`` (bench_codecs compares the two on the same planes)."""
    import zstandard

    if level is not None:
        return zstandard.ZstdCompressor(level=level)
    strategy = getattr(zstandard, f"STRATEGY_{str(ZSTD_PARAMETERS['strategy']).upper()}")
    return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        **dict(ZSTD_PARAMETERS, strategy=strategy)))


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per I/O thread. zstandard is imported with the
    first block coded: a daemon whose SSD tier stores blocks raw never imports it
    (tests/unit/test_startup_imports.py)."""

    def __init__(self) -> None:
        import zstandard

        self.zstd: Any = zstandard
        self.compress = zstd_compressor()
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
        zstd = self._contexts.compress
        split = memoryview(_split(payload, width))
        size = n // width
        heads: list[bytes | memoryview] = [_HEAD.pack(width)]
        bodies: list[bytes | memoryview] = []
        for i in range(width):
            plane = split[i * size:(i + 1) * size]
            packed = zstd.compress(plane) if self._pays(plane, margin) else None
            if packed is not None and len(packed) < size:
                heads.append(_PLANE.pack(ZSTD_PLANE, len(packed)))
                bodies.append(packed)
            else:
                heads.append(_PLANE.pack(RAW_PLANE, size))
                bodies.append(plane)
        stored = b"".join(heads + bodies)
        return stored if len(stored) <= n * (1.0 - margin) else None

    def _pays(self, plane: memoryview, margin: float) -> bool:
        """Whether a sample of ``plane`` shrinks by ``margin`` under zstd (a small plane is tried whole)."""
        sample = plane[:SAMPLE_BYTES]
        return len(self._contexts.compress.compress(sample)) <= len(sample) * (1.0 - margin)

    def decode(self, stored: memoryview, out: memoryview) -> None:
        n, width = len(out), self.width
        if n % width:
            raise CodecError(f"a payload of {n} bytes is not whole {width}-byte elements")
        table = _HEAD.size + width * _PLANE.size
        if len(stored) < table or stored[0] != width:
            raise CodecError(f"stored form does not start with a {width}-plane table")
        elements = n // width
        ctx = self._contexts
        zstandard = ctx.zstd
        planes: list[bytes | memoryview] = []
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
            planes.append(plane)
        if at != len(stored):
            raise CodecError(f"{len(stored) - at} bytes past the last plane")
        _merge(planes, width, out)


PLANES_ZSTD = register(BytePlanes("planes-zstd", 1, 2))
