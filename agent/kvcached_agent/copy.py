"""Copies between engine tensors and the daemon's shared arena.

The arena (the daemon's memfd, mapped once) is viewed as one uint8 tensor. With CUDA, the whole
mapping is registered as pinned memory (cudaHostRegister), so a GPU <-> arena copy is one DMA
with no bounce buffer; saves and loads run on their own CUDA streams and finish with an event,
never blocking the engine's compute stream. Without CUDA, the same calls copy between plain CPU
tensors and the arena.

Neighbouring blocks that are contiguous both in the engine's memory and in the arena (the
daemon hands out consecutive slots of a slab for a batch of equal blocks) are merged into one
copy: fewer, larger copies run several times faster than many small ones.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["ArenaCopier", "byte_view"]

log = logging.getLogger("kvcached_agent")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy). ValueError if not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("tensors given to kvcached must be contiguous (call .contiguous() first)")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(slots=True)
class _Run:
    tensor: torch.Tensor      # flat uint8 view of the engine side
    offset: int               # arena offset
    nbytes: int


class ArenaCopier:
    """Copies whole blocks between tensors and arena offsets, merged into contiguous runs."""

    def __init__(self, arena: mmap.mmap, size: int, *, use_cuda: bool | None = None) -> None:
        self.size = size
        self.arena = torch.frombuffer(arena, dtype=torch.uint8, count=size)
        self.cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.registered = False
        self._save_stream = self._load_stream = None
        if self.cuda:
            code = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), size, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the {size}-byte arena failed (error {int(code)}); "
                                   "is RLIMIT_MEMLOCK (LimitMEMLOCK) high enough?")
            self.registered = True
            self._save_stream = torch.cuda.Stream()
            self._load_stream = torch.cuda.Stream()

    def save(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
        """Copy each tensor's bytes to its arena offset; returns the number of copies made.
        Returns once every byte is in the arena."""
        runs = _merge([_Run(byte_view(t), o, t.numel() * t.element_size()) for t, o in zip(tensors, offsets)])
        self._check(runs)
        if self.cuda:
            stream = self._save_stream
            stream.wait_stream(torch.cuda.current_stream())     # the engine's writes come first
            with torch.cuda.stream(stream):
                for run in runs:
                    self.arena[run.offset:run.offset + run.nbytes].copy_(run.tensor, non_blocking=run.tensor.is_cuda)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()
        else:
            for run in runs:
                self.arena[run.offset:run.offset + run.nbytes].copy_(run.tensor)
        return len(runs)

    def load(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
        """Copy arena bytes at each offset into its tensor; returns the number of copies made.
        Returns once every copy is complete (the slots may then be released)."""
        runs = _merge([_Run(byte_view(t), o, t.numel() * t.element_size()) for t, o in zip(tensors, offsets)])
        self._check(runs)
        if self.cuda:
            stream = self._load_stream
            with torch.cuda.stream(stream):
                for run in runs:
                    run.tensor.copy_(self.arena[run.offset:run.offset + run.nbytes], non_blocking=run.tensor.is_cuda)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()
        else:
            for run in runs:
                run.tensor.copy_(self.arena[run.offset:run.offset + run.nbytes])
        return len(runs)

    def _check(self, runs: list[_Run]) -> None:
        for run in runs:
            if run.offset < 0 or run.offset + run.nbytes > self.size:
                raise ValueError(f"arena range {run.offset}+{run.nbytes} is outside the {self.size}-byte arena")

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self.registered = False


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
