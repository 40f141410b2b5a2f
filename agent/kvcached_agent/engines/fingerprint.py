"""What a model's KV depends on, as one name: stale KV must never be loaded into a changed model.

An engine plug-in names its model to the daemon, and that name is part of every block address
(with the dtype, the block size, the namespace and the parallel shard). The path an engine was
given is no such name: a relative and an absolute path to one folder would be two caches, and
new weights placed at an old path would be served the old weights' KV with no error. So the name
is the folder's last component (for people reading `kvcached stat`) then ``@`` and a BLAKE3
fingerprint of:

- the model's configuration (the engine's parsed config, canonical JSON: architecture, sizes,
  rope and attention settings, quantization);
- its weights: for a local folder, the BLAKE3 of every weight file's bytes; for a hub id, the id
  and revision (a pinned revision is a commit: immutable);
- the engine's KV layout (how one page of KV is laid out: the engine's spec of it).

Hashing weights reads them once: about a second per few GB. Digests are kept in a small cache
file keyed by each file's path, size, mtime, ctime and inode, so a restart costs one ``stat`` per
file and any change to a file (a copy, a rename over it, an edit, even one that puts the old
mtime back: the ctime cannot be put back) is hashed again. Processes that start together (vLLM's
scheduler and its workers) take turns on a lock file beside the cache, so the weights are read
once, by the first, and the others find its digests.

:func:`name_model` is what each plug-in calls: vLLM's connector with the engine's parsed config,
vLLM's secondary tier and SGLang's backend (which are given the model's path, not its config) with
the folder's ``config.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import blake3

__all__ = ["WEIGHT_SUFFIXES", "WeightDigests", "folder_config", "model_name", "name_model",
           "weights_fingerprint"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FINGERPRINT_HEX = 32          # 128 bits of BLAKE3 in the name: collisions are not a concern
_CACHE_VERSION = 1


def default_cache_path() -> Path:
    """``$KVCACHED_FINGERPRINT_CACHE``, else ``$XDG_CACHE_HOME/kvcached/weights.json`` (~/.cache)."""
    explicit = os.environ.get("KVCACHED_FINGERPRINT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcached" / "weights.json"


class WeightDigests:
    """BLAKE3 digests of weight files, remembered by (real path, size, mtime, ctime, inode).

    The cache is an optimisation only: an unreadable or unwritable cache file means hashing again,
    never an error, and a file whose stat changed is always hashed again."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_cache_path()
        self._entries: dict[str, dict[str, Any]] = self._read()
        self.hashed = 0                           # files read in full by this instance (tests look)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def digest(self, file: Path) -> str:
        real = os.path.realpath(file)
        st = os.stat(real)
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}
        known = self._entries.get(real)
        if known is not None and all(known.get(k) == v for k, v in stamp.items()):
            return str(known["blake3"])
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(real)
        self.hashed += 1
        self._entries[real] = {**stamp, "blake3": h.hexdigest()}
        return h.hexdigest()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the cache's lock file (blocking), then read the cache again: whatever another
        process hashed while this one waited is known. No lock (an unwritable place) is no error:
        the weights are then hashed by each process. Not re-entrant: a second hold in one
        process waits for ever."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._entries = {**self._entries, **self._read()}
            yield
        finally:
            os.close(fd)                                  # closing releases the lock

    def save(self) -> None:
        """Write the cache atomically (a temporary file renamed over it); failures are ignored."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".weights-")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _CACHE_VERSION, "files": self._entries}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder, in a stable order (subfolders included)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def weights_fingerprint(model: str, revision: str | None, digests: WeightDigests | None = None) -> str:
    """What identifies the weights of ``model``: for a local folder, each weight file's name and
    BLAKE3; otherwise (a hub id) the id and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return json.dumps({"hub": model, "revision": revision})
    digests = digests if digests is not None else WeightDigests()
    files = weight_files(folder)
    with digests.exclusive():
        hashed = digests.hashed
        listing = [(str(p.relative_to(folder)), digests.digest(p)) for p in files]
        if digests.hashed > hashed:
            digests.save()
    return json.dumps({"files": listing})


def folder_config(model: str) -> dict[str, Any]:
    """The ``config.json`` of a local model folder; empty for a hub id (its id and revision name
    its config) or a folder without one (its weights still name it)."""
    try:
        data = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _canonical(config: Mapping[str, Any]) -> str:
    """Canonical JSON of a configuration, leaving out what names a place rather than the model."""
    dropped = {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"}
    return json.dumps({k: v for k, v in config.items() if k not in dropped}, sort_keys=True, default=str)


def model_name(model: str, config: Mapping[str, Any], weights: str, kv_layout: Iterable[object]) -> str:
    """``<folder name>@<fingerprint>``: the name a plug-in gives the daemon for ``model``."""
    h = blake3.blake3()
    for part in (_canonical(config), weights, json.dumps([str(x) for x in kv_layout])):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    label = os.path.basename(model.rstrip("/")) or model
    return f"{label[:200]}@{h.hexdigest()[:FINGERPRINT_HEX]}"


def name_model(model: str, revision: str | None, kv_layout: Iterable[object],
               config: Mapping[str, Any] | None = None, digests: WeightDigests | None = None) -> str:
    """The name of ``model`` (a folder or a hub id) for a plug-in: :func:`model_name` over its
    configuration (``config``, else the folder's ``config.json``), its weights and ``kv_layout``."""
    config = config if config is not None else folder_config(model)
    return model_name(model, config, weights_fingerprint(model, revision, digests), kv_layout)
