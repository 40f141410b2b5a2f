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

Version 2 (a block stored in another form than its payload: coded, sealed or both; a plain
block is still written as version 1, so that an older kvcached reads it) adds, before the header
checksum, which moves to offset 160::

    96  u8  codec (kvcached.codecs: 0 raw)
    97  u8  sealed (1: AES-256-GCM under the tenant's key, kvcached.codecs.seal)
    98  6s  zero
    104 u64 stored length (bytes of the stored form after the header page; at most the length)
    112 28s the seal: a 16-byte salt (the file's key), then a 12-byte nonce (sealed; else zero)
    140 16s the seal's tag (sealed; else zero): kept here, a sealed block's file is no bigger
    156 4s  zero
    160 16s header checksum (BLAKE3-256 of bytes 0..160, first 16 bytes)

The payload checksum is always the payload's own (the decoded bytes), so it guards a coded block
exactly as a raw one.

A header that fails its own checksum, or disagrees with the index record, means the file is not
the block the index describes; a payload that fails the payload checksum is corrupt. Either way
the block is never served.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import blake3

__all__ = ["PAGE", "HEADER_BYTES", "MAGIC", "FORMAT_VERSION", "STORED_VERSION", "SUFFIX", "BlockHeader", "HeaderError",
           "block_dir", "block_name", "file_bytes", "padded", "leaf_dirs", "parse_name"]

PAGE = 4096
HEADER_BYTES = PAGE
MAGIC = b"KVCBLK\r\n"
FORMAT_VERSION = 1            # a plain block (its payload as it is)
STORED_VERSION = 2            # a coded or sealed block
SUFFIX = ".kvb"
TMP_MARK = ".tmp-"           # <name>.tmp-<boot token>-<n>: a write not yet published
_FIXED = struct.Struct("<8sHHIQd32s32s")
_CHECKED = _FIXED.size       # 96: bytes covered by the header checksum (version 1)
_STORED = struct.Struct("<BB6xQ28s16s4x")    # version 2's fields after the fixed ones
_CHECKED_V2 = _CHECKED + _STORED.size        # 160
_HEADER_SUM = 16
SEAL_BYTES = 28              # salt and nonce (kvcached.codecs.seal)
TAG_BYTES = 16


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
    """A block file's header: what the block is (digest, layer, payload length and checksum,
    created) and, for a coded or sealed block, how it is stored (``codec``, the stored form's
    length ``stored``, the seal's ``nonce``; defaults: a plain block)."""

    digest: bytes
    layer: int
    length: int
    checksum: bytes
    created: float
    codec: int = 0
    stored: int = -1          # -1: the payload's own length (a plain block)
    nonce: bytes = b""        # the seal (salt and nonce); b"": not sealed
    tag: bytes = b""          # the seal's tag (sealed)

    @property
    def stored_length(self) -> int:
        """Bytes of the stored form after the header page."""
        return self.length if self.stored < 0 else self.stored

    @property
    def plain(self) -> bool:
        """Whether the file holds the payload as it is (version 1)."""
        return self.codec == 0 and not self.nonce and self.stored_length == self.length

    @property
    def file_size(self) -> int:
        """The size of this block's file."""
        return HEADER_BYTES + padded(self.stored_length)

    def identity(self) -> bytes:
        """What the block is, as bytes (a seal's associated data: a sealed form moved under
        another block's name does not open)."""
        return self.digest + struct.pack("<IQ", self.layer, self.length) + self.checksum

    def encode(self) -> bytes:
        """The whole 4096-byte header page (version 1 for a plain block, else 2)."""
        plain = self.plain
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION if plain else STORED_VERSION, HEADER_BYTES, self.layer, self.length,
                            self.created, self.digest, self.checksum)
        if not plain:
            fixed += _STORED.pack(self.codec, 1 if self.nonce else 0, self.stored_length, self.nonce.ljust(SEAL_BYTES, b"\0"),
                                  self.tag.ljust(TAG_BYTES, b"\0"))
        return fixed + blake3.blake3(fixed).digest()[:_HEADER_SUM] + bytes(HEADER_BYTES - len(fixed) - _HEADER_SUM)

    @classmethod
    def decode(cls, page: bytes | bytearray | memoryview | mmap.mmap) -> "BlockHeader":
        if len(page) < _CHECKED + _HEADER_SUM:
            raise HeaderError(f"header is {len(page)} bytes, shorter than {_CHECKED + _HEADER_SUM}")
        magic, version, header_bytes, layer, length, created, digest, checksum = _FIXED.unpack(bytes(page[:_CHECKED]))
        if magic != MAGIC:
            raise HeaderError(f"bad magic {magic!r}: not a kvcached block file")
        if version not in (FORMAT_VERSION, STORED_VERSION):
            raise HeaderError(f"format version {version}; this kvcached reads {FORMAT_VERSION} and {STORED_VERSION}")
        checked = _CHECKED if version == FORMAT_VERSION else _CHECKED_V2
        if len(page) < checked + _HEADER_SUM:
            raise HeaderError(f"header is {len(page)} bytes, shorter than {checked + _HEADER_SUM}")
        fixed = bytes(page[:checked])
        if bytes(page[checked:checked + _HEADER_SUM]) != blake3.blake3(fixed).digest()[:_HEADER_SUM]:
            raise HeaderError("header checksum mismatch (damaged header)")
        if header_bytes != HEADER_BYTES:
            raise HeaderError(f"header size {header_bytes}; expected {HEADER_BYTES}")
        if version == FORMAT_VERSION:
            return cls(digest, layer, length, checksum, created)
        codec, sealed, stored, nonce, tag = _STORED.unpack_from(fixed, _CHECKED)
        if sealed not in (0, 1):
            raise HeaderError(f"sealed flag {sealed} is neither 0 nor 1")
        if stored > length:      # a stored form is never longer than its payload (a forged one must not size a read)
            raise HeaderError(f"stored length {stored} is more than the payload's {length}")
        return cls(digest, layer, length, checksum, created, codec, stored, nonce if sealed else b"", tag if sealed else b"")

    def disagreement(self, digest: bytes, layer: int, length: int, checksum: bytes) -> str | None:
        """Why this header does not describe that block (None: it does)."""
        if self.digest != digest or self.layer != layer:
            return "the header names another block"
        if self.length != length:
            return f"payload length {self.length} in the header, {length} in the index"
        if self.checksum != checksum:
            return "payload checksum in the header differs from the index"
        return None
