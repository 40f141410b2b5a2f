"""The agent's arena copier on CPU tensors (the path every machine without CUDA takes): bytes
exact for every dtype, contiguous neighbours merged into one copy, bad ranges refused."""

from __future__ import annotations

import mmap
from typing import Iterator

import pytest
import torch

from kvcached.tiers.arena import SharedArena
from kvcached_agent.copy import ArenaCopier, PageRows, Piece, byte_view

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


def test_page_rows_go_straight_between_rows_and_the_arena(shared: tuple[SharedArena, ArenaCopier]) -> None:
    arena, copier = shared
    cache = torch.randint(0, 256, (6, 3, 1024), dtype=torch.uint8)       # 6 pages, 3 KiB apart, 1 KiB used
    table = cache[:, 0]                                                    # a layer's page rows, strided
    pieces: list[Piece] = [PageRows((table,), [4, 1]), PageRows((table,), [2])]
    assert copier.save(pieces, [0, 2048]) == 3
    assert arena.read(0, 1024) == bytes(table[4].tolist()) and arena.read(2048, 1024) == bytes(table[2].tolist())
    back = torch.zeros(6, 1024, dtype=torch.uint8)                        # contiguous rows 3, 4, 5 merge
    assert copier.load([PageRows((back,), [3, 4, 5])], [0]) == 1
    assert torch.equal(back[3:], table[[4, 1, 2]]) and not back[:3].any()


def test_tensors_and_page_rows_mix_in_one_block(shared: tuple[SharedArena, ArenaCopier]) -> None:
    _, copier = shared
    cache = torch.randint(0, 256, (4, 512), dtype=torch.uint8)
    head = torch.randint(0, 256, (256,), dtype=torch.uint8)
    copier.save([head, PageRows((cache,), [0, 3])], [0, 256])
    into, rows = torch.zeros(256, dtype=torch.uint8), torch.zeros(4, 512, dtype=torch.uint8)
    copier.load([into, PageRows((rows,), [1, 2])], [0, 256])
    assert torch.equal(into, head) and torch.equal(rows[1:3], cache[[0, 3]])


def test_page_rows_of_several_tables_are_each_table_in_turn(shared: tuple[SharedArena, ArenaCopier]) -> None:
    arena, copier = shared
    layers = [torch.randint(0, 256, (5, 2, 256), dtype=torch.uint8)[:, 1] for _ in range(3)]   # strided rows
    copier.save([PageRows(layers, [3, 0])], [4096])                     # one block: every layer's pages 3, 0
    expected = b"".join(bytes(layer[row].tolist()) for layer in layers for row in (3, 0))
    assert arena.read(4096, len(expected)) == expected
    back = [torch.zeros(5, 256, dtype=torch.uint8) for _ in range(3)]
    copier.load([PageRows(back, [1, 2])], [4096])
    assert all(torch.equal(b[1:3], layer[[3, 0]]) for b, layer in zip(back, layers))
    narrow = torch.zeros(5, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one width"):
        copier.save([PageRows([back[0], narrow], [0])], [0])
    with pytest.raises(ValueError, match="one width"):           # tables seen before are checked too
        copier.save([PageRows([narrow], [0]), PageRows([back[0], narrow], [0])], [0, 1024])


def test_large_copies_are_shared_among_threads_bit_exact() -> None:
    size = 64 << 20
    arena = SharedArena(size, name="kvcached-copy-threads")
    mapping = mmap.mmap(arena.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    copier = ArenaCopier(mapping, size, use_cuda=False, threads=3)
    try:
        pages = torch.randint(0, 256, (300, 96 << 10), dtype=torch.uint8)   # 28 MiB of 96 KiB pages
        big = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8)          # and one 20 MiB block
        order = list(range(299, -1, -1))
        copier.save([PageRows((pages,), order), big], [0, 30 << 20])
        back, big_back = torch.zeros_like(pages), torch.zeros_like(big)
        copier.load([PageRows((back,), order), big_back], [0, 30 << 20])
        assert torch.equal(back, pages) and torch.equal(big_back, big)
    finally:
        copier.close()
        del copier
        mapping.close()
        arena.close()


def test_bad_page_rows_and_devices_are_refused(shared: tuple[SharedArena, ArenaCopier]) -> None:
    _, copier = shared
    with pytest.raises(ValueError, match="2-D uint8"):
        copier.save([PageRows((torch.zeros(4, 256),), [0])], [0])                          # not bytes
    with pytest.raises(ValueError, match="2-D uint8"):
        copier.save([PageRows((torch.zeros(256, 4, dtype=torch.uint8).t(),), [0])], [0])    # rows not contiguous
    with pytest.raises(ValueError, match="not all among"):
        copier.load([PageRows((torch.zeros(4, 256, dtype=torch.uint8),), [1, 4])], [0])
    with pytest.raises(ValueError, match="outside"):
        copier.load([PageRows((torch.zeros(4, 256, dtype=torch.uint8),), [0, 1])], [SIZE - 256])
    with pytest.raises(ValueError, match="meta"):
        copier.save([torch.empty(1024, dtype=torch.uint8, device="meta")], [0])
    with pytest.raises(ValueError, match="meta"):
        copier.load([PageRows([torch.empty(4, 256, dtype=torch.uint8, device="meta")], [0])], [0])
