"""Payload checksums: BLAKE3-256 over a block's bytes.

Every block carries this checksum from the moment it is stored; it is checked wherever bytes
cross a boundary that can damage them (a client's Put, SSD reads, peer pulls, fetched blocks in
clients). Shared by the daemon and the agent so both compute it the same way.
"""

from __future__ import annotations

import blake3

__all__ = ["CHECKSUM_BYTES", "payload_checksum"]

CHECKSUM_BYTES = 32
# From this size on BLAKE3 hashes on every core; below it, on 2 cores, starting the threads
# costs more than they give (measured: 1 MiB takes ~0.31 ms on one thread, ~0.36 ms on two).
_PARALLEL_HASH_BYTES = 4 << 20


def payload_checksum(payload: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte BLAKE3-256 checksum of a block payload."""
    if len(payload) >= _PARALLEL_HASH_BYTES:
        return blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest()
    return blake3.blake3(payload).digest()
