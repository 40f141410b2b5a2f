"""kvcached agent with GPU tensors: save and load through the daemon's arena against a raw pinned
copy of the same bytes, measured in the same run. Needs CUDA; where torch.cuda.is_available() is
False it says so in one line and exits 0.

    python bench/gpu_copy.py [--json PATH] [--quick]

A real ``kvcached serve`` subprocess (RAM arena 2 GiB, SSD off; bench_agent.start_agent) and one
agent in this process with CUDA on: the agent registers the whole arena with cudaHostRegister,
so each copy is one DMA between GPU memory and the arena, on the agent's own CUDA streams.

Cases: 1 MiB blocks in batches of 64 and 16 MiB blocks in batches of 16, the engine's blocks
being views of one GPU tensor. Baseline: the same bytes copied between the same GPU tensor and
a pinned host tensor (``torch.empty(..., pin_memory=True)``), one ``copy_(non_blocking=True)``
per block and then ``torch.cuda.synchronize()``: save = GPU -> host, load = host -> GPU. The
method is bench_agent.py's figure 1 (bench_agent.run_copy_case): the whole arena written once
first, then paired repetitions (fresh blocks for every save, after which the daemon's
background checksum is awaited off the clock; loads of blocks saved once, checked byte for byte
on the GPU), the device synchronised before each timed call, each side's p50 batch shown as
GB/s, the ratio the median of the ratios within a repetition. Target: >= 0.9x. Notes give the
baseline done as one copy of the whole batch and where a save's and a load's time goes.

--quick: 10 repetitions per case instead of 40.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch  # noqa: E402
from bench_agent import (
    CopyCase,
    block_views,
    copy_rows,
    fill,
    one_copy_note,
    phases,
    report,
    run_copy_case,
    run_script,
    start_agent,  # first: it silences torch's warning that numpy is missing
)
from bench_core import MiB, Row, progress, size_name

CASES = ((1 * MiB, 64), (16 * MiB, 16))
RAM_GIB = 2.0
TARGET = 0.9
TITLES = {1: "1. Agent save/load of GPU tensors <-> RAM arena (cudaHostRegister, SSD off) vs a raw pinned copy_ of "
             "the same bytes; GB/s of the p50 batch"}


def gpu_case(size: int, batch: int) -> CopyCase:
    device = torch.device("cuda")
    src = torch.randint(0, 256, (size * batch,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    host = torch.empty(size * batch, dtype=torch.uint8, pin_memory=True)
    src_b, dst_b, host_b = (block_views(t, size) for t in (src, dst, host))

    def base_save() -> None:
        for h, x in zip(host_b, src_b):
            h.copy_(x, non_blocking=True)
        torch.cuda.synchronize()

    def base_load() -> None:
        for d, h in zip(dst_b, host_b):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()

    def one_save() -> None:
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    def one_load() -> None:
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return CopyCase(f"{size_name(size)} x{batch}", src_b, dst_b, torch.empty(size, dtype=torch.uint8, device=device),
                    base_save, base_load, settle=torch.cuda.synchronize, one_copy=(one_save, one_load))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvcached agent save/load of GPU tensors vs a raw pinned copy")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="10 repetitions per case instead of 40")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_copy: CUDA is not available (torch.cuda.is_available() is False): benchmark skipped")
        return 0
    reps = 10 if args.quick else 40
    rows: list[Row] = []
    notes: list[str] = []
    started = time.time()
    gpu = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="kvcbench-gpu-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        progress(f"starting kvcached (RAM {RAM_GIB:g} GiB, SSD off); the agent registers the arena with CUDA")
        t0 = time.perf_counter()
        proc, agent = start_agent(stack, tmp, RAM_GIB, max(size for size, _ in CASES), use_cuda=True)
        notes.append(f"daemon start + agent connect (arena mapped and cudaHostRegister'ed): {time.perf_counter() - t0:.2f} s")
        if not agent.copier.registered:
            raise RuntimeError("the agent did not register the arena with CUDA")
        try:
            for size, batch in CASES:
                case = gpu_case(size, batch)
                progress(f"{case.label}: writing the whole arena once, then {reps} paired repetitions")
                first = fill(agent, case.src, int(RAM_GIB * 1024) * MiB + case.nbytes, case.scratch)
                t = run_copy_case(agent, case, reps)
                copy = copy_rows(1, case, t, f"pinned copy_, {batch} x {size_name(size)}", TARGET)
                progress(", ".join(f"{r.case} {r.kvcached:.2f} GB/s ({r.ratio:.2f}x)" for r in copy))
                rows += copy
                notes += [f"{case.label}: first write of the arena {first:.2f} GB/s", one_copy_note(case, t, copy),
                          phases(agent, case, min(reps, 20), proc.proc.pid)]
                del case
                torch.cuda.empty_cache()
        except BaseException:
            progress(f"kvcached log, last lines:\n{proc.tail(20)}")
            raise

    header = (f"kvcached agent GPU copy benchmark ({'quick' if args.quick else 'full'}): {gpu}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s\nsettings: arena {RAM_GIB:g} GiB, "
              f"SSD off, {reps} repetitions per case")
    report(rows, header, TITLES, notes, args.json, started, {"quick": args.quick, "gpu": gpu, "cuda": torch.version.cuda,
                                                              "ram_gib": RAM_GIB, "reps": reps})
    return 0


if __name__ == "__main__":
    run_script(main)
