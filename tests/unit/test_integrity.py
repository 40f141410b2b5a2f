"""Payload checksums: BLAKE3-256, the same one at every size and batch shape."""

from __future__ import annotations

import os

import blake3
import pytest

from kvcached_agent.integrity import CHECKSUM_BYTES, payload_checksum, payload_checksums


@pytest.mark.parametrize("size", [1, 4096, 300 << 10, (4 << 20) + 1])
def test_checksum_is_plain_blake3_at_every_size(size: int) -> None:
    data = os.urandom(size)
    assert payload_checksum(data) == blake3.blake3(data).digest()
    assert payload_checksum(memoryview(data)) == payload_checksum(bytearray(data))
    assert len(payload_checksum(data)) == CHECKSUM_BYTES


@pytest.mark.parametrize("sizes", [[], [10], [64 << 10] * 5, [300 << 10] * 4, [1 << 20, 5, 2 << 20]])
def test_batch_equals_one_by_one_in_order(sizes: list[int]) -> None:
    payloads = [os.urandom(n) for n in sizes]
    assert payload_checksums(payloads) == [blake3.blake3(p).digest() for p in payloads]
