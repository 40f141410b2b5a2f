"""The on-disk format of SSD block files (docs/ssd-format.md): names, header, layout. No I/O.

One file per block::

    <ssd_dir>/blocks/<k0>/<k1>/<digest[:8] hex>-<layer 8 hex>.kvb

where ``k0`` is the first byte of the block's index key in two hex digits and ``k1`` the high
nibble of the second byte in one (256 x 16 = 4096 leaf directories, so a million blocks put about
250 files in each). The file is a 4096-byte header page followed by the payload, zero-padded to
a multiple of 4096 so that reads and writes can use O_DIRECT straight into and out of arena
slots (which are 4 KiB aligned).

Header (little-endian; the rest of the page is zero)::

    0   8s  magic b"KVCBLK\\r\\n"
    8   u16 format version (1)
    10  u16 header bytes (4096)
    12  u32 layer
    16  u64 payload length
    24  f64 created (Unix seconds)
    32  32s digest (the block's chained BLAKE3 digest)
    64  32s payload checksum (BLAKE3-256 of the payload bytes)
    96  16s header checksum (BLAKE3-256 of bytes 0..96, first 16 bytes)

A header that fails its own checksum, or disagrees with the index record, means the file is not
the block the index describes; a payload that fails the payload checksum is corrupt. Either way
the block is never served.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import blake3

__all__ = ["PAGE", "HEADER_BYTES", "MAGIC", "FORMAT_VERSION", "SUFFIX", "BlockHeader", "HeaderError",
           "block_dir", "block_name", "file_bytes", "padded", "leaf_dirs", "parse_name"]

PAGE = 4096
HEADER_BYTES = PAGE
MAGIC = b"KVCBLK\r\n"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_MARK = ".tmp-"           # <name>.tmp-<boot token>-<n>: a write not yet published
_FIXED = struct.Struct("<8sHHIQd32s32s")
_CHECKED = _FIXED.size       # 96: bytes covered by the header checksum
_HEADER_SUM = 16


class HeaderError(ValueError):
    """The bytes are not a valid block header (the text says what is wrong)."""


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of pages."""
    return -(-nbytes // PAGE) * PAGE


def file_bytes(nbytes: int) -> int:
    """Size of the file of a block of ``nbytes`` payload bytes."""
    return HEADER_BYTES + padded(nbytes)


def block_dir(key: bytes) -> str:
    """The leaf directory (relative to ``<ssd_dir>/blocks``) of the block with index ``key``."""
    return f"{key[0]:02x}/{key[1] >> 4:x}"


def block_name(digest: bytes, layer: int) -> str:
    """The file name of block (digest, layer). The 64-bit digest prefix can collide; the header
    carries the whole digest and is checked on every read."""
    return f"{digest[:8].hex()}-{layer:08x}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int] | None:
    """(digest prefix, layer) of a block file name, or None if it is not one."""
    if len(name) != 16 + 1 + 8 + len(SUFFIX) or not name.endswith(SUFFIX) or name[16] != "-":
        return None
    try:
        return bytes.fromhex(name[:16]), int(name[17:25], 16)
    except ValueError:
        return None


def leaf_dirs() -> list[str]:
    """Every leaf directory, relative to ``<ssd_dir>/blocks``."""
    return [f"{a:02x}/{b:x}" for a in range(256) for b in range(16)]


@dataclass(frozen=True, slots=True)
class BlockHeader:
    digest: bytes
    layer: int
    length: int
    checksum: bytes
    created: float

    def encode(self) -> bytes:
        """The whole 4096-byte header page."""
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, self.layer, self.length, self.created,
                            self.digest, self.checksum)
        return fixed + blake3.blake3(fixed).digest()[:_HEADER_SUM] + bytes(HEADER_BYTES - _CHECKED - _HEADER_SUM)

    @classmethod
    def decode(cls, page: bytes | bytearray | memoryview | mmap.mmap) -> "BlockHeader":
        if len(page) < _CHECKED + _HEADER_SUM:
            raise HeaderError(f"header is {len(page)} bytes, shorter than {_CHECKED + _HEADER_SUM}")
        fixed = bytes(page[:_CHECKED])
        magic, version, header_bytes, layer, length, created, digest, checksum = _FIXED.unpack(fixed)
        if magic != MAGIC:
            raise HeaderError(f"bad magic {magic!r}: not a kvcached block file")
        if version != FORMAT_VERSION:
            raise HeaderError(f"format version {version}; this kvcached reads {FORMAT_VERSION}")
        if bytes(page[_CHECKED:_CHECKED + _HEADER_SUM]) != blake3.blake3(fixed).digest()[:_HEADER_SUM]:
            raise HeaderError("header checksum mismatch (damaged header)")
        if header_bytes != HEADER_BYTES:
            raise HeaderError(f"header size {header_bytes}; expected {HEADER_BYTES}")
        return cls(digest, layer, length, checksum, created)

    def disagreement(self, digest: bytes, layer: int, length: int, checksum: bytes) -> str | None:
        """Why this header does not describe that block (None: it does)."""
        if self.digest != digest or self.layer != layer:
            return "the header names another block"
        if self.length != length:
            return f"payload length {self.length} in the header, {length} in the index"
        if self.checksum != checksum:
            return "payload checksum in the header differs from the index"
        return None
