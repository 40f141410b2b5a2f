"""What a block becomes on a cold tier (docs/codecs.md): codecs (``base``: the interface and
registry, keyed by kv.ssd_codec; ``planes``: byte planes then zstd, lossless for 16-bit KV;
``choice``: whether coding pays on this disk, for kv.ssd_codec = "auto"),
sealing per tenant (``seal``: AES-256-GCM) and the two together (``stored``). No I/O."""

from __future__ import annotations

from kvcached.codecs import planes as _planes  # noqa: F401  (registers its codecs)
from kvcached.codecs.base import CODECS, RAW, Codec, CodecError, codec_coded, codec_named
from kvcached.codecs.choice import CodecChoice
from kvcached.codecs.seal import SEAL_PURPOSE, Sealer, SealError
from kvcached.codecs.stored import AUTO, Packed, StoredForm, UnpackError, stored_form

__all__ = ["AUTO", "CODECS", "RAW", "Codec", "CodecChoice", "CodecError", "Packed", "SEAL_PURPOSE", "SealError",
           "Sealer", "StoredForm", "UnpackError", "codec_coded", "codec_named", "stored_form"]
