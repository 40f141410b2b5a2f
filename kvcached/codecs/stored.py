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
from typing import Any, Callable

from kvcached.codecs.base import RAW, Codec, CodecError, codec_coded, codec_named
from kvcached.codecs.choice import CodecChoice
from kvcached.codecs.seal import Sealer, SealError

__all__ = ["AUTO", "AUTO_CODEC", "Packed", "StoredForm", "UnpackError", "stored_form"]

AUTO = "auto"                  # kv.ssd_codec: code where it pays (kvcached.codecs.choice)
AUTO_CODEC = "planes-zstd"     # ... with this codec

UnpackError = (CodecError, SealError)     # what unpacking a damaged or foreign stored form raises


@dataclass(frozen=True, slots=True)
class Packed:
    """A payload's stored form, the first ``length`` bytes of the buffer :meth:`StoredForm.pack`
    was given: ``codec`` its code (RAW: none); ``nonce`` and ``tag`` b"" unless sealed."""

    codec: int
    nonce: bytes
    tag: bytes
    length: int


class StoredForm:
    """The codec (None: raw) and sealer of a cold tier. ``sealer`` opens sealed files whatever
    ``seal`` says (a daemon that stops sealing still reads what it sealed); ``seal`` says whether
    new ones are sealed. With ``choice``, the codec is used only where it pays (``kv.ssd_codec =
    "auto"``), and the tier reports its I/O times here (:meth:`read`, :meth:`wrote`) for the
    choice to weigh. ``granule``: the tier stores in whole units of it (the SSD's pages), so a
    coded form must save the margin in those units, not in bytes that padding gives back."""

    def __init__(self, codec: Codec | None = None, margin: float = 0.1, sealer: Sealer | None = None,
                 choice: CodecChoice | None = None, *, seal: bool | None = None, granule: int = 1) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"codec margin {margin} is not a fraction in [0, 1)")
        if seal and sealer is None:
            raise ValueError("sealing new blocks needs a sealer (the tenant key)")
        self.codec = codec
        self.margin = margin
        self.sealer = sealer
        self.seal = sealer is not None if seal is None else seal
        self.choice = choice
        self.granule = granule

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
        """Whether every new block is stored as it is (no codec, no sealing)."""
        return self.codec is None and not self.seal

    def _whole(self, nbytes: int) -> int:
        return -(-nbytes // self.granule) * self.granule

    def pack(self, payload: memoryview, tenant: str, identity: bytes, buffer: Callable[[int], Any]) -> Packed | None:
        """The stored form of ``payload`` (``tenant``'s; ``identity``: what the block is, bound
        into a seal), written into ``buffer(n)`` (a writable buffer of at least n bytes); None
        when it is stored as it is (raw and unsealed: nothing written)."""
        code, data = RAW, None
        if self.codec is not None and (self.choice is None or self.choice.code_next()):
            started = time.perf_counter()
            data = self.codec.encode(payload, self.margin)
            if data is not None and self._whole(len(data)) > self._whole(len(payload)) * (1.0 - self.margin):
                data = None          # saves less than the margin once padded: not worth a decode at every read
            if data is not None:
                code = self.codec.code
            if self.choice is not None:
                stored = None if data is None else self._whole(len(data)) * len(payload) // self._whole(len(payload))
                self.choice.encoded(len(payload), stored, time.perf_counter() - started)
        if not self.seal or self.sealer is None:
            if data is None:
                return None
            buffer(len(data))[:len(data)] = data
            return Packed(code, b"", b"", len(data))
        source = payload if data is None else data
        nonce, tag = self.sealer.seal_into(tenant, source, identity + bytes([code]), buffer(len(source)))
        return Packed(code, nonce, tag, len(source))

    def unpack(self, codec: int, nonce: bytes, tag: bytes, stored: memoryview, out: memoryview, tenant: str,
               identity: bytes, spare: Callable[[int], Any]) -> None:
        """Write the payload of a stored form into ``out`` (exactly the payload's length), with
        ``spare(n)`` (a writable buffer of at least n bytes, not ``stored``'s) for a sealed and
        coded form's plain text. ``stored`` may share memory with ``out`` only when sealed: a
        sealed raw form is opened in place, a sealed coded one into ``spare`` before it is
        decoded. Raises CodecError or SealError (both in :data:`UnpackError`) for a form that
        does not unpack, ``out`` then holding bytes that must not be used; a sealed form needs
        this tier's sealer (the key), whatever sealing is set to now."""
        data: memoryview = stored
        opened = None
        if nonce:
            if self.sealer is None:
                raise SealError("the block is sealed and this daemon has no sealing key set up (tenants.seal_ssd)")
            associated = identity + bytes([codec])
            if codec == RAW:
                if len(stored) != len(out):
                    raise CodecError(f"sealed raw form of {len(stored)} bytes for a payload of {len(out)}")
                self.sealer.open_into(tenant, nonce, tag, stored, associated, out)
                return
            plain = spare(len(stored))
            self.sealer.open_into(tenant, nonce, tag, stored, associated, plain)
            data = opened = memoryview(plain)[:len(stored)]
        try:
            if codec == RAW:
                if len(data) != len(out):
                    raise CodecError(f"raw stored form of {len(data)} bytes for a payload of {len(out)}")
                out[:] = data
                return
            started = time.perf_counter()
            codec_coded(codec).decode(data, out)
            if self.choice is not None:
                self.choice.decoded(len(out), time.perf_counter() - started)
        finally:
            if opened is not None:
                opened.release()


def stored_form(codec: str, margin: float, sealer: Sealer | None, *, seal: bool = False, granule: int = 1) -> StoredForm:
    """The stored form ``kv.ssd_codec`` names: "none", a codec's name, or :data:`AUTO`
    (:data:`AUTO_CODEC` where it pays), new blocks sealed if ``seal``; KeyError for a name no
    codec has."""
    if codec == AUTO:
        return StoredForm(codec_named(AUTO_CODEC), margin, sealer, CodecChoice(), seal=seal, granule=granule)
    return StoredForm(codec_named(codec), margin, sealer, seal=seal, granule=granule)
