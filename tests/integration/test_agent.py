"""The agent socket end to end: real daemon processes, real Unix sockets, agents in the test
process and in processes of their own (tests/integration/agent_worker.py).

What is checked:

- save then load is bit-exact for several dtypes, shapes and batch sizes, per layer and
  cross-layer, from separate tensors and from views of one engine-style cache tensor; re-saves
  count as present; a missing block is reported and its tensor left alone; the blocks agents
  write are the blocks gRPC serves (with the checksum the daemon computed), and the reverse;
- several agent processes saving and loading distinct and shared blocks at once;
- an agent SIGKILLed between Allocate and Commit, or between Load and Release, gives back all it
  held: its slots are free for another writer, its pins no longer block a Delete, the other
  agents go on;
- the GPU view follows Pinned/Evicted events exactly (Overlap, the gpu column of Lookup, the
  stats), refuses events over agent.max_gpu_blocks, and forgets an agent that leaves;
- bad frames on a raw socket get the documented Error codes, fatal ones close the connection,
  others leave it usable, and the daemon goes on serving;
- the socket: a second daemon refuses a socket in use, mode and group are applied, an unknown
  group stops the daemon, agent.max_agents is enforced;
- an agent that stops heart-beating (SIGSTOP) is dropped with everything it held;
- the log names each agent with the pid the kernel reports (SO_PEERCRED).
"""

from __future__ import annotations

import grp
import json
import os
import queue
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
import pytest
import torch

from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent import protocol as p
from kvcached_agent.address import CROSS_LAYER, BlockAddress, chain_digests
from kvcached_agent.agent import Agent
from kvcached_agent.client import AgentError, ConnectionClosed

from .agent_worker import payload
from .conftest import ROOT, DaemonProcess, wait_for

WORKER = Path(__file__).with_name("agent_worker.py")
KIB = 1 << 10
NO_SSD = "kv.ssd_gib=0"


# -- helpers ---------------------------------------------------------------------------------

def agent_socket(daemon: DaemonProcess) -> str:
    return str(daemon.state / "agent.sock")


def chain(n: int, seed: int = 0, model: str = "test/model", dtype: str = "bfloat16") -> list[bytes]:
    return chain_digests(list(range(seed, seed + 16 * n)), 16, model=model, dtype=dtype)



def wait_stats(c: Any, *, agents: int | None = None, held: int | None = None, gpu_blocks: int | None = None,
               timeout: float = 20.0) -> pb.StatsResponse:
    """Poll gRPC Stats until the agent counters read as given (disconnects are handled by the
    daemon shortly after the kernel closes the socket)."""
    last: list[pb.StatsResponse] = []

    def ok() -> bool:
        s = c.stats()
        last[:] = [s]
        return ((agents is None or s.agents == agents) and (held is None or s.agent_held_bytes == held)
                and (gpu_blocks is None or s.gpu_blocks == gpu_blocks))
    try:
        wait_for(ok, timeout, f"agents={agents} held={held} gpu_blocks={gpu_blocks}")
    except AssertionError:
        s = last[0]
        raise AssertionError(f"stats never read agents={agents} held={held} gpu_blocks={gpu_blocks}; last: "
                             f"agents={s.agents} held={s.agent_held_bytes} gpu_blocks={s.gpu_blocks}") from None
    return last[0]


