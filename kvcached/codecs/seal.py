"""Sealing at rest: AES-256-GCM under a key of each tenant's own.

A sealed block's stored form is its ciphertext, as long as what was sealed; the nonce (12 random
bytes, new for every file written) and GCM's 16-byte tag are kept beside it, in the file's header,
so sealing adds nothing to a block's file. The associated data is what
the block is (its digest, layer, length, payload checksum and codec, laid out by the caller), so
a sealed form moved under another block's name, or opened with another tenant's key, fails its
tag: it is refused, never served. Random 96-bit nonces stay safe well past 2**32 files written
under one key (NIST SP 800-38D's bound), which no tier of one tenant reaches.

Each tenant's key is derived from the daemon's tenant key (kvcached.tenants.keyfile) and the
tenant's tag, so the disk alone, without that key file, opens nothing. No I/O here.
"""

from __future__ import annotations

import os
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["NONCE_BYTES", "SEAL_PURPOSE", "TAG_BYTES", "SealError", "Sealer"]

NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_PURPOSE = "ssd block sealing"      # what the tenant map derives the keys for (TenantMap.derived_key)


class SealError(ValueError):
    """A sealed form that does not open under the reader's key (wrong tenant, damaged bytes)."""


class Sealer:
    """Seals and opens stored forms under ``key_of(tenant tag)`` (32 bytes), one cipher per
    tenant kept. Safe to call from several threads at once."""

    def __init__(self, key_of: Callable[[str], bytes]) -> None:
        self._key_of = key_of
        self._ciphers: dict[str, AESGCM] = {}

    def _cipher(self, tenant: str) -> AESGCM:
        cipher = self._ciphers.get(tenant)
        if cipher is None:
            cipher = self._ciphers[tenant] = AESGCM(self._key_of(tenant))
        return cipher

    def seal(self, tenant: str, data: bytes | memoryview, associated: bytes) -> tuple[bytes, bytes, memoryview]:
        """(nonce, tag, ciphertext) of ``data`` under ``tenant``'s key; the ciphertext is as
        long as ``data``."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = memoryview(self._cipher(tenant).encrypt(nonce, data, associated))
        return nonce, bytes(sealed[-TAG_BYTES:]), sealed[:-TAG_BYTES]

    def open(self, tenant: str, nonce: bytes, tag: bytes, sealed: bytes | memoryview, associated: bytes) -> bytes:
        """The data ``sealed`` holds; SealError when it does not open under ``tenant``'s key
        with that nonce, tag and associated data (another tenant's block, a damaged or moved
        file). Nothing of the data is returned unless it opens."""
        if len(nonce) != NONCE_BYTES or len(tag) != TAG_BYTES:
            raise SealError("the seal's nonce or tag is missing")
        whole = bytearray(len(sealed) + TAG_BYTES)
        whole[:len(sealed)] = sealed
        whole[len(sealed):] = tag
        try:
            return self._cipher(tenant).decrypt(nonce, whole, associated)
        except InvalidTag:
            raise SealError("the sealed block does not open under its tenant's key (another tenant's, or damaged)") from None
