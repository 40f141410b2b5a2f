"""kvcached as a secondary tier behind vLLM's CPU offloading, against real daemons.

vLLM's OffloadingConnector is built in its scheduler role by vLLM's KVConnectorFactory from the
kv-transfer-config the docs give; TieringOffloadingSpec builds the real CPU primary tier (its
shared-memory region) and loads KvcachedTier by module path. The tests then make the calls vLLM's
OffloadingConnectorScheduler makes on that manager (under its lock): prepare_store /
complete_store, lookup until the verdicts settle, prepare_load / complete_load, on_schedule_end
once per step. What vLLM's GPU worker would do (copy GPU <-> primary) is a copy of known bytes into
and out of the primary's rows: there is no GPU here.
"""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvcached_agent.engines.vllm_tier import KvcachedTier
from tests.engines.vllm_engine import DTYPE, HEAD_SIZE, KV_HEADS, LAYERS, PAGE_TOKENS, tiny_llama
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_peers import Cluster, connected

CPU_BYTES = 128 << 10      # vLLM's CPU tier: a few dozen chunks here; more evict the oldest


def tier_config(socket: str, **keys: Any) -> dict[str, Any]:
    """kv_connector_extra_config of an OffloadingConnector with kvcached behind its CPU tier."""
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES,
            "secondary_tiers": [{"type": "KvcachedTier", "module_path": "kvcached_agent.engines.vllm_tier",
                                 "socket": socket, **keys}]}


def keys_of(name: str, n: int) -> list[OffloadKey]:
    """``n`` offload keys standing for the chunks of one prompt (vLLM derives them from block hashes)."""
    return [make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0) for i in range(n)]


def payload(key: OffloadKey, size: int) -> bytes:
    """The bytes the stand-in GPU worker writes for a chunk: a function of its key."""
    return hashlib.shake_256(key).digest(size)


