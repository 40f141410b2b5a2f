"""Copies between engine tensors and the daemon's shared arena.

The arena (the daemon's memfd, mapped once) is viewed as one uint8 tensor. With CUDA, the whole
mapping is registered as pinned memory (cudaHostRegister), so a GPU <-> arena copy is one DMA
with no bounce buffer; saves and loads run on their own CUDA streams (one pair per GPU), start
after the work already queued on the engine's stream, and finish with an event, never blocking
the engine's compute stream. Without CUDA, the same calls copy between plain CPU
tensors and the arena.

Neighbouring blocks that are contiguous both in the engine's memory and in the arena (the
daemon hands out consecutive slots of a slab for a batch of equal blocks) are merged into one
copy: fewer, larger copies run several times faster than many small ones.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["ArenaCopier", "byte_view"]

log = logging.getLogger("kvcached_agent")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy). ValueError if not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError("tensors given to kvcached must be contiguous (call .contiguous() first)")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1:
        return tensor                      # already what we need (a page row of an engine's cache)
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
        self._streams: dict[torch.device, tuple[Any, Any]] = {}     # per GPU: (save stream, load stream)
        if self.cuda:
            cudart = torch.cuda.cudart()
            code = cudart.cudaHostRegister(self.arena.data_ptr(), size, 0)
            if int(code) != 0:
                cudart.cudaGetLastError()        # clear the error so later CUDA calls do not report it
                raise RuntimeError(f"cudaHostRegister of the {size}-byte arena failed (error {int(code)}); "
                                   "is RLIMIT_MEMLOCK (LimitMEMLOCK) high enough?")
            self.registered = True

    def save(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
        """Copy each tensor's bytes to its arena offset; returns the number of copies made.
        Returns once every byte is in the arena."""
        return self._copy(tensors, offsets, to_arena=True)

    def load(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
        """Copy arena bytes at each offset into its tensor; returns the number of copies made.
        Returns once every copy is complete (the slots may then be released)."""
        return self._copy(tensors, offsets, to_arena=False)

    def _copy(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *, to_arena: bool) -> int:
        runs = _merge([_Run(byte_view(t), o, t.nbytes) for t, o in zip(tensors, offsets)])
        self._check(runs)
        gpu: dict[torch.device, list[_Run]] = {}
        for run in runs:
            if run.tensor.is_cuda:
                gpu.setdefault(run.tensor.device, []).append(run)
            else:
                self._copy_run(run, to_arena, non_blocking=False)
        done = []
        for device, device_runs in gpu.items():
            # Each GPU's copies on that GPU's own stream, after the work the engine has already
            # queued on its current stream there (it wrote the blocks we save, or last used the
            # memory we load into), then one event: one wait per GPU, never on the compute stream.
            stream = self._stream(device, to_arena)
            with torch.cuda.device(device):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for run in device_runs:
                        self._copy_run(run, to_arena, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            done.append(event)
        for event in done:
            event.synchronize()
        return len(runs)

    def _copy_run(self, run: _Run, to_arena: bool, *, non_blocking: bool) -> None:
        arena = self.arena[run.offset:run.offset + run.nbytes]
        if to_arena:
            arena.copy_(run.tensor, non_blocking=non_blocking)
        else:
            run.tensor.copy_(arena, non_blocking=non_blocking)

    def _stream(self, device: torch.device, to_arena: bool) -> Any:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device][0 if to_arena else 1]

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
