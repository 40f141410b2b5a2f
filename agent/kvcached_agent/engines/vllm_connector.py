"""kvcached as a vLLM V1 KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcachedConnector",
        "kv_connector_module_path": "kvcached_agent.engines.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvcached/agent.sock"}}'

vLLM builds one instance in the scheduler (role SCHEDULER) and one per worker (role WORKER); this
class only routes vLLM's calls to :class:`~kvcached_agent.engines.vllm_scheduler.SchedulerSide`
and :class:`~kvcached_agent.engines.vllm_worker.WorkerSide`. ``kv_connector_extra_config`` takes
the keys of :class:`~kvcached_agent.engines.common.PluginSettings`; anything else is an error.

It supports vLLM's hybrid KV cache manager (``SupportsHMA``), so vLLM keeps it on for hybrid
models: full-attention (MLA included), sliding-window and Mamba-style state groups, each kind
stored as kvcached_agent.engines.hybrid describes. Other kinds of group are refused at start,
with their name.
"""

from __future__ import annotations

from kvcached_agent.engines import versions

versions.require("vllm")

import logging  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import TYPE_CHECKING, Any, Callable, Iterable  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvcached_agent.engines.common import PluginSettings, open_agent, rank_namespace  # noqa: E402
from kvcached_agent.engines.fingerprint import name_model  # noqa: E402
from kvcached_agent.engines.hybrid import FULL, PRIMARY, SLIDING, STATE, GroupKind, kind_root  # noqa: E402
from kvcached_agent.engines.vllm_routes import RouteBook  # noqa: E402
from kvcached_agent.engines.vllm_scheduler import LoadOp, SaveOp, SchedulerSide  # noqa: E402
from kvcached_agent.engines.vllm_worker import WorkerSide, page_views  # noqa: E402
from kvcached_agent.prefill import PrefillRate  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KvcachedConnector", "KvcachedConnectorMetadata"]

log = logging.getLogger("kvcached_agent")


@dataclass
class KvcachedConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    pinned: list[bytes] = field(default_factory=list)     # blocks now in vLLM's GPU prefix cache
    evicted: list[bytes] = field(default_factory=list)    # blocks whose pages vLLM reused


def _hash_conversion() -> Callable[[Any], Any] | None:
    """vLLM's conversion of a block hash for its KV events (integers unless configured
    otherwise), so kvcached's events carry the engine's own; None where this vLLM has none."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:
        return None
    return maybe_convert_block_hash


def _ranks(worker: bool) -> tuple[int, int]:
    """This worker's (tensor, pipeline) parallel ranks; the scheduler looks up as rank 0."""
    from vllm.distributed import parallel_state

    if worker and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
    return 0, 0


def _model_name(vllm_config: "VllmConfig", specs: list[Any]) -> str:
    """The model's name in every address: its folder's name and a fingerprint of its config,
    weights and KV layout (kvcached_agent.engines.fingerprint), never the path string alone."""
    mc = vllm_config.model_config
    layout = ((type(specs[0]).__name__, repr(specs[0])) if len(specs) == 1
              else (tuple(type(s).__name__ for s in specs), tuple(repr(s) for s in specs)))
    return name_model(mc.model, mc.revision, layout, config=mc.hf_config.to_dict())


def group_kinds(specs: list[Any]) -> list[GroupKind]:
    """The kinds of block of a model whose KV cache groups have these specs (vLLM's; groups of
    equal specs are one kind, as vLLM's hybrid coordinator looks them up together). ValueError
    for a kind of group kvcached does not store, naming it."""
    kinds: list[tuple[Any, GroupKind]] = []
    for group, spec in enumerate(specs):
        for i, (known, kind) in enumerate(kinds):
            if known == spec:
                kinds[i] = (known, GroupKind(kind.name, kind.kind, kind.group_ids + (group,), kind.window_blocks))
                break
        else:
            kinds.append((spec, _kind_of(spec, group, [k.kind for _, k in kinds])))
    return [kind for _, kind in kinds]


