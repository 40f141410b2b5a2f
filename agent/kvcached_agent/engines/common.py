"""What both engine plug-ins share: their settings, the agent they open, and per-request hashing.

Settings come from the engine's own plug-in configuration (vLLM's ``kv_connector_extra_config``,
SGLang's ``--hicache-storage-backend-extra-config``), so turning kvcached on is one flag; an
unknown key or a wrong value is an error at engine start, never a silent default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import blake3

from kvcached_agent.address import chain_digests

__all__ = ["DEFAULT_SOCKET", "PluginSettings", "TokenChain", "key_digests", "open_agent"]

# The packaged systemd unit's agent socket; KVCACHED_AGENT_SOCKET overrides it for every engine.
DEFAULT_SOCKET = "/run/kvcached/agent.sock"


@dataclass(frozen=True)
class PluginSettings:
    """The keys a plug-in accepts from its engine's configuration."""

    socket: str = ""              # the daemon's agent socket ("" = $KVCACHED_AGENT_SOCKET or DEFAULT_SOCKET)
    namespace: str = ""           # separates caches that share a daemon, model and dtype (part of every address)
    block_tokens: int = 0         # tokens per kvcached block; 0 = the engine's block (page) size
    timeout_s: float = 10.0       # one request to the daemon, at most
    retry_s: float = 0.5          # a down daemon is tried again after this, doubling ...
    retry_max_s: float = 10.0     # ... up to this
    skip_slow_loads: bool = True  # ask for a load plan: SSD and peer blocks slower than recomputing are recomputed
    prefill_tokens_per_s: float = 0.0   # the engine's prefill rate for that plan (0 = measured from its steps)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, where: str, ignore: Sequence[str] = ()) -> "PluginSettings":
        """Settings from ``values``; ValueError naming ``where`` for an unknown key or a bad value.
        Keys in ``ignore`` belong to the engine (SGLang's backend_name, module_path, ...)."""
        known = {f.name: f for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in (values or {}).items():
            if key in ignore:
                continue
            if key not in known:
                raise ValueError(f"{where}: unknown kvcached setting {key!r} (known: {', '.join(sorted(known))})")
            default = known[key].default
            if isinstance(default, str):
                ok, want = isinstance(value, str), "a string"
            elif isinstance(default, bool):
                ok, want = isinstance(value, bool), "true or false"
            elif isinstance(default, int):
                ok, want = type(value) is int and value >= 0, "a whole number >= 0"
            elif default == 0:
                ok, want = type(value) in (int, float) and 0 <= value < math.inf, "a number >= 0"
            else:
                ok, want = type(value) in (int, float) and 0 < value < math.inf, "a number > 0"
            if not ok:
                raise ValueError(f"{where}: kvcached setting {key!r} must be {want}, not {value!r}")
            out[key] = float(value) if isinstance(default, float) else value
        return cls(**out)

    @property
    def socket_path(self) -> str:
        return self.socket or os.environ.get("KVCACHED_AGENT_SOCKET", "") or DEFAULT_SOCKET


def rank_namespace(namespace: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The address namespace of one tensor/pipeline-parallel shard: each rank stores its own
    slice of a block under its own addresses, and a rank never reads another's."""
    shard = f"tp{tp_rank}of{tp_size}" + (f".pp{pp_rank}of{pp_size}" if pp_size > 1 else "")
    return f"{namespace}|{shard}" if namespace else shard


def open_agent(settings: PluginSettings, *, agent_id: str, model: str, dtype: str, block_tokens: int,
               num_layers: int, layer_block_bytes: int, namespace: str) -> Any:
    """An Agent in reconnect mode: a daemon that is down is a cache with nothing in it, so the
    engine serves on and recomputes; it is connected again when the daemon is back."""
    from kvcached_agent.agent import Agent

    return Agent.connect(settings.socket_path, agent_id=agent_id, model=model, dtype=dtype,
                         block_tokens=block_tokens, num_layers=num_layers, layer_block_bytes=layer_block_bytes,
                         namespace=namespace, timeout=settings.timeout_s, reconnect=True,
                         retry_s=settings.retry_s, retry_max_s=settings.retry_max_s)


class TokenChain:
    """The digests of one request's full blocks, hashed once each as its tokens arrive."""

    __slots__ = ("root", "block_tokens", "digests")

    def __init__(self, root: bytes, block_tokens: int) -> None:
        self.root = root
        self.block_tokens = block_tokens
        self.digests: list[bytes] = []

    def upto(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """Digests of the first ``blocks`` blocks of ``tokens`` (which must hold that many)."""
        have = len(self.digests)
        if blocks > have:
            bt = self.block_tokens
            parent = self.digests[-1] if have else self.root
            self.digests += chain_digests(list(tokens[have * bt:blocks * bt]), bt, parent=parent)
        return self.digests[:blocks]


def key_digests(root: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """kvcached digests of an engine's own block keys (SGLang page keys, vLLM offload keys):
    BLAKE3(root, key). The engine's key already chains over the blocks before it, so the root
    (model, dtype, block size, namespace) is all that is added."""
    return [blake3.blake3(root + key).digest() for key in keys]