class Offloading:
    """vLLM's OffloadingConnector (scheduler role) with the calls its scheduler makes."""

    def __init__(self, model: Path, extra: dict[str, Any], engine_id: str, num_pages: int = 64) -> None:
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=PAGE_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
        page = spec.page_size_bytes
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine_id,
                                    kv_connector_extra_config=extra)
        config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=8192),
            cache_config=CacheConfig(block_size=PAGE_TOKENS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=8192,
                                             is_encoder_decoder=False),
            kv_transfer_config=transfer)
        kv_cache_config = KVCacheConfig(
            num_blocks=num_pages,
            kv_cache_tensors=[KVCacheTensor(size=page * num_pages, layers=[name], layer_stride=0, block_stride=page)
                              for name in layers],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        self.connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.manager = self.connector.scheduler.manager
        assert isinstance(self.manager, TieringOffloadingManager)
        (tier,) = self.manager.secondary_tiers
        assert isinstance(tier, KvcachedTier)
        self.tier = tier
        self.chunk = self.tier.block_size_bytes
        # The primary's rows, flat (a 2-D memoryview cannot be sliced); released before shutdown,
        # as vLLM releases the primary's view then.
        view = self.manager.primary_tier.get_kv_memoryview()
        self.capacity = view.shape[0]        # chunks the primary holds (vLLM sizes them from the KV layout)
        self.primary = view.cast("B")
        self.requests: dict[str, ReqContext] = {}

    def close(self) -> None:
        self.primary.release()
        self.connector.shutdown()            # the manager shuts the tier down before the primary

    def request(self, req_id: str) -> ReqContext:
        if req_id not in self.requests:
            self.requests[req_id] = ReqContext(req_id=req_id)
            with self.manager.lock:
                self.manager.on_new_request(self.requests[req_id])
        return self.requests[req_id]

    def finish(self, req_id: str) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(self.requests.pop(req_id))

    def step(self) -> None:
        """The end of a scheduler step: finished jobs, promotions and lookups go out."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, req_id: str, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """GPU -> primary as vLLM's worker does it (the known bytes of each chunk); the manager
        then cascades them to kvcached. Returns the keys the primary stored."""
        ctx = self.request(req_id)
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
            assert out is not None, "the primary tier has no room"
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.primary[int(chunk) * self.chunk:(int(chunk) + 1) * self.chunk] = payload(key, self.chunk)
            self.manager.complete_store(out.keys_to_store, ctx)
        return out.keys_to_store

    def settle(self, timeout: float = 10.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            assert time.monotonic() < deadline, "transfers still in flight"
            time.sleep(0.005)

    def lookup(self, req_id: str, keys: Sequence[OffloadKey], timeout: float = 10.0) -> int:
        """How many chunks from the first are ready in the primary, as the scheduler finds it:
        each step, look the keys up in order until a miss; while any answer is RETRY or
        HIT_PENDING (a kvcached lookup or a promotion under way), step and ask again."""
        ctx = self.request(req_id)
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred = 0, False
            with self.manager.lock:
                for key in keys:
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    hits += result is not LookupResult.RETRY
                    deferred |= result is not LookupResult.HIT
            if not deferred:
                return hits
            assert time.monotonic() < deadline, "lookups never settled"
            self.step()
            time.sleep(0.005)

    def read(self, req_id: str, keys: Sequence[OffloadKey]) -> list[bytes]:
        """Primary -> GPU as vLLM's worker does it: the bytes of each chunk."""
        ctx = self.request(req_id)
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
            rows = [bytes(self.primary[int(c) * self.chunk:(int(c) + 1) * self.chunk]) for c in spec.chunk_ids]
            self.manager.complete_load(list(keys), ctx)
        return rows

    def in_primary(self, keys: Sequence[OffloadKey]) -> int:
        ctx = self.request("probe")
        with self.manager.lock:
            return sum(self.manager.primary_tier.lookup(k, ctx) is LookupResult.HIT for k in keys)

    def failures(self, metric: str) -> int:
        """A failure counter from vLLM's own offloading stats (what Prometheus would get)."""
        with self.manager.lock:
            stats = self.manager.get_stats()
        return int(sum((stats.data["data"].get(metric) or {}).values())) if stats is not None else 0

    def in_daemon(self, d: DaemonProcess, keys: Sequence[OffloadKey]) -> int:
        with d.client() as c:
            return c.lookup(self.tier.digests(keys)).longest


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return tiny_llama(tmp_path / "model")


@pytest.fixture
def make_offloading(tmp_path: Path) -> Iterator[Callable[..., Offloading]]:
    """OffloadingConnectors with a kvcached tier on a daemon's agent socket (short reconnect
    intervals), shut down after the test."""
    made: list[Offloading] = []

    def make(d: DaemonProcess, model: Path, **keys: Any) -> Offloading:
        extra = tier_config(str(d.state / "agent.sock"), **{"retry_s": 0.2, "retry_max_s": 0.5, **keys})
        made.append(Offloading(model, extra, engine_id=f"tier-{tmp_path.name}-{len(made)}"))
        return made[-1]
    yield make
    for o in made:
        o.close()


def test_chunks_cascade_to_kvcached_and_come_back_bit_exact_after_the_primary_evicts_them(
        daemon: DaemonProcess, model: Path, make_offloading) -> None:
    o = make_offloading(daemon, model)
    first = keys_of("first", 6)
    assert o.store("first", first) == first
    o.settle()
    assert o.in_daemon(daemon, first) == 6                      # cascaded: every chunk is in kvcached
    o.store("second", keys_of("second", o.capacity))         # fills the primary: the first chunks go
    o.settle()
    assert o.in_primary(first) == 0
    assert o.lookup("third", first) == 6                         # found in kvcached, promoted into the primary
    assert o.in_primary(first) == 6
    assert o.read("third", first) == [payload(k, o.chunk) for k in first]
    assert o.failures(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES) == 0
    with daemon.client() as c:
        assert c.stats().agents == 1                              # one agent: the scheduler's tier


def test_chunks_kvcached_never_had_are_a_miss_and_a_partial_prefix_counts_to_its_first_gap(
        daemon: DaemonProcess, model: Path, make_offloading) -> None:
    o = make_offloading(daemon, model)
    assert o.lookup("unknown", keys_of("unknown", 4)) == 0
    held = keys_of("held", 5)
    o.store("held", held[:3])
    o.settle()
    o.store("filler", keys_of("filler", o.capacity))
    o.settle()
    assert o.lookup("again", held) == 3                          # three in kvcached, then a miss
    assert o.read("again", held[:3]) == [payload(k, o.chunk) for k in held[:3]]


def test_a_daemon_killed_mid_way_is_a_miss_with_failed_jobs_and_the_tier_reconnects(
        make_daemon, model: Path, make_offloading) -> None:
    d = make_daemon()
    o = make_offloading(d, model)
    first = keys_of("first", 4)
    o.store("first", first)
    o.settle()
    d.stop(signal.SIGKILL)
    o.store("second", keys_of("second", o.capacity))         # cascades while the daemon is gone: they fail
    o.settle()
    assert o.failures(TieringOffloadingMetrics.CASCADE_JOB_FAILURES) >= 1
    assert o.in_primary(first) == 0
    assert o.lookup("third", first) == 0                         # a missing daemon is an empty cache
    d.start()                                                    # a restarted daemon: RAM blocks are gone
    time.sleep(0.6)                                              # past the agent's retry interval
    again = keys_of("again", 3)
    o.store("again", again)
    o.settle()
    assert o.tier.agent.reconnects >= 1
    assert o.in_daemon(d, again) == 3
    o.store("filler", keys_of("filler", o.capacity))
    o.settle()
    assert o.lookup("fourth", again) == 3
    assert o.read("fourth", again) == [payload(k, o.chunk) for k in again]


def test_a_promotion_whose_block_is_gone_fails_and_the_chunk_is_then_a_miss(make_daemon, model: Path,
                                                                             make_offloading) -> None:
    """The daemon answered the lookup, then lost the block before the load: the promotion job
    fails, vLLM frees the slot, and the tier's cached verdict turns into a miss (no retry loop)."""
    d = make_daemon()
    o = make_offloading(d, model)
    first = keys_of("first", 2)
    o.store("first", first)
    o.settle()
    o.store("second", keys_of("second", o.capacity))
    o.settle()
    ctx = o.request("third")

    def verdict() -> LookupResult:
        with o.manager.lock:
            return o.manager.lookup(first[0], ctx)

    def stepped_verdict() -> LookupResult:
        o.step()                                                 # lookups go out, verdicts come in
        return verdict()
    assert verdict() is LookupResult.RETRY
    wait_for(lambda: stepped_verdict() is not LookupResult.RETRY, 5, "the daemon's verdict")
    assert verdict() is LookupResult.HIT_PENDING                 # a promotion is set up, not yet submitted
    d.stop(signal.SIGKILL)
    assert o.lookup("third", first) == 0                         # HIT, promotion fails, then MISS
    assert o.failures(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES) >= 1
    with o.manager.lock:
        assert o.manager.lookup(first[0], ctx) is LookupResult.MISS


def test_drain_jobs_waits_for_every_job_and_reset_cache_keeps_kvcached(daemon: DaemonProcess, model: Path,
                                                                       make_offloading) -> None:
    o = make_offloading(daemon, model)
    first = keys_of("first", o.capacity)
    o.store("first", first)                                      # cascades queued on the tier's thread
    o.tier.drain_jobs()
    assert o.in_daemon(daemon, first) == o.capacity          # done before drain_jobs returned
    o.finish("first")
    with o.manager.lock:
        o.manager.reset_cache()                                  # vLLM's reset: drains the tiers, empties the primary
        o.manager.on_reset_flushed()
    assert o.in_primary(first) == 0
    assert o.lookup("second", first) == o.capacity           # kvcached kept them
    assert o.read("second", first) == [payload(k, o.chunk) for k in first]


def test_chunks_stored_by_one_engine_are_promoted_by_an_engine_on_a_peer_node(cluster: Cluster, model: Path,
                                                                              make_offloading) -> None:
    a = cluster.daemon("node-a", peers={"node-b": cluster.addresses["node-b"]})
    b = cluster.daemon("node-b", peers={"node-a": cluster.addresses["node-a"]})
    wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="a and b connected")
    writer = make_offloading(a, model)
    shared = keys_of("shared", 4)
    writer.store("first", shared)
    writer.settle()
    reader = make_offloading(b, model)
    wait_for(lambda: reader.in_daemon(b, shared) == 4, text="b learns a's chunks")
    assert reader.lookup("probe", shared) == 4
    assert reader.read("probe", shared) == [payload(k, reader.chunk) for k in shared]


