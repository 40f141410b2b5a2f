"""Payload checksums: BLAKE3-256, the same one at every size and batch shape."""

from __future__ import annotations

import os

import blake3
import pytest

from kvcached_agent.integrity import CHECKSUM_BYTES, Hasher, payload_checksum


@pytest.mark.parametrize("size", [1, 4096, 300 << 10, (4 << 20) + 1])
def test_checksum_is_plain_blake3_at_every_size(size: int) -> None:
    data = os.urandom(size)
    assert payload_checksum(data) == blake3.blake3(data).digest()
    assert payload_checksum(memoryview(data)) == payload_checksum(bytearray(data))
    assert len(payload_checksum(data)) == CHECKSUM_BYTES


@pytest.mark.parametrize("sizes", [[], [10], [64 << 10] * 5, [300 << 10] * 4, [1 << 20, 5, 2 << 20]])
def test_batch_equals_one_by_one_in_order(sizes: list[int]) -> None:
    payloads = [os.urandom(n) for n in sizes]
    hasher = Hasher(2)
    try:
        assert hasher.checksums(payloads) == [blake3.blake3(p).digest() for p in payloads]
    finally:
        hasher.close()


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_hasher_gives_the_same_checksums_on_any_number_of_threads(threads: int) -> None:
    """kv.hash_threads changes where the daemon hashes, never what: every shape of batch (small
    payloads one by one, a few hundred KiB over the pool, one of 4 MiB and more by BLAKE3's own
    threads) hashes to plain BLAKE3, in order; closed, it starts again on the next batch."""
    hasher = Hasher(threads)
    try:
        for sizes in ([10, 64 << 10], [300 << 10] * 6, [(4 << 20) + 3, 1 << 20, 5]):
            payloads = [os.urandom(n) for n in sizes]
            assert hasher.checksums(payloads) == [blake3.blake3(p).digest() for p in payloads]
        hasher.close()
        again = [os.urandom(300 << 10) for _ in range(3)]
        assert hasher.checksums(again) == [blake3.blake3(p).digest() for p in again]
    finally:
        hasher.close()


def test_a_hasher_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="a thread at least"):
        Hasher(0)


def test_hash_threads_zero_is_one_per_cpu_of_the_affinity() -> None:
    from kvcached.host.process import AUTO_THREADS_MOST, cpu_threads
    cpus = len(os.sched_getaffinity(0))
    assert cpu_threads(0) == min(cpus, AUTO_THREADS_MOST) and cpu_threads(0, most=1) == 1
    assert cpu_threads(3) == 3 and cpu_threads(64) == 64      # set: as set, whatever the CPUs
