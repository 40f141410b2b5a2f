"""kvcached_agent.transfer.chunks: how a batch is cut into chunks whose requests overlap the
copies (the save and load paths themselves run against a real daemon in
tests/integration/test_agent_chunks.py)."""

from __future__ import annotations

import pytest

from kvcached_agent.transfer import GROWTH, WHOLE_BATCH_BYTES, chunks

MIB = 1 << 20


def test_large_blocks_go_in_a_small_first_chunk_then_chunks_that_grow_up_to_the_bound() -> None:
    """The first chunk's request is the one waited for: small. Each next one is asked for while
    the one before is copied, which takes several times longer than the daemon's answer."""
    assert GROWTH == 4
    assert [len(s) for s in chunks([MIB] * 64)] == [1, 4, 16, 43]
    spans = chunks([MIB] * 64, first=2 * MIB, most=16 * MIB)
    assert [len(s) for s in spans] == [2, 8, 16, 16, 16, 6]
    assert [i for s in spans for i in s] == list(range(64))          # every block once, in order


@pytest.mark.parametrize("sizes", [[4096] * 64, [64 << 10] * 64, [1], [WHOLE_BATCH_BYTES]])
def test_small_batches_stay_one_chunk(sizes: list[int]) -> None:
    """Blocks of a few KiB: one request for the batch, as before (a request costs more than
    their copies)."""
    assert chunks(sizes) == [range(len(sizes))]


def test_a_block_over_the_bound_is_a_chunk_of_its_own() -> None:
    spans = chunks([MIB, 40 * MIB, MIB, MIB, 40 * MIB], most=16 * MIB)
    assert spans == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]


def test_nothing_to_cut() -> None:
    assert chunks([]) == []
