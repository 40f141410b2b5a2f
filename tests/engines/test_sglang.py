"""The SGLang HiCache storage backend, built by SGLang's own StorageBackendFactory (the
``dynamic`` backend of ``--hicache-storage-backend``), against real daemons."""

from __future__ import annotations

import dataclasses
import hashlib
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.engines.test_vllm import evict_ram
from tests.integration.conftest import DaemonProcess

LAYERS, PAGE, HEADS, HEAD_DIM = 4, 16, 2, 32
PAGE_ELEMENTS = 2 * LAYERS * PAGE * HEADS * HEAD_DIM          # SGLang's flat data page: K and V of every layer


def storage_config(d: DaemonProcess, **extra: object) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny-llama",
        extra_config={"backend_name": "kvcached", "module_path": "kvcached_agent.engines.sglang_storage",
                      "class_name": "KvcachedStorage", "socket": str(d.state / "agent.sock"),
                      "retry_s": 0.2, "retry_max_s": 0.5, **extra})


def backend(d: DaemonProcess, **extra: object) -> HiCacheStorage:
    return StorageBackendFactory.create_backend("dynamic", storage_config(d, **extra), None)


def keys(n: int, salt: str = "") -> list[str]:
    """SGLang-style page keys: hex digests chained over the pages before."""
    out, prev = [], salt
    for i in range(n):
        prev = hashlib.sha256(f"{prev}|{i}".encode()).hexdigest()
        out.append(prev)
    return out


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_ELEMENTS, generator=g).to(torch.bfloat16) for _ in range(n)]


def empty_pages(n: int) -> list[torch.Tensor]:
    return [torch.zeros(PAGE_ELEMENTS, dtype=torch.bfloat16) for _ in range(n)]


def test_batch_set_then_batch_get_round_trips_bit_exact(daemon: DaemonProcess) -> None:
    b = backend(daemon)
    try:
        assert type(b).__name__ == "KvcachedStorage"
        k, data = keys(8), pages(8)
        assert b.batch_set(k, data)
        assert b.batch_set(k, data)                               # again: already there, still a success
        got = b.batch_get(k, empty_pages(8))
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, data))
        one = b.get(k[3], torch.zeros(PAGE_ELEMENTS, dtype=torch.bfloat16))
        assert one is not None and torch.equal(one, data[3])
        assert b.batch_get(keys(2, "other"), empty_pages(2)) == [None, None]
    finally:
        b.close()


def test_batch_exists_returns_the_longest_cached_prefix(daemon: DaemonProcess) -> None:
    b = backend(daemon)
    try:
        k = keys(6)
        data = pages(6)
        assert b.batch_set(k[:2] + k[3:], data[:2] + data[3:])  # page 2 missing
        assert b.batch_exists(k) == 2
        assert b.exists(k[4]) and not b.exists(k[2])
        assert b.batch_set([k[2]], [data[2]])
        assert b.batch_exists(k) == 6
        assert b.batch_exists(k + keys(1, "x")) == 6
        assert b.batch_exists([]) == 0
    finally:
        b.close()


def test_pages_on_ssd_only_are_read_back(daemon: DaemonProcess) -> None:
    b = backend(daemon)
    try:
        k, data = keys(5), pages(5, seed=1)
        assert b.batch_set(k, data)
        evict_ram(daemon, b.model)
        assert b.batch_exists(k) == 5
        got = b.batch_get(k, empty_pages(5))
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, data))
    finally:
        b.close()


def test_pages_slower_to_fetch_than_to_recompute_are_not_fetched(daemon: DaemonProcess) -> None:
    """Loads that pay, with ``prefill_tokens_per_s`` given: once the daemon has measured its SSD,
    a server that recomputes ten billion tokens a second is told to fetch none of the pages on
    SSD, one that recomputes one a second all of them."""
    slow, fast = backend(daemon, prefill_tokens_per_s=1), backend(daemon, prefill_tokens_per_s=1e10)
    try:
        k, data = keys(5, "pay"), pages(5, seed=2)
        assert slow.batch_set(k, data) and fast.batch_set(k, data)
        evict_ram(daemon, slow.model)
        assert slow.batch_exists(k) == 5
        got = slow.batch_get(k, empty_pages(5))                    # the daemon's SSD reads: measured
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, data))
        evict_ram(daemon, slow.model)
        assert fast.batch_exists(k) == 0
        assert slow.batch_exists(k) == 5
        with daemon.client() as c:
            assert c.stats().loads_skipped_ssd == 5
    finally:
        slow.close()
        fast.close()


def test_ranks_do_not_read_each_others_pages(daemon: DaemonProcess) -> None:
    configs = [storage_config(daemon) for _ in range(2)]
    for rank, c in enumerate(configs):
        c.tp_rank, c.tp_size = rank, 2
    r0, r1 = (StorageBackendFactory.create_backend("dynamic", c, None) for c in configs)
    try:
        k = keys(3)
        assert r0.batch_set(k, pages(3))
        assert r0.batch_exists(k) == 3 and r1.batch_exists(k) == 0
    finally:
        r0.close()
        r1.close()


def test_a_down_daemon_is_an_empty_cache_and_the_backend_reconnects(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    b = backend(d)
    try:
        k, data = keys(4), pages(4)
        assert b.batch_set(k, data)
        d.stop(signal.SIGKILL)
        assert b.batch_exists(k) == 0                             # nothing raises: a miss
        assert b.batch_get(k, empty_pages(4)) == [None] * 4
        assert not b.batch_set(keys(2, "later"), pages(2))
        d.start()
        time.sleep(0.6)
        assert b.batch_set(k, data)
        got = b.batch_get(k, empty_pages(4))
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, data))
    finally:
        b.close()


