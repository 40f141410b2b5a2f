"""KV events (issue 40) as a KV-aware router consumes them: three daemons, each publishing its
RAM ("CPU") and SSD ("STORAGE") tiers in vLLM's schema over ZMQ, and a router-style indexer
written like llm-d's KV-cache indexer (:class:`RouterIndex`): it subscribes to every daemon's
stream, keeps per node and per medium the set of engine block hashes, applies BlockStored,
BlockRemoved and AllBlocksCleared (a clear only empties the medium it names), and fills sequence
gaps from each daemon's replay endpoint.

After every step of a realistic run the indexer's answer to "which node holds the longest
prefix of this prompt, and in which tier" must be what the daemons themselves answer: per node
and prompt, (longest, ram, ssd) as the agent's Lookup counts them (kvcached.store.read_path: each
a prefix from the first block; a block in RAM and on SSD counts in both columns; ``longest``
where each block is in some tier), so the indexer counts the same way from its CPU and STORAGE
sets. The steps:

1. saves on different nodes (prompts sharing a system prefix, one saved without engine keys,
   named by its kvcached digest);
2. enough saves that RAM (16 blocks) evicts to SSD;
3. enough that the SSD tier (31 blocks) evicts;
4. a daemon SIGKILLed and started again: its RAM tier is gone (AllBlocksCleared(medium="CPU"),
   fetched from replay: the subscriber has not reconnected when it is sent), its SSD tier is
   not, and its sequence numbers go on forward across a gap no replay can fill;
5. an upgrade (``kvcached upgrade``): the RAM tier is kept, nothing is cleared, and the
   sequence numbers continue without a gap;
6. a late subscriber, rebuilding from replay from sequence number 0 and then following live.

Every comparison first waits for things to settle (the daemons idle, each indexer caught up by
asking replay for what follows the last batch it holds), with a deadline; nothing is timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import zmq

from kvcached.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent import protocol as p
from kvcached_agent.address import CROSS_LAYER
from kvcached_agent.agent import Agent
from kvcached_agent.route import RouteKey, encode_routes

from .conftest import DaemonProcess, run_cli, wait_for
from .test_agent import agent_socket
from .test_upgrade import alive

MODEL, DTYPE = "test/model", "bfloat16"
BLOCK = 16                                  # tokens per block: one engine page per kvcached block
BLOCK_BYTES = 256 << 10                     # cross-layer block payload
RAM_BLOCKS, SSD_BLOCKS = 16, 31             # 4 MiB arena; 8 MiB SSD of 260 KiB files (header included)
CPU, STORAGE = "CPU", "STORAGE"
END = (-1).to_bytes(8, "big", signed=True)
NONE_HASH = b"kvcached-test-none-hash"      # the parent of a prompt's first page (vLLM's NONE_HASH)
SETTLE_S = 30.0
REPLAY_WAIT_MS = 10_000


# -- the engine's side ----------------------------------------------------------------------------

def engine_hash(parent: int | None, tokens: list[int]) -> int:
    """A page's hash as vLLM makes it (hash_block_tokens: sha256 of the parent's hash and the
    page's tokens), published as an int of its last 8 bytes (vLLM's maybe_convert_block_hash)."""
    seed = NONE_HASH if parent is None else parent.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(seed + repr(tuple(tokens)).encode()).digest()[-8:], "big")


def digest_hash(digest: bytes) -> int:
    """The hash a block saved without engine keys is published under (its digest's last 8 bytes)."""
    return int.from_bytes(digest[-8:], "big")


@dataclass
class Prompt:
    name: str
    tokens: list[int]
    digests: list[bytes] = field(default_factory=list)      # kvcached's chain (set by the cluster)
    routed: bool = True                                      # saved with the engine's keys

    def __post_init__(self) -> None:
        assert len(self.tokens) % BLOCK == 0
        self.hashes: list[int] = []
        self.keys: list[RouteKey] = []
        parent = None
        for i in range(0, len(self.tokens), BLOCK):
            page = self.tokens[i:i + BLOCK]
            h = engine_hash(parent, page)
            self.keys.append(RouteKey(block_hashes=[h], parent_block_hash=parent, token_ids=page, block_size=BLOCK))
            self.hashes.append(h)
            parent = h

    @property
    def router_keys(self) -> list[int]:
        """What a router matches this prompt by: the engine's hashes, or the digests' for blocks
        saved without them."""
        return self.hashes if self.routed else [digest_hash(d) for d in self.digests]


def tokens_of(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(blocks * BLOCK)]


# -- the router ---------------------------------------------------------------------------------

Answer = tuple[int, int, int]            # (longest, ram, ssd): Lookup's columns


def prefix(keys: list[int], held: Callable[[int], bool]) -> int:
    return next((i for i, k in enumerate(keys) if not held(k)), len(keys))


@dataclass
class NodeView:
    """What the router knows of one daemon."""

    name: str
    endpoint: str
    replay: str
    sub: zmq.Socket  # type: ignore[type-arg]
    media: dict[str, set[int]] = field(default_factory=lambda: {CPU: set(), STORAGE: set()})
    last: int | None = None                   # the last sequence number applied
    seqs: list[int] = field(default_factory=list)
    gaps: list[tuple[int, int, str]] = field(default_factory=list)   # (first, last, reason) replay could not fill
    partial: str = ""                         # why replay could not give the whole history (a late joiner)
    clears: list[tuple[int, str | None]] = field(default_factory=list)
    stored: Counter[str] = field(default_factory=Counter)
    removed: Counter[str] = field(default_factory=Counter)
    replays: int = 0


class RouterIndex:
    """A KV-cache indexer as llm-d writes one: per node and medium, the engine block hashes held.
    SUB per daemon for the live stream (every topic of that daemon), a DEALER to its replay
    ROUTER for what the stream missed: a sequence number that skips ahead, or a probe from the
    next one expected to learn that nothing is missing (:meth:`caught_up`)."""

    def __init__(self, nodes: dict[str, tuple[str, str]]) -> None:
        self.ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
        self.nodes: dict[str, NodeView] = {}
        self.poller = zmq.Poller()
        for name, (endpoint, replay) in nodes.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")          # llm-d subscribes to the kv@ topics
            sub.connect(endpoint)
            self.nodes[name] = NodeView(name, endpoint, replay, sub)
            self.poller.register(sub, zmq.POLLIN)
        self._by_socket = {v.sub: v for v in self.nodes.values()}

    def close(self) -> None:
        for v in self.nodes.values():
            v.sub.close(linger=0)
        self.ctx.term()

    # -- receiving ------------------------------------------------------------------------------

    def pump(self, timeout_ms: int = 0) -> int:
        """Apply what the live streams hold now; how many batches came."""
        n = 0
        while True:
            ready = dict(self.poller.poll(timeout_ms))
            if not ready:
                return n
            timeout_ms = 0
            for sock in ready:
                view = self._by_socket[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    assert len(frames) == 3, f"{view.name}: a batch of {len(frames)} frames"
                    topic, seq, payload = frames
                    assert len(seq) == 8
                    self._on_batch(view, topic, int.from_bytes(seq, "big"), payload)
                    n += 1

    def _on_batch(self, view: NodeView, topic: bytes, seq: int, payload: bytes) -> None:
        if view.last is not None and seq <= view.last:
            return                                   # had it already (from replay)
        expected = 0 if view.last is None else view.last + 1
        if seq != expected:                          # a gap: fill it from replay first
            self._fill(view, expected)
            if view.last is not None and seq <= view.last:
                return
            assert view.last is not None and seq == view.last + 1, \
                f"{view.name}: batch {seq} neither replayed nor next after {view.last}"
        self._apply(view, topic, seq, payload)

    def caught_up(self, name: str) -> bool:
        """Ask replay for what follows the last batch held: True when nothing more can be had
        (applying whatever came instead)."""
        view = self.nodes[name]
        return self._fill(view, 0 if view.last is None else view.last + 1)

    def _fill(self, view: NodeView, start: int) -> bool:
        """Replay from ``start`` (following cut answers); True if the answer held nothing new.
        Batches that cannot be had are recorded: a gap (a daemon that crashed skips numbers; a
        slow subscriber may lose batches past what replay keeps), or, for an indexer that joins
        late, ``partial``."""
        while True:
            got = self._replay(view, start)
            if got is None:
                return False
            batches, reason = got
            fresh = [b for b in batches if view.last is None or b[1] > view.last]
            if fresh:
                first = fresh[0][1]
                wanted = 0 if view.last is None else view.last + 1
                if first > wanted:
                    assert "no longer kept" in reason, f"{view.name}: replay from {wanted} began at {first}: {reason!r}"
                    if view.last is None:
                        view.partial = reason
                    else:
                        view.gaps.append((wanted, first - 1, reason))
                for i, (topic, seq, payload) in enumerate(fresh):      # kept batches are consecutive
                    assert i == 0 or seq == view.last + 1, f"{view.name}: replay gave {seq} after {view.last}"
                    self._apply(view, topic, seq, payload)
            if reason.startswith("cut after"):
                start = view.last + 1 if view.last is not None else 0
                continue
            assert reason == "" or "no longer kept" in reason, f"{view.name}: replay refused: {reason}"
            if not fresh and reason:                  # not kept, and nothing after it yet
                if view.last is None:
                    view.partial = reason
                elif not view.gaps or view.gaps[-1][2] != reason:
                    view.gaps.append((start, -1, reason))
            return not fresh

    def _replay(self, view: NodeView, start: int) -> tuple[list[tuple[bytes, int, bytes]], str] | None:
        """One replay request (a DEALER of its own: a daemon that restarted has a new ROUTER);
        None if no answer came in time."""
        view.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(view.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[bytes, int, bytes]] = []
            while True:
                if not sock.poll(REPLAY_WAIT_MS):
                    return None
                frames = sock.recv_multipart()
                assert frames[0] == b"", frames[:2]
                if frames[2] == END:
                    assert frames[1] == b"" and len(frames) == 4, frames
                    return out, frames[3].decode()
                assert len(frames) == 4, f"{view.name}: a replayed batch of {len(frames) - 1} frames"
                out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            sock.close(linger=0)

    # -- applying -------------------------------------------------------------------------------

    def _apply(self, view: NodeView, topic: bytes, seq: int, payload: bytes) -> None:
        view.last = seq
        view.seqs.append(seq)
        batch = decode_batch(payload)
        owner = f"kvcached@{view.name}"
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                assert topic.startswith(f"kv@{view.name}@".encode()), topic
                view.clears.append((seq, ev.medium))
                for medium in ([ev.medium] if ev.medium is not None else list(view.media)):
                    view.media[medium].clear()
                continue
            assert topic == f"kv@{view.name}@{MODEL}".encode(), topic
            assert ev.medium in (CPU, STORAGE) and ev.ownership == owner, ev
            if isinstance(ev, BlockStored):
                self._check_names(view, ev)
                view.media[ev.medium].update(ev.block_hashes)        # type: ignore[arg-type]
                view.stored[ev.medium] += 1
            else:
                assert isinstance(ev, BlockRemoved)
                view.media[ev.medium].difference_update(ev.block_hashes)
                view.removed[ev.medium] += 1

    @staticmethod
    def _check_names(view: NodeView, ev: BlockStored) -> None:
        """The keys the engine gave come through as given (a router can check each page's hash
        from its parent and tokens; a chain of pages saved together is one event, its tokens
        joined, as vLLM sends a request's pages); a block saved without them is named by its
        digest, one event each."""
        assert ev.block_hashes and all(isinstance(h, int) for h in ev.block_hashes), ev
        if ev.extra_keys is None:
            assert ev.block_size == BLOCK and len(ev.token_ids) == BLOCK * len(ev.block_hashes), ev
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                assert h == engine_hash(parent, ev.token_ids[i * BLOCK:(i + 1) * BLOCK]), ev   # type: ignore[arg-type]
                parent = h
            return
        assert len(ev.block_hashes) == 1, ev
        [[mark, digest_hex, layer]] = ev.extra_keys
        assert (mark, layer) == ("kvcached-digest", CROSS_LAYER), ev
        assert ev.block_hashes[0] == digest_hash(bytes.fromhex(digest_hex)), ev
        assert (ev.block_size, ev.token_ids, ev.parent_block_hash) == (0, [], None), ev

    # -- answering ------------------------------------------------------------------------------

    def answer(self, name: str, keys: list[int]) -> Answer:
        cpu, ssd = self.nodes[name].media[CPU], self.nodes[name].media[STORAGE]
        return (prefix(keys, lambda k: k in cpu or k in ssd), prefix(keys, cpu.__contains__),
                prefix(keys, ssd.__contains__))

    def table(self, prompts: list[Prompt], nodes: list[str] | None = None) -> dict[str, dict[str, Answer]]:
        return {n: {pr.name: self.answer(n, pr.router_keys) for pr in prompts} for n in (nodes or self.nodes)}


def route(table: dict[str, dict[str, Answer]], prompt: str) -> tuple[str | None, int, str]:
    """Where to send ``prompt``: the node with the longest prefix (more of it in RAM breaks a
    tie, then the node's name), and the tier it is read from."""
    name = max(sorted(table), key=lambda n: table[n][prompt][:2])
    longest, ram, ssd = table[name][prompt]
    if not longest:
        return None, 0, ""
    return name, longest, CPU if ram == longest else STORAGE if ssd == longest else f"{CPU}+{STORAGE}"


def differences(mine: dict[str, dict[str, Answer]], truth: dict[str, dict[str, Answer]]) -> list[str]:
    out = [f"{n} {pr}: indexer {mine[n][pr]} daemon {truth[n][pr]} (longest, ram, ssd)"
           for n in mine for pr in mine[n] if mine[n][pr] != truth[n][pr]]
    if not out and set(mine) == set(truth):
        for pr in next(iter(truth.values())):
            if route(mine, pr) != route(truth, pr):
                out.append(f"{pr}: routed {route(mine, pr)}, daemons say {route(truth, pr)}")
    return out


# -- the cluster --------------------------------------------------------------------------------

@dataclass
class Node:
    name: str
    daemon: DaemonProcess
    agent: Agent | None = None
    pid: int = 0                                # the serving process (an upgrade changes it)

    @property
    def endpoints(self) -> tuple[str, str]:
        return f"ipc://{self.daemon.state / 'ev'}", f"ipc://{self.daemon.state / 'rp'}"

    def connect(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.agent = Agent.connect(agent_socket(self.daemon), agent_id=f"engine-{self.name}", model=MODEL,
                                   dtype=DTYPE, block_tokens=BLOCK, num_layers=1, layer_block_bytes=BLOCK_BYTES,
                                   timeout=30)
        assert self.agent.wants_routes

    def save(self, prompt: Prompt, blocks: int | None = None) -> None:
        """Save the prompt's first ``blocks`` blocks with the engine's keys (all of them by
        default); blocks the daemon cannot take now (write-back: RAM full of blocks not on SSD
        yet) are offered again."""
        agent = self.agent
        assert agent is not None
        n = len(prompt.digests) if blocks is None else blocks
        addresses = agent.addresses(prompt.digests[:n])
        routes = [encode_routes([k]) for k in prompt.keys[:n]] if prompt.routed else None
        data = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
        todo = list(range(n))
        for _ in range(500):
            r = agent.save([addresses[i] for i in todo], [data] * len(todo),
                           routes=[routes[i] for i in todo] if routes else None)
            todo = [todo[i] for i in r.skipped]
            if not todo:
                return
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: blocks {todo} of {prompt.name} never saved")

    def lookup(self, prompt: Prompt) -> Answer:
        assert self.agent is not None
        r = self.agent.lookup(prompt.digests)
        assert (r.gpu, r.peer) == (0, 0), r
        return r.longest, r.ram, r.ssd

    def present(self, digests: list[bytes]) -> bytes:
        assert self.agent is not None
        return self.agent.present(digests)

    def written_back(self) -> None:
        """Wait until no block waits for write-back (at once under write-through)."""
        def clean() -> bool:
            with self.daemon.client(timeout=10) as c:
                return c.stats().ram_dirty_bytes == 0
        wait_for(clean, SETTLE_S, f"{self.name}: write-back done")

    def quiet(self) -> bool:
        """Nothing left to change on its own: no block waiting for write-back, the SSD tier
        counted and within its capacity (capacity eviction is done)."""
        with self.daemon.client(timeout=10) as c:
            s = c.stats()
        (ssd,) = [t for t in s.tiers if t.tier == pb.TIER_SSD]
        return s.ram_dirty_bytes == 0 and s.ssd_reconciled and ssd.reserved_bytes <= ssd.capacity_bytes


class Cluster:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.prompts: list[Prompt] = []

    def prompt(self, name: str, tokens: list[int], *, routed: bool = True) -> Prompt:
        pr = Prompt(name, tokens, routed=routed)
        agent = next(iter(self.nodes.values())).agent
        assert agent is not None
        pr.digests = agent.hash_tokens(tokens)
        assert len(pr.digests) == len(tokens) // BLOCK
        self.prompts.append(pr)
        return pr

    def truth(self) -> dict[str, dict[str, Answer]]:
        return {n: {pr.name: node.lookup(pr) for pr in self.prompts} for n, node in self.nodes.items()}

    def settle(self, routers: list[RouterIndex],
               check: Callable[[dict[str, dict[str, Answer]]], list[str]] | None = None) -> dict[str, dict[str, Answer]]:
        """Wait until the daemons are idle and every indexer has caught up, then until
        ``check(truth)`` (by default: the first indexer's table is the daemons') finds nothing;
        the daemons' answers then. AssertionError with the last differences after SETTLE_S."""
        def default(truth: dict[str, dict[str, Answer]]) -> list[str]:
            return differences(routers[0].table(self.prompts), truth)
        check = check or default
        deadline = time.monotonic() + SETTLE_S
        problems = ["the daemons never went idle, or an indexer never caught up"]
        while time.monotonic() < deadline:
            for r in routers:
                r.pump(20)
            if all(n.quiet() for n in self.nodes.values()) and all(
                    r.caught_up(name) for r in routers for name in self.nodes):
                truth = self.truth()
                problems = check(truth)
                if not problems:
                    return truth
            time.sleep(0.05)
        raise AssertionError("indexer and daemons disagree after settling:\n" + "\n".join(problems))


def node_settings(state: Path, name: str, write_policy: str) -> list[str]:
    return [f'events.endpoint="ipc://{state / "ev"}"', f'events.replay_endpoint="ipc://{state / "rp"}"',
            "events.batch_ms=10", f'events.node="{name}"',
            f"kv.ram_gib={RAM_BLOCKS * BLOCK_BYTES / (1 << 30)!r}", "kv.max_block_mib=1",
            f"kv.ssd_gib={8 / 1024!r}", f'kv.write_policy="{write_policy}"', 'kv.ssd_durability="none"']


@pytest.fixture
def cluster(make_daemon, tmp_path: Path) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    """node-a: write-back (blocks reach SSD after their RAM event); node-b, node-c: write-through."""
    nodes = []
    for name, policy in (("node-a", "write_back"), ("node-b", "write_through"), ("node-c", "write_through")):
        state = tmp_path / name[-1]
        state.mkdir()
        nodes.append(Node(name, make_daemon(*node_settings(state, name, policy), state=state, start=False)))
    for n in nodes:
        n.daemon.start(wait=False)
    for n in nodes:
        n.daemon.wait_ready()
        assert n.daemon.proc is not None
        n.pid = n.daemon.proc.pid
        n.connect()
    c = Cluster(nodes)
    yield c
    for n in nodes:
        if n.agent is not None:
            n.agent.close()
        if n.daemon.proc is not None and n.pid != n.daemon.proc.pid and alive(n.pid):   # an upgrade's successor
            os.kill(n.pid, signal.SIGKILL)


def upgrade(node: Node) -> None:
    """``kvcached upgrade`` as tests/integration/test_upgrade.py drives it."""
    before = node.pid
    r = run_cli(["upgrade", "--json", *node.daemon.args()], timeout=120)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{node.daemon.log()}"
    answer = json.loads(r.stdout)
    assert answer["op"] == "upgraded" and answer["ok"], answer
    node.pid = answer["pid"]
    wait_for(lambda: not alive(before), text=f"the previous daemon {before} exiting")


# -- the test -----------------------------------------------------------------------------------

def test_a_router_indexer_follows_three_daemons_through_evictions_a_crash_an_upgrade_and_a_late_join(
        cluster: Cluster) -> None:
    a, b, c = (cluster.nodes[n] for n in ("node-a", "node-b", "node-c"))
    endpoints = {n.name: n.endpoints for n in (a, b, c)}
    live = RouterIndex(endpoints)
    late: RouterIndex | None = None
    try:
        system = tokens_of(1, 3)                     # a system prompt of 3 blocks many prompts share
        p1 = cluster.prompt("chat-1", system + tokens_of(11, 5))
        p2 = cluster.prompt("chat-2", system + tokens_of(12, 5))
        p3 = cluster.prompt("doc-3", tokens_of(13, 6))
        raw = cluster.prompt("unkeyed", tokens_of(14, 4), routed=False)

        # 1. saves on different nodes: A the whole of chat-1, B chat-2 and 5 blocks of chat-1, C
        # the system prompt, doc-3 and a prompt without engine keys (named by digest).
        a.save(p1)
        b.save(p2)
        b.save(p1, 5)
        c.save(p1, 3)
        c.save(p3)
        c.save(raw)
        truth = cluster.settle([live])
        assert route(truth, "chat-1") == ("node-a", 8, CPU)
        assert route(truth, "chat-2") == ("node-b", 8, CPU)
        assert route(truth, "doc-3")[:2] == ("node-c", 6)
        assert truth["node-c"]["unkeyed"][0] == 4 and truth["node-b"]["chat-1"][0] == 5
        for n in (a, b, c):                          # each daemon's first batch: its (empty) RAM tier cleared
            assert live.nodes[n.name].clears[:1] == [(0, CPU)]
            assert live.nodes[n.name].stored[STORAGE] > 0 and not live.nodes[n.name].gaps

        # 2. RAM (16 blocks) evicts to SSD: 16 more blocks on each node. Each save is on SSD
        # before the next needs room in RAM, so A (write-back) evicts to SSD, never drops.
        for i, n in enumerate((a, b, c)):
            for j in range(2):
                n.save(cluster.prompt(f"fill-{n.name}-{j}", tokens_of(100 + 10 * i + j, 8)))
                n.written_back()
        truth = cluster.settle([live])
        for n in (a, b, c):
            assert live.nodes[n.name].removed[CPU] > 0, f"{n.name}: no RAM eviction"
            assert any(lon > ram for lon, ram, _ in truth[n.name].values()), f"{n.name}: nothing only on SSD"

        # 3. the SSD tier (31 blocks) evicts: 16 more blocks on each node.
        for i, n in enumerate((a, b, c)):
            for j in range(2, 4):
                n.save(cluster.prompt(f"fill-{n.name}-{j}", tokens_of(100 + 10 * i + j, 8)))
                n.written_back()
        truth = cluster.settle([live])
        for n in (a, b, c):
            assert live.nodes[n.name].removed[STORAGE] > 0, f"{n.name}: no SSD eviction"
        saved = {("node-a", "chat-1"): 8, ("node-b", "chat-2"): 8, ("node-c", "doc-3"): 6}
        assert any(truth[n][pr][0] < k for (n, pr), k in saved.items()), "nothing lost to SSD eviction"

        # 4. B is SIGKILLed and started again: its RAM tier is gone, its SSD tier is not.
        ram_before = {pr: ans[1] for pr, ans in truth["node-b"].items()}
        ssd_before = {pr: ans[2] for pr, ans in truth["node-b"].items()}
        assert any(ram_before.values()) and any(ssd_before.values())
        b_last = live.nodes["node-b"].last
        assert b.agent is not None
        b.agent.close()
        b.agent = None
        b.daemon.stop(signal.SIGKILL)
        b.daemon.start()
        assert b.daemon.proc is not None
        b.pid = b.daemon.proc.pid
        b.connect()
        truth = cluster.settle([live])
        view = live.nodes["node-b"]
        assert all(ans[1] == 0 for ans in truth["node-b"].values())
        assert {pr: ans[2] for pr, ans in truth["node-b"].items()} == ssd_before
        assert b_last is not None and view.clears[-1][1] == CPU and view.clears[-1][0] > b_last
        # Sequence numbers go on forward: the numbers a crash skips are a gap no replay fills.
        [(gap_first, gap_last, reason)] = view.gaps
        restart_seq = view.seqs[view.seqs.index(b_last) + 1]
        assert (gap_first, gap_last) == (b_last + 1, restart_seq - 1) and "no longer kept" in reason
        assert view.clears[-1][0] == restart_seq          # the clear is the new process's first batch
        assert view.seqs == list(range(b_last + 1)) + list(range(restart_seq, view.last + 1))  # type: ignore[operator]
        fresh_b = cluster.prompt("after-crash-b", tokens_of(200, 6))
        b.save(fresh_b)
        b.save(p2, 4)
        truth = cluster.settle([live])
        assert truth["node-b"]["after-crash-b"] == (6, 6, 6)

        # 5. C is upgraded: the RAM tier is kept, nothing is cleared, numbering goes on.
        c_before = truth["node-c"]
        c_last = live.nodes["node-c"].last
        assert c.agent is not None
        c.agent.close()
        c.agent = None
        upgrade(c)
        c.connect()
        truth = cluster.settle([live])
        assert truth["node-c"] == c_before, "the upgrade changed what C holds"
        fresh_c = cluster.prompt("after-upgrade-c", tokens_of(300, 5))
        c.save(fresh_c)
        truth = cluster.settle([live])
        assert truth["node-c"]["after-upgrade-c"] == (5, 5, 5)
        view = live.nodes["node-c"]
        assert c_last is not None and view.last is not None and view.last > c_last
        assert view.clears == [(0, CPU)] and not view.gaps and view.seqs == list(range(view.last + 1))
        view = live.nodes["node-a"]
        assert view.clears == [(0, CPU)] and not view.gaps and view.seqs == list(range(view.last + 1))  # type: ignore[operator]

        # 6. A late subscriber rebuilds from replay from sequence number 0. Replay keeps only the
        # batches of the daemon's current process (the last events.replay_batches of them), so
        # only A, whose process has run since the start, can be rebuilt whole: from A's replay
        # the late indexer must know exactly what the live one knows. B's process began at its
        # restart and C's at its upgrade: their replay says the batches before are no longer kept
        # (the late indexer marks them partial) and holds only what happened since, so there the
        # late indexer must answer exactly for the prompts first saved after the restart and the
        # upgrade, and everything else it believes must be true (a subset of the daemons' tiers).
        late = RouterIndex(endpoints)
        fresh = {"node-b": {"after-crash-b"}, "node-c": {"after-upgrade-c"}}

        def late_check(truth: dict[str, dict[str, Answer]]) -> list[str]:
            assert late is not None
            out = differences(live.table(cluster.prompts), truth)
            out += differences(late.table(cluster.prompts, ["node-a"]), {"node-a": truth["node-a"]})
            for name, names in fresh.items():
                prompts = [pr for pr in cluster.prompts if pr.name in names]
                out += differences(late.table(prompts, [name]), {name: {pr: truth[name][pr] for pr in names}})
            return out
        truth = cluster.settle([live, late], late_check)
        assert late.nodes["node-a"].media == live.nodes["node-a"].media
        assert not late.nodes["node-a"].partial and late.nodes["node-a"].seqs == live.nodes["node-a"].seqs
        for name in ("node-b", "node-c"):
            view = late.nodes[name]
            assert "no longer kept" in view.partial and view.seqs[0] > 0, (name, view.partial, view.seqs[:3])
            assert view.seqs == live.nodes[name].seqs[-len(view.seqs):]
            by_hash = {k: d for pr in cluster.prompts for k, d in zip(pr.router_keys, pr.digests)}
            for medium, flag in ((CPU, p.HELD_RAM), (STORAGE, p.HELD_SSD)):
                known = sorted(view.media[medium])
                assert all(k in by_hash for k in known), f"{name}: unknown hashes in {medium}"
                held = cluster.nodes[name].present([by_hash[k] for k in known])
                wrong = [k for k, h in zip(known, held) if not h & flag]
                assert not wrong, f"late indexer: {name} holds {len(wrong)} blocks in {medium} that it does not"
                assert view.media[medium] <= live.nodes[name].media[medium]

        # ... and then follows live, beside the first indexer.
        tail = cluster.prompt("tail-a", system + tokens_of(400, 2))
        a.save(tail)
        b.save(tail, 4)
        truth = cluster.settle([live, late], late_check)
        assert route(truth, "tail-a") == ("node-a", 5, CPU)
        assert late.nodes["node-a"].media == live.nodes["node-a"].media
    finally:
        live.close()
        if late is not None:
            late.close()


def test_a_late_subscriber_right_after_an_upgrade_is_told_that_history_is_missing(make_daemon, tmp_path: Path) -> None:
    """A late subscriber that joins after an upgrade, before the successor has published
    anything, must learn that the batches before are not kept (its view of the node is
    partial), as it does once the successor has published one batch."""
    state = tmp_path / "u"
    state.mkdir()
    node = Node("node-u", make_daemon(*node_settings(state, "node-u", "write_through"), state=state))
    assert node.daemon.proc is not None
    node.pid = node.daemon.proc.pid
    router = RouterIndex({node.name: node.endpoints})
    late: RouterIndex | None = None
    try:
        node.connect()
        pr = Prompt("u", tokens_of(7, 4))
        assert node.agent is not None
        pr.digests = node.agent.hash_tokens(pr.tokens)
        node.save(pr)
        wait_for(lambda: router.caught_up(node.name) and router.answer(node.name, pr.hashes) == (4, 4, 4),
                 SETTLE_S, "the saves published")
        node.agent.close()
        node.agent = None
        upgrade(node)
        late = RouterIndex({node.name: node.endpoints})
        assert late.caught_up(node.name) and late.nodes[node.name].seqs == []
        assert "no longer kept" in late.nodes[node.name].partial, \
            "replay from 0 answered as complete, though the batches before the upgrade are not kept"
    finally:
        router.close()
        if late is not None:
            late.close()
        if node.agent is not None:
            node.agent.close()
        if node.daemon.proc is not None and node.pid != node.daemon.proc.pid and alive(node.pid):
            os.kill(node.pid, signal.SIGKILL)
