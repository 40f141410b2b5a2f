"""An agent in a process of its own, driven by the integration tests (tests/integration/test_agent.py).

    python agent_worker.py SOCKET AGENT_ID [--torch] [--model M] [--dtype D] [--block-tokens N]
                           [--num-layers L] [--layer-block-bytes B] [--no-heartbeat]

It connects to the daemon's agent socket, prints one JSON line (``pid``, ``session``), then
reads one JSON command per line on stdin and answers each with one JSON line on stdout:
``{"ok": true, ...}`` or ``{"ok": false, "error": CLASS, "code": N, "message": TEXT}``. Between
commands it just waits on stdin, so a test can leave it holding slots or pins and then SIGKILL
or SIGSTOP it at a known point of the protocol.

Without ``--torch`` it uses only the blocking client (kvcached_agent.client) and the mapped
arena: starting takes a tenth of a second. With it, it uses the full Agent (torch tensors,
the arena copier) for ``save``, ``load`` and ``stress``.

Block payloads are a function of the address (:func:`payload`), so the test and the worker
agree on every byte without sending any.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from typing import Any, Callable

import blake3

from kvcached_agent import protocol as p
from kvcached_agent.address import CROSS_LAYER, BlockAddress
from kvcached_agent.client import AgentClient, AgentError


def payload(digest: bytes, layer: int, nbytes: int) -> bytes:
    """The bytes of block (digest, layer) of size ``nbytes`` in every test: a BLAKE3 stream."""
    hasher = blake3.blake3(digest + layer.to_bytes(4, "little"), derive_key_context="kvcached test payload")
    return hasher.digest(length=nbytes)


def _blocks(spec: list[list[Any]]) -> list[BlockAddress]:
    return [BlockAddress(bytes.fromhex(entry[0]), int(entry[1])) for entry in spec]


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        hello = dict(agent_id=args.agent_id, model=args.model, dtype=args.dtype, block_tokens=args.block_tokens,
                     num_layers=args.num_layers, layer_block_bytes=args.layer_block_bytes)
        self.agent: Any = None
        if args.torch:
            from kvcached_agent.agent import Agent

            self.agent = Agent.connect(args.socket, **hello)  # type: ignore[arg-type]
            self.client: AgentClient = self.agent.client
            self.arena: mmap.mmap = self.agent._map
        else:
            self.client = AgentClient(args.socket, p.Hello(**hello),  # type: ignore[arg-type]
                                      heartbeat=not args.no_heartbeat)
            self.arena = mmap.mmap(self.client.arena_fd, self.client.welcome.arena_bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)

    # -- low level: the protocol itself -------------------------------------------------------

    def op_allocate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Allocate; with ``write`` fill the OK slots with their payloads (a save stopped
        right before its Commit), with ``write == "half"`` only their first halves (a save
        stopped in the middle of its copy)."""
        blocks = [(bytes.fromhex(d), int(layer), int(n)) for d, layer, n in cmd["blocks"]]
        slots = self.client.call(p.Allocate(blocks))
        assert isinstance(slots, p.Slots)
        if cmd.get("write"):
            for (digest, layer, n), (status, _, offset) in zip(blocks, slots.entries):
                if status == p.Status.OK:
                    m = n // 2 if cmd["write"] == "half" else n
                    self.arena[offset:offset + m] = payload(digest, layer, n)[:m]
        return {"slots": [list(e) for e in slots.entries]}

    def op_commit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        committed = self.client.call(p.Commit(cmd["handles"]))
        assert isinstance(committed, p.Committed)
        return {"statuses": list(committed.statuses)}

    def op_load_hold(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Load and keep the pins (no Release): a load stopped before its Release. Reports
        which OK entries hold exactly their payload in the arena."""
        addresses = _blocks(cmd["blocks"])
        loaded = self.client.call(p.Load([(a.digest, a.layer) for a in addresses]))
        assert isinstance(loaded, p.Loaded)
        exact = [status == p.Status.OK and self.arena[offset:offset + n] == payload(a.digest, a.layer, n)
                 for a, (status, _, offset, n) in zip(addresses, loaded.entries)]
        return {"entries": [list(e) for e in loaded.entries], "exact": exact}

    def op_release(self, cmd: dict[str, Any]) -> dict[str, Any]:
        released = self.client.call(p.Release(cmd["handles"]))
        assert isinstance(released, p.Released)
        return {"released": released.released, "unknown": released.unknown}

    def _sync(self) -> None:
        """A round trip: the daemon has handled every event sent before it (in order)."""
        self.client.call(p.Lookup(CROSS_LAYER, []))

    def op_pinned(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.client.send(p.Pinned([bytes.fromhex(d) for d in cmd["digests"]]))
        self._sync()
        return {"event_errors": [e.code for e in self.client.event_errors]}

    def op_evicted(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.client.send(p.Evicted([bytes.fromhex(d) for d in cmd["digests"]]))
        self._sync()
        return {"event_errors": [e.code for e in self.client.event_errors]}

    def op_lookup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        r = self.client.call(p.Lookup(int(cmd.get("layer", CROSS_LAYER)), [bytes.fromhex(d) for d in cmd["digests"]]))
        assert isinstance(r, p.LookupResult)
        return {"result": [r.longest, r.gpu, r.ram, r.ssd, r.peer]}

    def op_overlap(self, cmd: dict[str, Any]) -> dict[str, Any]:
        r = self.client.call(p.Overlap([bytes.fromhex(d) for d in cmd["digests"]]))
        assert isinstance(r, p.OverlapResult)
        return {"agents": [[a.session, a.pid, a.prefix, a.agent_id] for a in r.agents]}

    # -- the Agent (torch) ----------------------------------------------------------------------

    def _tensor(self, a: BlockAddress, dtype: str, shape: list[int]) -> Any:
        import torch

        dt = getattr(torch, dtype)
        n = dt.itemsize
        for s in shape:
            n *= s
        return torch.frombuffer(bytearray(payload(a.digest, a.layer, n)), dtype=torch.uint8).view(dt).reshape(shape)

    def _save(self, addresses: list[BlockAddress], dtype: str, shape: list[int]) -> Any:
        return self.agent.save(addresses, [self._tensor(a, dtype, shape) for a in addresses])

    def _load_check(self, addresses: list[BlockAddress], dtype: str, shape: list[int]) -> tuple[Any, list[int]]:
        """Load into sentinel-filled tensors; the indexes whose bytes are wrong (a loaded block
        not bit-exact, or a missing block whose tensor was touched)."""
        import torch

        dt = getattr(torch, dtype)
        nbytes = dt.itemsize
        for s in shape:
            nbytes *= s
        out = [torch.full((nbytes,), 0x5A, dtype=torch.uint8).view(dt).reshape(shape) for _ in addresses]
        result = self.agent.load(addresses, out)
        missing = set(result.missing)
        bad = []
        for i, (a, t) in enumerate(zip(addresses, out)):
            got = t.reshape(-1).view(torch.uint8)
            want = (torch.full_like(got, 0x5A) if i in missing
                    else torch.frombuffer(bytearray(payload(a.digest, a.layer, got.numel())), dtype=torch.uint8))
            if not torch.equal(got, want):
                bad.append(i)
        return result, bad

    def op_save(self, cmd: dict[str, Any]) -> dict[str, Any]:
        r = self._save(_blocks(cmd["blocks"]), cmd["dtype"], cmd["shape"])
        return {"stored": r.stored, "present": r.present, "skipped": r.skipped}

    def op_load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        r, bad = self._load_check(_blocks(cmd["blocks"]), cmd["dtype"], cmd["shape"])
        return {"loaded": r.loaded, "missing": r.missing, "bad": bad}

    def op_stress(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Rounds of: save this worker's own blocks, save the shared blocks (which the other
        workers save at the same time: BUSY is retried until the block is there), load and
        check everything saved so far. Counts what happened; ``bad`` must stay empty."""
        dtype, shape = cmd["dtype"], cmd["shape"]
        own, shared = _blocks(cmd["own"]), _blocks(cmd["shared"])
        rounds, per = int(cmd["rounds"]), int(cmd["per_round"])
        stats = {"stored": 0, "present": 0, "busy_retries": 0, "loaded": 0, "bad": [], "missing": []}
        done: list[BlockAddress] = []
        for r in range(rounds):
            mine = own[r * per:(r + 1) * per]
            ours = shared[r * per:(r + 1) * per]
            res = self._save(mine, dtype, shape)
            if res.skipped or res.present:
                raise AssertionError(f"own blocks not stored: {res}")
            stats["stored"] += res.stored
            todo = ours
            for _ in range(200):
                res = self._save(todo, dtype, shape)
                stats["stored"] += res.stored
                stats["present"] += res.present
                if not res.skipped:
                    break
                stats["busy_retries"] += 1
                todo = [todo[i] for i in res.skipped]
                time.sleep(0.005)
            else:
                raise AssertionError(f"shared blocks still busy after 200 tries: {len(todo)}")
            done += mine + ours
            result, bad = self._load_check(done, dtype, shape)
            stats["loaded"] += result.loaded
            stats["bad"] += [str(done[i]) for i in bad]
            stats["missing"] += [str(done[i]) for i in result.missing]
        return stats

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.agent is not None:
            self.agent.close()
        else:
            self.client.close()
        return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("agent_id")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--model", default="test/model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--layer-block-bytes", type=int, default=16 << 10)
    ap.add_argument("--no-heartbeat", action="store_true")
    args = ap.parse_args()

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        worker = Worker(args)
    except AgentError as exc:
        reply({"ok": False, "error": type(exc).__name__, "code": int(exc.code), "message": exc.message})
        return 1
    reply({"ok": True, "pid": os.getpid(), "session": worker.client.welcome.session})
    for line in sys.stdin:
        cmd = json.loads(line)
        handler: Callable[[dict[str, Any]], dict[str, Any]] = getattr(worker, "op_" + cmd["op"])
        try:
            reply({"ok": True, **handler(cmd)})
        except AgentError as exc:
            reply({"ok": False, "error": type(exc).__name__, "code": int(exc.code), "message": exc.message})
        except Exception as exc:         # a failed check: the test shows it
            import traceback

            reply({"ok": False, "error": type(exc).__name__, "code": -1, "message": traceback.format_exc()})
        if cmd["op"] == "close":
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
