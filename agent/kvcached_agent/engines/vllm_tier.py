"""kvcached as a secondary tier behind vLLM's own CPU offloading (vLLM's ``TieringOffloadingSpec``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
          "secondary_tiers": [{"type": "KvcachedTier", "module_path": "kvcached_agent.engines.vllm_tier",
                               "socket": "/run/kvcached/agent.sock"}]}}'

vLLM keeps its own CPU tier (the primary) and drives this tier from its scheduler process: every
chunk stored in the primary is cascaded here (copied from the primary's shared memory into the
daemon's arena), and a chunk the primary no longer holds is looked up here and promoted back into
a primary slot. Block bytes never reach the GPU from here; vLLM's worker copies primary <-> GPU.

- A kvcached block is one vLLM offloading chunk (``block_size`` / ``blocks_per_chunk`` of the
  extra config), stored as one cross-layer address, opaque bytes: the primary's row. Its digest is
  BLAKE3(root, OffloadKey), as SGLang's page keys are; the root holds the model, the dtype, the
  chunk's tokens and a namespace naming the chunk layout (the same facts vLLM's own file tier
  names its folders by), so chunks of another layout, or kvcached's own connector blocks, never
  share an address. The model is named by its fingerprint (kvcached_agent.engines.fingerprint:
  the folder's config.json and weights), never by the path string vLLM passes: new weights at an
  old path are another model. vLLM 0.33 gives a tier the model's name only, not its revision, so
  a hub id is named by the id: pin a revision by serving a local snapshot folder.
- Lookups are vLLM's batched asynchronous lookups (``AsyncLookupManager``, as its file tier): a
  key first answers RETRY, each step's keys go to the daemon as one lookup per request on a
  background thread, and the verdict is there the next step. The scheduler never waits on the
  socket. The daemon answers a longest prefix, so a key after a request's first miss is a miss.
- Stores and loads run on one worker thread (loads first: a request waits on them); ``submit_*``
  only queue. ``drain_jobs`` waits until the queue is empty and nothing is running.
- A daemon that is down is an empty cache (the agent's reconnect mode): lookups miss, loads fail
  (vLLM recomputes), stores fail (vLLM drops them), nothing raises into vLLM; the agent connects
  again when the daemon is back.

Tier-config keys besides vLLM's own (``type``, ``module_path``, ``backpressure``, ``locality``) are
those of :class:`~kvcached_agent.engines.common.PluginSettings`, ``block_tokens`` excepted.
"""

from __future__ import annotations

from kvcached_agent.engines import versions

versions.require("vllm", since="0.33.0")   # ConfigInfo and the tiering interface are 0.33's

import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    ConfigInfo,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob  # noqa: E402

from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.engines.common import PluginSettings, key_digests, open_agent  # noqa: E402
from kvcached_agent.engines.fingerprint import name_model  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvcachedTier", "KvcachedTierInfo"]

log = logging.getLogger("kvcached_agent")


def layout_namespace(namespace: str, offloading_spec: "OffloadingSpec") -> str:
    """The address namespace of this engine's chunks: ``namespace`` plus a hash of the facts that
    make two engines' chunks byte-compatible (vLLM's FileMapper run config: model, dtype, tokens
    per hash and per chunk, cache groups, parallel layout unless portable across it)."""
    fields = FileMapper.from_offloading_spec("", offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
                                             parallel_agnostic=True).get_run_config()
    layout = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    return f"{namespace}|vllm-offload.{layout}" if namespace else f"vllm-offload.{layout}"


@dataclass(frozen=True)
class KvcachedTierInfo(ConfigInfo):
    """The labels this tier publishes on vllm:kv_offload_config_info."""

    kvcached_socket: str
    kvcached_namespace: str


@dataclass(frozen=True, slots=True)
class _Job:
    job_id: int
    keys: list[OffloadKey]
    chunks: list[int]
    is_load: bool