def _kind_of(spec: Any, group: int, before: list[str]) -> GroupKind:
    """The kind of a group whose spec no group before it has (``before``: their kinds)."""
    states, fulls = before.count(STATE), before.count(FULL)
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupKind(f"full{fulls}" if fulls else PRIMARY, FULL, (group,))
    if isinstance(spec, SlidingWindowSpec) and spec.sliding_window > 0:
        need = -(-(spec.sliding_window - 1) // spec.block_size)     # vLLM's blocks for a sliding-window hit
        return GroupKind(f"sliding{spec.sliding_window}", SLIDING, (group,), max(1, need))
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            raise ValueError(f"KV cache group {group} holds state (Mamba) layers in cache mode "
                             f"{spec.mamba_cache_mode!r}: kvcached stores a state taken exactly at a block "
                             "boundary, which vLLM keeps in mode 'align' (prefix caching on)")
        return GroupKind(f"state{states}" if states else "state", STATE, (group,))
    raise ValueError(f"KV cache group {group} is of a kind kvcached does not store ({type(spec).__name__}); "
                     "supported: full attention, MLA, sliding window and Mamba-style state layers")


def block_geometry(specs: list[Any], block_tokens: int) -> tuple[list[GroupKind], int, int]:
    """The kinds of block of a model with these KV cache group specs, vLLM's block size (a page,
    in tokens) and the pages in one kvcached block (``block_tokens`` of the plug-in settings, 0:
    one page). ValueError, saying why, for what kvcached cannot store."""
    if not specs:
        raise ValueError("the kvcached connector needs a model with a KV cache (this one has no KV cache groups)")
    kinds = group_kinds(specs)
    page_tokens = specs[0].block_size
    if any(spec.block_size != page_tokens for spec in specs):
        raise ValueError(f"the KV cache groups of this model have different block sizes "
                         f"({sorted({spec.block_size for spec in specs})}); kvcached needs one")
    block_tokens = block_tokens or page_tokens
    if block_tokens % page_tokens:
        raise ValueError(f"kv_connector_extra_config: block_tokens ({block_tokens}) must be a multiple of "
                         f"vLLM's block size ({page_tokens})")
    if block_tokens != page_tokens and (len(specs) > 1 or kinds[0].name != PRIMARY):
        raise ValueError(f"kv_connector_extra_config: block_tokens ({block_tokens}) must be vLLM's block size "
                         f"({page_tokens}) for a model with sliding-window or state layers (its hits end on "
                         "vLLM's blocks)")
    return kinds, page_tokens, block_tokens // page_tokens


class KvcachedConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over the kvcached agent (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = PluginSettings.from_mapping(self._kv_transfer_config.kv_connector_extra_config,
                                               "kv_connector_extra_config")
        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        kinds, page_tokens, per_block = block_geometry(specs, settings.block_tokens)
        block_tokens = page_tokens * per_block
        self._groups = [list(g.layer_names) for g in groups]
        self._page_bytes = [spec.page_size_bytes for spec in specs]
        self._num_pages = kv_cache_config.num_blocks
        model = _model_name(vllm_config, specs)
        # The KV dtype of the first group that has one (a state group has one per state tensor).
        dtype = str(next((s.dtype for s in specs if hasattr(s, "dtype")), vllm_config.model_config.dtype))
        dtype = dtype.removeprefix("torch.")
        parallel = vllm_config.parallel_config
        rank, pp_rank = _ranks(role == KVConnectorRole.WORKER)
        namespace = rank_namespace(settings.namespace, rank, parallel.tensor_parallel_size, pp_rank,
                                   parallel.pipeline_parallel_size)
        who = "scheduler" if role == KVConnectorRole.SCHEDULER else f"rank{rank}"
        agent = open_agent(settings, agent_id=f"vllm-{self._kv_transfer_config.engine_id}-{who}", model=model,
                           dtype=dtype, block_tokens=block_tokens, num_layers=sum(map(len, self._groups)),
                           layer_block_bytes=max(self._page_bytes) * per_block, namespace=namespace)
        root = agent.root                 # the chain root of this rank's addresses (model, dtype, size, namespace)
        roots = [kind_root(model, dtype, block_tokens, namespace, kind) for kind in kinds]
        self.kinds = kinds
        self.agent = agent
        self.model_name = model           # what the daemon knows this model as (Admin Evict, chain_digests)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A cache miss must never fail a request: a block evicted or a daemon gone between
                # the lookup and the load is recomputed (read by vLLM's scheduler after this).
                log.warning("kvcached sets kv_load_failure_policy to 'recompute': a block that cannot be "
                            "loaded is computed again, never an error for the request")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            events = getattr(vllm_config, "kv_events_config", None)
            self.routes = RouteBook(agent, kinds, roots, block_tokens=block_tokens, page_tokens=page_tokens,
                                    convert=_hash_conversion(),
                                    engine_events=bool(events and getattr(events, "enable_kv_cache_events", False)))
            prefill = (PrefillRate(settings.prefill_tokens_per_s, prefill_tokens=block_tokens)
                       if settings.skip_slow_loads else None)
            if prefill is not None and not prefill.given and vllm_config.scheduler_config.async_scheduling:
                # Steps overlap with asynchronous scheduling: the time between two schedules is
                # not the step's own, so the rate is not measured; every hit is loaded.
                log.info("kvcached: vLLM schedules asynchronously, so the prefill rate is not measured; "
                         "give prefill_tokens_per_s to skip loads slower than recomputing")
                prefill = None
            self.scheduler_side = SchedulerSide(agent, root, block_tokens=block_tokens, page_tokens=page_tokens,
                                                kinds=kinds, roots=roots, routes=self.routes, prefill=prefill)
        else:
            self.worker_side = WorkerSide(agent, root, block_tokens=block_tokens, pages_per_block=per_block,
                                          reports_gpu=rank == 0 and pp_rank == 0, kinds=kinds, roots=roots)

    # -- worker role ---------------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    def _metadata(self) -> KvcachedConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcachedConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register({g: page_views(kv_caches, layers, self._num_pages, self._page_bytes[g])
                                 for g, layers in enumerate(self._groups)})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._metadata()
        self._worker().report(meta.pinned, meta.evicted)
        self._worker().start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole-block loads: every layer is in place before the forward starts."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Whole-block saves: a block holds every layer, so it is stored in wait_for_save."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker().save(self._metadata().saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads done, and (a hybrid model's) loads that failed: vLLM takes block-level errors
        from a model with one KV cache group only, and recomputes a failed request whole."""
        done = self._worker().finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=self._worker().failed())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        else:
            self.agent.close()

    # -- scheduler role ------------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvcachedConnectorMetadata(*self._scheduler().build(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().transfers_done(connector_output.finished_recving)

    def take_events(self) -> Iterable[Any]:
        """The blocks this connector stored in kvcached or loaded from it since the last call, as
        vLLM's BlockStored events for the engine's own stream (the engine publishes KV events):
        medium "CPU", ownership "kvcached". Their removal is the daemon's stream's to tell."""
        from vllm.distributed.kv_events import BlockStored
        return [BlockStored(block_hashes=k.block_hashes, parent_block_hash=k.parent_block_hash, token_ids=k.token_ids,
                            block_size=k.block_size, lora_id=k.lora_id, medium="CPU", lora_name=k.lora_name,
                            group_idx=k.group_idx, kv_cache_spec_kind=k.kv_cache_spec_kind, locality="LOCAL",
                            ownership="kvcached") for k in self.routes.take()] if self.scheduler_side is not None else []

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request), None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """As request_finished, for every group at once (vLLM's hybrid manager calls this one)."""
        return self._scheduler().finished(request), None

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        ram, ssd, peer = self._scheduler().hit_tiers(request)
        total = ram + ssd + peer
        if total == 0:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        # Tokens split by block share; the first blocks (vLLM's own hits aside) come from RAM.
        out = {CacheHitSource.HOST: num_external_tokens * ram // total,
               CacheHitSource.DISK: num_external_tokens * ssd // total}
        out[CacheHitSource.P2P] = num_external_tokens - out[CacheHitSource.HOST] - out[CacheHitSource.DISK]
        return {source: n for source, n in out.items() if n}
