"""Copies between engine tensors and the daemon's shared arena.

The arena (the daemon's memfd, mapped once) is viewed as one uint8 tensor. With CUDA, the whole
mapping is registered as pinned memory (cudaHostRegister), so a GPU <-> arena copy is one DMA
with no bounce buffer; saves and loads run on their own CUDA streams (one pair per GPU), start
after the work already queued on the engine's stream, and finish with an event, never blocking
the engine's compute stream.

Without CUDA (CPU tensors), a copy is a list of byte ranges, each moved with one ``memmove``
straight between the tensor's memory and the arena: a paged cache's blocks are many pages of
tens of KiB, where a torch ``copy_`` per page spends as long in the call as in the copy. The
ranges are shared out among a few threads (``memmove`` through ctypes releases the GIL), as a
large torch copy is, since one core does not reach the memory bandwidth. Every range is checked
against the arena and against its tensor before anything is copied.

Neighbouring pieces that are contiguous both in the engine's memory and in the arena (the
daemon hands out consecutive slots of a slab for a batch of equal blocks) are merged into one
copy: fewer, larger copies run several times faster than many small ones.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch

from kvcached_agent.slab_pins import SlabGenerationsView, SlabPins

__all__ = ["ArenaCopier", "PageRows", "Piece", "byte_view"]

log = logging.getLogger("kvcached_agent")

# A CPU copy is shared among threads only above this size; pieces of a range are at most
# _SPLIT bytes so that one large block still keeps every thread busy.
_PARALLEL_MIN = 4 << 20
_SPLIT = 4 << 20


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy). ValueError if not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("tensors given to kvcached must be contiguous (call .contiguous() first)")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1:
        return tensor                      # already what we need
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True, slots=True)
class PageRows:
    """The given rows of each table in turn, copied as consecutive bytes of a block. A table is a
    2-D uint8 view of one layer of an engine's paged cache, one row per page (rows may be
    further apart than they are long); every table has rows of the same width. One object
    stands for all the layers' pages of a block, so the copier goes from row numbers to
    addresses without building a tensor per page or a piece per layer."""

    tables: Sequence[torch.Tensor]
    rows: Sequence[int]

    @property
    def nbytes(self) -> int:
        return len(self.tables) * len(self.rows) * self.tables[0].shape[1] if self.tables else 0


Piece = Union[torch.Tensor, PageRows]


@dataclass(slots=True)
class _Run:
    tensor: torch.Tensor      # flat uint8 view of the engine side
    offset: int               # arena offset
    nbytes: int


class ArenaCopier:
    """Copies whole blocks between tensors and arena offsets, merged into contiguous runs."""

    def __init__(self, arena: mmap.mmap, size: int, *, use_cuda: bool | None = None,
                 threads: int | None = None, generations: SlabGenerationsView | None = None) -> None:
        """``generations``: the arena's slab generations, where the daemon recycles its slabs
        between tenants (kvcached_agent.slab_pins): with CUDA, slabs are then page-locked one
        at a time as copies touch them, and again after the daemon recycled them; without it
        the whole arena is locked once. Owned by the copier."""
        self.size = size
        self.arena = torch.frombuffer(arena, dtype=torch.uint8, count=size)
        self.cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.threads = max(1, min(4, torch.get_num_threads()) if threads is None else threads)
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvcached-copy") \
            if self.threads > 1 else None
        self.registered = False
        self._streams: dict[torch.device, tuple[Any, Any]] = {}     # per GPU: (save stream, load stream)
        self.generations = generations
        self.pins: SlabPins | None = None
        if self.cuda and generations is not None:
            self.pins = SlabPins(generations, self._lock_range, self._unlock_range)
        elif self.cuda:
            cudart = torch.cuda.cudart()
            code = cudart.cudaHostRegister(self.arena.data_ptr(), size, 0)
            if int(code) != 0:
                cudart.cudaGetLastError()        # clear the error so later CUDA calls do not report it
                raise RuntimeError(f"cudaHostRegister of the {size}-byte arena failed (error {int(code)}); "
                                   "is RLIMIT_MEMLOCK (LimitMEMLOCK) high enough?")
            self.registered = True

    def _lock_range(self, offset: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(self.arena.data_ptr() + offset, nbytes, 0)
        if int(code) != 0:
            cudart.cudaGetLastError()
            raise RuntimeError(f"cudaHostRegister of {nbytes} arena bytes failed (error {int(code)}); "
                               "is RLIMIT_MEMLOCK (LimitMEMLOCK) high enough?")

    def _unlock_range(self, offset: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr() + offset)

    def save(self, pieces: Sequence[Piece], offsets: Sequence[int]) -> int:
        """Copy each piece's bytes to its arena offset; returns the number of copies made.
        Returns once every byte is in the arena."""
        return self._copy(pieces, offsets, to_arena=True)

    def load(self, pieces: Sequence[Piece], offsets: Sequence[int]) -> int:
        """Copy arena bytes at each offset into its piece; returns the number of copies made.
        Returns once every copy is complete (the slots may then be released)."""
        return self._copy(pieces, offsets, to_arena=False)

    def _copy(self, pieces: Sequence[Piece], offsets: Sequence[int], *, to_arena: bool) -> int:
        ranges = _Ranges(self.size)                     # the CPU pieces
        gpu_runs: list[_Run] = []
        tables: dict[int, tuple[str, int, int, int, int]] = {}      # id -> what _table says
        for piece, offset in zip(pieces, offsets):
            if isinstance(piece, PageRows):
                width = -1
                for tensor in piece.tables:
                    table = tables.get(id(tensor))
                    if table is None:
                        table = tables[id(tensor)] = _table(tensor)
                    if table[3] != width and width >= 0:     # nbytes counts every row as wide as the first
                        raise ValueError(f"PageRows tables must have rows of one width; got {width} and {table[3]}")
                    width = table[3]
                    if table[0] == "cpu":
                        ranges.add_rows(table, piece.rows, offset)
                    else:
                        gpu_runs += _row_runs(tensor, table[0], piece.rows, offset)
                    offset += len(piece.rows) * table[3]
                continue
            device = piece.device.type
            if device == "cpu":
                ranges.add(byte_view(piece).data_ptr(), offset, piece.nbytes)
            elif device == "cuda":
                gpu_runs.append(_Run(byte_view(piece), offset, piece.nbytes))
            else:
                raise ValueError(f"kvcached copies CPU and CUDA tensors, not {device} ones")
        gpu_runs = _merge(gpu_runs)
        for run in gpu_runs:
            ranges.check(run.offset, run.nbytes)
        if self.pins is not None and gpu_runs:      # each slab locked on its own: no copy spans two
            gpu_runs = _split_at(gpu_runs, self.pins.generations.slab_bytes)
            for run in gpu_runs:
                self.pins.cover(run.offset, run.nbytes)
        if ranges.moves:
            self._copy_cpu(ranges.moves, to_arena)
        if gpu_runs:
            self._copy_gpu(gpu_runs, to_arena)
        return len(ranges.moves) + len(gpu_runs)

    def _copy_cpu(self, ranges: list[list[int]], to_arena: bool) -> None:
        base = self.arena.data_ptr()
        moves = [(base + o, a, n) if to_arena else (a, base + o, n) for a, o, n in ranges]
        total = sum(n for _, _, n in moves)
        if self._pool is None or total < _PARALLEL_MIN:
            _memmove_all(moves)
            return
        shares = _share(moves, self.threads)
        futures = [self._pool.submit(_memmove_all, share) for share in shares[1:]]
        _memmove_all(shares[0])
        for future in futures:
            future.result()

    def _copy_gpu(self, runs: list[_Run], to_arena: bool) -> None:
        by_device: dict[torch.device, list[_Run]] = {}
        for run in runs:
            by_device.setdefault(run.tensor.device, []).append(run)
        done = []
        for device, device_runs in by_device.items():
            # Each GPU's copies on that GPU's own stream, after the work the engine has already
            # queued on its current stream there (it wrote the blocks we save, or last used the
            # memory we load into), then one event: one wait per GPU, never on the compute stream.
            stream = self._stream(device, to_arena)
            with torch.cuda.device(device):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for run in device_runs:
                        arena = self.arena[run.offset:run.offset + run.nbytes]
                        if to_arena:
                            arena.copy_(run.tensor, non_blocking=True)
                        else:
                            run.tensor.copy_(arena, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            done.append(event)
        for event in done:
            event.synchronize()

    def _stream(self, device: torch.device, to_arena: bool) -> Any:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device][0 if to_arena else 1]

    def close(self) -> None:
        """Stop the copy threads and let go of the arena (the mapping may then be closed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self.registered = False
        if self.pins is not None:
            self.pins.close()
            self.pins = None
        if self.generations is not None:
            self.generations.close()
            self.generations = None
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.size = 0


def _split_at(runs: list[_Run], boundary: int) -> list[_Run]:
    """``runs`` cut where they cross a multiple of ``boundary`` in the arena."""
    out: list[_Run] = []
    for run in runs:
        start, end = run.offset, run.offset + run.nbytes
        while start < end:
            stop = min(end, (start // boundary + 1) * boundary)
            at = start - run.offset
            out.append(_Run(run.tensor[at:at + stop - start], start, stop - start))
            start = stop
    return out


def _table(table: torch.Tensor) -> tuple[str, int, int, int, int]:
    """A PageRows table's device type, address, row stride and row width in bytes, and rows;
    ValueError unless it is a table of contiguous byte rows."""
    if table.dtype != torch.uint8 or table.dim() != 2 or table.stride(1) != 1 \
            or (table.shape[0] > 1 and table.stride(0) < table.shape[1]):
        raise ValueError(f"PageRows needs 2-D uint8 tables of contiguous, non-overlapping rows; got "
                         f"{table.dtype} of shape {tuple(table.shape)}, strides {table.stride()}")
    return table.device.type, table.data_ptr(), table.stride(0), table.shape[1], table.shape[0]


class _Ranges:
    """CPU byte ranges to copy, each [engine address, arena offset, bytes], checked against the
    arena as they are added; a range that follows on from the last one on both sides extends it."""

    def __init__(self, arena_size: int) -> None:
        self.size = arena_size
        self.moves: list[list[int]] = []

    def check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"arena range {offset}+{nbytes} is outside the {self.size}-byte arena")

    def add(self, address: int, offset: int, nbytes: int) -> None:
        self.check(offset, nbytes)
        moves = self.moves
        if moves:
            last = moves[-1]
            if last[0] + last[2] == address and last[1] + last[2] == offset:
                last[2] += nbytes
                return
        moves.append([address, offset, nbytes])

    def add_rows(self, table: tuple[str, int, int, int, int], rows: Sequence[int], offset: int) -> None:
        _, base, stride, width, count = table
        if not rows:
            return
        _check_rows(rows, count)
        self.check(offset, len(rows) * width)
        moves = self.moves
        last = moves[-1] if moves else [0, -1, 0]          # nothing ends where a row begins
        for row in rows:
            address = base + row * stride
            if last[0] + last[2] == address and last[1] + last[2] == offset:
                last[2] += width
            else:
                last = [address, offset, width]
                moves.append(last)
            offset += width


def _share(moves: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Deal the moves out into ``parts`` lists of about equal bytes, in order, cutting large
    moves into pieces of at most _SPLIT bytes."""
    pieces: list[tuple[int, int, int]] = []
    for dst, src, n in moves:
        for at in range(0, n, _SPLIT):
            pieces.append((dst + at, src + at, min(_SPLIT, n - at)))
    total = sum(n for _, _, n in pieces)
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    done = 0
    for move in pieces:
        shares[min(parts - 1, done * parts // total)].append(move)
        done += move[2]
    return shares


def _memmove_all(moves: Sequence[tuple[int, int, int]]) -> None:
    memmove = ctypes.memmove
    for dst, src, n in moves:
        memmove(dst, src, n)


def _row_runs(table: torch.Tensor, device: str, rows: Sequence[int], offset: int) -> list[_Run]:
    if device != "cuda":
        raise ValueError(f"kvcached copies CPU and CUDA tensors, not {device} ones")
    _check_rows(rows, table.shape[0])
    width = table.shape[1]
    return [_Run(table[row], offset + i * width, width) for i, row in enumerate(rows)]


def _check_rows(rows: Sequence[int], count: int) -> None:
    if rows and (min(rows) < 0 or max(rows) >= count):
        raise ValueError(f"pages {min(rows)}..{max(rows)} are not all among the table's {count} pages")


def _merge(runs: list[_Run]) -> list[_Run]:
    """Join neighbours that are contiguous on both sides (same storage, same device)."""
    out: list[_Run] = []
    for run in runs:
        if out:
            last = out[-1]
            t, u = last.tensor, run.tensor
            if (last.offset + last.nbytes == run.offset and t.device == u.device
                    and t.data_ptr() + last.nbytes == u.data_ptr()
                    and t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()):
                merged = torch.empty(0, dtype=torch.uint8, device=t.device)
                merged.set_(t.untyped_storage(), t.storage_offset(), (last.nbytes + run.nbytes,), (1,))
                out[-1] = _Run(merged, last.offset, last.nbytes + run.nbytes)
                continue
        out.append(run)
    return out
