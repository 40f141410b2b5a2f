"""The vLLM connector through vLLM's own scheduler and connector plumbing, against real daemons."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import chain_digests
from tests.engines.vllm_engine import PAGE_TOKENS, MiniEngine, tiny_llama
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_peers import Cluster, connected

PROMPT = [(i * 7919) % 30000 + 1 for i in range(200)]        # 12 full blocks of 16 and 8 tokens


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return tiny_llama(tmp_path / "model")


@pytest.fixture
def make_engine() -> Iterator[Callable[..., MiniEngine]]:
    """MiniEngines on a daemon's agent socket (short reconnect intervals), closed after the test."""
    made: list[MiniEngine] = []

    def make(d: DaemonProcess, model: Path, extra: dict[str, object] | None = None, **kw: object) -> MiniEngine:
        settings = {"socket": str(d.state / "agent.sock"), "retry_s": 0.2, "retry_max_s": 0.5, **(extra or {})}
        made.append(MiniEngine(model, settings, **kw))  # type: ignore[arg-type]
        return made[-1]
    yield make
    for e in made:
        e.close()


def computed_at_first_step(e: MiniEngine, req_id: str) -> int:
    """The tokens vLLM counts as computed (its prefix cache plus kvcached) when it first
    schedules ``req_id``: what the connector matched."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = e.step()
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.num_computed_tokens
    raise AssertionError(f"{req_id} was never scheduled")


def loads_bit_exact(e: MiniEngine, req_id: str, blocks: int, block_tokens: int = PAGE_TOKENS) -> None:
    """``req_id`` is first scheduled with ``blocks`` blocks counted as computed, runs to its end,
    and the worker loaded them (MiniEngine compared every one of those tokens' KV)."""
    assert computed_at_first_step(e, req_id) == blocks * block_tokens
    e.run()
    assert e.worker.worker_side.loaded_blocks == blocks
    assert e.loaded_checked[req_id] >= blocks * block_tokens


def test_a_prefix_saved_by_one_request_is_matched_and_loaded_bit_exact_by_the_next(daemon: DaemonProcess, model: Path,
                                                                                     make_engine) -> None:
    e = make_engine(daemon, model)
    e.add("first", PROMPT)
    e.run()
    assert e.worker.worker_side.saved_blocks == 12           # 203 tokens' KV: 12 whole blocks, no partial one
    digests = chain_digests(PROMPT, PAGE_TOKENS, model=e.worker.model_name, dtype="bfloat16", namespace="tp0of1")
    with daemon.client() as c:
        assert c.stats().agents == 2                          # the scheduler's and the worker's agents
        # The worker told the daemon what vLLM's GPU prefix cache holds.
        assert {(a.agent_id, a.prefix) for a in c.overlap(digests).agents} >= {("vllm-test-rank0", 12)}
    assert e.scheduler.reset_prefix_cache()                  # vLLM's own cache forgets: only kvcached has it
    e.add("second", PROMPT + [5, 6, 7])
    loads_bit_exact(e, "second", 12)


def test_mlas_single_latent_cache_is_saved_and_loaded_bit_exact(daemon: DaemonProcess, model: Path,
                                                                 make_engine) -> None:
    """MLA (DeepSeek's attention): one tensor per layer holding one latent vector per token, no
    separate K and V. Its blocks are stored and loaded as a full-attention group's, bit-exact
    (the end-to-end test runs a real MLA model where vLLM keeps prefix caching on for it)."""
    e = make_engine(daemon, model, mla=True)
    assert [k.kind for k in e.connector.kinds] == ["full"]
    e.add("first", PROMPT)
    e.run()
    assert e.worker.worker_side.saved_blocks == 12
    assert e.scheduler.reset_prefix_cache()
    e.add("second", PROMPT + [5, 6, 7])
    loads_bit_exact(e, "second", 12)


def test_a_partly_cached_prompt_matches_only_its_cached_blocks(daemon: DaemonProcess, model: Path, make_engine) -> None:
    e = make_engine(daemon, model)
    e.add("first", PROMPT[:100])
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.add("second", PROMPT[:70] + [9] * 60)                  # shares 70 tokens: 4 whole blocks
    assert computed_at_first_step(e, "second") == 4 * PAGE_TOKENS
    e.run()
    e.add("third", [3] * 120)                                 # shares nothing
    assert computed_at_first_step(e, "third") == 0
    e.run()
    # A prompt that is all cached still leaves its last token to vLLM (it samples the next one).
    assert e.scheduler.reset_prefix_cache()
    e.add("fourth", PROMPT[:96])
    assert computed_at_first_step(e, "fourth") == 5 * PAGE_TOKENS
    e.run()


def held(d: DaemonProcess) -> int:
    with d.client() as c:
        return c.stats().agent_held_bytes


def test_requests_that_finish_early_or_are_aborted_leave_nothing_pinned(daemon: DaemonProcess, model: Path,
                                                                        make_engine) -> None:
    e = make_engine(daemon, model, max_tokens_per_step=64)            # a 200-token prefill takes four steps
    e.add("aborted", PROMPT)
    e.step()
    e.step()
    e.abort("aborted")
    e.add("short", [4] * 50, max_tokens=1)
    e.run()
    assert not e.scheduler.requests
    assert e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == e.kv_cache_config.num_blocks - 1
    wait_for(lambda: held(daemon) == 0, 5, "no arena bytes held for the engine")
    # What the aborted request completed before the abort was saved, and only that.
    assert e.worker.worker_side.saved_blocks == 8 + 3


def evict_ram(d: DaemonProcess, model: str) -> None:
    """Drop the RAM copies of every block of ``model`` once write-back has put them on SSD
    (until then the daemon answers busy for a block and keeps it)."""
    evicted = 0

    def evict() -> bool:
        nonlocal evicted
        with grpc.insecure_channel(d.target) as ch:
            r = pb_grpc.AdminStub(ch).Evict(pb.EvictRequest(model=model, tier=pb.TIER_RAM), timeout=10)
        evicted += r.evicted
        return evicted > 0 and r.busy == 0
    wait_for(evict, 10, "RAM copies evicted once on SSD")


def prompt_on_ssd_only(e: MiniEngine, d: DaemonProcess, model: Path) -> None:
    """Run a request, keep its blocks only on the daemon's SSD, and add a second request that
    extends its prompt ("second")."""
    e.add("first", PROMPT)
    e.run()
    evict_ram(d, e.worker.model_name)
    assert e.scheduler.reset_prefix_cache()
    e.add("second", PROMPT + [1])


def test_blocks_on_ssd_are_loaded_asynchronously(daemon: DaemonProcess, model: Path, make_engine) -> None:
    e = make_engine(daemon, model)
    prompt_on_ssd_only(e, daemon, model)
    # On SSD only: vLLM parks the request (WAITING_FOR_REMOTE_KVS) while the worker loads.
    assert e.connector.get_num_new_matched_tokens(e.requests["second"], 0) == (12 * PAGE_TOKENS, True)
    loads_bit_exact(e, "second", 12)
    with daemon.client() as c:
        assert c.stats().promotions >= 12


def test_ssd_blocks_slower_to_load_than_to_recompute_are_recomputed(daemon: DaemonProcess, model: Path,
                                                                   make_engine) -> None:
    """Loads that pay, with the engines' prefill rates given: an engine that recomputes a token
    in a second loads SSD blocks; one that recomputes ten billion a second leaves them to be
    recomputed once the daemon has measured its SSD, and its request runs to the end without a
    load. Then, the same engine with ``skip_slow_loads`` off loads them again."""
    slow = make_engine(daemon, model, extra={"prefill_tokens_per_s": 1})
    prompt_on_ssd_only(slow, daemon, model)
    loads_bit_exact(slow, "second", 12)                       # also the daemon's first SSD reads: measured
    fast = make_engine(daemon, model, extra={"prefill_tokens_per_s": 1e10}, engine_id="fast")
    evict_ram(daemon, fast.worker.model_name)
    fast.add("third", PROMPT + [3])
    assert fast.connector.get_num_new_matched_tokens(fast.requests["third"], 0) == (0, False)
    assert computed_at_first_step(fast, "third") == 0
    fast.run()
    assert fast.worker.worker_side.loaded_blocks == 0
    with daemon.client() as c:
        assert c.stats().loads_skipped_ssd >= 12
        assert c.lookup(chain_digests(PROMPT, PAGE_TOKENS, model=fast.worker.model_name, dtype="bfloat16",
                                      namespace="tp0of1")).ram == 0     # still on SSD only
    always = make_engine(daemon, model, extra={"prefill_tokens_per_s": 1e10, "skip_slow_loads": False},
                         engine_id="always")
    always.add("fourth", PROMPT + [4])
    loads_bit_exact(always, "fourth", 12)


def test_the_engines_prefill_rate_is_measured_from_its_own_steps(daemon: DaemonProcess, model: Path,
                                                                 make_engine) -> None:
    """No rate given: the scheduler fits one from the steps it schedules (chunked prefills of
    up to 64 tokens and decodes here), and asks for load plans once it has one; a hit in RAM is
    loaded whatever the rate."""
    e = make_engine(daemon, model, max_tokens_per_step=64)
    side = e.connector.scheduler_side
    assert side.prefill is not None and side.prefill.seconds_per_token() is None
    for req_id, prompt in (("first", PROMPT), ("other", [t + 1 for t in PROMPT])):
        e.add(req_id, prompt)                             # 3 chunks of 64 tokens each, then decodes
        e.run()
    assert side.prefill.seconds_per_token() is not None and len(side.prefill.steps()) >= 4
    assert e.scheduler.reset_prefix_cache()
    e.add("second", PROMPT + [1])
    loads_bit_exact(e, "second", 12)


def test_an_aborted_asynchronous_load_frees_its_pages_after_the_load(daemon: DaemonProcess, model: Path,
                                                                     make_engine) -> None:
    e = make_engine(daemon, model)
    prompt_on_ssd_only(e, daemon, model)
    e.step()                                                  # the load starts
    e.abort("second")                                         # vLLM keeps the pages until the load is done
    e.run()
    assert not e.scheduler.requests
    assert e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == e.kv_cache_config.num_blocks - 1
    wait_for(lambda: held(daemon) == 0, 5, "no arena bytes held for the engine")


def test_blocks_held_only_by_a_peer_daemon_are_loaded(cluster: Cluster, model: Path, make_engine) -> None:
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="a and b connected")
    writer = make_engine(a, model, engine_id="node-a")
    writer.add("first", PROMPT)
    writer.run()
    digests = chain_digests(PROMPT, PAGE_TOKENS, model=writer.worker.model_name, dtype="bfloat16", namespace="tp0of1")
    with b.client() as c:
        wait_for(lambda: c.lookup(digests).longest == 12, text="b learns a's blocks")
    reader = make_engine(b, model, engine_id="node-b")
    reader.add("probe", PROMPT + [2])
    loads_bit_exact(reader, "probe", 12)
    with b.client() as c:
        assert c.stats().peer_pulled >= 12


