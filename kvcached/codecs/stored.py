"""What a block becomes on a cold tier: codec first, then sealing (:class:`StoredForm`).

Packing tries the configured codec (a block it cannot shrink by ``margin`` stays raw), then
seals the result under the block's tenant's key when sealing is on. Unpacking reverses it from
what the block's own header says (its codec's code, its nonce), not from the configuration, so
a block written under any settings reads under any other. The payload's checksum is the
caller's to check on the unpacked bytes. No I/O; runs on the SSD tier's I/O threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvcached.codecs.base import RAW, Codec, CodecError, codec_coded, codec_named
from kvcached.codecs.choice import CodecChoice
from kvcached.codecs.seal import Sealer, SealError

__all__ = ["AUTO", "AUTO_CODEC", "Packed", "StoredForm", "UnpackError", "stored_form"]

AUTO = "auto"                  # kv.ssd_codec: code where it pays (kvcached.codecs.choice)
AUTO_CODEC = "planes-zstd"     # ... with this codec

UnpackError = (CodecError, SealError)     # what unpacking a damaged or foreign stored form raises


@dataclass(frozen=True, slots=True)
class Packed:
    """A payload's stored form: ``codec`` its code (RAW: none); ``nonce`` and ``tag`` b"" unless
    sealed."""

    codec: int
    nonce: bytes
    tag: bytes
    data: bytes | memoryview


class StoredForm:
    """The codec (None: raw) and sealer (None: no sealing) of a cold tier; with ``choice``, the
    codec is used only where it pays (``kv.ssd_codec = "auto"``), and the tier reports its reads'
    times here (:meth:`read`) for the choice to weigh."""

    def __init__(self, codec: Codec | None = None, margin: float = 0.1, sealer: Sealer | None = None,
                 choice: CodecChoice | None = None) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"codec margin {margin} is not a fraction in [0, 1)")
        self.codec = codec
        self.margin = margin
        self.sealer = sealer
        self.choice = choice

    def read(self, nbytes: int, seconds: float) -> None:
        """The tier read ``nbytes`` of a block file from the disk in ``seconds`` (what coding
        would save a part of)."""
        if self.choice is not None:
            self.choice.read(nbytes, seconds)

    def wrote(self, nbytes: int, seconds: float) -> None:
        """The tier wrote (and synced) ``nbytes`` of a block file in ``seconds``."""
        if self.choice is not None:
            self.choice.wrote(nbytes, seconds)

    @property
    def plain(self) -> bool:
        """Whether every block is stored as it is (no codec, no sealing)."""
        return self.codec is None and self.sealer is None

    def pack(self, payload: memoryview, tenant: str, identity: bytes) -> Packed | None:
        """The stored form of ``payload`` (``tenant``'s; ``identity``: what the block is, bound
        into a seal), or None when it is stored as it is (raw and unsealed)."""
        code, data = RAW, None
        if self.codec is not None and (self.choice is None or self.choice.code_next()):
            started = time.perf_counter()
            data = self.codec.encode(payload, self.margin)
            if data is not None:
                code = self.codec.code
            if self.choice is not None:
                self.choice.encoded(len(payload), None if data is None else len(data), time.perf_counter() - started)
        if self.sealer is None:
            return None if data is None else Packed(code, b"", b"", data)
        nonce, tag, sealed = self.sealer.seal(tenant, payload if data is None else data, identity + bytes([code]))
        return Packed(code, nonce, tag, sealed)

    def unpack(self, codec: int, nonce: bytes, tag: bytes, stored: memoryview, out: memoryview, tenant: str,
               identity: bytes) -> None:
        """Write the payload of a stored form into ``out`` (exactly the payload's length).
        Raises CodecError or SealError (both in :data:`UnpackError`) for a form that does not
        unpack; a sealed form needs this tier's sealer (the key), whatever sealing is set to now."""
        data: bytes | memoryview = stored
        if nonce:
            if self.sealer is None:
                raise SealError("the block is sealed and this daemon has no sealing key set up (tenants.seal_ssd)")
            data = self.sealer.open(tenant, nonce, tag, stored, identity + bytes([codec]))
        if codec == RAW:
            if len(data) != len(out):
                raise CodecError(f"raw stored form of {len(data)} bytes for a payload of {len(out)}")
            out[:] = data
            return
        started = time.perf_counter()
        codec_coded(codec).decode(memoryview(data), out)
        if self.choice is not None:
            self.choice.decoded(len(out), time.perf_counter() - started)


def stored_form(codec: str, margin: float, sealer: Sealer | None) -> StoredForm:
    """The stored form ``kv.ssd_codec`` names: "none", a codec's name, or :data:`AUTO`
    (:data:`AUTO_CODEC` where it pays); KeyError for a name no codec has."""
    if codec == AUTO:
        return StoredForm(codec_named(AUTO_CODEC), margin, sealer, CodecChoice())
    return StoredForm(codec_named(codec), margin, sealer)
