"""kvcached as an SGLang HiCache storage backend (the L3 tier behind SGLang's host memory).

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvcached", "module_path": "kvcached_agent.engines.sglang_storage",
          "class_name": "KvcachedStorage", "socket": "/run/kvcached/agent.sock", "interface_v1": 1}'

SGLang names each page by a key it derives from the page's tokens and every page before it, so a
key is already a prefix chain; kvcached addresses the page as BLAKE3(root, key), where the root
holds the model, the dtype, the page size and this rank's shard (tensor, pipeline and attention
context-parallel ranks; MLA pages are the same on every tensor rank and share one address).
The model is named by its fingerprint (kvcached_agent.engines.fingerprint: config.json and
weights of ``--model-path``, or the hub id and ``--revision``), never by the served name SGLang
passes: new weights at an old path are another model, and two servers of one model share blocks
whatever names they serve it under.
Pages travel two ways, as SGLang asks: its flat data pages (``batch_set``/``batch_get``, the
path a dynamic backend gets by default: SGLang copies each page out of its host pool first), or
zero-copy (``batch_set_v1``/``batch_get_v1``, with ``"interface_v1": 1`` in the extra config): the
agent copies straight between the host pool's memory and the daemon's arena, a page taken as
views of the pool's buffer in the flat page's byte order, so a block is the same bytes either
way and engines of both kinds share it. A host pool whose page is not a view of its memory gets
the flat copy. A daemon that is down is an empty cache: ``batch_exists`` finds nothing, gets
miss, sets report failure, and SGLang serves on.

Extra-config keys besides SGLang's own are those of
:class:`~kvcached_agent.engines.common.PluginSettings` (``block_tokens`` excepted: a kvcached
block here is always one SGLang page).
"""

from __future__ import annotations

from kvcached_agent.engines import versions

versions.require("sglang")

import itertools  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
from typing import Any, List, Optional  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402

from kvcached_agent.address import BlockAddress  # noqa: E402
from kvcached_agent.engines.common import PluginSettings, key_digests, open_agent, rank_namespace  # noqa: E402
from kvcached_agent.engines.fingerprint import name_model  # noqa: E402

__all__ = ["KvcachedStorage"]

log = logging.getLogger("kvcached_agent")

# Keys of the extra config that are SGLang's own (its factory and cache controller read them; some
# it removes before the backend sees the config).
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                "hicache_storage_pass_prefix_keys", "tp_lcm_size")


