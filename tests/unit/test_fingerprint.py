"""The model name engine plug-ins give the daemon: bound to what the KV depends on, not to a path."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvcached_agent.engines.fingerprint import (
    WeightDigests,
    folder_config,
    model_name,
    name_model,
    weights_fingerprint,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
          "_name_or_path": "/somewhere/tiny", "transformers_version": "5.19.0"}
LAYOUT = ("FullAttentionSpec", "FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64)")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights-one" * 1000)
    (model / "config.json").write_text("{}")
    return model


def name(path: str, digests: WeightDigests, config: dict[str, object] = CONFIG) -> str:
    return model_name(path, config, weights_fingerprint(path, None, digests), LAYOUT)


def test_a_relative_and_an_absolute_path_name_one_model(folder: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    digests = WeightDigests(tmp_path / "cache.json")
    absolute = name(str(folder), digests)
    monkeypatch.chdir(folder.parent)
    assert name("tiny", digests) == name("./tiny/", digests) == absolute
    assert absolute.startswith("tiny@") and len(absolute) == len("tiny@") + 32
    assert name(str(folder), digests, {**CONFIG, "_name_or_path": "/elsewhere"}) == absolute


def test_new_weights_at_the_old_path_are_another_model(folder: Path, tmp_path: Path) -> None:
    digests = WeightDigests(tmp_path / "cache.json")
    old = name(str(folder), digests)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"weights-two" * 1000)                    # same size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))    # the old mtime put back, same inode
    second = name(str(folder), digests)                           # the cache saw the old bytes: ctime differs
    assert second != old
    assert name(str(folder), WeightDigests(tmp_path / "other-cache.json")) == second
    replaced = folder / "new.tmp"                                 # a copy renamed over it: a new inode
    replaced.write_bytes(b"weights-three" * 1000)
    os.replace(replaced, weights)
    assert name(str(folder), digests) not in (old, second)


def test_other_config_or_kv_layout_is_another_model(folder: Path, tmp_path: Path) -> None:
    digests = WeightDigests(tmp_path / "cache.json")
    base = name(str(folder), digests)
    assert name(str(folder), digests, {**CONFIG, "num_hidden_layers": 3}) != base
    other_layout = model_name(str(folder), CONFIG, weights_fingerprint(str(folder), None, digests),
                              (LAYOUT[0], LAYOUT[1].replace("block_size=32", "block_size=64")))
    assert other_layout != base


def test_weights_are_hashed_once_then_known_by_their_stat(folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "weights.json"
    first = WeightDigests(cache)
    weights_fingerprint(str(folder), None, first)
    assert first.hashed == 1 and cache.exists()
    again = WeightDigests(cache)                                  # a restarted engine
    weights_fingerprint(str(folder), None, again)
    assert again.hashed == 0
    (folder / "model.safetensors").write_bytes(b"changed" * 10)
    weights_fingerprint(str(folder), None, again)
    assert again.hashed == 1


@pytest.mark.parametrize("content", [b"not json", b'{"version": 99, "files": {}}', b"[]"])
def test_a_damaged_cache_file_means_hashing_again(folder: Path, tmp_path: Path, content: bytes) -> None:
    cache = tmp_path / "weights.json"
    expected = weights_fingerprint(str(folder), None, WeightDigests(tmp_path / "clean.json"))
    cache.write_bytes(content)
    digests = WeightDigests(cache)
    assert weights_fingerprint(str(folder), None, digests) == expected and digests.hashed == 1


def test_an_unwritable_cache_is_no_error(folder: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    digests = WeightDigests(blocker / "weights.json")             # its parent is a file
    assert weights_fingerprint(str(folder), None, digests)


def test_a_hub_id_is_named_by_id_and_revision(tmp_path: Path) -> None:
    digests = WeightDigests(tmp_path / "cache.json")
    a = weights_fingerprint("org/model-that-is-no-folder", "abc123", digests)
    assert a != weights_fingerprint("org/model-that-is-no-folder", "def456", digests)
    assert digests.hashed == 0


def test_processes_starting_together_hash_the_weights_once(folder: Path, tmp_path: Path) -> None:
    """vLLM's scheduler and workers start together: the one that waited on the lock finds the
    digests the first wrote and reads no weights."""
    cache = tmp_path / "cache" / "weights.json"
    first, second = WeightDigests(cache), WeightDigests(cache)
    result: list[str] = []
    with first.exclusive():
        waiter = threading.Thread(target=lambda: result.append(weights_fingerprint(str(folder), None, second)))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not result                   # held back by the lock
        first.digest(folder / "model.safetensors")                # the first process hashes and saves
        first.save()
    waiter.join(10)
    assert result == [weights_fingerprint(str(folder), None, first)]
    assert first.hashed == 1 and second.hashed == 0


def test_name_model_reads_the_folders_config_when_none_is_given(folder: Path, tmp_path: Path) -> None:
    digests = WeightDigests(tmp_path / "cache.json")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    assert folder_config(str(folder)) == CONFIG
    assert name_model(str(folder), None, LAYOUT, digests=digests) == name(str(folder), digests)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 512}))
    assert name_model(str(folder), None, LAYOUT, digests=digests) != name(str(folder), digests)
    assert folder_config("org/hub-model") == {}
    (folder / "config.json").write_text("[1, 2]")                # not a mapping: named by its weights
    assert folder_config(str(folder)) == {}