def test_bad_backend_settings_fail_when_sglang_builds_the_backend(daemon: DaemonProcess) -> None:
    with pytest.raises(ValueError, match="unknown kvcached setting 'sokcet'"):
        backend(daemon, sokcet="/x")
    with pytest.raises(ValueError, match="a number > 0"):
        backend(daemon, timeout_s=0)
    with pytest.raises(ValueError, match="block_tokens does not apply"):
        backend(daemon, block_tokens=32)


def host_pool(layout: str, seed: int = 0) -> MHATokenToKVPoolHost:
    """SGLang's own host pool (its MHA one, on the CPU) over its own device pool, holding random
    KV: what a HiCache server hands its storage backend."""
    device = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=256, start_layer=0,
                                end_layer=LAYERS)
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(torch.bfloat16))
    return host


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_zero_copy_pages_go_straight_between_the_host_pool_and_the_daemon(daemon: DaemonProcess, layout: str) -> None:
    """interface_v1 (SGLang's zero-copy batch_set_v1/batch_get_v1): pages are copied between the
    host pool's own memory and the daemon's arena, no flat copy in between, bit-exact in each of
    the pool's layouts, and a page stored this way is the same bytes as SGLang's flat page (a
    server on the flat path reads it)."""
    host = host_pool(layout)
    b = backend(daemon, interface_v1=1)
    try:
        b.register_mem_pool_host(host)
        k = keys(4, layout)
        indices = torch.arange(2 * PAGE, 6 * PAGE)                 # pages 2 to 5 of the pool
        views = b.host_page_views(2 * PAGE)
        assert views and all(v.untyped_storage().data_ptr() == host.kv_buffer.untyped_storage().data_ptr()
                             for v in views), "the page is taken as views of the pool's memory"
        with pytest.raises(ValueError, match="4 pages need 64 host indices, got 63"):
            b.batch_set_v1(k, indices[:-1])
        assert b.batch_set_v1(k, indices) == [True] * 4
        flat = b.batch_get(k, empty_pages(4))
        assert all(f is not None and torch.equal(f, host.get_data_page(i * PAGE, flat=True))
                   for f, i in zip(flat, range(2, 6))), "the flat path reads the same bytes"
        stored = [host.get_data_page(i * PAGE, flat=True).clone() for i in range(2, 6)]
        host.kv_buffer.zero_()
        assert b.batch_get_v1(k + keys(1, "missing"), torch.arange(2 * PAGE, 7 * PAGE)) == [True] * 4 + [False]
        assert all(torch.equal(host.get_data_page(i * PAGE, flat=True), page) for i, page in zip(range(2, 6), stored))
        assert not host.get_data_page(1 * PAGE).any() and not host.get_data_page(6 * PAGE).any()
    finally:
        b.close()


def test_mismatched_pages_are_refused_and_nothing_is_stored(daemon: DaemonProcess) -> None:
    b = backend(daemon)
    try:
        k, data = keys(3), pages(3)
        with pytest.raises(ValueError, match="3 keys need as many pages, got 2"):
            b.batch_set(k, data[:2])
        assert b.batch_exists(k) == 0
        assert b.batch_set(k, data)
        with pytest.raises(ValueError, match="a target page for each key"):
            b.batch_get(k, empty_pages(2))
        with pytest.raises(ValueError, match="bytes but its tensor holds"):
            b.batch_get(k[:1], [torch.zeros(8, dtype=torch.bfloat16)])
        got = b.batch_get(k, empty_pages(3))                      # all still there, unchanged
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, data))
    finally:
        b.close()


def _model_folder(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_pages_are_named_by_the_model_weights_not_by_its_path(daemon: DaemonProcess, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend built outside a server takes SGLang's model name for the path: another path to
    the same folder shares the pages; new weights placed at the old path are another model."""
    monkeypatch.setenv("KVCACHED_FINGERPRINT_CACHE", str(tmp_path / "weights.json"))
    folder = _model_folder(tmp_path / "models" / "tiny", b"weights-one" * 100)
    monkeypatch.chdir(tmp_path)

    def at(path: str) -> HiCacheStorage:
        return StorageBackendFactory.create_backend("dynamic", dataclasses.replace(storage_config(daemon),
                                                                                   model_name=path), None)

    k = keys(4, "fingerprint")
    first, relative = at(str(folder)), at("models/tiny")
    try:
        assert first.batch_set(k, pages(4))
        assert relative.batch_set(k[:1], pages(1))                # opens it (no host pool registered here)
        assert first.model.startswith("tiny@") and relative.model == first.model
        assert relative.batch_exists(k) == 4
    finally:
        first.close()
        relative.close()
    _model_folder(folder, b"weights-two" * 100)                   # same path, same size, new weights
    swapped = at(str(folder))
    try:
        assert swapped.batch_set(keys(1, "other"), pages(1))
        assert swapped.model != first.model and swapped.batch_exists(k) == 0
        assert swapped.batch_get(k, empty_pages(4)) == [None] * 4
    finally:
        swapped.close()


def test_a_server_names_its_model_by_its_model_path_and_revision(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a server the published --model-path and --revision name the model, whatever served
    name SGLang passes the backend (it may carry a pool tag)."""
    import sglang.srt.runtime_context as runtime

    from kvcached_agent.engines.sglang_storage import served_model

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="served-name-tag")
    assert served_model(config) == ("served-name-tag", None)      # no server args published here
    published = SimpleNamespace(model_path=str(tmp_path), revision="abc123")
    monkeypatch.setattr(runtime, "get_server_args", lambda: published)
    assert served_model(config) == (str(tmp_path), "abc123")