def test_a_daemon_killed_mid_request_is_a_miss_and_the_engine_reconnects(make_daemon, model: Path, make_engine) -> None:
    d = make_daemon()
    e = make_engine(d, model, max_tokens_per_step=64)
    e.add("first", PROMPT)
    e.step()
    d.stop(signal.SIGKILL)                                    # mid-prefill: saves now fail, nothing raises
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.add("second", PROMPT)
    assert computed_at_first_step(e, "second") == 0          # a missing daemon is a miss
    e.run()
    saved = e.worker.worker_side.saved_blocks
    d.start()
    time.sleep(0.6)                                           # past the agents' retry interval
    assert e.scheduler.reset_prefix_cache()
    e.add("third", PROMPT)
    e.run()
    assert e.worker.worker_side.saved_blocks > saved          # saving again (blocks lost with the kill or not)
    assert e.scheduler.reset_prefix_cache()
    e.add("fourth", PROMPT)
    assert computed_at_first_step(e, "fourth") == 12 * PAGE_TOKENS
    e.run()
    assert e.connector.agent.reconnects >= 1 and e.worker.worker_side.agent.reconnects >= 1


def test_blocks_of_two_vllm_pages_load_around_a_local_hit_that_ends_inside_one(daemon: DaemonProcess, model: Path,
                                                                                make_engine) -> None:
    """kvcached blocks of 32 tokens over vLLM's 16-token pages: when vLLM's own prefix cache ends
    inside a block, only that block's remaining pages are loaded (the held one is skipped)."""
    e = make_engine(daemon, model, {"block_tokens": 32})
    e.add("first", PROMPT)
    e.run()
    assert e.worker.worker_side.saved_blocks == 6                # 203 tokens' KV: 6 whole blocks of 32
    assert e.scheduler.reset_prefix_cache()
    e.add("warm", PROMPT[:17], max_tokens=1)                      # vLLM keeps one 16-token page of it
    e.run()
    second = e.add("second", PROMPT + [1])
    _, local, _ = e.scheduler.kv_cache_manager.get_computed_blocks(second)
    assert local == PAGE_TOKENS, "vLLM's own prefix cache holds one page of the prompt (the path under test)"
    loads_bit_exact(e, "second", 6, 32)                            # 16 tokens local, 176 loaded


