"""Who a caller is, and the block addresses that are its own (docs/security.md). No I/O here.

A tenant is named by what the kernel proves about the process at the other end of a connection
(its uid and gid, SO_PEERCRED), never by what the caller says. Each tenant's blocks have
addresses of their own: the daemon maps every digest a tenant's agent names through the
tenant's :class:`Scope` before anything else sees it, so the same tokens saved by two tenants
are two blocks, and one tenant's lookup of another's prefix is a lookup of an address nobody
stored (it costs what any miss costs).

The tenant called ``default`` owns the digests as agents send them: every block stored before
tenants were configured is its own, and a daemon with no ``[tenants]`` settings serves every
agent as before. Every other tenant's addresses are a keyed BLAKE3 of the digest, under a key
derived from the daemon's secret (``tenants.key_file``) and the tenant's name. The key is
secret so that no caller can compute another tenant's address and send it as a digest of its
own (an agent of the default tenant sends addresses unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import blake3

__all__ = ["DEFAULT", "KEY_BYTES", "Scope", "Tenant", "TenantMap"]

DEFAULT = "default"          # the tenant whose addresses are the digests as sent
KEY_BYTES = 32
_CONTEXT = b"kvcached tenant scope v1\x00"
REMEMBERED = 8192            # digests a tenant's scope remembers the address of (about 1.5 MiB)


class Scope:
    """Maps the digests one tenant names to the addresses its blocks are stored under: the
    identity for the default tenant, a keyed BLAKE3-256 for every other.

    The digests mapped last are remembered (at most :data:`REMEMBERED`, then forgotten all at
    once): an engine names the same digests again and again (a Lookup then its Load, a save's
    Allocate then its GPU events), and a dict hit costs a tenth of the hash. One Scope per
    tenant, so what it remembers tells nothing of any other tenant's digests."""

    def __init__(self, key: bytes | None) -> None:
        self._hasher = None if key is None else blake3.blake3(key=key)
        self._known: dict[bytes, bytes] = {}

    @property
    def identity(self) -> bool:
        return self._hasher is None

    def digest(self, digest: bytes) -> bytes:
        if self._hasher is None:
            return digest
        known = self._known
        address = known.get(digest)
        if address is None:
            h = self._hasher.copy()
            h.update(digest)
            address = h.digest()
            if len(known) >= REMEMBERED:
                known.clear()
            known[digest] = address
        return address

    def digests(self, digests: Sequence[bytes]) -> Sequence[bytes]:
        if self._hasher is None:
            return digests
        return [self.digest(d) for d in digests]


@dataclass(frozen=True)
class Tenant:
    name: str
    scope: Scope = field(compare=False, repr=False)

    @property
    def tag(self) -> str:
        """What a block record says of its tenant (kvcached.index.format): "" for the default
        tenant, as in every record written before tenants existed."""
        return "" if self.name == DEFAULT else self.name


class TenantMap:
    """The tenant of each connecting process, by uid first, then gid, then the default (None:
    refused), or by the tenant's own agent socket it came through (``sockets``: their tenants).
    ``secret``: the daemon's tenant key (KEY_BYTES), from which each tenant's scope is
    derived; the same secret and names give the same addresses on every node of a cluster."""

    def __init__(self, secret: bytes, *, default: str = DEFAULT, uids: Mapping[str, Sequence[int]] | None = None,
                 gids: Mapping[str, Sequence[int]] | None = None,
                 certs: Mapping[str, Sequence[str]] | None = None, sockets: Sequence[str] = ()) -> None:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"the tenant key is {len(secret)} bytes, not {KEY_BYTES}")
        self._secret = secret
        self._tenants: dict[str, Tenant] = {}
        self._by_uid = {uid: self._tenant(name) for name, ids in (uids or {}).items() for uid in ids}
        self._by_gid = {gid: self._tenant(name) for name, ids in (gids or {}).items() for gid in ids}
        self._by_cert = {n: self._tenant(name) for name, names in (certs or {}).items() for n in names}
        for name in sockets:          # tenants named by the agent socket their engines connect through
            self._tenant(name)
        self.default = self._tenant(default) if default else None

    def _tenant(self, name: str) -> Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            key = None if name == DEFAULT else blake3.blake3(_CONTEXT + name.encode(), key=self._secret).digest()
            tenant = self._tenants[name] = Tenant(name, Scope(key))
        return tenant

    def resolve(self, uid: int, gid: int) -> Tenant | None:
        """The tenant of a process running as ``uid`` and ``gid``; None if none is named and
        there is no default (the connection is refused)."""
        return self._by_uid.get(uid) or self._by_gid.get(gid) or self.default

    def through_socket(self, name: str, uid: int, gid: int) -> Tenant | None:
        """The tenant of a process that connected through tenant ``name``'s own agent socket
        (tenants.agent_sockets): that tenant, unless its uid or gid names another (None: refused;
        a socket mounted where it should not be is no way into another tenant's blocks)."""
        tenant = self._tenants[name]
        named = self._by_uid.get(uid) or self._by_gid.get(gid)
        return tenant if named is None or named is tenant else None

    def by_certificate(self, names: Sequence[str]) -> Tenant | None:
        """The tenant the first of a client certificate's ``names`` that tenants.certs maps
        belongs to, else the default; None: refused."""
        return next((self._by_cert[n] for n in names if n in self._by_cert), self.default)

    def derived_key(self, purpose: str, tag: str) -> bytes:
        """A 32-byte key of tenant ``tag``'s own ("" the default tenant) for ``purpose`` (a
        fixed text naming what it keys), derived from the daemon's tenant key: BLAKE3's
        key-derivation mode, so keys for different purposes or tenants say nothing of each
        other or of the tenant key."""
        return blake3.blake3(self._secret + tag.encode(), derive_key_context=f"kvcached 2026-12-07 {purpose}").digest()

    def named(self, name: str) -> Tenant | None:
        """The configured tenant called ``name`` (None: the configuration names no such tenant)."""
        return self._tenants.get(name)

    @property
    def several(self) -> bool:
        """Whether any tenant but the default one is configured. With the default alone every
        block is its own, so what lists or counts the whole store reveals no other tenant's."""
        return any(name != DEFAULT for name in self._tenants)

    @property
    def tags(self) -> list[str]:
        """Every configured tenant's tag (Tenant.tag: "" the default tenant's)."""
        return [self._tenants[name].tag for name in sorted(self._tenants)]

    @property
    def names(self) -> list[str]:
        """Every tenant the configuration names (metric labels come from here, never from input)."""
        return sorted(self._tenants)
