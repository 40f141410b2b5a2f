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

With ``reconnect=True`` (what engine plug-ins use) a daemon that is down or goes away is a
cache that has nothing: lookups find nothing, loads miss, saves are skipped, events are dropped,
and no call raises for it. The agent tries to connect again at most every ``retry_s`` (doubling
up to ``retry_max_s``), maps the restarted daemon's new arena, and reports again the blocks it
holds on its GPU, so the engine never has to know.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from typing import Callable, Sequence, TypeVar

from kvcached_agent import protocol as p
from kvcached_agent.address import CROSS_LAYER, BlockAddress, chain_digests, chain_root
from kvcached_agent.client import AgentClient, AgentError, ConnectionClosed, unreachable_reason
from kvcached_agent.copy import ArenaCopier
from kvcached_agent.slab_pins import SlabGenerationsView
from kvcached_agent.transfer import Block, LoadResult, SaveResult, load_batch, save_batch

__all__ = ["Agent", "Block", "SaveResult", "LoadResult", "Lookup"]

Lookup = p.LookupResult
log = logging.getLogger("kvcached_agent")
_T = TypeVar("_T")

class Agent:
    def __init__(self, client: AgentClient | None, hello: p.Hello, *, use_cuda: bool | None = None,
                 path: str = "", timeout: float = 60.0, reconnect: bool = False, retry_s: float = 0.5,
                 retry_max_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hello = hello
        self.root = chain_root(hello.model, hello.dtype, hello.block_tokens, hello.namespace)
        self.path = path or (client.path if client is not None else "")
        self.timeout = timeout
        self.reconnect = reconnect
        self._use_cuda = use_cuda
        self._retry = (retry_s, retry_max_s)
        self._retry_next = retry_s
        self._retry_at = 0.0
        self._clock = clock
        self._on_gpu: dict[bytes, None] = {}     # reported pinned and not evicted: told again after a reconnect
        # Copies and close() exclude each other: unmapping the arena under a running copy would
        # crash the process (tensors over an mmap do not keep it mapped).
        self._lock = threading.RLock()
        self._closed = False
        self.client: AgentClient | None = None
        self.session = 0
        self.reconnects = 0
        #: The daemon publishes KV events and wants the engine's keys of saved blocks (save's ``routes``).
        self.wants_routes = False
        if client is not None:
            self._attach(client)

    @classmethod
    def connect(cls, path: str, *, agent_id: str, model: str, dtype: str, block_tokens: int, num_layers: int,
                layer_block_bytes: int, namespace: str | bytes = b"", timeout: float = 60.0,
                use_cuda: bool | None = None, reconnect: bool = False, retry_s: float = 0.5,
                retry_max_s: float = 10.0) -> "Agent":
        """Connect to the daemon at ``path`` and map its arena. AgentError if it refuses, or,
        without ``reconnect``, if it cannot be reached; with ``reconnect`` an unreachable daemon
        gives an agent that connects later (see the module docstring)."""
        hello = p.Hello(agent_id, model, dtype, block_tokens, num_layers, layer_block_bytes,
                        namespace.encode() if isinstance(namespace, str) else bytes(namespace))
        options = dict(use_cuda=use_cuda, path=path, timeout=timeout, reconnect=reconnect, retry_s=retry_s,
                       retry_max_s=retry_max_s)
        try:
            client = AgentClient(path, hello, timeout=timeout)
        except (OSError, ConnectionClosed) as exc:
            if not reconnect:
                raise
            reason = unreachable_reason(path, exc) if isinstance(exc, OSError) else f"{path}: {exc}"
            log.warning("kvcached daemon not reachable (%s); serving without it until it is", reason,
                        extra={"socket": path, "error": str(exc)})
            agent = cls(None, hello, **options)  # type: ignore[arg-type]
            agent._retry_at = agent._clock() + retry_s
            return agent
        try:
            return cls(client, hello, **options)  # type: ignore[arg-type]
        except BaseException:
            client.close()
            raise

    # -- the connection -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self.client is not None

    def _attach(self, client: AgentClient) -> None:
        size = client.welcome.arena_bytes
        # MAP_NORESERVE: an arena on hugetlbfs reserves no huge pages for the whole mapping (the
        # daemon's slab allocator bounds what is used; docs/kubernetes.md, "Sizing").
        self._map = mmap.mmap(client.arena_fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0),
                              mmap.PROT_READ | mmap.PROT_WRITE)
        try:            # huge pages where the kernel's shmem THP setting allows (as the daemon asks)
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError, ValueError):
            pass
        generations = SlabGenerationsView(client.generations_fd) if client.generations_fd >= 0 else None
        self.copier = ArenaCopier(self._map, size, use_cuda=self._use_cuda, generations=generations)
        self.client = client
        self.session = client.welcome.session
        try:
            features = client.call(p.Features())
            self.wants_routes = isinstance(features, p.FeatureSet) and bool(features.flags & p.FeatureSet.ROUTE_KEYS)
        except AgentError as exc:
            if exc.code != p.ErrorCode.UNKNOWN_TYPE:      # a daemon older than Features asks for nothing
                raise
            self.wants_routes = False

    def _detach(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        self.copier.close()
        self._map.close()
        client.close()

    def _ready(self) -> bool:
        """Connected, or connected again now; False while the daemon is down (reconnect mode:
        tried at most every few seconds)."""
        if self._closed:
            raise ConnectionClosed("the agent is closed")
        if self.client is not None:
            return True
        if not self.reconnect:
            raise ConnectionClosed("the connection to the daemon is closed")
        now = self._clock()
        if now < self._retry_at:
            return False
        try:
            client = AgentClient(self.path, self.hello, timeout=self.timeout)
        except (OSError, ConnectionClosed):
            self._retry_at = now + self._retry_next
            self._retry_next = min(self._retry[1], self._retry_next * 2)
            return False
        self._attach(client)
        self._retry_next = self._retry[0]
        self.reconnects += 1
        log.warning("kvcached daemon reachable again", extra={"session": self.session, "gpu_blocks": len(self._on_gpu)})
        try:
            self._report(p.Pinned, list(self._on_gpu))
        except ConnectionClosed as exc:
            self._lost(exc)
            return False
        return True

    def _lost(self, exc: ConnectionClosed) -> None:
        """The daemon went away mid-call: without ``reconnect`` the error stands; with it the
        call answers as a miss and the agent connects again later."""
        if not self.reconnect:
            raise exc
        log.warning("lost the kvcached daemon; serving without it until it is back", extra={"error": str(exc)})
        self._detach()
        # The first attempt is at once: a daemon handing over to its successor (an upgrade)
        # ends connections while its listening socket, passed on, keeps accepting.
        self._retry_at = self._clock()

    def _guarded(self, work: Callable[[], _T], down: _T) -> _T:
        """Run ``work`` on the connection; ``down`` is the answer while the daemon is away. A
        connection lost during the call is made again at once and the call tried once more
        (every call is safe to repeat: a save finds what it saved already present)."""
        with self._lock:
            for _ in range(2):
                if not self._ready():
                    return down
                try:
                    return work()
                except ConnectionClosed as exc:
                    self._lost(exc)
            self._retry_at = self._clock() + self._retry[0]    # lost twice running: back off
            return down

    # -- addressing -----------------------------------------------------------------------------

    def hash_tokens(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``tokens`` (kvcached_agent.address, as the daemon)."""
        return chain_digests(tokens, self.hello.block_tokens, root=self.root, parent=parent)

    @staticmethod
    def addresses(digests: Sequence[bytes], layer: int = CROSS_LAYER) -> list[BlockAddress]:
        return [BlockAddress(d, layer) for d in digests]

    # -- requests -------------------------------------------------------------------------------

    def lookup(self, digests: Sequence[bytes], layer: int = CROSS_LAYER) -> p.LookupResult:
        """Longest prefix of the chain per tier (this agent's GPU, RAM, SSD, peers); all 0
        while the daemon is away (reconnect mode)."""
        return self._guarded(lambda: self._lookup(digests, layer), p.LookupResult(0, 0, 0, 0, 0))

    def _lookup(self, digests: Sequence[bytes], layer: int) -> p.LookupResult:
        assert self.client is not None
        if len(digests) <= p.MAX_BATCH:
            answer = self.client.call(p.Lookup(layer, list(digests)))
            assert isinstance(answer, p.LookupResult)
            return answer
        first = self._lookup(digests[:p.MAX_BATCH], layer)       # a prefix longer than a batch: rare
        if first.longest < p.MAX_BATCH:
            return first
        rest = self._lookup(digests[p.MAX_BATCH:], layer)

        def join(a: int, b: int) -> int:
            return a + b if a == p.MAX_BATCH else a
        return p.LookupResult(join(first.longest, rest.longest), join(first.gpu, rest.gpu), join(first.ram, rest.ram),
                              join(first.ssd, rest.ssd), join(first.peer, rest.peer))

    def plan_loads(self, digests: Sequence[bytes], recompute_s: float, layer: int = CROSS_LAYER) -> p.LoadPlan:
        """How many blocks of the chain to load, the rest recomputed at ``recompute_s`` a block
        (PlanLoads; docs/engines.md "Loads that pay"); nothing while the daemon is away."""
        return self._guarded(lambda: _ask_plan(self, digests, recompute_s, layer), p.LoadPlan(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0))

    def present(self, digests: Sequence[bytes], layer: int = CROSS_LAYER) -> bytes:
        """Per digest, the protocol's HELD_* flags of the tiers holding that block, each block on
        its own (not a chain's prefix); all 0 while the daemon is away (reconnect mode)."""
        return self._guarded(lambda: self._present(digests, layer), bytes(len(digests)))

    def _present(self, digests: Sequence[bytes], layer: int) -> bytes:
        assert self.client is not None
        out = b""
        for start in range(0, len(digests), p.MAX_BATCH):
            answer = self.client.call(p.Present(layer, list(digests[start:start + p.MAX_BATCH])))
            assert isinstance(answer, p.PresentResult)
            out += answer.held
        return out

    def save(self, addresses: Sequence[BlockAddress], tensors: Sequence[Block], *, confirm: bool = True,
             routes: Sequence[bytes | None] | None = None) -> SaveResult:
        """Store each tensor's bytes (or a list of tensors' bytes, in order) as the block at the
        same position. Blocks the daemon has already are not copied again. Returns what was
        stored; blocks it could not take now (busy, no room, the daemon away) are listed in
        ``skipped``.

        ``confirm=False`` returns once the bytes are in the arena and the Commit is sent, without
        waiting for its answer: the tensors may be reused at once, and the caller does not wait
        for the daemon's checksums or (under write-through) its SSD write. A block the daemon
        could not keep in the end is then not reported here (the daemon counts it); ``stored``
        counts the commits sent. For a cache in an engine's step, where a block not kept is
        merely computed again later. The daemon's limit of 64 waiting requests per agent still
        applies: past it the next call waits, which is the back-pressure a writer needs.

        ``routes``: per block, the engine's keys of it (kvcached_agent.route.encode_routes; None
        where none), sent only while :attr:`wants_routes` (the daemon's KV events carry them)."""
        if len(addresses) != len(tensors):
            raise ValueError(f"{len(addresses)} addresses but {len(tensors)} tensors")
        if routes is not None and len(routes) != len(addresses):
            raise ValueError(f"{len(addresses)} addresses but {len(routes)} route keys")
        result = SaveResult()
        done = 0

        def work() -> bool:
            nonlocal done
            for start in range(0, len(addresses), p.MAX_BATCH):
                end = start + p.MAX_BATCH
                if routes is not None and self.wants_routes:
                    self._send_routes(addresses[start:end], routes[start:end])
                self._save_batch(addresses[start:end], tensors[start:end], start, result, confirm)
                done = min(end, len(addresses))
            return True
        if not self._guarded(work, False):
            result.skipped = sorted(set(result.skipped) | set(range(done, len(addresses))))
        return result

    def send_routes(self, addresses: Sequence[BlockAddress], routes: Sequence[bytes | None]) -> None:
        """Tell the daemon the engine's keys of blocks about to be saved, perhaps by another agent
        (the vLLM connector's scheduler names the blocks its workers save). Only while
        :attr:`wants_routes`; nothing while the daemon is away."""
        if not self.wants_routes:
            return
        self._guarded(lambda: self._send_routes(addresses, routes), None)

    def _send_routes(self, addresses: Sequence[BlockAddress], routes: Sequence[bytes | None]) -> None:
        assert self.client is not None
        frame: list[tuple[bytes, int, bytes]] = []
        size = 4
        for a, blob in zip(addresses, routes):
            if not blob:
                continue
            if size + 40 + len(blob) > p.MAX_BODY:          # one frame's body at most
                self.client.send(p.Route(frame))
                frame, size = [], 4
            frame.append((a.digest, a.layer, blob))
            size += 40 + len(blob)
        if frame:
            self.client.send(p.Route(frame))

    def _save_batch(self, addresses: Sequence[BlockAddress], tensors: Sequence[Block], base: int,
                    result: SaveResult, confirm: bool = True) -> None:
        assert self.client is not None
        save_batch(self.client, self.copier, addresses, tensors, base, result, confirm)

    def load(self, addresses: Sequence[BlockAddress], tensors: Sequence[Block]) -> LoadResult:
        """Copy each block into the tensor (or the list of tensors and skipped byte counts) at
        the same position, which must have exactly the block's size. Blocks no tier holds (or
        all, while the daemon is away) are listed in ``missing``; their tensors are left as they
        were."""
        if len(addresses) != len(tensors):
            raise ValueError(f"{len(addresses)} addresses but {len(tensors)} tensors")
        result = LoadResult()
        done = 0

        def work() -> bool:
            nonlocal done
            for start in range(0, len(addresses), p.MAX_BATCH):
                end = start + p.MAX_BATCH
                self._load_batch(addresses[start:end], tensors[start:end], start, result)
                done = min(end, len(addresses))
            return True
        if not self._guarded(work, False):
            result.missing = sorted(set(result.missing) | set(range(done, len(addresses))))
            result.loaded = done - sum(1 for i in result.missing if i < done)
        return result

    def _load_batch(self, addresses: Sequence[BlockAddress], tensors: Sequence[Block], base: int,
                    result: LoadResult) -> None:
        assert self.client is not None
        load_batch(self.client, self.copier, addresses, tensors, base, result)

    def report_pinned(self, digests: Sequence[bytes]) -> None:
        """Event: these blocks are now on this engine's GPU (remembered, and told again to a
        restarted daemon)."""
        self._on_gpu.update(dict.fromkeys(digests))
        self._guarded(lambda: self._report(p.Pinned, digests), None)

    def report_evicted(self, digests: Sequence[bytes]) -> None:
        """Event: these blocks left this engine's GPU."""
        for digest in digests:
            self._on_gpu.pop(digest, None)
        self._guarded(lambda: self._report(p.Evicted, digests), None)

    def _report(self, event: type[p.Pinned] | type[p.Evicted], digests: Sequence[bytes]) -> None:
        assert self.client is not None
        for start in range(0, len(digests), p.MAX_BATCH):
            self.client.send(event(list(digests[start:start + p.MAX_BATCH])))

    def overlap(self, digests: Sequence[bytes]) -> list[p.AgentPrefix]:
        """For each connected agent, how long a prefix of the chain it holds on its GPU."""
        def work() -> list[p.AgentPrefix]:
            assert self.client is not None
            answer = self.client.call(p.Overlap(list(digests[:p.MAX_BATCH])))
            assert isinstance(answer, p.OverlapResult)
            return list(answer.agents)
        return self._guarded(work, [])

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnect (the daemon releases anything still held) and unmap the arena; waits
        for a save or load in progress in another thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._detach()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ += ["AgentError"]


# Connections to a daemon that answered PlanLoads with UNKNOWN_TYPE (older than the request).
_NO_PLANS: "weakref.WeakSet[AgentClient]" = weakref.WeakSet()


def _ask_plan(agent: Agent, digests: Sequence[bytes], recompute_s: float, layer: int) -> p.LoadPlan:
    """:meth:`Agent.plan_loads` asked of a connected daemon: what the tiers hold, less SSD and
    peer blocks slower to load than to recompute. A daemon that predates PlanLoads: what its
    Lookup finds."""
    client = agent.client
    assert client is not None
    hello = agent.hello
    block_bytes = hello.layer_block_bytes * (hello.num_layers if layer == CROSS_LAYER else 1)
    try:
        if client in _NO_PLANS:
            raise AgentError(p.ErrorCode.UNKNOWN_TYPE, "this daemon does not know PlanLoads")
        recompute_s = min(max(recompute_s, 0.0), p.MAX_RECOMPUTE_S) + 0.0     # a measured rate past the range, and -0.0
        answer = client.call(p.PlanLoads(layer, recompute_s, block_bytes, list(digests[:p.MAX_BATCH])))
    except AgentError as exc:
        if exc.code != p.ErrorCode.UNKNOWN_TYPE:
            raise
        _NO_PLANS.add(client)     # asked once a connection: a daemon does not learn it while connected
        found = agent.lookup(digests, layer)
        ram = min(max(found.gpu, found.ram), found.longest)
        ssd = min(max(found.ssd, ram), found.longest) - ram
        return p.LoadPlan(found.longest, found.longest, ram, ssd, 0, 0, 0.0, 0.0, 0.0)
    assert isinstance(answer, p.LoadPlan)
    return answer
