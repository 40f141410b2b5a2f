"""Engine plug-in benchmark: what the vLLM connector and the SGLang backend add on top of the
agent, each figure next to a baseline measured in the same run.

    .venv-engines/bin/python bench/bench_engines.py [--json PATH] [--quick]

Runs in the engines environment (``make bench`` builds it and runs this there). A real
``kvcached serve`` subprocess (bench_core.start_kvcached, state in a temp dir, 1 GiB RAM arena,
SSD off). The vLLM side is vLLM 0.33's own Scheduler and worker connector
(tests/engines/vllm_engine.MiniEngine) for a model of 32 layers, 8 KV heads of 128, bfloat16,
16-token pages: a 2,048-token prompt is 128 blocks of 2 MiB (256 MiB), stored once at the start
by a real request through the connector.

1. Scheduler-side lookup of a 2,048-token prompt (all of it held in RAM), per request:
   - vLLM: ``get_num_new_matched_tokens`` of a new Request each time (its blocks hashed, one
     lookup, the hit planned), then ``request_finished``;
   - SGLang: ``batch_exists`` of the prompt's 128 page keys (key -> address, one lookup);
   against the agent's bare lookup of the same prompt: ``Agent.hash_tokens`` then
   ``Agent.lookup`` on an agent of its own. Interleaved rounds, p50 per side per round; the ratio
   is the median over rounds of the within-round ratio. Target <= 1.5x.
2. Loading that prompt's 128 blocks from RAM into vLLM's paged cache through the worker
   connector (``start_load_kv`` of the metadata the scheduler built: 4,096 pages of 64 KiB, each
   one ``memmove`` from the arena) against a plain torch copy of the same 256 MiB (one ``copy_``
   from a contiguous tensor into a preallocated one), as GB/s; loaded bytes checked once. Target
   >= 0.5x. A third row times the same 4,096 ``memmove`` calls alone, from plain memory and with
   their addresses worked out in advance: the floor of page-by-page copying, so the gap between
   it and the plug-in is what the connector, the agent and the daemon's round trip add.

--quick: fewer rounds and calls (a smoke test). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from bench_core import Row, percentile, progress, start_kvcached  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE = 32, 8, 128
PROMPT_TOKENS = 2048


def timed(call: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


def paired(sides: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Per side, the p50 of ``calls`` calls in each round; sides interleaved, order alternating."""
    p50s: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            p50s[name].append(percentile(timed(sides[name], calls), 50))
    return p50s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, calls, loads = (4, 50, 3) if args.quick else (10, 200, 7)
    torch.set_num_threads(1)            # the second core is the daemon's (as bench_agent.py)

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvcached_agent import Agent
    from kvcached_agent.engines.vllm_scheduler import LoadOp
    from tests.engines.vllm_engine import PAGE_TOKENS, MiniEngine, tiny_llama

    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcached-bench-engines-")))
        progress("starting kvcached")
        start_kvcached(stack, tmp, 1.0, ["kv.ssd_gib=0", 'kv.write_policy="write_back"', "kv.max_block_mib=4"])
        socket = str(tmp / "agent.sock")
        model = tiny_llama(tmp / "model", LAYERS, KV_HEADS, HEAD_SIZE)
        progress("vLLM: storing a 2,048-token prompt through the connector")
        e = MiniEngine(model, {"socket": socket}, num_pages=PROMPT_TOKENS // PAGE_TOKENS + 8, layers=LAYERS,
                       kv_heads=KV_HEADS, head_size=HEAD_SIZE)
        stack.callback(e.close)
        prompt = [(i * 7919) % 30000 + 1 for i in range(PROMPT_TOKENS + 1)]
        for cache in e.caches.values():
            cache.normal_()
        request = e.add("writer", prompt, max_tokens=1)
        out = e.scheduler.schedule()                 # one step, no stand-in forward: the pages keep random KV
        pages = list(out.scheduled_new_reqs[0].block_ids[0])
        e.worker.bind_connector_metadata(out.kv_connector_metadata)
        e.worker.wait_for_save()
        e.worker.clear_connector_metadata()
        blocks = PROMPT_TOKENS // PAGE_TOKENS
        assert e.worker.worker_side.saved_blocks == blocks, e.worker.worker_side.saved_blocks
        e.abort("writer")

        # -- figure 1: scheduler-side lookups --------------------------------------------------
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        connector = e.connector
        page_bytes = e.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        bare = Agent.connect(socket, agent_id="bare", model=str(model), dtype="bfloat16", block_tokens=PAGE_TOKENS,
                             num_layers=LAYERS, layer_block_bytes=page_bytes, namespace="tp0of1")
        stack.callback(bare.close)
        assert bare.lookup(bare.hash_tokens(prompt)).longest == blocks
        params = SamplingParams(max_tokens=1)
        # New requests, built off the clock (the engine builds them whatever the connector).
        fresh = iter([Request(f"q{i}", prompt, params, None) for i in range(2 * rounds * calls + 100)])

        def vllm_lookup() -> None:
            r = next(fresh)
            assert connector.get_num_new_matched_tokens(r, 0) == (blocks * PAGE_TOKENS, False)
            connector.request_finished(r, [])

        def bare_lookup() -> None:
            assert bare.lookup(bare.hash_tokens(prompt)).longest == blocks

        sg = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="bench",
            extra_config={"backend_name": "kvcached", "module_path": "kvcached_agent.engines.sglang_storage",
                          "class_name": "KvcachedStorage", "socket": socket}), None)
        stack.callback(sg.close)
        keys = [f"{i:064x}" for i in range(blocks)]
        small = [torch.zeros(1024, dtype=torch.bfloat16) for _ in keys]
        assert sg.batch_set(keys, small)
        sg_addresses = sg._digests(keys)

        def sglang_exists() -> None:
            assert sg.batch_exists(keys) == blocks

        def sglang_bare() -> None:
            assert bare.lookup(sg_addresses).longest == blocks

        progress("figure 1: lookups")
        for call in (vllm_lookup, bare_lookup, sglang_exists, sglang_bare):
            timed(call, 20)                              # warm-up
        p = paired({"vllm": vllm_lookup, "bare": bare_lookup}, rounds, calls)
        q = paired({"sglang": sglang_exists, "bare": sglang_bare}, rounds, calls)
        for name, side, base, base_name in (("vLLM get_num_new_matched_tokens", p["vllm"], p["bare"],
                                             "Agent.hash_tokens + lookup"),
                                            ("SGLang batch_exists (128 keys)", q["sglang"], q["bare"],
                                             "Agent.lookup of the same addresses")):
            ratio = statistics.median(a / b for a, b in zip(side, base))
            rows.append(Row(1, name, "us", statistics.median(side) * 1e6, base_name, statistics.median(base) * 1e6,
                            False, "<= 1.5x", ratio <= 1.5, paired_ratio=ratio))

        # -- figure 2: loading the prompt from RAM into vLLM's pages ---------------------------
        progress("figure 2: loads")
        worker = e.worker
        nbytes = blocks * LAYERS * page_bytes
        want = [cache[pages[:blocks]].clone() for cache in e.caches.values()]
        targets = pages[::-1]                    # each block into another page than it was saved from
        for cache in e.caches.values():
            cache.zero_()
        meta = type(out.kv_connector_metadata)(loads=[LoadOp("reader", request.all_token_ids, 0, blocks, targets)])
        src = torch.randn(nbytes // 2, dtype=torch.bfloat16)
        dst = torch.empty_like(src)

        def plugin_load() -> None:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
            assert not worker.get_block_ids_with_load_errors()

        def torch_copy() -> None:
            dst.copy_(src)

        views, flat = worker.worker_side.views, src.view(torch.uint8)
        moves = [(view.data_ptr() + page * view.stride(0), flat.data_ptr() + (k * len(views) + v) * page_bytes)
                 for k, page in enumerate(targets) for v, view in enumerate(views)]

        def page_loop() -> None:
            """The plug-in's copies alone: the same 4,096 page memmoves, from plain memory."""
            for dst_address, src_address in moves:
                ctypes.memmove(dst_address, src_address, page_bytes)

        plugin_load()
        assert all(torch.equal(cache[targets], w) for cache, w in zip(e.caches.values(), want)), "loaded bytes differ"
        p = paired({"plugin": plugin_load, "torch": torch_copy, "pages": page_loop}, rounds, loads)
        for side, case, target in (("plugin", "vLLM start_load_kv, 128 blocks from RAM", ">= 0.5x"),
                                   ("pages", "its 4,096 page memmoves alone", "")):
            ratio = statistics.median(b / a for a, b in zip(p[side], p["torch"]))
            rows.append(Row(2, case, "GB/s", nbytes / statistics.median(p[side]) / 1e9, "torch copy_ of the same bytes",
                            nbytes / statistics.median(p["torch"]) / 1e9, True, target,
                            ratio >= 0.5 if target else None, paired_ratio=ratio))

    print(f"\nkvcached engine plug-ins ({'quick' if args.quick else 'full'}), {PROMPT_TOKENS}-token prompt, "
          f"{LAYERS} layers x {KV_HEADS} KV heads x {HEAD_SIZE}, bfloat16, {PAGE_TOKENS}-token blocks")
    print(f"{'fig':>3}  {'case':<42} {'kvcached':>12} {'baseline':>12}  {'ratio':>6}  {'target':<8} verdict  baseline")
    for r in rows:
        print(f"{r.figure:>3}  {r.case:<42} {r.kvcached:>9.1f} {r.unit:<2} {r.baseline:>9.1f} {r.unit:<2}  "
              f"{r.ratio:>5.2f}x  {r.target:<8} {r.verdict:<7}  {r.baseline_name}")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