def served_model(storage_config: HiCacheStorageConfig) -> tuple[str, Optional[str]]:
    """The model SGLang serves: ``--model-path`` and ``--revision`` of its published server args.
    Where none are published (a backend built outside a server), the model name SGLang gave the
    backend stands for the path (it is ``--model-path`` unless a served name was set)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except (ImportError, ValueError):                    # ValueError: "Global server args is not set yet!"
        return storage_config.model_name or "sglang", None
    return str(args.model_path), getattr(args, "revision", None)


def contiguous_runs(view: torch.Tensor) -> list[torch.Tensor]:
    """``view``'s elements in row-major order as the fewest contiguous 1-D views its strides
    allow (no copy): the trailing dimensions that are laid out densely form one run each."""
    inner, dense = view.dim(), 1
    while inner > 0 and (view.shape[inner - 1] == 1 or view.stride(inner - 1) == dense):
        dense *= view.shape[inner - 1]
        inner -= 1
    if inner == 0:
        return [view.view(-1)]
    return [view[index].view(-1) for index in itertools.product(*map(range, view.shape[:inner]))]


class KvcachedStorage(HiCacheStorage):
    """HiCacheStorage over the kvcached agent (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        settings = PluginSettings.from_mapping(extra, "--hicache-storage-backend-extra-config", ignore=_SGLANG_KEYS)
        if settings.block_tokens:
            raise ValueError("--hicache-storage-backend-extra-config: block_tokens does not apply to SGLang "
                             "(a block is one page, --page-size)")
        self.settings = settings
        self.config = storage_config
        self.model_path, self.revision = served_model(storage_config)
        self.model = ""                          # the fingerprint name, once the page layout is known
        self.format_tag: Optional[str] = None
        c = storage_config
        tp_rank, tp_size = (0, 1) if c.is_mla_model else (c.tp_rank, c.tp_size)
        namespace = rank_namespace(settings.namespace, tp_rank, tp_size, c.pp_rank, c.pp_size)
        if c.attn_cp_size > 1:
            namespace += f".cp{c.attn_cp_rank}of{c.attn_cp_size}"
        self.namespace = namespace
        self.writer = c.is_storage_writer        # MLA: one rank writes the pages every rank shares
        self._lock = threading.Lock()
        self._agent: Any = None
        self._root = b""
        self.page_bytes = 0
        self._recompute_s = 0.0                  # one page's prefill, where the config gives a rate

    # -- the connection: opened once the page size is known ------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.format_tag = getattr(mem_pool_host, "storage_format_tag", None)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._open(page.numel() * page.element_size(), page.dtype, mem_pool_host.page_size, mem_pool_host.layer_num)

    def _open(self, page_bytes: int, dtype: torch.dtype, page_tokens: int, layers: int) -> None:
        with self._lock:
            if self._agent is not None:
                return
            name = str(dtype).removeprefix("torch.")
            # The host pool's page format tag (SGLang adds it to the served name) tells pools apart.
            layout = ("sglang-page", self.format_tag, name, page_tokens, layers, page_bytes,
                      self.config.is_page_first_layout)
            self.model = name_model(self.model_path, self.revision, layout)
            rank = f"tp{self.config.tp_rank}" + (f"pp{self.config.pp_rank}" if self.config.pp_size > 1 else "")
            self._agent = open_agent(self.settings, agent_id=f"sglang-{rank}", model=self.model, dtype=name,
                                     block_tokens=page_tokens, num_layers=max(layers, 1),
                                     layer_block_bytes=max(page_bytes // max(layers, 1), 1), namespace=self.namespace)
            self._root = self._agent.root
            self.page_bytes = page_bytes
            rate = self.settings.prefill_tokens_per_s
            self._recompute_s = page_tokens / rate if rate > 0 and self.settings.skip_slow_loads else 0.0

    def _digests(self, keys: List[str]) -> list[bytes]:
        return key_digests(self._root, [key.encode() for key in keys])

    def _addresses(self, keys: List[str]) -> list[BlockAddress]:
        return [BlockAddress(d) for d in self._digests(keys)]

    # -- lookups -------------------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many keys, from the first, to fetch: those kvcached holds in any tier (RAM, SSD,
        a peer), less SSD and peer pages slower to load than to recompute where the extra
        config gives the engine's ``prefill_tokens_per_s`` (a load plan; SGLang shows the
        backend none of its forward passes, so here the rate is given, never measured)."""
        if self._agent is None or not keys:
            return 0
        if self._recompute_s > 0:
            return min(self._agent.plan_loads(self._digests(keys), self._recompute_s).load, len(keys))
        return min(self._agent.lookup(self._digests(keys)).longest, len(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- pages ---------------------------------------------------------------------------------

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store each flat data page under its key. True when every page is in kvcached now
        (stored, already there, or declined by the daemon's admission policy)."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many pages, got {0 if values is None else len(values)}")
        if not self.writer:
            return True                          # an MLA page: the writing rank stores the shared copy
        pages = [v.contiguous() for v in values]
        if self._agent is None:
            first = pages[0]
            self._open(first.numel() * first.element_size(), first.dtype, 1, 1)
        result = self._agent.save(self._addresses(keys), pages)
        return not result.skipped

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Each page copied into its target (SGLang passes empty flat pages), None where
        kvcached does not hold it."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvcached's batch_get needs a target page for each key")
        if self._agent is None:
            return [None] * len(keys)
        result = self._agent.load(self._addresses(keys), list(target_locations))
        missing = set(result.missing)
        return [None if i in missing else target for i, target in enumerate(target_locations)]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # -- zero-copy pages (interface_v1) ---------------------------------------------------------

    def host_page_views(self, index: int) -> list[torch.Tensor] | None:
        """The host pool's page at token ``index`` as views of the pool's memory, in the flat
        page's byte order; None where the pool hands out its page as a copy (not a view)."""
        pool = self.mem_pool_host
        view = pool.get_data_page(index, flat=False)
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return None
        return contiguous_runs(view)

    def _indices(self, keys: List[str], host_indices: torch.Tensor) -> list[int]:
        page = self.mem_pool_host.page_size
        if len(host_indices) < len(keys) * page:
            raise ValueError(f"{len(keys)} pages need {len(keys) * page} host indices, got {len(host_indices)}")
        return [int(host_indices[i * page]) for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Store each page straight from the host pool's memory (no flat copy), per key whether
        it is in kvcached now."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)            # an MLA page: the writing rank stores the shared copy
        if self._agent is None:
            return [False] * len(keys)
        pages: list[Any] = []
        for index in self._indices(keys, host_indices):
            views = self.host_page_views(index)
            pages.append(views if views is not None else self.mem_pool_host.get_data_page(index, flat=True))
        skipped = set(self._agent.save(self._addresses(keys), pages).skipped)
        return [i not in skipped for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Load each page straight into the host pool's memory (no flat copy), per key whether
        it was found; SGLang uses the pages up to the first miss."""
        if not keys:
            return []
        if self._agent is None:
            return [False] * len(keys)
        pool = self.mem_pool_host
        targets: list[Any] = []
        copied: list[tuple[int, int, torch.Tensor]] = []       # pages the pool takes as flat copies
        for i, index in enumerate(self._indices(keys, host_indices)):
            views = self.host_page_views(index)
            if views is None:
                flat = pool.get_dummy_flat_data_page()
                copied.append((i, index, flat))
                targets.append(flat)
            else:
                targets.append(views)
        missing = set(self._agent.load(self._addresses(keys), targets).missing)
        for i, index, flat in copied:
            if i not in missing:
                pool.set_from_flat_data_page(index, flat)
        return [i not in missing for i in range(len(keys))]

    def clear(self) -> None:
        """Nothing: the daemon's cache is shared by every engine of the node; an operator drops
        blocks with its Admin API (Evict)."""

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
