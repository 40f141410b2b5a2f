"""A vLLM engine without a model: vLLM's own Scheduler and connector plumbing, with a stand-in
forward pass that writes each token's KV as a function of its prefix.

Everything around the forward is vLLM 0.33's: the Scheduler (with its prefix cache and the
connector's scheduler role, built by vLLM from ``--kv-transfer-config``), the worker connector
(built by vLLM's KVConnectorFactory), the connector calls around a step
(``KVConnectorModelRunnerMixin._get_kv_connector_output``: bind metadata, start_load_kv before
or after the forward as the scheduler asks, wait_for_save, get_finished, load errors) and
``Scheduler.update_from_output``. The KV cache is CPU tensors laid out as vLLM's (pages along
dimension 0 of each layer's tensor).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE, PAGE_TOKENS = 4, 2, 32, 16
DTYPE = torch.bfloat16


def tiny_llama(folder: Path, layers: int = LAYERS, kv_heads: int = KV_HEADS, head_size: int = HEAD_SIZE) -> Path:
    """A hand-written config.json of a Llama (small by default): all vLLM's ModelConfig reads, offline."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": kv_heads * head_size * 2,
        "intermediate_size": 512, "num_attention_heads": kv_heads * 2, "num_key_value_heads": kv_heads,
        "head_dim": head_size, "num_hidden_layers": layers, "vocab_size": 32000, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    return folder


def token_kv(tokens: list[int], position: int, layer: int) -> torch.Tensor:
    """What the stand-in forward writes for one token of one layer: K and V bytes derived from
    the whole prefix up to that token (as real KV depends on it)."""
    seed = hashlib.blake2b(repr((layer, tokens[:position + 1])).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(seed, "little") & ((1 << 63) - 1))
    return torch.randn((2, KV_HEADS, HEAD_SIZE), generator=g).to(DTYPE)


class MiniEngine:
    """vLLM's scheduler and worker connector around a stand-in forward (see the module docstring)."""

    def __init__(self, model_dir: Path, extra_config: dict[str, Any], *, num_pages: int = 256,
                 max_tokens_per_step: int = 2048, engine_id: str = "test", layers: int = LAYERS,
                 kv_heads: int = KV_HEADS, head_size: int = HEAD_SIZE, mla: bool = False) -> None:
        """The model at ``model_dir`` must have the given geometry (tiny_llama writes it); the
        stand-in forward and its checks need the default one. ``mla``: the KV cache is MLA's, one
        latent vector per token in one tensor per layer (no separate K and V), as vLLM lays out
        DeepSeek's."""
        transfer = KVTransferConfig(kv_connector="KvcachedConnector",
                                    kv_connector_module_path="kvcached_agent.engines.vllm_connector",
                                    kv_role="kv_both", engine_id=engine_id, kv_connector_extra_config=extra_config)
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=8192),
            cache_config=CacheConfig(block_size=PAGE_TOKENS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=max_tokens_per_step, max_num_seqs=16,
                                             max_model_len=8192, is_encoder_decoder=False),
            kv_transfer_config=transfer)
        self.config.cache_config.num_gpu_blocks = num_pages      # what the engine core sets after profiling
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.mla = mla
        spec: FullAttentionSpec = (
            MLAAttentionSpec(block_size=PAGE_TOKENS, num_kv_heads=1, head_size=2 * kv_heads * head_size, dtype=DTYPE)
            if mla else FullAttentionSpec(block_size=PAGE_TOKENS, num_kv_heads=kv_heads, head_size=head_size,
                                          dtype=DTYPE))
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_pages,
            kv_cache_tensors=[KVCacheTensor(size=page * num_pages, layers=[name], layer_stride=0, block_stride=page)
                              for name in self.layers],
            kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)])
        # vLLM's layout: per layer, pages along dimension 0; a page holds K then V of its tokens
        # (MLA: the latent vector of each token).
        shape = (num_pages, PAGE_TOKENS, 2 * kv_heads * head_size) if mla else (num_pages, 2, PAGE_TOKENS, kv_heads,
                                                                                 head_size)
        self.caches = {name: torch.zeros(shape, dtype=DTYPE) for name in self.layers}
        self.scheduler = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                                   block_size=PAGE_TOKENS)
        self.connector = self.scheduler.connector
        # Requests are built as vLLM's engine core builds them: with the block hasher, without
        # which vLLM's own prefix cache silently finds nothing (and a test of a local hit would
        # pass without ever taking that path).
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(PAGE_TOKENS, hash_fn)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        self.requests: dict[str, Request] = {}
        self.loaded_checked: dict[str, int] = {}    # request -> tokens whose KV was verified after a load

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None

    # -- requests ------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, list(prompt), params, None, block_hasher=self.block_hasher)
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def pages_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_blocks(req_id).get_block_ids()[0])

    # -- steps ---------------------------------------------------------------------------------

    def step(self) -> Any:
        """One engine step: schedule, the worker's connector calls around a stand-in forward, and
        the scheduler's update from the output."""
        out = self.scheduler.schedule()
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        req_ids, sampled = [], []
        with set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
            for req_id, count in out.num_scheduled_tokens.items():
                request = self.requests[req_id]
                start = request.num_computed_tokens - count      # advanced by schedule()
                self._check_loaded(req_id, start)
                self._forward(req_id, start, count)
                req_ids.append(req_id)
                # A token is sampled once the step reaches the end of what is known.
                done = start + count >= request.num_tokens
                sampled.append([1000 + len(request.output_token_ids)] if done else [])
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_output)
        self.scheduler.update_from_output(out, runner_output)
        if not req_ids:
            time.sleep(0.005)          # only transfers in flight: an idle engine polls, it does not spin
        return out

    def run(self, timeout: float = 60.0) -> None:
        """Step until every request is finished."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"requests did not finish within {timeout} s")
            self.step()

    def _slot(self, pages: list[int], position: int) -> tuple[int, int]:
        return pages[position // PAGE_TOKENS], position % PAGE_TOKENS

    def _token(self, name: str, page: int, offset: int) -> torch.Tensor:
        """One token's KV in a layer's cache (a view)."""
        return self.caches[name][page, offset] if self.mla else self.caches[name][page, :, offset]

    def _forward(self, req_id: str, start: int, count: int) -> None:
        request = self.requests[req_id]
        tokens = list(request.all_token_ids)
        pages = self.pages_of(req_id)
        for position in range(start, start + count):
            page, offset = self._slot(pages, position)
            for layer, name in enumerate(self.layers):
                self._token(name, page, offset).copy_(token_kv(tokens, position, layer).reshape(self._token(
                    name, page, offset).shape))

    def _check_loaded(self, req_id: str, computed: int) -> None:
        """Every token before ``computed`` (vLLM's prefix cache or a kvcached load) holds exactly
        the KV the forward wrote for it: loads are bit-exact or vLLM recomputes."""
        checked = self.loaded_checked.get(req_id, 0)
        if computed <= checked:
            return
        self.loaded_checked[req_id] = computed
        tokens = list(self.requests[req_id].all_token_ids)
        pages = self.pages_of(req_id)
        for position in range(checked, computed):
            page, offset = self._slot(pages, position)
            for layer, name in enumerate(self.layers):
                got = self._token(name, page, offset)
                want = token_kv(tokens, position, layer).reshape(got.shape)
                assert torch.equal(got, want), f"{req_id}: KV of token {position}, layer {layer} differs"
