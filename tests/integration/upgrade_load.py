"""A client in a process of its own that keeps a daemon busy while it is upgraded
(tests/integration/test_upgrade.py, bench/bench_upgrade.py).

    python upgrade_load.py grpc TARGET SEED      # Puts and Gets over gRPC
    python upgrade_load.py agent SOCKET SEED     # an engine's agent: saves and loads (torch)

It works in a loop until SIGTERM, then prints one JSON line: how many calls it made, how many
failed (and the first few errors), how many answers had wrong bytes, how many blocks it had
stored were missing later, and the longest any one call took (``max_call_s``: the gap a client
saw). Block payloads are a function of the address (agent_worker.payload), so every byte is
checked.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

from agent_worker import payload  # type: ignore[import-not-found]  # run as a script, beside it

from kvcached_agent.address import BlockAddress

BLOCK = 64 * 1024
BLOCKS = 96          # cycled through: a bounded working set that fits the test daemons' RAM
stopping = False


def _stop(*_: Any) -> None:
    global stopping
    stopping = True


def addresses(seed: str) -> list[BlockAddress]:
    return [BlockAddress(f"{seed}-{i}".encode().ljust(32, b".")[:32]) for i in range(BLOCKS)]


def grpc_loop(target: str, seed: str, counts: dict[str, Any]) -> None:
    import grpc

    from kvcached.client import KvCacheClient

    blocks = addresses(seed)
    stored: set[BlockAddress] = set()
    i = 0
    with KvCacheClient(target, timeout=60) as c:
        while not stopping:
            batch = [blocks[(i + j) % BLOCKS] for j in range(4)]
            i += 4
            t0 = time.monotonic()
            try:
                c.put([(a, payload(a.digest, a.layer, BLOCK)) for a in batch])
                stored.update(batch)
                want = sorted(stored, key=lambda a: a.digest)[:16]
                fetched, misses = c.get(want, allow_partial=True)
            except grpc.RpcError as exc:
                counts["failed"] += 1
                if len(counts["errors"]) < 5:
                    counts["errors"].append(f"{exc.code().name}: {exc.details()}")
                continue
            finally:
                counts["max_call_s"] = max(counts["max_call_s"], time.monotonic() - t0)
            counts["calls"] += 2
            counts["wrong"] += sum(f.payload != payload(f.address.digest, f.address.layer, BLOCK) for f in fetched)
            counts["missing"] += len(misses)


def agent_loop(path: str, seed: str, counts: dict[str, Any]) -> None:
    import torch

    from kvcached_agent.agent import Agent

    agent = Agent.connect(path, agent_id=f"load-{seed}", model="upgrade-test", dtype="uint8", block_tokens=16,
                          num_layers=1, layer_block_bytes=BLOCK, reconnect=True, retry_s=0.05, retry_max_s=0.5)
    blocks = addresses(seed)
    saved: list[BlockAddress] = []
    i = 0
    try:
        while not stopping:
            batch = [blocks[(i + j) % BLOCKS] for j in range(4)]
            i += 4
            tensors = [torch.frombuffer(bytearray(payload(a.digest, a.layer, BLOCK)), dtype=torch.uint8) for a in batch]
            t0 = time.monotonic()
            result = agent.save(batch, tensors)
            if result.skipped:
                counts["failed"] += 1
                if len(counts["errors"]) < 5:
                    counts["errors"].append(f"save skipped {len(result.skipped)} of {len(batch)}")
            else:
                saved += [a for a in batch if a not in saved]
            want = saved[-16:]
            out = [torch.full((BLOCK,), 0x5A, dtype=torch.uint8) for _ in want]
            loaded = agent.load(want, out)
            counts["max_call_s"] = max(counts["max_call_s"], time.monotonic() - t0)
            counts["calls"] += 2
            counts["missing"] += len(loaded.missing)
            if loaded.missing and len(counts["errors"]) < 5:
                counts["errors"].append(f"load missed {len(loaded.missing)} of {len(want)} "
                                        f"(reconnects so far: {agent.reconnects}, connected: {agent.client is not None})")
            missing = set(loaded.missing)
            for k, (a, t) in enumerate(zip(want, out)):
                if k not in missing and bytes(t.numpy()) != payload(a.digest, a.layer, BLOCK):
                    counts["wrong"] += 1
        counts["reconnects"] = agent.reconnects
    finally:
        agent.close()


def main() -> int:
    mode, where, seed = sys.argv[1:4]
    signal.signal(signal.SIGTERM, _stop)
    counts: dict[str, Any] = {"calls": 0, "failed": 0, "wrong": 0, "missing": 0, "max_call_s": 0.0, "errors": []}
    print(json.dumps({"started": True}), flush=True)
    (grpc_loop if mode == "grpc" else agent_loop)(where, seed, counts)
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