def test_bad_tier_settings_fail_at_engine_start(model: Path, tmp_path: Path) -> None:
    socket = str(tmp_path / "none.sock")
    with pytest.raises(ValueError, match=r"secondary_tiers\[type=KvcachedTier\]: unknown kvcached setting 'sockets'"):
        Offloading(model, tier_config(socket, sockets="/x"), engine_id=f"bad-{tmp_path.name}-0")
    with pytest.raises(ValueError, match="'timeout_s' must be a number > 0"):
        Offloading(model, tier_config(socket, timeout_s=0), engine_id=f"bad-{tmp_path.name}-1")
    with pytest.raises(ValueError, match="block_tokens does not apply"):
        Offloading(model, tier_config(socket, block_tokens=32), engine_id=f"bad-{tmp_path.name}-2")


def test_new_weights_at_the_old_path_are_another_model_to_the_tier(
        daemon: DaemonProcess, model: Path, make_offloading, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM gives a tier the model's path only; the tier names the model by the folder's
    config.json and weights, so chunks stored for old weights are never promoted into new ones."""
    monkeypatch.setenv("KVCACHED_FINGERPRINT_CACHE", str(tmp_path / "weights.json"))
    (model / "model.safetensors").write_bytes(b"weights-one" * 100)
    old = make_offloading(daemon, model)
    stored = keys_of("stored", 4)
    old.store("stored", stored)
    old.settle()
    assert old.in_daemon(daemon, stored) == 4 and old.tier.model_name.startswith("model@")
    same = make_offloading(daemon, model)                        # a restarted engine, same weights
    assert same.tier.model_name == old.tier.model_name and same.in_daemon(daemon, stored) == 4
    (model / "model.safetensors").write_bytes(b"weights-two" * 100)
    new = make_offloading(daemon, model)
    assert new.tier.model_name != old.tier.model_name
    assert new.in_daemon(daemon, stored) == 0
    assert new.lookup("again", stored) == 0
