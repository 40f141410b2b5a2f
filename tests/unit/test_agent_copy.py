"""The agent's arena copier on CPU tensors (the path every machine without CUDA takes): bytes
exact for every dtype, contiguous neighbours merged into one copy, bad ranges refused."""

from __future__ import annotations

import mmap
from typing import Iterator

import pytest
import torch

from kvcached.tiers.arena import SharedArena
from kvcached_agent.copy import ArenaCopier, byte_view

SIZE = 1 << 20


@pytest.fixture
def shared() -> Iterator[tuple[SharedArena, ArenaCopier]]:
    arena = SharedArena(SIZE, name="kvcached-copy-test")
    mapping = mmap.mmap(arena.fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)   # as an agent maps it
    copier = ArenaCopier(mapping, SIZE, use_cuda=False)
    yield arena, copier
    copier.close()
    del copier
    arena.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_save_then_load_is_bit_exact(shared: tuple[SharedArena, ArenaCopier], dtype: torch.dtype) -> None:
    arena, copier = shared
    src = (torch.rand(3, 4, 512) * 200).to(dtype)
    offsets = [0, 64 << 10, 8 << 10]
    copier.save(list(src), offsets)
    raw = bytes(byte_view(src[1]).tolist())
    assert arena.read(offsets[1], len(raw)) == raw        # the daemon sees the very bytes
    back = torch.zeros_like(src)
    copier.load(list(back), offsets)
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))


def test_contiguous_neighbours_are_one_copy(shared: tuple[SharedArena, ArenaCopier]) -> None:
    _, copier = shared
    src = torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024)      # 4 KiB rows, one storage
    assert copier.save(list(src), [i * 4096 for i in range(8)]) == 1
    assert copier.save(list(src), [i * 4096 for i in (0, 1, 2, 5, 6, 7, 3, 4)]) == 3
    back = torch.zeros(8, 1024)
    assert copier.load(list(back), [i * 4096 for i in (0, 1, 2, 5, 6, 7, 3, 4)]) == 3
    assert torch.equal(back, src)
    separate = [torch.ones(1024), torch.ones(1024)]                         # two storages: two copies
    assert copier.save(separate, [0, 4096]) == 2


def test_non_contiguous_tensors_and_bad_ranges_are_refused(shared: tuple[SharedArena, ArenaCopier]) -> None:
    _, copier = shared
    with pytest.raises(ValueError, match="contiguous"):
        copier.save([torch.zeros(64, 64).t()], [0])
    with pytest.raises(ValueError, match="outside"):
        copier.save([torch.zeros(1024)], [SIZE - 100])
    with pytest.raises(ValueError, match="outside"):
        copier.load([torch.zeros(1024)], [-4096])
