"""Sealing at rest: AES-256-GCM under a key of each tenant's own.

A sealed block's stored form is its ciphertext, as long as what was sealed; its seal (a 16-byte
random salt and a 12-byte random GCM nonce, new for every file written) and GCM's 16-byte tag
are kept beside it, in the file's header, so sealing adds nothing to a block's file. The associated data is what
the block is (its digest, layer, length, payload checksum and codec, laid out by the caller), so
a sealed form moved under another block's name, or opened with another tenant's key, fails its
tag: it is refused, never served.

Keys: each tenant's key is derived from the daemon's tenant key (kvcached.tenants.keyfile) and the
tenant's tag, so the disk alone, without that key file, opens nothing; and each file is sealed
under a key of its own, BLAKE3 keyed with the tenant's key over the file's random salt. The
tenant key is shared by a cluster's nodes and never rotated, so a nonce drawn at random under it
directly would, past 2**32 files written (NIST SP 800-38D's bound; days of a busy node), risk a
repeat, which would leak the XOR of two blocks and GCM's hash key. Under a key per file a nonce
is never used twice with the same key. No I/O here.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["SALT_BYTES", "SEAL_BYTES", "SEAL_PURPOSE", "TAG_BYTES", "SealError", "Sealer"]

SALT_BYTES = 16
NONCE_BYTES = 12
SEAL_BYTES = SALT_BYTES + NONCE_BYTES     # what a sealed file keeps of its seal: salt, then nonce
TAG_BYTES = 16
SEAL_PURPOSE = "ssd block sealing"      # what the tenant map derives the keys for (TenantMap.derived_key)


class SealError(ValueError):
    """A sealed form that does not open under the reader's key (wrong tenant, damaged bytes)."""


class Sealer:
    """Seals and opens stored forms under ``key_of(tenant tag)`` (32 bytes), one key schedule per
    tenant kept. Both write into a buffer the caller gives (the tier's scratch area, or the
    arena slot itself: GCM is a stream cipher, so the output may be the input's own memory): a
    block is encrypted or decrypted in one pass, with no copy and no allocation of its size.
    The cipher runs without the GIL. Safe to call from several threads at once."""

    def __init__(self, key_of: Callable[[str], bytes]) -> None:
        self._key_of = key_of
        self._keys: dict[str, bytes] = {}

    def _file_key(self, tenant: str, salt: bytes) -> algorithms.AES:
        """The key of one file: the tenant's key over the file's salt (BLAKE3 keyed)."""
        key = self._keys.get(tenant)
        if key is None:
            key = self._keys[tenant] = self._key_of(tenant)
        return algorithms.AES(blake3.blake3(salt, key=key).digest())

    def seal_into(self, tenant: str, data: Any, associated: bytes, out: Any) -> tuple[bytes, bytes]:
        """Write the ciphertext of ``data`` (as long as it) under a new key of ``tenant``'s into
        ``out`` (at least as long); returns (seal, tag): the seal (SEAL_BYTES: salt, nonce) and
        the tag are what :meth:`open_into` needs besides the key."""
        salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
        encryptor = Cipher(self._file_key(tenant, salt), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(associated)
        encryptor.update_into(data, out)
        encryptor.finalize()
        return salt + nonce, encryptor.tag

    def open_into(self, tenant: str, seal: bytes, tag: bytes, sealed: Any, associated: bytes, out: Any) -> None:
        """Write the data ``sealed`` holds into ``out`` (at least as long; it may be ``sealed``'s
        own memory); SealError when it does not open under ``tenant``'s key with that seal, tag
        and associated data (another tenant's block, a damaged or moved file): ``out`` then
        holds bytes that must not be used (with another tenant's key, noise)."""
        if len(seal) != SEAL_BYTES or len(tag) != TAG_BYTES:
            raise SealError("the seal's salt, nonce or tag is missing")
        salt, nonce = seal[:SALT_BYTES], seal[SALT_BYTES:]
        decryptor = Cipher(self._file_key(tenant, salt), modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(associated)
        decryptor.update_into(sealed, out)
        try:
            decryptor.finalize()
        except InvalidTag:
            raise SealError("the sealed block does not open under its tenant's key (another tenant's, or damaged)") from None
