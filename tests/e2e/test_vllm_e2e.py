"""A real vLLM engine (the CPU build) runs the test model with KvcachedConnector: outputs are the proof.

A hit must give what vLLM's own prefix cache gives for the same prompt (the same KV reuse path:
any difference would be kvcached's), bit for bit; against a cold run, where vLLM computes the
whole prompt in one chunk instead of on top of cached KV, the logprobs agree within
``COLD_TOLERANCE`` and the greedy tokens are the same (the test model's logits are peaked).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.v1 import kvcache_pb2 as pb
from tests.e2e.conftest import ROOT, EngineRun, run_engine
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_peers import Cluster, connected, peer_stats

# A test runs one to three engines, each 15-60 s to start on two cores (the first of a fresh
# machine also compiles vLLM's kernels; eager, in-process ones least): the suite's 120 s default is for one
# daemon's tests.
pytestmark = pytest.mark.timeout(900)

BLOCK = 32                  # vLLM's block size here (its CPU attention wants a multiple of 32)
COLD_TOLERANCE = 0.05       # |logprob difference| hit vs cold: bfloat16 sums in another order
MAX_TOKENS = 8
RETRY_MAX_S = 0.5          # the agents' longest wait between tries while the daemon is away


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def kvcached(d: DaemonProcess, **extra: Any) -> dict[str, Any]:
    return {"kind": "kvcached", "socket": str(d.state / "agent.sock"), "extra": extra}


def loadable(tokens: int) -> int:
    """Prompt tokens a connector can hand back: whole blocks, the last token always left to vLLM."""
    return (tokens - 1) // BLOCK * BLOCK


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def close_to_cold(hit: dict[str, Any], cold: dict[str, Any]) -> None:
    assert hit["token_ids"] == cold["token_ids"]
    worst = max(abs(x - y) for x, y in zip(hit["logprobs"], cold["logprobs"]))
    assert worst <= COLD_TOLERANCE, f"logprobs differ by {worst} from the cold run"


# The prompts three tests compare with an engine without kvcached. One such engine serves all of
# them, round by round, for the module (an engine takes 20-30 s to start and serve here).
HALF_FIRST = prompt(2, 1000)
HALF_SHARED = 500
HALF_SECOND = HALF_FIRST[:HALF_SHARED] + prompt(3, 500)
DOWN_PROMPTS = [prompt(4, 700), prompt(5, 300)]
KILLED_A = [prompt(10 + i, 1500) for i in range(4)]
KILLED_B = [prompt(20 + i, 400) for i in range(2)]
KILLED_C = [prompt(30, 700)]
PLAIN_ROUNDS = {
    "half": {"prompts": [HALF_SECOND], "max_tokens": MAX_TOKENS},
    "down": {"prompts": DOWN_PROMPTS, "max_tokens": MAX_TOKENS},
    "killed-a": {"prompts": KILLED_A, "max_tokens": MAX_TOKENS},
    "killed-b": {"prompts": KILLED_B, "max_tokens": MAX_TOKENS},
    "killed-c": {"prompts": KILLED_C, "max_tokens": MAX_TOKENS},
    "killed-c-again": {"prompts": KILLED_C, "max_tokens": MAX_TOKENS},      # from vLLM's own prefix cache
}


@pytest.fixture(scope="module")
def plain(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each round of PLAIN_ROUNDS served by one engine without the connector: its outputs by name."""
    result = run_engine(tmp_path_factory.mktemp("plain"), 0, tiny_model, list(PLAIN_ROUNDS.values()))
    return {name: r["outputs"] for name, r in zip(PLAIN_ROUNDS, result["rounds"])}