def payload_tensor(address: BlockAddress, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    n = dtype.itemsize
    for s in shape:
        n *= s
    data = bytearray(payload(address.digest, address.layer, n))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (NaN payloads included): compare the bytes, not the values."""
    return a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8).cpu(),
                                              b.contiguous().reshape(-1).view(torch.uint8).cpu())


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaNs and infinities included)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def connect(daemon: DaemonProcess, agent_id: str, *, model: str = "test/model", dtype: str = "bfloat16",
            num_layers: int = 4, layer_block_bytes: int = 16 * KIB) -> Agent:
    return Agent.connect(agent_socket(daemon), agent_id=agent_id, model=model, dtype=dtype, block_tokens=16,
                         num_layers=num_layers, layer_block_bytes=layer_block_bytes, timeout=30)


def log_lines(daemon: DaemonProcess, msg: str) -> list[str]:
    return [line for line in daemon.log().splitlines() if f'msg="{msg}"' in line or f"msg={msg} " in line]


class Worker:
    """An agent_worker.py process: one JSON command per line in, one JSON answer per line out."""

    def __init__(self, daemon: DaemonProcess, agent_id: str, *args: str, use_torch: bool = False,
                 socket_path: str = "", prefix: list[str] | None = None) -> None:
        """``socket_path``: the agent socket (default: the daemon's); ``prefix``: what the worker runs
        under (a pod: tests/pods.py), where its pid is another than the one the test sees."""
        self.agent_id = agent_id
        self.stderr_path = daemon.state / f"worker-{agent_id}-{time.monotonic_ns()}.err"
        err = open(self.stderr_path, "wb")
        cmd = [*(prefix or []), sys.executable, str(WORKER), socket_path or agent_socket(daemon), agent_id, *args] + (
            ["--torch"] if use_torch else [])
        self.in_pod = prefix is not None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.proc.pid
        self.session = -1

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.agent_id}: no answer within {timeout} s\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"worker {self.agent_id} exited ({self.proc.poll()}):\n{self.stderr()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def ready(self, timeout: float = 60.0) -> "Worker":
        hello = self.reply(timeout)
        assert hello["ok"], hello
        assert hello["pid"] == self.pid or self.in_pod
        self.session = hello["session"]
        return self

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, *, check: bool = True, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        answer = self.reply(timeout)
        if check:
            assert answer["ok"], f"worker {self.agent_id} {op}: {answer}"
        return answer

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


@pytest.fixture
def workers() -> Any:
    started: list[Worker] = []

    def make(daemon: DaemonProcess, agent_id: str, *args: str, use_torch: bool = False, ready: bool = True) -> Worker:
        w = Worker(daemon, agent_id, *args, use_torch=use_torch)
        started.append(w)
        return w.ready() if ready else w

    yield make
    for w in started:
        try:
            os.kill(w.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        w.finish()


def hexes(addresses: Sequence[BlockAddress], nbytes: int | None = None) -> list[list[Any]]:
    return [[a.digest.hex(), a.layer] + ([nbytes] if nbytes is not None else []) for a in addresses]


# -- 1. bit-exact round trips ----------------------------------------------------------------

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
#: one layer's block of one engine: (K/V, tokens, heads, head size), a different one per dtype
SHAPES = {torch.float16: (2, 16, 2, 64), torch.bfloat16: (2, 16, 4, 24), torch.float32: (2, 16, 1, 40),
          torch.uint8: (2, 16, 8, 17)}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_save_load_round_trip_bit_exact(make_daemon, device: str) -> None:
    daemon = make_daemon()
    gen = torch.Generator().manual_seed(1234)
    layers = 3
    with daemon.client() as c:
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            shape = SHAPES[dtype]
            layer_bytes = dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3]
            with connect(daemon, f"rt-{name}", model="test/rt", dtype=name, num_layers=layers,
                         layer_block_bytes=layer_bytes) as agent:
                for n in (1, 7, 64):
                    digests = agent.hash_tokens(list(range(1000 * n, 1000 * n + 16 * n + 5)))   # a partial block too
                    assert len(digests) == n
                    # per-layer blocks: layer 0..L-1; separate tensors (7), views of one cache (1, 64)
                    for layer in range(layers):
                        addresses = agent.addresses(digests, layer)
                        if n == 7:
                            src = [random_tensor(shape, dtype, gen).to(device) for _ in range(n)]
                            dst_cache = None
                            dst = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
                        else:
                            cache = random_tensor((n, *shape), dtype, gen).to(device)
                            src = list(cache.unbind(0))               # neighbours: one merged copy
                            dst_cache = torch.zeros_like(cache)
                            dst = list(dst_cache.unbind(0))
                        r = agent.save(addresses, src)
                        assert (r.stored, r.present, r.skipped) == (n, 0, []), (name, n, layer, r)
                        got = agent.load(addresses, dst)
                        assert (got.loaded, got.missing, got.prefix) == (n, [], n)
                        assert all(same_bytes(a, b) for a, b in zip(src, dst)), (name, n, layer)
                        if dst_cache is not None and n > 1:
                            again = torch.zeros_like(dst_cache)       # reversed: neighbours no more, still exact
                            got = agent.load(addresses[::-1], list(again.unbind(0))[::-1])
                            assert got.loaded == n and same_bytes(again, dst_cache)
                            part = torch.zeros_like(dst_cache)        # a run in the middle of the cache
                            got = agent.load(addresses[5:40], list(part.unbind(0))[5:40])
                            assert got.loaded == 35 and same_bytes(part[5:40], dst_cache[5:40])
                            assert not part[:5].view(torch.uint8).any() and not part[40:].view(torch.uint8).any()
                        # the daemon checksummed what the agent wrote: gRPC serves the same bytes (verified)
                        (block,), _ = c.get([addresses[-1]])
                        assert block.payload == tensor_bytes(src[-1])
                        r = agent.lookup(digests, layer)      # ssd: what write-back has published so far
                        assert (r.longest, r.gpu, r.ram, r.peer) == (n, 0, n, 0) and 0 <= r.ssd <= n
                        # a re-save is counted as present; nothing is copied
                        r = agent.save(addresses, src)
                        assert (r.stored, r.present, r.skipped) == (0, n, [])
                    # cross-layer blocks: every layer in one unit
                    xshape = (layers, *shape)
                    xsrc = [random_tensor(xshape, dtype, gen).to(device) for _ in range(n)]
                    xaddr = agent.addresses(digests)
                    assert all(a.layer == CROSS_LAYER for a in xaddr)
                    r = agent.save(xaddr, xsrc)
                    assert (r.stored, r.present) == (n, 0)
                    xdst = [torch.zeros(xshape, dtype=dtype, device=device) for _ in range(n)]
                    assert agent.load(xaddr, xdst).loaded == n
                    assert all(same_bytes(a, b) for a, b in zip(xsrc, xdst))
                    assert agent.lookup(digests).longest == n
                    # half known, half new: counted apart
                    more = agent.hash_tokens(list(range(1000 * n, 1000 * n + 16 * (n + 3))))
                    extra = [random_tensor(xshape, dtype, gen).to(device) for _ in range(3)]
                    r = agent.save(agent.addresses(more), xsrc + extra)
                    assert (r.stored, r.present, r.skipped) == (3, n, [])

                # a block that is not there: listed in missing, its tensor untouched, the rest loaded
                digests = agent.hash_tokens(list(range(1000 * 7, 1000 * 7 + 16 * 7)))
                gap = agent.hash_tokens(list(range(555_000, 555_016)))[0]
                addresses = agent.addresses(digests[:3] + [gap] + digests[3:5], 1)
                sentinel = random_tensor(shape, dtype, gen)
                dst = [sentinel.clone().to(device) for _ in addresses]
                got = agent.load(addresses, dst)
                assert (got.loaded, got.missing, got.prefix) == (5, [3], 3)
                assert same_bytes(dst[3], sentinel)
                assert not any(same_bytes(dst[i], sentinel) for i in (0, 1, 2, 4, 5))
                none = agent.load(agent.addresses([gap]), [dst[3]])
                assert (none.loaded, none.missing, none.prefix) == (0, [0], 0) and same_bytes(dst[3], sentinel)

        # the other way round: a block put over gRPC loads into a tensor bit-exact
        with connect(daemon, "rt-grpc", model="test/rt", dtype="float16", num_layers=2,
                     layer_block_bytes=4 * KIB) as agent:
            address = agent.addresses(agent.hash_tokens(list(range(16))), 1)[0]
            data = os.urandom(4 * KIB)
            assert c.put([(address, data)], model="test/rt").stored == 1
            r = agent.save([address], [torch.zeros(2048, dtype=torch.float16)])
            assert (r.stored, r.present) == (0, 1)
            t = torch.zeros(2048, dtype=torch.float16, device=device)
            assert agent.load([address], [t]).loaded == 1
            assert tensor_bytes(t) == data
        wait_stats(c, agents=0, held=0)


def test_a_block_given_in_pieces_saves_and_loads_bit_exact_and_skips_what_is_held(daemon) -> None:
    """A block can be several tensors (a paged cache keeps a block's layers apart): saved in
    order, loaded back into pieces, and an int in a load leaves that many bytes uncopied."""
    gen = torch.Generator().manual_seed(7)
    with connect(daemon, "pieces", num_layers=4, layer_block_bytes=4 * KIB) as agent:
        cache = random_tensor((4, 8, 4 * KIB), torch.uint8, gen)      # 4 layers x 8 pages of 4 KiB
        addresses = agent.addresses(agent.hash_tokens(list(range(32))))
        blocks = [[cache[layer, page] for layer in range(4)] for page in (3, 5)]
        r = agent.save(addresses, blocks)
        assert (r.stored, r.skipped) == (2, [])
        out = torch.zeros_like(cache)
        got = agent.load(addresses, [[out[layer, page] for layer in range(4)] for page in (0, 1)])
        assert (got.loaded, got.missing) == (2, [])
        assert all(torch.equal(out[layer, new], cache[layer, old])
                   for layer in range(4) for new, old in ((0, 3), (1, 5)))
        held = torch.zeros_like(cache)
        got = agent.load(addresses[:1], [[4 * KIB, held[1, 0], 4 * KIB, held[3, 0]]])   # layers 0 and 2 held already
        assert got.loaded == 1
        assert torch.equal(held[1, 0], cache[1, 3]) and torch.equal(held[3, 0], cache[3, 3])
        assert not held[0].any() and not held[2].any()
        with pytest.raises(ValueError, match="16384 bytes but its tensor holds 12288"):
            agent.load(addresses[:1], [[held[0, 0], held[1, 0], held[2, 0]]])
        with pytest.raises(ValueError, match="tensors only"):
            agent.save(addresses[:1], [[4 * KIB, held[1, 0]]])


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_blocks_saved_by_an_agent_come_back_from_ssd(make_daemon, write_policy: str) -> None:
    """An 8 MiB arena and three times that saved: the blocks leave RAM for the SSD tier and a
    Load promotes them back, bit-exact (Lookup counts them on SSD). Under write_through a
    Commit answers once its blocks are published: none is lost. Under write_back, blocks not
    yet published when RAM needs room may be dropped (counted in dirty_dropped; agent saves
    get no write-back throttle today, see the report): every block is either on SSD and loads
    bit-exact, or counted as dropped and reported missing."""
    daemon = make_daemon("kv.ram_gib=0.0078125", "kv.max_block_mib=1", f'kv.write_policy="{write_policy}"')
    size, n, batch = 256 * KIB, 96, 8
    gen = torch.Generator().manual_seed(5)
    with daemon.client() as c, connect(daemon, "ssd", dtype="float32", num_layers=1, layer_block_bytes=size) as agent:
        digests = agent.hash_tokens(list(range(16 * n)))
        addresses = agent.addresses(digests)
        data = [random_tensor((size // 4,), torch.float32, gen) for _ in addresses]
        stored = 0
        for i in range(0, n, batch):
            todo = list(range(i, i + batch))
            for _ in range(500):             # FULL while RAM holds only unpublished blocks: retried
                r = agent.save([addresses[j] for j in todo], [data[j] for j in todo])
                stored += r.stored
                assert r.present == 0
                todo = [todo[j] for j in r.skipped]
                if not todo:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError(f"blocks {todo} never saved")
        assert stored == n

        def published() -> bool:
            return c.stats().ram_dirty_bytes == 0
        wait_for(published, 30, "nothing left to publish")
        s = c.stats()
        (ssd,) = [t for t in s.tiers if t.tier == pb.TIER_SSD]
        assert ssd.blocks + s.dirty_dropped == n, s
        if write_policy == "write_through":
            assert s.dirty_dropped == 0
            hit = agent.lookup(digests)
            assert (hit.longest, hit.ssd) == (n, n) and hit.ram < n
        missing = 0
        for i in range(0, n, batch):
            dst = [torch.zeros(size // 4, dtype=torch.float32) for _ in range(batch)]
            got = agent.load(addresses[i:i + batch], dst)
            assert got.loaded + len(got.missing) == batch
            missing += len(got.missing)
            for j, (a, b) in enumerate(zip(data[i:i + batch], dst)):
                assert same_bytes(a, b) if j not in got.missing else not b.view(torch.uint8).any(), (i, j)
        assert missing == s.dirty_dropped
        s = c.stats()
        assert s.promotions > 0 and s.ssd_corrupt == 0 and s.ssd_write_errors == 0
        wait_stats(c, agents=1, held=0)


def test_a_save_that_does_not_wait_for_its_commit(make_daemon) -> None:
    """confirm=False (an engine's step): save returns once the bytes are in the arena and the
    Commit is sent; under write-through the SSD publish happens after it. The answers it did not
    wait for are read by later calls without confusing them, and every block comes back exact."""
    daemon = make_daemon('kv.write_policy="write_through"')
    size, n = 64 * KIB, 48
    gen = torch.Generator().manual_seed(9)
    with daemon.client() as c, connect(daemon, "nowait", dtype="float32", num_layers=1, layer_block_bytes=size) as agent:
        digests = agent.hash_tokens(list(range(16 * n)))
        addresses = agent.addresses(digests)
        data = [random_tensor((size // 4,), torch.float32, gen) for _ in addresses]
        expected = [tensor_bytes(t) for t in data]
        for i in range(0, n, 4):                  # twelve saves, no answer waited for
            r = agent.save(addresses[i:i + 4], data[i:i + 4], confirm=False)
            assert (r.stored, r.skipped) == (4, [])
            assert agent.client._ignore, "the Commit went out and its answer was not waited for"
            for t in data[i:i + 4]:
                t.zero_()                          # the tensors are free once save returns
        wait_for(lambda: agent.lookup(digests).ssd == n, 30, "every block committed and on SSD")
        again = agent.save(addresses[:4], [torch.zeros(size // 4) for _ in range(4)])
        assert (again.stored, again.present) == (0, 4)
        dst = [torch.zeros(size // 4, dtype=torch.float32) for _ in range(n)]
        assert agent.load(addresses, dst).loaded == n
        assert [tensor_bytes(t) for t in dst] == expected
        (block,), _ = c.get([addresses[5]])
        assert block.payload == expected[5]
        wait_stats(c, agents=1, held=0)


def test_agent_mistakes_give_back_what_they_held(daemon) -> None:
    """A save or load that fails on the agent's side (a tensor of the wrong size, one not
    contiguous) releases its slots and pins; a block over the size limit is skipped."""
    with daemon.client() as c, \
            connect(daemon, "mistakes", dtype="float16", num_layers=2, layer_block_bytes=4 * KIB) as agent:
        addresses = agent.addresses(agent.hash_tokens(list(range(16 * 4))), 0)
        good = [torch.randn(2048).half() for _ in addresses]
        strided = torch.randn(2048, 2).half()[:, 0]
        assert not strided.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            agent.save(addresses, good[:3] + [strided])
        wait_stats(c, agents=1, held=0)
        r = agent.save(addresses, good)                 # the slots went back: nothing busy
        assert (r.stored, r.skipped) == (4, [])
        with pytest.raises(ValueError, match="bytes but its tensor holds"):
            agent.load(addresses, [torch.zeros(2048, dtype=torch.float16)] * 3 + [torch.zeros(100, dtype=torch.float16)])
        wait_stats(c, agents=1, held=0)
        assert c.delete(addresses[:1]).deleted == 1     # not pinned any more
        with pytest.raises(ValueError, match="2 addresses but 1 tensors"):
            agent.save(addresses[:2], good[:1])
        big = torch.zeros((8 << 20) + 2, dtype=torch.uint8)     # over kv.max_block_mib = 8
        r = agent.save(agent.addresses(agent.hash_tokens(list(range(900, 916)))), [big])
        assert (r.stored, r.skipped) == (0, [0])
        wait_stats(c, agents=1, held=0)
        assert len(agent.client.event_errors) == 0


# -- 2. several agent processes at once ------------------------------------------------------

def test_several_agent_processes_save_and_load_concurrently(make_daemon, workers) -> None:
    daemon = make_daemon(NO_SSD)
    n_workers, rounds, per = 3, 6, 8
    shape = [4, 2, 16, 2, 32]                    # cross-layer: 4 layers of 4 KiB bfloat16
    nbytes = 4 * 2 * 16 * 2 * 32 * 2
    own = [[BlockAddress(d) for d in chain(rounds * per, seed=100_000 * (i + 1), model="test/multi")]
           for i in range(n_workers)]
    shared = [BlockAddress(d) for d in chain(rounds * per, seed=7, model="test/multi")]
    procs = [workers(daemon, f"multi-{i}", "--model", "test/multi", "--layer-block-bytes", str(nbytes // 4),
                     use_torch=True, ready=False) for i in range(n_workers)]
    for w in procs:                              # torch imports in parallel
        w.ready(timeout=120)
    with daemon.client() as c:
        wait_stats(c, agents=n_workers)
        for i, w in enumerate(procs):            # all at once: every worker is mid-stream together
            w.send("stress", own=hexes(own[i]), shared=hexes(shared), rounds=rounds, per_round=per,
                   dtype="bfloat16", shape=shape)
        results = [w.reply(timeout=120) for w in procs]
        for w, r in zip(procs, results):
            assert r["ok"], f"{w.agent_id}: {r}"
            assert r["bad"] == [] and r["missing"] == [], r
        # each shared block was stored exactly once, by whoever came first; the others found it present or busy
        stored = sum(r["stored"] for r in results)
        assert stored == n_workers * rounds * per + rounds * per, results
        assert sum(r["present"] for r in results) == (n_workers - 1) * rounds * per, results
        # every worker reads what the others wrote, bit-exact
        for i, w in enumerate(procs):
            others = [a for j in range(n_workers) if j != i for a in own[j]]
            w.send("load", blocks=hexes(others + shared), dtype="bfloat16", shape=shape)
        for w in procs:
            r = w.reply(timeout=120)
            assert r["ok"] and r["bad"] == [] and r["missing"] == [], r
            assert r["loaded"] == (n_workers - 1) * rounds * per + rounds * per, r
        found, misses = c.get([own[0][0], own[1][-1], own[2][5], shared[0], shared[-1]])
        assert not misses and all(f.payload == payload(f.address.digest, f.address.layer, nbytes) for f in found)
        s = c.stats()
        assert s.puts == stored and s.tiers[0].blocks == stored and s.tiers[0].evictions == 0
        for w in procs:
            w.call("close")
        wait_stats(c, agents=0, held=0)


# -- 3. agents killed mid-save and mid-load --------------------------------------------------

def test_agent_killed_between_allocate_and_commit_or_load_and_release(make_daemon, workers) -> None:
    daemon = make_daemon()
    size = 8 * KIB
    with daemon.client() as c, \
            connect(daemon, "bystander", dtype="float16", num_layers=2, layer_block_bytes=size) as other:
        shape = (size // 2,)
        # -- killed mid-save: slots allocated and half written, no Commit
        xs = other.addresses(other.hash_tokens(list(range(16 * 5))), 0)
        writer = workers(daemon, "writer")
        r = writer.call("allocate", blocks=hexes(xs, size), write="half")
        assert [s[0] for s in r["slots"]] == [p.Status.OK] * 5
        wait_stats(c, agents=2, held=5 * size)
        tensors = [payload_tensor(a, torch.float16, shape) for a in xs]
        busy = other.save(xs, tensors)                  # someone is writing them right now
        assert (busy.stored, busy.skipped) == (0, [0, 1, 2, 3, 4])
        assert other.lookup([a.digest for a in xs], 0).longest == 0     # reserved is not stored
        assert other.load(xs, [torch.zeros(shape, dtype=torch.float16) for _ in xs]).missing == [0, 1, 2, 3, 4]
        with pytest.raises(grpc.RpcError) as err:
            c.get(xs[:1])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            c.delete(xs[:1])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being written" in err.value.details()
        writer.kill()
        wait_stats(c, agents=1, held=0)
        r = other.save(xs, tensors)                     # free for another writer now
        assert (r.stored, r.present, r.skipped) == (5, 0, [])
        back = [torch.zeros(shape, dtype=torch.float16) for _ in xs]
        assert other.load(xs, back).loaded == 5 and all(same_bytes(a, b) for a, b in zip(tensors, back))

        # -- killed mid-load: blocks pinned, no Release
        ys = other.addresses(other.hash_tokens(list(range(50_000, 50_000 + 16 * 4))), 1)
        assert other.save(ys, [payload_tensor(a, torch.float16, shape) for a in ys]).stored == 4
        reader = workers(daemon, "reader")
        r = reader.call("load_hold", blocks=hexes(ys + xs[:1]))
        assert [e[0] for e in r["entries"]] == [p.Status.OK] * 5 and all(r["exact"]), r
        wait_stats(c, agents=2, held=5 * size)
        with pytest.raises(grpc.RpcError) as err:
            c.delete(ys)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "in use" in err.value.details()
        reader.kill()
        wait_stats(c, agents=1, held=0)
        assert (c.delete(ys).deleted, c.delete(xs[:1]).deleted) == (4, 1)

        # -- killed holding both, with a commit of some of its slots done first
        zs = other.addresses(other.hash_tokens(list(range(70_000, 70_000 + 16 * 4))), 0)
        both = workers(daemon, "both")
        slots = both.call("allocate", blocks=hexes(zs, size), write=True)["slots"]
        assert both.call("commit", handles=[slots[0][1], 12345])["statuses"] == [p.Status.OK, p.Status.UNKNOWN_HANDLE]
        assert both.call("load_hold", blocks=hexes(xs[1:3]))["exact"] == [True, True]
        wait_stats(c, agents=2, held=3 * size + 2 * size)
        both.kill()
        wait_stats(c, agents=1, held=0)
        (kept,), _ = c.get(zs[:1])                    # the committed one stays, the others are free
        assert kept.payload == payload(zs[0].digest, 0, size)
        r = other.save(zs, [payload_tensor(a, torch.float16, shape) for a in zs])
        assert (r.stored, r.present, r.skipped) == (3, 1, [])

        # the bystander was never disturbed
        assert other.lookup([a.digest for a in xs[1:]], 0).longest == 4       # (xs[0] was deleted)
        assert len(other.client.event_errors) == 0
        disconnects = log_lines(daemon, "agent disconnected")
        assert len(disconnects) == 3
        assert "released_slots=5 released_pins=0" in disconnects[0]
        assert "released_slots=0 released_pins=5" in disconnects[1]
        assert "released_slots=3 released_pins=2" in disconnects[2]
    assert daemon.stop() == 0


def test_daemon_stop_with_agents_holding_slots_and_pins(make_daemon, workers) -> None:
    """SIGTERM while agents hold slots and pins: the daemon ends every connection (an Error
    frame, then EOF) and stops cleanly; the agents see the connection closed."""
    daemon = make_daemon(NO_SSD)
    size = 4 * KIB
    xs = [BlockAddress(x, 0) for x in chain(4, seed=31)]
    with daemon.client() as c:
        c.put([(a, payload(a.digest, 0, size)) for a in xs[:2]])
    w = workers(daemon, "holder")
    assert w.call("load_hold", blocks=hexes(xs[:2]))["exact"] == [True, True]
    assert [s[0] for s in w.call("allocate", blocks=hexes(xs[2:], size))["slots"]] == [p.Status.OK] * 2
    with connect(daemon, "idle") as agent:
        assert daemon.stop() == 0
        with pytest.raises(AgentError) as err:
            agent.lookup(chain(1))
        assert err.value.code == p.ErrorCode.UNAVAILABLE
    r = w.call("lookup", digests=[], check=False)
    assert not r["ok"] and r["error"] == "ConnectionClosed", r
    assert "released_slots=2 released_pins=2" in "".join(log_lines(daemon, "agent disconnected"))
    assert not os.path.exists(agent_socket(daemon))


def test_grpc_put_of_a_block_an_agent_is_writing(make_daemon, workers) -> None:
    """A Put must not say a block is present on the strength of a reservation: the writer may
    die before its Commit. It fails (FAILED_PRECONDITION, nothing stored) and may be retried."""
    daemon = make_daemon(NO_SSD)
    size = 4 * KIB
    (x,) = [BlockAddress(d, 0) for d in chain(1, seed=41)]
    w = workers(daemon, "dies")
    assert w.call("allocate", blocks=hexes([x], size))["slots"][0][0] == p.Status.OK
    outcome: list[Any] = []

    def put() -> None:
        try:
            with daemon.client() as c:
                outcome.append(c.put([(x, payload(x.digest, 0, size))]))
        except grpc.RpcError as exc:
            outcome.append(exc)
    t = threading.Thread(target=put)
    t.start()
    time.sleep(0.5)
    w.kill()
    t.join(30)
    (r,) = outcome
    assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.FAILED_PRECONDITION, r
    assert "being written by an agent" in r.details()
    with daemon.client() as c:                          # once the writer is gone, the Put goes through
        assert c.put([(x, payload(x.digest, 0, size))]).stored == 1
        (got,), _ = c.get([x])
        assert got.payload == payload(x.digest, 0, size)


# -- 4. the GPU view: overlap follows pinned/evicted events ----------------------------------

def test_overlap_follows_pinned_and_evicted_events(make_daemon, workers) -> None:
    daemon = make_daemon(NO_SSD, "agent.max_gpu_blocks=8")
    d = chain(10, seed=3)
    hx = [x.hex() for x in d]
    with daemon.client() as c, connect(daemon, "gpu-a") as a:
        b = workers(daemon, "gpu-b")

        def overlap_by_a(digests: Sequence[bytes]) -> list[tuple[int, int, int, str]]:
            return [(x.session, x.pid, x.prefix, x.agent_id) for x in a.overlap(digests)]

        def overlap_by_b(digests: Sequence[bytes]) -> list[tuple[int, int, int, str]]:
            return [tuple(x) for x in b.call("overlap", digests=[x.hex() for x in digests])["agents"]]  # type: ignore[misc]

        def view() -> list[tuple[int, int, int, str]]:
            mine, theirs = overlap_by_a(d), overlap_by_b(d)
            assert mine == theirs
            return mine

        def A(prefix: int) -> tuple[int, int, int, str]:       # noqa: N802 - what agent A holds
            return (a.session, os.getpid(), prefix, "gpu-a")

        def B(prefix: int) -> tuple[int, int, int, str]:       # noqa: N802 - what agent B holds
            return (b.session, b.pid, prefix, "gpu-b")

        assert a.session != b.session
        assert view() == [A(0), B(0)]                            # ties: by session
        a.report_pinned(d[:5])
        a.lookup([])                                             # a round trip: the event is in
        assert b.call("pinned", digests=hx[:3] + hx[4:8])["event_errors"] == []
        assert view() == [A(5), B(3)]
        wait_stats(c, agents=2, gpu_blocks=12)
        # Lookup's gpu column: the asking agent's own prefix, which also counts towards longest
        assert a.lookup(d) == p.LookupResult(5, 5, 0, 0, 0)
        assert b.call("lookup", digests=hx)["result"] == [3, 3, 0, 0, 0]
        assert b.call("lookup", digests=hx[4:])["result"] == [4, 4, 0, 0, 0]
        assert a.lookup(d[4:]) == p.LookupResult(1, 1, 0, 0, 0)
        assert overlap_by_a(d[4:]) == [B(4), A(1)]
        # gRPC Lookup (no agent): the longest prefix any one agent holds; not servable, so not in longest
        r = c.lookup(d)
        assert (r.gpu, r.longest) == (5, 0)
        # blocks on RAM and on this agent's GPU together make up longest
        other = [torch.zeros(4 * 16 * KIB // 2, dtype=torch.bfloat16) for _ in range(2)]
        assert a.save(a.addresses(d[5:7]), other).stored == 2
        assert a.lookup(d) == p.LookupResult(7, 5, 0, 0, 0)
        assert b.call("lookup", digests=hx)["result"] == [3, 3, 0, 0, 0]

        # evictions: unknown digests are ignored; the view shrinks exactly
        a.report_evicted([d[2], chain(1, seed=999)[0]])
        a.lookup([])
        assert view() == [B(3), A(2)]
        assert b.call("evicted", digests=[hx[0]])["event_errors"] == []
        assert view() == [A(2), B(0)]
        assert overlap_by_a(d[1:]) == [B(2), A(1)]
        wait_stats(c, gpu_blocks=4 + 6)
        a.report_pinned(d[2:5])                                  # again: idempotent with what it has
        a.report_pinned(d[:3])
        a.lookup([])
        assert view() == [A(5), B(0)]

        # over agent.max_gpu_blocks (8): refused as a whole, the view unchanged, the error read later
        a.report_pinned(d[5:10] + chain(3, seed=77))
        assert a.lookup(d).gpu == 5
        (refused,) = a.client.event_errors
        assert refused.code == p.ErrorCode.RESOURCE_EXHAUSTED and "max_gpu_blocks" in refused.message
        assert view() == [A(5), B(0)]
        a.report_pinned(d[5:8])                                  # up to the limit is fine
        a.lookup([])
        assert view() == [A(8), B(0)]
        assert len(a.client.event_errors) == 1

        # an agent that disconnects: its view is gone at once, for everyone
        assert b.call("pinned", digests=hx[:6])["event_errors"] == []
        wait_stats(c, gpu_blocks=8 + 8)
        b.call("close")
        b.proc.wait(10)
        wait_stats(c, agents=1, gpu_blocks=8)
        assert overlap_by_a(d) == [A(8)]
        c2 = connect(daemon, "gpu-c")
        try:
            assert [(x.agent_id, x.prefix) for x in c2.overlap(d)] == [("gpu-a", 8), ("gpu-c", 0)]
            assert c2.lookup(d) == p.LookupResult(0, 0, 0, 0, 0)
        finally:
            c2.close()
        a.report_evicted(d)
        a.lookup([])
        assert overlap_by_a(d) == [A(0)]
        wait_stats(c, agents=1, gpu_blocks=0)


# -- 5. bad input on a raw socket ------------------------------------------------------------

class Raw:
    """A hand-driven agent connection: bytes in, frames out."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.decoder = p.FrameDecoder()

    def hello(self, request_id: int = 1, **kw: Any) -> p.Message:
        fields = dict(agent_id="raw", model="m", dtype="float16", block_tokens=16, num_layers=2,
                      layer_block_bytes=4 * KIB) | kw
        self.send(p.encode(p.Hello(**fields), request_id))    # type: ignore[arg-type]
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        for fd in fds:
            os.close(fd)
        self.decoder.feed(data)
        frame = self.frame()
        assert frame is not None
        message = p.decode(frame)
        if isinstance(message, p.Welcome):
            assert len(fds) == 1 and frame.request_id == request_id
        return message

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self) -> p.Frame | None:
        """The next frame; None at EOF."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.decoder.feed(data)

    def answer(self, request_id: int) -> p.Message:
        frame = self.frame()
        assert frame is not None, "connection closed instead of an answer"
        assert frame.request_id == request_id, (frame, request_id)
        return p.decode(frame)

    def error(self, request_id: int, code: p.ErrorCode) -> p.Error:
        message = self.answer(request_id)
        assert isinstance(message, p.Error) and message.code == code, message
        return message

    def closed(self) -> bool:
        try:
            return self.frame() is None
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def frame_of(type_: int, body: bytes, request_id: int, *, version: int = p.VERSION, flags: int = 0,
             length: int | None = None) -> bytes:
    return p.HEADER.pack(len(body) if length is None else length, version, type_, flags, request_id) + body


def test_bad_frames_get_error_codes_and_the_daemon_goes_on(daemon) -> None:
    path = agent_socket(daemon)
    d = chain(3, seed=11)
    lookup = lambda rid: p.encode(p.Lookup(CROSS_LAYER, d), rid)     # noqa: E731

    # Hello and a request sent together, before the Welcome is read: both answered, in order
    raw = Raw(path)
    raw.send(p.encode(p.Hello("early", "m", "float16", 16, 2, 4 * KIB), 3) + lookup(4))
    data, fds, _, _ = socket.recv_fds(raw.sock, 1 << 16, 4)
    assert len(fds) == 1
    os.close(fds[0])
    raw.decoder.feed(data)
    assert isinstance(raw.answer(3), p.Welcome) and isinstance(raw.answer(4), p.LookupResult)
    raw.close()

    # -- one connection, many request-level errors: each answered, the connection goes on
    raw = Raw(path)
    assert isinstance(raw.hello(request_id=77), p.Welcome)
    raw.send(frame_of(p.Lookup.TYPE, b"abc", 7))                          # body ends early
    raw.error(7, p.ErrorCode.MALFORMED)
    raw.send(frame_of(p.Lookup.TYPE, struct.pack("<II", 0, 2) + d[0], 8))  # 2 entries, 1 present
    raw.error(8, p.ErrorCode.MALFORMED)
    raw.send(frame_of(p.Lookup.TYPE, struct.pack("<II", 0, p.MAX_BATCH + 1), 9))
    raw.error(9, p.ErrorCode.TOO_LARGE)
    raw.send(frame_of(p.Lookup.TYPE, p.Lookup(0, d).encode_body() + b"x", 10))   # bytes left over
    raw.error(10, p.ErrorCode.MALFORMED)
    raw.send(lookup(11))
    assert raw.answer(11) == p.LookupResult(0, 0, 0, 0, 0)
    raw.send(frame_of(0x55, b"whatever", 12))                              # unknown type
    raw.error(12, p.ErrorCode.UNKNOWN_TYPE)
    raw.send(p.encode(p.Released(1, 2), 13))                               # a reply type as a request
    raw.error(13, p.ErrorCode.UNKNOWN_TYPE)
    raw.send(p.encode(p.Hello("raw", "m", "float16", 16, 2, 4 * KIB), 14))  # a second Hello
    raw.error(14, p.ErrorCode.HANDSHAKE)
    raw.send(frame_of(p.Pinned.TYPE, struct.pack("<I", 1) + b"short", 15))  # an event: no reply unless wrong
    raw.error(15, p.ErrorCode.MALFORMED)
    raw.send(frame_of(p.Hello.TYPE, struct.pack("<HH", 1, 2) + b"\xff\xfe" + b"\0" * 30, 16))  # not UTF-8
    raw.error(16, p.ErrorCode.MALFORMED)
    raw.send(p.encode(p.Allocate([(d[0], 0, 0), (d[1], 0, (8 << 20) + 1)]), 17))
    assert raw.answer(17) == p.Slots([(p.Status.INVALID, 0, 0)] * 2)
    raw.send(p.encode(p.Commit([1, 99]), 18))
    assert raw.answer(18) == p.Committed([p.Status.UNKNOWN_HANDLE] * 2)
    raw.send(p.encode(p.Release([5]), 19))
    assert raw.answer(19) == p.Released(0, 1)
    raw.send(p.encode(p.Load([(d[0], 0)]), 20))
    assert raw.answer(20) == p.Loaded([(p.Status.MISS, 0, 0, 0)])
    raw.send(frame_of(p.Lookup.TYPE, struct.pack("<I", 0) + struct.pack("<I", 1) + b"\x01" * 31 + b"", 21))
    raw.error(21, p.ErrorCode.MALFORMED)
    # pipelined, with a broken frame in the middle, and one frame cut into pieces: answered in order
    burst = lookup(30) + frame_of(p.Lookup.TYPE, b"\0", 31) + p.encode(p.Heartbeat(), 32) + lookup(33)
    for i in range(0, len(burst), 5):
        raw.send(burst[i:i + 5])
        if i < 40:
            time.sleep(0.002)
    assert isinstance(raw.answer(30), p.LookupResult)
    raw.error(31, p.ErrorCode.MALFORMED)
    assert isinstance(raw.answer(33), p.LookupResult)                     # (the heartbeat has no answer)
    # non-zero flags break the framing: Error, then closed
    raw.send(frame_of(p.Lookup.TYPE, p.Lookup(0, d).encode_body(), 40, flags=1))
    raw.error(40, p.ErrorCode.MALFORMED)
    assert raw.closed()
    raw.close()

    def fatal(setup: Callable[[Raw], None], data: bytes, request_id: int, code: p.ErrorCode) -> str:
        r = Raw(path)
        setup(r)
        r.send(data)
        message = r.error(request_id, code).message
        assert r.closed(), f"still open after {code.name}"
        r.close()
        return message

    def hello(r: Raw) -> None:
        assert isinstance(r.hello(), p.Welcome)

    def nothing(r: Raw) -> None:
        pass

    # framing errors after Hello: closed
    assert "version 2" in fatal(hello, frame_of(p.Lookup.TYPE, b"", 50, version=2), 50, p.ErrorCode.UNSUPPORTED_VERSION)
    assert "over the limit" in fatal(hello, frame_of(p.Lookup.TYPE, b"", 51, length=p.MAX_BODY + 1), 51,
                                     p.ErrorCode.TOO_LARGE)
    assert "over the limit" in fatal(nothing, frame_of(p.Hello.TYPE, b"", 52, length=0xFFFFFFFF), 52,
                                     p.ErrorCode.TOO_LARGE)
    # handshake errors: closed
    assert "must be Hello" in fatal(nothing, lookup(53), 53, p.ErrorCode.HANDSHAKE)
    assert "must be Hello" in fatal(nothing, p.encode(p.Heartbeat(), 54), 54, p.ErrorCode.HANDSHAKE)
    assert "version 2" in fatal(nothing, p.encode(p.Hello("raw", "m", "f16", 16, 2, 4096, version=2), 55), 55,
                                p.ErrorCode.UNSUPPORTED_VERSION)
    assert "agent_id" in fatal(nothing, p.encode(p.Hello("", "m", "f16", 16, 2, 4096), 56), 56,
                               p.ErrorCode.INVALID_ARGUMENT)
    assert "max_block_mib" in fatal(nothing, p.encode(p.Hello("raw", "m", "f16", 16, 2, (8 << 20) + 1), 57), 57,
                                    p.ErrorCode.INVALID_ARGUMENT)
    assert "positive" in fatal(nothing, p.encode(p.Hello("raw", "m", "f16", 0, 2, 4096), 58), 58,
                               p.ErrorCode.INVALID_ARGUMENT)
    fatal(nothing, frame_of(p.Hello.TYPE, b"\x01\x00\x05", 59), 59, p.ErrorCode.MALFORMED)
    fatal(nothing, frame_of(0x55, b"", 60), 60, p.ErrorCode.UNKNOWN_TYPE)
    # truncated frames, then the agent goes: nothing to answer, nothing held
    for cut in (frame_of(p.Lookup.TYPE, b"\0" * 10, 61, length=100), p.HEADER.pack(100, 1, 4, 0, 62)[:7], b""):
        for with_hello in (False, True):
            r = Raw(path)
            if with_hello:
                hello(r)
            r.send(cut)
            r.close()
    # a Hello and gone before the Welcome is read; many agents at once
    for _ in range(10):
        r = Raw(path)
        r.send(p.encode(p.Hello("gone", "m", "f16", 16, 2, 4096), 1))
        r.close()
    crowd = [Raw(path) for _ in range(40)]
    for i, r in enumerate(crowd):
        assert isinstance(r.hello(request_id=i), p.Welcome)
    with daemon.client() as c:
        wait_stats(c, agents=40)
        for r in crowd:
            r.close()
        wait_stats(c, agents=0, held=0)

    # an agent that does not read its answers: the daemon stops reading its requests (its
    # buffered answers over 4 MiB) and goes on once they are read; nothing is lost (answers to
    # Allocate, which may wait for back-pressure, can come after a later Lookup's: ids match them)
    raw = Raw(path)
    assert isinstance(raw.hello(), p.Welcome)
    big = p.Allocate([(d[0], 0, 0)] * p.MAX_BATCH)       # ~2.6 MB asks, ~1.1 MB answers (all INVALID)
    frames = [p.encode(big, 100 + i) for i in range(5)] + [lookup(200)]
    sender = threading.Thread(target=lambda: raw.send(b"".join(frames)))
    sender.start()
    time.sleep(0.5)
    answers = {}
    for _ in range(6):
        frame = raw.frame()
        assert frame is not None and frame.request_id not in answers
        answers[frame.request_id] = p.decode(frame)
    assert sorted(answers) == [100, 101, 102, 103, 104, 200]
    for i in range(5):
        answer = answers[100 + i]
        assert isinstance(answer, p.Slots) and len(answer.entries) == p.MAX_BATCH
        assert set(answer.entries) == {(p.Status.INVALID, 0, 0)}
    assert isinstance(answers[200], p.LookupResult)
    sender.join(30)
    raw.close()

    # the daemon goes on: agents and gRPC served, nothing held, no error logged
    with daemon.client() as c:
        wait_stats(c, agents=0, held=0)
        with connect(daemon, "after", dtype="float16", num_layers=2, layer_block_bytes=4 * KIB) as agent:
            addresses = agent.addresses(agent.hash_tokens(list(range(32))), 0)
            t = [torch.randn(2048).half() for _ in addresses]
            assert agent.save(addresses, t).stored == 2
            back = [torch.zeros(2048, dtype=torch.float16) for _ in addresses]
            assert agent.load(addresses, back).loaded == 2 and all(same_bytes(x, y) for x, y in zip(t, back))
        (got,), _ = c.get(addresses[:1])
        assert got.payload == tensor_bytes(t[0])
    text = daemon.log()
    assert "level=error" not in text and "Traceback" not in text, text
    refused = "\n".join(log_lines(daemon, "agent connection refused"))
    for reason in ("over the limit", "must be Hello, got Lookup", "must be Hello, got Heartbeat", "protocol version 2",
                   "agent_id must not be empty", "max_block_mib", "must be positive", "a broken first frame"):
        assert reason in refused, (reason, refused)


# -- 6. the socket: in use, mode, group, max_agents ------------------------------------------

def test_socket_in_use_mode_group_and_max_agents(make_daemon, tmp_path: Path) -> None:
    first = make_daemon()
    path = agent_socket(first)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getegid()

    # a second daemon on the same agent socket refuses to start, and the first goes on
    (tmp_path / "second").mkdir()
    second = make_daemon(f'agent.socket="{path}"', state=tmp_path / "second", start=False)
    second.start(wait=False)
    assert second.proc is not None
    assert second.proc.wait(30) != 0
    assert "in use" in second.log() and path in second.log(), second.log()
    with connect(first, "still-there") as agent:
        assert agent.lookup(chain(2)).longest == 0
    assert first.stop() == 0
    assert not os.path.exists(path), "a clean stop removes the agent socket"

    # mode and group applied (a group this process may give: any when root, else one of its own)
    own = set(os.getgroups()) | {os.getegid()}
    candidates = [(g.gr_name, g.gr_gid) for g in grp.getgrall() if os.geteuid() == 0 or g.gr_gid in own]
    group_name, gid = next((g for g in candidates if g[1] != os.getegid()),
                           candidates[0] if candidates else (str(os.getegid()), os.getegid()))
    (tmp_path / "third").mkdir()
    third = make_daemon('agent.mode="0600"', f'agent.group="{group_name}"', "agent.max_agents=2",
                        state=tmp_path / "third")
    st = os.stat(agent_socket(third))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == gid
    # agent.max_agents: one more is refused with an error, and admitted once one has gone
    a1, a2 = connect(third, "one"), connect(third, "two")
    with pytest.raises(AgentError) as err:
        connect(third, "three")
    assert err.value.code == p.ErrorCode.RESOURCE_EXHAUSTED and "max_agents" in err.value.message
    a1.close()
    with third.client() as c:
        wait_stats(c, agents=1)
    a3 = connect(third, "three")
    a2.close()
    a3.close()
    assert third.stop() == 0
    # a numeric group works too; a SIGKILLed daemon's stale socket is replaced at the next start
    (tmp_path / "fourth").mkdir()
    fourth = make_daemon(f'agent.group="{gid}"', state=tmp_path / "fourth")
    assert os.stat(agent_socket(fourth)).st_gid == gid
    fourth.stop(signal.SIGKILL)
    assert os.path.exists(agent_socket(fourth))
    fourth = make_daemon(state=tmp_path / "fourth")
    with connect(fourth, "after-crash") as agent:
        assert agent.lookup(chain(1)).longest == 0

    # an unknown group stops the daemon, naming the key
    (tmp_path / "fifth").mkdir()
    fifth = make_daemon('agent.group="no-such-group-kvcached"', state=tmp_path / "fifth", start=False)
    fifth.start(wait=False)
    assert fifth.proc is not None
    assert fifth.proc.wait(30) != 0
    assert "agent.group" in fifth.log() and "no-such-group-kvcached" in fifth.log(), fifth.log()
    assert not os.path.exists(agent_socket(fifth))


# -- 7. heartbeats: a stopped agent is dropped -------------------------------------------------

def test_agent_that_stops_heart_beating_is_dropped(make_daemon, workers) -> None:
    heartbeat = 0.4
    daemon = make_daemon(NO_SSD, f"agent.heartbeat_s={heartbeat}")
    size = 4 * KIB
    ds = chain(6, seed=21)
    held = [BlockAddress(x, 0) for x in ds[:3]]
    writes = [BlockAddress(x, 1) for x in ds]
    with daemon.client() as c:
        c.put([(a, payload(a.digest, a.layer, size)) for a in held])
        w = workers(daemon, "sleepy")
        assert w.call("load_hold", blocks=hexes(held))["exact"] == [True] * 3
        assert [s[0] for s in w.call("allocate", blocks=hexes(writes, size))["slots"]] == [p.Status.OK] * 6
        w.call("pinned", digests=[x.hex() for x in ds])
        wait_stats(c, agents=1, held=9 * size, gpu_blocks=6)
        time.sleep(6 * heartbeat)                       # idle but alive: its heartbeats keep it
        wait_stats(c, agents=1, held=9 * size, gpu_blocks=6, timeout=1)
        assert c.lookup(ds).gpu == 6

        os.kill(w.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_stats(c, agents=0, held=0, gpu_blocks=0)
        assert time.monotonic() - stopped >= 2 * heartbeat
        assert c.lookup(ds).gpu == 0
        (line,) = log_lines(daemon, "agent disconnected")
        assert "no heartbeat" in line and f"pid={w.pid}" in line and "released_slots=6 released_pins=3" in line
        assert "gpu_blocks_dropped=6" in line
        assert c.delete(held).deleted == 3               # its pins are gone
        with connect(daemon, "watcher") as agent:       # its view is gone from overlap
            assert [(x.agent_id, x.prefix) for x in agent.overlap(ds)] == [("watcher", 0)]
            r = agent.save(agent.addresses(ds, 1), [torch.zeros(size // 2, dtype=torch.bfloat16)] * 6)
            assert (r.stored, r.skipped) == (6, [])     # its slots are free

        os.kill(w.pid, signal.SIGCONT)                   # it wakes up to a closed connection
        r = w.call("lookup", digests=[], check=False)
        assert not r["ok"] and r["error"] == "ConnectionClosed", r
        w.kill()
        wait_stats(c, agents=0, held=0)

        # a connection that never says Hello is ended too (an Error frame, then EOF)
        silent = Raw(agent_socket(daemon))
        frame = silent.frame()
        assert frame is not None and frame.type == p.Error.TYPE
        assert p.decode(frame).code in (p.ErrorCode.UNAVAILABLE, p.ErrorCode.HANDSHAKE)  # type: ignore[union-attr]
        assert silent.closed()
        silent.close()


# -- 8. the log names the agent's process ------------------------------------------------------

def test_log_names_agent_pid_from_peer_credentials(daemon, workers) -> None:
    w = workers(daemon, "logged-worker")
    with connect(daemon, "logged-here") as agent:
        session = agent.session
    wait_for(lambda: len(log_lines(daemon, "agent disconnected")) == 1, 10, "the in-process agent's disconnect")
    lines = log_lines(daemon, "agent connected")
    (theirs,) = [x for x in lines if "agent_id=logged-worker" in x]
    (mine,) = [x for x in lines if "agent_id=logged-here" in x]
    assert f"pid={w.pid} " in theirs and f"session={w.session} " in theirs
    assert f"uid={os.geteuid()} gid={os.getegid()}" in theirs
    assert f"pid={os.getpid()} " in mine and f"session={session} " in mine
    w.call("close")
    w.proc.wait(10)
    wait_for(lambda: len(log_lines(daemon, "agent disconnected")) == 2, 10, "the worker's disconnect")
    (gone,) = [x for x in log_lines(daemon, "agent disconnected") if "agent_id=logged-worker" in x]
    assert f"pid={w.pid} " in gone and 'reason="agent closed the connection"' in gone


# -- addressing: the agent hashes as the daemon and the spec do --------------------------------

def test_agent_hashes_tokens_as_the_spec_says(make_daemon) -> None:
    """docs/addressing.md section 10, vectors 1 and 2, through Agent.hash_tokens (the same code
    the daemon imports) and across a split chain (parent=)."""
    from tests.unit.test_address import BT, DTYPE, MODEL, TOKENS, V1_DIGESTS, V2_DIGESTS, V2_NAMESPACE

    daemon = make_daemon(NO_SSD)
    with Agent.connect(agent_socket(daemon), agent_id="vectors", model=MODEL, dtype=DTYPE, block_tokens=BT,
                       num_layers=1, layer_block_bytes=4 * KIB) as agent:
        assert [d.hex() for d in agent.hash_tokens(TOKENS)] == V1_DIGESTS
        first = agent.hash_tokens(TOKENS[:BT])
        assert [d.hex() for d in first + agent.hash_tokens(TOKENS[BT:], parent=first[-1])] == V1_DIGESTS
        assert agent.hash_tokens(TOKENS[:BT - 1]) == []         # a partial block has no address
    with Agent.connect(agent_socket(daemon), agent_id="vectors-ns", model=MODEL, dtype=DTYPE, block_tokens=BT,
                       num_layers=1, layer_block_bytes=4 * KIB, namespace=V2_NAMESPACE) as agent:
        assert [d.hex() for d in agent.hash_tokens(TOKENS)] == V2_DIGESTS


def test_agent_package_stays_out_of_the_daemon_and_the_daemon_out_of_torch() -> None:
    """The agent installs into engine environments: it must not pull grpc, rocksdict or any
    top-level `kvcached`; the daemon must not pull torch."""
    agent = subprocess.run([sys.executable, "-c", (
        "import sys, kvcached_agent.agent, kvcached_agent.client;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'rocksdict', 'kvcached', 'google'));"
        "print(bad); sys.exit(1 if bad else 0)")], capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stdout + agent.stderr
    daemon = subprocess.run([sys.executable, "-c", (
        "import sys, kvcached.lifecycle.daemon;"
        "sys.exit(1 if 'torch' in sys.modules else 0)")], capture_output=True, text=True, timeout=120)
    assert daemon.returncode == 0, daemon.stdout + daemon.stderr


def test_reconnecting_agent_treats_a_missing_daemon_as_a_miss(make_daemon, tmp_path) -> None:
    """reconnect=True (engine plug-ins): the daemon killed mid-run is a cache with nothing in it
    (no call raises); once it is back the agent connects again by itself, maps the new arena,
    tells it the blocks on its GPU again, and saves and loads bit-exact. An agent started before
    its daemon connects once the daemon is there."""
    daemon = make_daemon(NO_SSD)
    xs = [BlockAddress(d, 0) for d in chain(3, seed=51)]
    tensors = [payload_tensor(a, torch.bfloat16, (8, 512)) for a in xs]
    out = [torch.zeros(8, 512, dtype=torch.bfloat16) for _ in xs]
    agent = Agent.connect(agent_socket(daemon), agent_id="engine", model="test/model", dtype="bfloat16",
                          block_tokens=16, num_layers=4, layer_block_bytes=8 * KIB, timeout=5, reconnect=True,
                          retry_s=0.1, retry_max_s=0.2)
    with agent:
        assert agent.save(xs, tensors).stored == 3
        agent.report_pinned([a.digest for a in xs[:2]])
        daemon.stop(signal.SIGKILL)
        assert agent.lookup([a.digest for a in xs]).longest == 0
        missed = agent.load(xs, out)
        assert (missed.loaded, missed.missing) == (0, [0, 1, 2]) and not agent.connected
        assert agent.save(xs, tensors).skipped == [0, 1, 2]
        agent.report_evicted([xs[1].digest])                 # remembered while the daemon is away
        daemon.start()
        wait_for(lambda: agent.lookup([xs[2].digest]).longest == 0 and agent.connected, 10,
                 "the agent connected again")                # a call connects it (none raises meanwhile)
        assert agent.lookup([a.digest for a in xs]).gpu == 1, "its GPU blocks told again"
        assert agent.reconnects == 1
        with daemon.client() as c:
            wait_stats(c, agents=1, gpu_blocks=1)            # the GPU view told again: xs[0] only
        assert agent.save(xs, tensors).stored == 3
        loaded = agent.load(xs, out)
        assert loaded.loaded == 3 and all(same_bytes(a, b) for a, b in zip(out, tensors))
    daemon.stop()
    early = Agent.connect(str(tmp_path / "not-yet.sock"), agent_id="early", model="test/model", dtype="bfloat16",
                          block_tokens=16, num_layers=4, layer_block_bytes=8 * KIB, reconnect=True, retry_s=0.1)
    with early:
        assert not early.connected and early.lookup([xs[0].digest]).longest == 0
        with pytest.raises(OSError):                         # without reconnect: an error, as before
            Agent.connect(str(tmp_path / "not-yet.sock"), agent_id="strict", model="m", dtype="bfloat16",
                          block_tokens=16, num_layers=4, layer_block_bytes=8 * KIB)


def test_a_refused_hello_is_an_error_even_when_reconnecting(daemon) -> None:
    """reconnect=True turns a daemon that is down into a miss, never a refusal: a block larger
    than kv.max_block_mib (8 MiB here) stops the engine at start with the daemon's reason
    (the vLLM tier's chunk and the connector's page both reach the daemon this way)."""
    with pytest.raises(AgentError, match="max_block_mib") as refused:
        Agent.connect(agent_socket(daemon), agent_id="too-big", model="test/model", dtype="bfloat16",
                      block_tokens=16, num_layers=1, layer_block_bytes=(8 << 20) + 1, reconnect=True)
    assert not isinstance(refused.value, ConnectionClosed)
    with daemon.client() as c:
        assert c.stats().agents == 0


def test_a_wrong_socket_says_which_path_and_why(daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What a new user meets with a wrong socket: a path with no socket, or one nothing listens
    on, is named with its reason (an engine serves on, connecting later); the daemon's gRPC
    socket is refused at once as not an agent socket, never as a protocol version mismatch."""
    from kvcached_agent.client import unreachable_reason

    def connect(path: Path, **kw: Any) -> Agent:
        return Agent.connect(str(path), agent_id="engine", model="test/model", dtype="bfloat16", block_tokens=16,
                             num_layers=1, layer_block_bytes=8 * KIB, timeout=5, **kw)

    typo = tmp_path / "agnet.sock"
    with caplog.at_level("WARNING", logger="kvcached_agent"), connect(typo, reconnect=True) as agent:
        assert not agent.connected
    assert f"no socket at {typo}" in caplog.text and "agent.socket" in caplog.text
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))                                   # a socket file nothing listens on
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvcached_agent"), connect(dead, reconnect=True):
        pass
    assert f"nothing accepts connections at {dead}" in caplog.text
    assert "permission denied opening /x" in unreachable_reason("/x", PermissionError(13, "Permission denied"))
    with pytest.raises(AgentError, match="not a kvcached agent socket") as wrong:
        connect(daemon.socket, reconnect=True)
    assert "HTTP/2" in str(wrong.value) and "version" not in str(wrong.value)
