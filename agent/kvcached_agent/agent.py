"""The agent: what an engine worker uses to save, find and load KV blocks through its daemon.

    agent = Agent.connect("/run/kvcached/agent.sock", agent_id="vllm-0", model="llama-3-8b",
                          dtype="bfloat16", block_tokens=16, num_layers=32, layer_block_bytes=1 << 20)
    digests = agent.hash_tokens(prompt_tokens)
    hit = agent.lookup(digests)                      # longest prefix per tier
    agent.save(agent.addresses(digests), tensors)    # GPU/CPU tensors -> daemon arena
    agent.load(agent.addresses(digests[:hit.longest]), tensors)
    agent.report_pinned(digests)                     # GPU residency events

Block bytes go straight between the engine's tensors and the daemon's shared arena (mapped
once, at connect); the socket carries only addresses, slot offsets and handles. Every call is
batched and split into protocol-sized requests as needed.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvcached_agent import protocol as p
from kvcached_agent.address import CROSS_LAYER, BlockAddress, chain_digests, chain_root
from kvcached_agent.client import AgentClient, AgentError, ConnectionClosed
from kvcached_agent.copy import ArenaCopier

__all__ = ["Agent", "SaveResult", "LoadResult", "Lookup"]

Lookup = p.LookupResult


@dataclass(slots=True)
class SaveResult:
    stored: int = 0                                        # written and committed now
    present: int = 0                                       # the daemon had them already
    declined: int = 0                                      # the daemon's admission policy did not take them
    skipped: list[int] = field(default_factory=list)       # indexes not stored (busy, full, failed)


@dataclass(slots=True)
class LoadResult:
    loaded: int = 0
    missing: list[int] = field(default_factory=list)       # indexes no tier holds (tensors untouched)

    @property
    def prefix(self) -> int:
        """How many blocks from the first were loaded."""
        return self.missing[0] if self.missing else self.loaded


class Agent:
    def __init__(self, client: AgentClient, hello: p.Hello, *, use_cuda: bool | None = None) -> None:
        self.client = client
        self.hello = hello
        self.session = client.welcome.session
        self.root = chain_root(hello.model, hello.dtype, hello.block_tokens, hello.namespace)
        size = client.welcome.arena_bytes
        self._map = mmap.mmap(client.arena_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.copier = ArenaCopier(self._map, size, use_cuda=use_cuda)
        # Copies and close() exclude each other: unmapping the arena under a running copy would
        # crash the process (tensors over an mmap do not keep it mapped).
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def connect(cls, path: str, *, agent_id: str, model: str, dtype: str, block_tokens: int, num_layers: int,
                layer_block_bytes: int, namespace: str | bytes = b"", timeout: float = 60.0,
                use_cuda: bool | None = None) -> "Agent":
        """Connect to the daemon at ``path`` and map its arena. AgentError if it refuses."""
        hello = p.Hello(agent_id, model, dtype, block_tokens, num_layers, layer_block_bytes,
                        namespace.encode() if isinstance(namespace, str) else bytes(namespace))
        client = AgentClient(path, hello, timeout=timeout)
        try:
            return cls(client, hello, use_cuda=use_cuda)
        except BaseException:
            client.close()
            raise

    # -- addressing -----------------------------------------------------------------------------

    def hash_tokens(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``tokens`` (kvcached_agent.address, as the daemon)."""
        return chain_digests(tokens, self.hello.block_tokens, root=self.root, parent=parent)

    @staticmethod
    def addresses(digests: Sequence[bytes], layer: int = CROSS_LAYER) -> list[BlockAddress]:
        return [BlockAddress(d, layer) for d in digests]

    # -- requests -------------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes], layer: int = CROSS_LAYER) -> p.LookupResult:
        """Longest prefix of the chain per tier (this agent's GPU, RAM, SSD, peers)."""
        if len(digests) <= p.MAX_BATCH:
            answer = self.client.call(p.Lookup(layer, list(digests)))
            assert isinstance(answer, p.LookupResult)
            return answer
        first = self.lookup(digests[:p.MAX_BATCH], layer)       # a prefix longer than a batch: rare
        if first.longest < p.MAX_BATCH:
            return first
        rest = self.lookup(digests[p.MAX_BATCH:], layer)

        def join(a: int, b: int) -> int:
            return a + b if a == p.MAX_BATCH else a
        return p.LookupResult(join(first.longest, rest.longest), join(first.gpu, rest.gpu), join(first.ram, rest.ram),
                              join(first.ssd, rest.ssd), join(first.peer, rest.peer))

    def save(self, addresses: Sequence[BlockAddress], tensors: Sequence[torch.Tensor]) -> SaveResult:
        """Store each tensor's bytes as the block at the same position. Blocks the daemon has
        already are not copied again. Returns what was stored; blocks it could not take now
        (busy, no room) are listed in ``skipped``."""
        if len(addresses) != len(tensors):
            raise ValueError(f"{len(addresses)} addresses but {len(tensors)} tensors")
        result = SaveResult()
        with self._lock:
            self._check_open()
            for start in range(0, len(addresses), p.MAX_BATCH):
                end = start + p.MAX_BATCH
                self._save_batch(addresses[start:end], tensors[start:end], start, result)
        return result

    def _save_batch(self, addresses: Sequence[BlockAddress], tensors: Sequence[torch.Tensor], base: int,
                    result: SaveResult) -> None:
        sizes = [t.numel() * t.element_size() for t in tensors]
        slots = self.client.call(p.Allocate([(a.digest, a.layer, n) for a, n in zip(addresses, sizes)]))
        assert isinstance(slots, p.Slots)
        todo: list[tuple[int, int, int]] = []        # (index, handle, offset)
        for i, (status, handle, offset) in enumerate(slots.entries):
            if status == p.Status.OK:
                todo.append((i, handle, offset))
            elif status == p.Status.PRESENT:
                result.present += 1
            elif status == p.Status.DECLINED:
                result.declined += 1
            else:
                result.skipped.append(base + i)
        if not todo:
            return
        handles = [h for _, h, _ in todo]
        try:
            self.copier.save([tensors[i] for i, _, _ in todo], [o for _, _, o in todo])
        except BaseException:
            self.client.send(p.Release(handles))      # the slots go back; nothing half-written is kept
            raise
        committed = self.client.call(p.Commit(handles))
        assert isinstance(committed, p.Committed)
        for (i, _, _), status in zip(todo, committed.statuses):
            if status == p.Status.OK:
                result.stored += 1
            else:
                result.skipped.append(base + i)

    def load(self, addresses: Sequence[BlockAddress], tensors: Sequence[torch.Tensor]) -> LoadResult:
        """Copy each block into the tensor at the same position (a tensor must have exactly
        the block's size). Blocks no tier holds are listed in ``missing``; their tensors are
        left as they were."""
        if len(addresses) != len(tensors):
            raise ValueError(f"{len(addresses)} addresses but {len(tensors)} tensors")
        result = LoadResult()
        with self._lock:
            self._check_open()
            for start in range(0, len(addresses), p.MAX_BATCH):
                end = start + p.MAX_BATCH
                self._load_batch(addresses[start:end], tensors[start:end], start, result)
        return result

    def _load_batch(self, addresses: Sequence[BlockAddress], tensors: Sequence[torch.Tensor], base: int,
                    result: LoadResult) -> None:
        loaded = self.client.call(p.Load([(a.digest, a.layer) for a in addresses]))
        assert isinstance(loaded, p.Loaded)
        handles = [h for status, h, _, _ in loaded.entries if status == p.Status.OK]
        try:
            targets, offsets = [], []
            for i, (status, _, offset, length) in enumerate(loaded.entries):
                if status != p.Status.OK:
                    result.missing.append(base + i)
                    continue
                size = tensors[i].numel() * tensors[i].element_size()
                if size != length:
                    raise ValueError(f"block {addresses[i]} is {length} bytes but its tensor holds {size}")
                targets.append(tensors[i])
                offsets.append(offset)
            self.copier.load(targets, offsets)
            result.loaded += len(targets)
        finally:
            if handles:
                self.client.send(p.Release(handles))     # no need to wait: the copies are complete

    def report_pinned(self, digests: Sequence[bytes]) -> None:
        """Event: these blocks are now on this engine's GPU."""
        for start in range(0, len(digests), p.MAX_BATCH):
            self.client.send(p.Pinned(list(digests[start:start + p.MAX_BATCH])))

    def report_evicted(self, digests: Sequence[bytes]) -> None:
        """Event: these blocks left this engine's GPU."""
        for start in range(0, len(digests), p.MAX_BATCH):
            self.client.send(p.Evicted(list(digests[start:start + p.MAX_BATCH])))

    def overlap(self, digests: Sequence[bytes]) -> list[p.AgentPrefix]:
        """For each connected agent, how long a prefix of the chain it holds on its GPU."""
        answer = self.client.call(p.Overlap(list(digests[:p.MAX_BATCH])))
        assert isinstance(answer, p.OverlapResult)
        return list(answer.agents)

    # -- lifetime -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("the agent is closed")

    def close(self) -> None:
        """Disconnect (the daemon releases anything still held) and unmap the arena; waits
        for a save or load in progress in another thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.copier.close()
            self.copier.arena = torch.empty(0, dtype=torch.uint8)
            self._map.close()
            self.client.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ += ["AgentError"]
