"""Tenants: who is calling, as the kernel says, and block addresses of each tenant's own
(docs/security.md). ``identity``: the tenant map and scopes, without I/O; ``keyfile``: the
daemon's tenant key on disk."""

from __future__ import annotations

import os

from kvcached.config import Config, tenant_share_bytes
from kvcached.tenants.identity import DEFAULT, Scope, Tenant, TenantMap
from kvcached.tenants.keyfile import load_key

__all__ = ["DEFAULT", "Scope", "Tenant", "TenantMap", "ram_shares", "ssd_shares", "tenants_for"]

KEY_FILE = "tenants.key"


def tenants_for(config: Config) -> TenantMap:
    """The tenant map ``[tenants]`` describes, with the key from ``tenants.key_file`` (created if
    missing; ``kv.index_dir``/tenants.key by default). OSError if the key file is unfit."""
    t = config.tenants
    path = t.key_file or os.path.join(config.kv.index_dir, KEY_FILE)
    return TenantMap(load_key(path), default=t.default, uids=t.uids, gids=t.gids, certs=t.certs,
                     sockets=list(t.agent_sockets))


def ram_shares(config: Config, capacity: int) -> dict[str, int]:
    """``tenants.ram_shares`` in bytes of a RAM tier of ``capacity``, by tenant tag ("": the
    default tenant; kvcached.tiers.ram_shares)."""
    return _in_bytes(config.tenants.ram_shares, capacity)


def ssd_shares(config: Config) -> dict[str, int]:
    """``tenants.ssd_shares`` in file bytes of the SSD tier, by tenant tag
    (kvcached.tiers.ssd_shares)."""
    return _in_bytes(config.tenants.ssd_shares, config.ssd_bytes)


def _in_bytes(shares: dict[str, float | int], capacity: int) -> dict[str, int]:
    return {"" if name == DEFAULT else name: tenant_share_bytes(share, capacity) for name, share in shares.items()}
