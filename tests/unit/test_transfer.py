"""kvcached_agent.transfer.chunks: how a batch is cut into chunks whose requests overlap the
copies (the save and load paths themselves run against a real daemon in
tests/integration/test_agent_chunks.py)."""

from __future__ import annotations

import pytest

from kvcached_agent.transfer import CHUNK_BYTES, chunks

MIB = 1 << 20


def test_large_blocks_go_in_a_quarter_chunk_then_whole_ones() -> None:
    spans = chunks([MIB] * 64, 16 * MIB)
    assert [len(s) for s in spans] == [4, 16, 16, 16, 12]
    assert [i for s in spans for i in s] == list(range(64))          # every block once, in order


@pytest.mark.parametrize("sizes", [[4096] * 64, [64 << 10] * 64, [1], [CHUNK_BYTES // 4]])
def test_small_batches_stay_one_chunk(sizes: list[int]) -> None:
    """Blocks of a few KiB: one request for the batch, as before (a request costs more than
    their copies)."""
    assert chunks(sizes) == [range(len(sizes))]


def test_a_block_over_the_bound_is_a_chunk_of_its_own() -> None:
    spans = chunks([MIB, 40 * MIB, MIB, MIB, 40 * MIB], 16 * MIB)
    assert spans == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]


def test_nothing_to_cut() -> None:
    assert chunks([]) == []
