"""A real vLLM engine's blocks stored coded and sealed on SSD (docs/codecs.md): a hit served from
those files after a daemon restart gives output bit-identical to vLLM's own prefix cache, as a
hit from plain files does (test_vllm_e2e): an exact codec changes nothing an engine can see."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from kvcached.tiers.ssd_format import HEADER_BYTES, BlockHeader
from tests.e2e.conftest import EngineRun
from tests.e2e.test_vllm_e2e import BLOCK, MAX_TOKENS, kvcached, loadable, prompt, same_output
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.timeout(900)


def test_a_hit_from_coded_sealed_ssd_files_is_vllms_own_output(make_daemon, tiny_model: Path, engine: EngineRun,  # type: ignore[no-untyped-def]
                                                               tmp_path: Path) -> None:
    d = make_daemon('kv.write_policy="write_through"', 'kv.ssd_codec="planes-zstd"', "tenants.seal_ssd=true")
    p = prompt(41, 900)
    stored, restarted, loaded = (tmp_path / name for name in ("stored", "restarted", "loaded"))
    rounds = [{"prompts": [p], "max_tokens": MAX_TOKENS},
              {"prompts": [p], "max_tokens": MAX_TOKENS, "signal_after": str(stored)},
              {"prompts": [p], "max_tokens": MAX_TOKENS, "wait_for": str(restarted), "reset_prefix_cache": True,
               "signal_after": str(loaded)}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(engine, tiny_model, rounds, kvcached(d, retry_s=0.2, prefill_tokens_per_s=1e10))
        wait_for(lambda: stored.exists() or run.done(), timeout=600, text="the engine's first rounds")
        assert d.stop() == 0
        headers = [BlockHeader.decode(f.read_bytes()[:HEADER_BYTES]) for f in (tmp_path / "ssd" / "blocks").rglob("*.kvb")]
        assert len(headers) >= loadable(len(p)) // BLOCK
        assert all(h.nonce for h in headers), "every file sealed"
        coded = sum(h.codec != 0 for h in headers)
        assert coded == len(headers), f"{coded} of {len(headers)} of the engine's blocks coded"
        d.start()
        restarted.touch()
        wait_for(lambda: loaded.exists() or run.done(), timeout=300, text="the hit from SSD")
        with d.client() as c:
            s = c.stats()
        result = run.result()
    local_hit, hit = (r["outputs"][0] for r in result["rounds"][1:])
    assert hit["num_cached_tokens"] == loadable(len(p))
    assert s.promotions >= loadable(len(p)) // BLOCK and s.ssd_corrupt == 0, "the blocks came from the coded files"
    assert same_output(hit, local_hit), (hit, local_hit)
    assert "Traceback" not in d.log()
