"""Sustained saves through the agent at 4 KiB, 64 KiB and 1 MiB blocks, with the SSD tier off,
written back and written through (issue 44): figure 3 of bench_agent.py, or alone:

    python bench/agent_sustained.py [--quick] [--json PATH]

Per tier setting one ``kvcached serve`` subprocess (bench_core.start_kvcached: RAM 0.5 GiB;
SSD 2 GiB where on, ``kv.ssd_durability = "batch"``), and per block size one agent
(kvcached_agent.Agent, CPU tensors) saving batches of 64 fresh blocks back to back for
``seconds``: stored bytes over the time, against the same 64 ``copy_`` calls into a
preallocated buffer run as many times back to back, in the same run (the baseline an engine
would have with no cache at all). The ratio is kvcached / baseline; no target here (the 1 MiB
case under "RAM only" is figure 1's sustained save, whose note gives the bound a CPU-tensor
save cannot pass). Blocks the daemon refuses (Allocate answered FULL: RAM held by blocks not
yet checksummed, or not yet written to SSD) are counted and do not count as stored. Before
its cases each daemon's arena is written once (1 MiB saves), so the cases run in a long-lived
cache's steady state (pages mapped, every save evicting older blocks), and before each case the
write-back of what came before is waited out, so no case pays for another's.

--quick: 0.5 s a case instead of 2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)   # torch's CPU build; numpy is not used
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from bench_core import (  # noqa: E402
    GrpcBackend,
    KiB,
    MiB,
    Row,
    drained,
    print_table,
    proc_times,
    progress,
    size_name,
    start_kvcached,
)

from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402

SIZES = (4 * KiB, 64 * KiB, 1 * MiB)
BATCH = 64
TIERS = (("RAM only", ["kv.ssd_gib=0", 'kv.write_policy="write_back"']),
         ("SSD write-back", ["kv.ssd_gib=2", 'kv.write_policy="write_back"', 'kv.ssd_durability="batch"']),
         ("SSD write-through", ["kv.ssd_gib=2", 'kv.write_policy="write_through"', 'kv.ssd_durability="batch"']))
RAM_GIB = 0.5
FIGURE = 3
TITLE = (f"{FIGURE}. Sustained agent saves, {BATCH} fresh blocks a batch back to back, CPU tensors, by block size and "
         "SSD setting, vs the same copy_ calls back to back (GB/s, higher is better; no target)")


def connect(tmp: Path, block_bytes: int, proc: Any, *, agent_id: str = "bench-sustained",
            model: str = "bench/sustained", use_cuda: bool = False, timeout: float = 30.0) -> Agent:
    """An agent connected to the daemon ``proc`` started in ``tmp`` (bench_core.start_kvcached),
    once its agent socket listens."""
    deadline = time.monotonic() + timeout
    while True:      # the agent socket listens right after gRPC does
        try:
            return Agent.connect(str(tmp / "agent.sock"), agent_id=agent_id, model=model, dtype="bfloat16",
                                 block_tokens=16, num_layers=1, layer_block_bytes=block_bytes, use_cuda=use_cuda)
        except (FileNotFoundError, ConnectionRefusedError):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"no agent socket from kvcached:\n{proc.tail()}") from None
            time.sleep(0.05)


def fill_arena(tmp: Path, proc: Any) -> None:
    """Save fresh 1 MiB blocks until the arena was written once over (and a batch more)."""
    agent = connect(tmp, MiB, proc)
    try:
        src = list(torch.randint(0, 256, (BATCH * MiB,), dtype=torch.uint8).view(BATCH, MiB))
        for _ in range(int(RAM_GIB * 1024) // BATCH + 1):
            agent.save([BlockAddress(os.urandom(32)) for _ in range(BATCH)], src)
    finally:
        agent.close()


def one_case(agent: Agent, size: int, seconds: float, pid: int) -> dict[str, Any]:
    """Saves of ``BATCH`` fresh ``size``-byte blocks back to back for ``seconds``, then the same
    copies as many times back to back."""
    src = list(torch.randint(0, 256, (BATCH * size,), dtype=torch.uint8).view(BATCH, size))
    buf = list(torch.zeros(BATCH * size, dtype=torch.uint8).view(BATCH, size))
    for _ in range(2):           # warm-up: the first saves map arena pages never touched
        agent.save([BlockAddress(os.urandom(32)) for _ in range(BATCH)], src)
    batches = stored = refused = 0
    cpu0 = proc_times(pid)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        result = agent.save([BlockAddress(os.urandom(32)) for _ in range(BATCH)], src)
        stored += result.stored
        refused += len(result.skipped)
        batches += 1
    save_s = time.perf_counter() - t0
    cpu1 = proc_times(pid)
    t0 = time.perf_counter()
    for _ in range(batches):
        for b, x in zip(buf, src):
            b.copy_(x)
    base_s = time.perf_counter() - t0
    return {"batches": batches, "stored": stored, "refused": refused, "seconds": save_s, "base_seconds": base_s,
            "gbps": stored * size / save_s / 1e9, "base_gbps": batches * BATCH * size / base_s / 1e9,
            "daemon_cpu_s": cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]}


def sustained_rows(seconds: float) -> tuple[list[Row], list[str]]:
    """Figure 3: every tier setting and block size (see the module)."""
    rows: list[Row] = []
    notes: list[str] = []
    for tier, sets in TIERS:
        with tempfile.TemporaryDirectory(prefix="kvcbench-sustained-") as tmpdir, contextlib.ExitStack() as stack:
            tmp = Path(tmpdir)
            progress(f"sustained saves, {tier}: starting kvcached (RAM {RAM_GIB:g} GiB)")
            proc, channel = start_kvcached(stack, tmp, RAM_GIB, sets)
            backend = GrpcBackend(tier, channel, proc.proc.pid)
            fill_arena(tmp, proc)
            for size in SIZES:
                if "kv.ssd_gib=0" not in sets:        # (without an SSD, nothing is written back)
                    drained(backend)
                agent = connect(tmp, size, proc)
                try:
                    got = one_case(agent, size, seconds, proc.proc.pid)
                finally:
                    agent.close()
                label = f"{size_name(size)} x{BATCH}, {tier}"
                rows.append(Row(FIGURE, label, "GB/s", got["gbps"], "the same copy_ calls", got["base_gbps"], True,
                                details=got))
                notes.append(f"sustained {label}: {got['batches']} batches in {got['seconds']:.2f} s, {got['stored']} "
                             f"blocks stored, {got['refused']} refused; daemon CPU "
                             f"{got['daemon_cpu_s'] / got['batches'] * 1e3:.2f} ms a batch")
                progress(f"{label}: {got['gbps']:.3f} GB/s against {got['base_gbps']:.3f} GB/s")
    return rows, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="0.5 s a case")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)        # the other core is the daemon's (as bench_agent)
    started = time.time()
    rows, notes = sustained_rows(0.5 if args.quick else 2.0)
    print_table(rows, f"kvcached sustained agent saves ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
                      f"{time.time() - started:.0f} s", {FIGURE: TITLE})
    for note in notes:
        print(note)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