class _DaemonLookups(AsyncLookupManager):
    """vLLM's async lookup front end over the daemon: one Lookup per request per step."""

    def __init__(self, tier: "KvcachedTier") -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Runs on the lookup thread. Keys come in the request's chunk order, so the daemon's
        longest prefix gives each verdict; a key after the first miss reads as a miss."""
        longest = self._tier.agent.lookup(self._tier.digests(keys)).longest
        return [i < longest for i in range(len(keys))]


class KvcachedTier(SecondaryTierManager):
    """vLLM secondary tier over the kvcached agent (see the module docstring).

    Methods other than the worker thread's run in vLLM's scheduler under its manager lock and
    never block on the daemon; copies and daemon calls happen on this tier's threads. The daemon
    decides where a block lives (RAM, SSD, a peer), so ``medium`` stays unknown (None: a
    request's tier filter never excludes this tier) and its hits count as external."""

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: "BackpressureDetector | None" = None, locality: str | None = None,
                 **settings: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"kv_connector_extra_config.secondary_tiers[type={tier_type}]"
        parsed = PluginSettings.from_mapping(settings, where)
        if parsed.block_tokens:
            raise ValueError(f"{where}: block_tokens does not apply here (a kvcached block is one vLLM chunk; "
                             "set block_size or blocks_per_chunk in kv_connector_extra_config)")
        self.locality = Locality(locality) if locality is not None else None
        self.settings = parsed
        config = offloading_spec.config
        self.namespace = layout_namespace(parsed.namespace, offloading_spec)
        # The chunk is one opaque block: one "layer" of the primary's row size, so a daemon whose
        # kv.max_block_mib is smaller refuses the Hello (a clear error at engine start).
        self.model_name = name_model(config.model.name, None, ("vllm-offload-chunk", self.namespace,
                                                                self.block_size_bytes))
        self.agent: Any = open_agent(parsed, agent_id=f"vllm-{config.engine_id}-tier", model=self.model_name,
                                     dtype=config.model.dtype, num_layers=1, layer_block_bytes=self.block_size_bytes,
                                     block_tokens=config.groups[0].tokens_per_block * offloading_spec.blocks_per_chunk,
                                     namespace=self.namespace)
        self._root: bytes = self.agent.root
        # The primary's rows as uint8 tensors over its shared memory (no copy); dropped at
        # shutdown, before vLLM releases the memoryview.
        self._rows: torch.Tensor | None = torch.frombuffer(primary_kv_view, dtype=torch.uint8).view(
            -1, self.block_size_bytes)
        self._info = KvcachedTierInfo(kvcached_socket=parsed.socket_path, kvcached_namespace=self.namespace)
        self._cond = threading.Condition()
        self._loads: deque[_Job] = deque()
        self._stores: deque[_Job] = deque()
        self._busy = 0                                                 # jobs queued or running
        self._finished: list[tuple[JobResult, list[OffloadKey]]] = []  # with a load's failed keys
        self._stopping = False
        self._lookups = _DaemonLookups(self)
        self._worker = threading.Thread(target=self._work, name=f"kvcached_tier_{tier_type}", daemon=True)
        self._worker.start()

    # -- addressing -----------------------------------------------------------------------------

    def digests(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """kvcached digests of vLLM's keys: BLAKE3(root, key)."""
        return key_digests(self._root, keys)

    # -- the scheduler's calls ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._queue(job_metadata, self._stores)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._queue(job_metadata, self._loads)

    def _queue(self, job: TransferJob, queue: deque[_Job]) -> None:
        keys, chunks = list(job.keys), [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunks):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(chunks)} chunks")
        with self._cond:
            queue.append(_Job(job.job_id, keys, chunks, job.is_promotion))
            self._busy += 1
            self._cond.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._cond:
            finished, self._finished = self._finished, []
        for _, failed in finished:
            if failed:
                # A load that failed (evicted since the lookup, or the daemon gone) must not be
                # promoted again on the strength of a cached verdict (vLLM's livelock #49176).
                self._lookups.mark_miss(failed)
        return [result for result, _ in finished]

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished (their results stay for the next
        get_finished_jobs). A job in progress is never cut short."""
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return KvcachedTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._info.as_config_info()

    def shutdown(self) -> None:
        """Fail the jobs not started, wait for the one running, stop the lookup thread and
        disconnect; then nothing of this tier refers to the primary's memory."""
        with self._cond:
            self._stopping = True
            for job in (*self._loads, *self._stores):
                self._finished.append(self._failed(job))
                self._busy -= 1
            self._loads.clear()
            self._stores.clear()
            self._cond.notify_all()
        self._worker.join()
        self._lookups.shutdown()
        self.agent.close()
        self._rows = None

    # -- the worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads or self._stores or self._stopping)
                if self._stopping:
                    return
                job = self._loads.popleft() if self._loads else self._stores.popleft()
            try:
                done = self._run(job)
            except Exception:            # never lose the thread, nor a job's result
                log.exception("kvcached tier: job %d failed", job.job_id)
                done = self._failed(job)
            with self._cond:
                self._finished.append(done)
                self._busy -= 1
                self._cond.notify_all()

    def _failed(self, job: _Job) -> tuple[JobResult, list[OffloadKey]]:
        return JobResult(job_id=job.job_id, success=False), job.keys if job.is_load else []

    def _run(self, job: _Job) -> tuple[JobResult, list[OffloadKey]]:
        rows = self._rows
        assert rows is not None
        tensors = [rows[c] for c in job.chunks]
        addresses = [BlockAddress(d) for d in self.digests(job.keys)]
        start = time.monotonic()
        if not job.is_load:
            saved = self.agent.save(addresses, tensors)
            return JobResult(job_id=job.job_id, success=not saved.skipped, transfer_time=time.monotonic() - start,
                             transfer_bytes=saved.stored * self.block_size_bytes), []
        loaded = self.agent.load(addresses, tensors)
        missing = set(loaded.missing)
        failed = [k for i, k in enumerate(job.keys) if i in missing]
        kept = tuple(k for i, k in enumerate(job.keys) if i not in missing)
        return JobResult(job_id=job.job_id, success=not failed, successful_keys=kept if failed and kept else None,
                         transfer_time=time.monotonic() - start,
                         transfer_bytes=loaded.loaded * self.block_size_bytes), failed