def test_bad_connector_settings_fail_at_engine_start(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown kvcached setting 'sockets'"):
        MiniEngine(model, {"sockets": "/x"})
    with pytest.raises(ValueError, match="block_tokens .* must be a multiple"):
        MiniEngine(model, {"socket": str(tmp_path / "none.sock"), "block_tokens": 24})


def test_an_engine_started_before_its_daemon_serves_and_connects_later(make_daemon, model: Path, make_engine) -> None:
    d = make_daemon(start=False)
    d.state.mkdir(parents=True, exist_ok=True)
    e = make_engine(d, model)
    e.add("first", PROMPT)
    e.run()                                                   # no daemon: every block is recomputed
    assert e.worker.worker_side.saved_blocks == 0
    d.start()
    time.sleep(0.6)
    e.add("second", PROMPT[:100])
    e.run()
    assert e.worker.worker_side.saved_blocks > 0


def test_kinds_of_kv_cache_groups_and_what_is_refused_at_start() -> None:
    """vLLM's group specs map to kvcached's kinds of block (equal specs one kind, a second
    full-attention spec a kind of its own); what kvcached cannot store is refused with a reason
    that names it, before any agent is opened."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvcached_agent.engines.vllm_connector import block_geometry

    def full(block: int = 16, heads: int = 2) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=32, dtype=torch.bfloat16)

    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=40)

    def mamba(mode: str) -> MambaSpec:
        return MambaSpec(block_size=16, shapes=((3, 64), (2, 32, 32)), dtypes=(torch.bfloat16, torch.float32),
                         mamba_cache_mode=mode)

    kinds, page, per_block = block_geometry([swa, full(), swa, mamba("align"), full(heads=4)], 0)
    assert [(k.name, k.kind, k.group_ids, k.window_blocks) for k in kinds] == [
        ("sliding40", "sliding", (0, 2), 3), ("full", "full", (1,), 0), ("state", "state", (3,), 0),
        ("full1", "full", (4,), 0)]
    assert (page, per_block) == (16, 1)
    assert block_geometry([full()], 32)[1:] == (16, 2)             # a plain model: blocks of two pages
    with pytest.raises(ValueError, match="cache mode 'none'.*'align'"):
        block_geometry([full(), mamba("none")], 0)
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        block_geometry([ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                                  attention_chunk_size=64)], 0)
    with pytest.raises(ValueError, match=r"different block sizes \(\[16, 32\]\)"):
        block_geometry([full(), full(block=32, heads=4)], 0)
    with pytest.raises(ValueError, match="must be vLLM's block size .*sliding-window or state"):
        block_geometry([swa, full()], 32)
    with pytest.raises(ValueError, match="must be vLLM's block size"):
        block_geometry([swa], 32)                                  # one group, but no chain of full blocks
    with pytest.raises(ValueError, match="no KV cache groups"):
        block_geometry([], 0)