class EventTap:
    """A router's view: SUB sockets on the daemon's and the engine's KV event streams, every
    batch decoded with vLLM's own classes (what a consumer written for vLLM does)."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context()
        self._socks = {}
        for name, endpoint in endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVTIMEO, 100)
            sock.connect(endpoint)
            self._socks[name] = sock
        self.events: dict[str, list[Any]] = {name: [] for name in endpoints}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        while not self._stop.is_set():
            for name, sock in self._socks.items():
                try:
                    _topic, _seq, payload = sock.recv_multipart()
                except zmq.Again:
                    continue
                self.events[name].extend(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()


def test_a_kvcached_hit_in_a_new_engine_gives_vllms_own_prefix_cache_output(
        make_daemon, tiny_model: Path, engine: EngineRun, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With vLLM's default execution (torch.compile, the engine core a process of its own): the
    other tests run eager engines, their engine cores in the engine's process. One
    engine serves the prompt cold, then from its own prefix cache, then, that cache emptied (as
    a new engine's is), from kvcached: the last bit-identical to the second. The engine publishes
    its KV events, and the daemon its own: a router reading both sees the blocks kvcached holds
    under the engine's own hashes and tokens (issue 40)."""
    daemon = make_daemon(f'events.endpoint="ipc://{tmp_path}/daemon-events"', "events.batch_ms=10")
    p = prompt(1, 1000)
    engine_events = f"ipc://{tmp_path}/engine-events"
    tap = EventTap({"daemon": f"ipc://{tmp_path}/daemon-events", "engine": engine_events})
    try:
        run = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2
                     + [{"prompts": [p], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}],
                     kvcached(daemon), eager=False, in_process=False, kv_events=engine_events)
        wait_for(lambda: sum(len(e.block_hashes) for e in tap.events["daemon"] if type(e).__name__ == "BlockStored")
                 >= loadable(len(p)) // BLOCK, text="the daemon's BlockStored events")
    finally:
        tap.close()
    same_blocks_in_both_streams(tap.events, p)
    cold, local_hit, hit = (r["outputs"][0] for r in run["rounds"])
    assert cold["num_cached_tokens"] == 0 and local_hit["num_cached_tokens"] >= loadable(len(p))
    assert hit["num_cached_tokens"] == loadable(len(p)), "the engine's prefix cache was emptied: kvcached loaded these"
    with daemon.client() as c:
        stats = c.stats()
    assert stats.puts >= loadable(len(p)) // BLOCK, "the engine stored its blocks"
    assert stats.hits >= loadable(len(p)) // BLOCK, "the daemon served the blocks"
    assert same_output(hit, local_hit), (hit, local_hit)
    close_to_cold(hit, cold)


def same_blocks_in_both_streams(events: dict[str, list[Any]], tokens: list[int]) -> None:
    """The engine's GPU blocks, kvcached's RAM blocks (the daemon's stream) and the connector's
    stores (the engine's stream, medium CPU) name each saved block alike: hash, parent, tokens."""
    def stored(name: str, medium: str) -> dict[Any, tuple[Any, list[int]]]:
        out = {}
        for e in events[name]:
            if type(e).__name__ != "BlockStored" or e.medium != medium or not e.token_ids:
                continue
            parent, n = e.parent_block_hash, e.block_size
            for i, h in enumerate(e.block_hashes):          # one event may name several blocks, in order
                out[h] = (parent, list(e.token_ids[i * n:(i + 1) * n]))
                parent = h
        return out
    gpu, ram, connector = stored("engine", "GPU"), stored("daemon", "CPU"), stored("engine", "CPU")
    saved = loadable(len(tokens)) // BLOCK
    assert len(ram) >= saved and all(isinstance(h, int) for h in ram), "int hashes, as vLLM's by default"
    for h, (parent, block_tokens) in ram.items():
        assert gpu.get(h) == (parent, block_tokens), "kvcached's block lines up with the engine's own event"
        assert connector.get(h) == (parent, block_tokens), "the connector told the engine's stream too"
    assert {e.ownership for e in events["daemon"] if type(e).__name__ == "BlockStored"} == {f"kvcached@{os.uname().nodename}"}


def test_a_prompt_sharing_half_matches_whole_blocks_of_the_shared_part(
        daemon: DaemonProcess, tiny_model: Path, engine: EngineRun, plain: dict[str, Any]) -> None:
    # One engine: the second prompt after vLLM's own prefix cache is emptied (as a new engine's
    # is), so its shared part can only come from kvcached.
    run = engine(tiny_model, [{"prompts": [HALF_FIRST], "max_tokens": 1},
                              {"prompts": [HALF_SECOND], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}],
                 kvcached(daemon))
    hit = run["rounds"][1]["outputs"][0]
    assert hit["num_cached_tokens"] == HALF_SHARED // BLOCK * BLOCK
    close_to_cold(hit, plain["half"][0])


def test_with_the_daemon_down_the_engine_serves_as_without_kvcached(
        daemon: DaemonProcess, tiny_model: Path, engine: EngineRun, plain: dict[str, Any]) -> None:
    """No daemon behind the socket: every request is served, computed, with the output of an
    engine without the connector, bit for bit (nothing is loaded, so nothing can differ)."""
    assert daemon.stop() == 0
    rounds = [PLAIN_ROUNDS["down"]]
    down = engine(tiny_model, rounds, kvcached(daemon, retry_s=0.2))["rounds"][0]["outputs"]
    assert [o["num_cached_tokens"] for o in down] == [0, 0]
    assert all(same_output(a, b) for a, b in zip(down, plain["down"])), (down, plain["down"])


def test_the_cache_follows_the_model_not_its_path(daemon: DaemonProcess, engine: EngineRun, tmp_path: Path) -> None:
    """A relative path to the same folder shares the cache; new weights placed at the old path
    are another model: nothing stored for the old weights is loaded into the new ones."""
    from tests.e2e.model import TinyLlama

    folder = TinyLlama(seed=0).build(tmp_path / "swapped")
    p = prompt(6, 600)
    rounds = [{"prompts": [p], "max_tokens": MAX_TOKENS}]
    old = engine(folder, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    relative = Path(os.path.relpath(folder, ROOT))                  # the engine runs in ROOT
    again = engine(relative, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    assert again["num_cached_tokens"] == loadable(len(p))
    TinyLlama(seed=1).build(folder)                                 # new weights, same path, same shapes
    new = engine(folder, rounds, kvcached(daemon))["rounds"][0]["outputs"][0]
    assert new["num_cached_tokens"] == 0, "KV of the old weights was loaded into the new ones"
    assert new["token_ids"] != old["token_ids"]


def test_after_a_daemon_restart_the_hit_comes_from_ssd(make_daemon, tiny_model: Path, engine: EngineRun,  # type: ignore[no-untyped-def]
                                                      tmp_path: Path) -> None:
    """Write-through: the blocks are on SSD when the engine's request ends; the daemon restarts
    (its RAM tier empty) while the engine waits, then the engine, its own prefix cache emptied,
    loads them from SSD (its agent connects again), output bit-identical to vLLM's own
    prefix-cache hit.

    Loads that pay: the engine's prefill rate is given as ten billion tokens a second, so a
    block is always cheaper to recompute than to read. The restarted daemon has measured no
    SSD read yet and the plan takes the SSD to pay (the hit above, its reads then measured);
    once the blocks are back on SSD only, the plan leaves all of them to be recomputed: nothing
    loaded, and the output bit-identical to the cold run's (a skipped load is a recompute)."""
    d = make_daemon('kv.write_policy="write_through"')
    p = prompt(7, 900)
    stored, restarted, loaded, evicted = (tmp_path / name for name in ("stored", "restarted", "loaded", "evicted"))
    rounds = [{"prompts": [p], "max_tokens": MAX_TOKENS},
              {"prompts": [p], "max_tokens": MAX_TOKENS, "signal_after": str(stored)},
              {"prompts": [p], "max_tokens": MAX_TOKENS, "wait_for": str(restarted), "reset_prefix_cache": True,
               "signal_after": str(loaded)},
              {"prompts": [p], "max_tokens": MAX_TOKENS, "wait_for": str(evicted), "reset_prefix_cache": True}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(engine, tiny_model, rounds, kvcached(d, retry_s=0.2, prefill_tokens_per_s=1e10))
        wait_for(lambda: stored.exists() or run.done(), timeout=600, text="the engine's first rounds")
        assert d.stop() == 0
        d.start()
        with d.client() as c:
            ram_before = c.stats().tiers[0].blocks
        restarted.touch()
        wait_for(lambda: loaded.exists() or run.done(), timeout=300, text="the hit from SSD")
        with d.client() as c:
            promoted = c.stats().promotions
            for model in {info.model for info in c.list_blocks(tier=pb.TIER_RAM)}:
                c.evict(model=model, tier=pb.TIER_RAM)
            assert c.stats().tiers[0].blocks == 0
        evicted.touch()
        result = run.result()
    cold = result["rounds"][0]["outputs"][0]
    local_hit, hit, skipped = (r["outputs"][0] for r in result["rounds"][1:])
    assert ram_before == 0 and hit["num_cached_tokens"] == loadable(len(p))
    assert promoted >= loadable(len(p)) // BLOCK, "the blocks came from the SSD tier"
    assert same_output(hit, local_hit), (hit, local_hit)
    assert skipped["num_cached_tokens"] == 0, "the plan left every SSD block to be recomputed"
    with d.client() as c:
        s = c.stats()
    assert s.promotions == promoted and s.loads_skipped_ssd >= loadable(len(p)) // BLOCK
    assert same_output(skipped, cold), (skipped, cold)


def test_the_daemon_killed_during_a_request(daemon: DaemonProcess, tiny_model: Path, engine: EngineRun,
                                            tmp_path: Path, plain: dict[str, Any]) -> None:
    """SIGKILL while the engine serves a batch: that batch and the next (daemon down) complete
    with the tokens of an engine without kvcached (logprobs within ``COLD_TOLERANCE``: while
    lookups fail, vLLM may step the batch's requests in other groupings, and bfloat16 sums
    depend on the batch); once the daemon is back, a prompt stored then loads from it again
    (vLLM's own prefix cache emptied first), bit-identical to vLLM's own prefix-cache hit."""
    started, back = tmp_path / "round-started", tmp_path / "daemon-back"
    rounds = [{"prompts": KILLED_A, "max_tokens": MAX_TOKENS, "signal": str(started)},
              {"prompts": KILLED_B, "max_tokens": MAX_TOKENS},
              {"prompts": KILLED_C, "max_tokens": MAX_TOKENS, "wait_for": str(back)},
              {"prompts": KILLED_C, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(engine, tiny_model, rounds, kvcached(daemon, retry_s=0.2, retry_max_s=RETRY_MAX_S))
        deadline = time.monotonic() + 300
        while not started.exists():
            assert time.monotonic() < deadline and not run.done(), run.exception() if run.done() else "no start"
            time.sleep(0.02)
        time.sleep(0.2)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        time.sleep(2 * RETRY_MAX_S)      # the agents try again at their next call once their backoff ends
        back.touch()
        served = run.result()["rounds"]
    wanted = [plain[name] for name in ("killed-a", "killed-b", "killed-c", "killed-c-again")]
    for k in range(3):                   # a batch may be stepped otherwise while lookups fail: close, same tokens
        for got, want in zip(served[k]["outputs"], wanted[k]):
            close_to_cold(got, want)
    hit = served[3]["outputs"][0]
    assert hit["num_cached_tokens"] == loadable(len(KILLED_C[0])), "hits return once the daemon is back"
    assert same_output(hit, wanted[3][0])


def test_a_peer_daemon_holding_the_blocks(cluster: Cluster, tiny_model: Path, engine: EngineRun) -> None:
    """Two daemons with the peer tier on (QUIC, mutual TLS): an engine on node A stores a prompt;
    a new engine on node B, whose daemon holds nothing, loads it through B pulling from A,
    bit-identical to vLLM's own prefix-cache hit on A."""
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="a and b connected")
    p = prompt(8, 800)
    first = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}] * 2, kvcached(a))
    local_hit = first["rounds"][1]["outputs"][0]
    blocks = loadable(len(p)) // BLOCK
    wait_for(lambda: peer_stats(b)["node-a"].blocks >= blocks, text="b learns a's blocks")
    hit = engine(tiny_model, [{"prompts": [p], "max_tokens": MAX_TOKENS}], kvcached(b))["rounds"][0]["outputs"][0]
    assert hit["num_cached_tokens"] == loadable(len(p))
    with b.client() as c:
        assert c.stats().peer_pulled >= blocks, "the blocks came from the peer"
    assert same_output(hit, local_hit), (hit, local_hit)
