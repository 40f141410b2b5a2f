"""Which tenant a gRPC call acts as, by the listener it came in on (docs/security.md, "Tenants").

- **The daemon's own Unix sockets** (grpc.listen): the operator, whose calls reach every block
  as the digests name them, or act as one tenant named by the ``kvcached-tenant`` header.
- **Mutual-TLS TCP listeners**: the client certificate's names (tenants.cert_field) looked up
  in tenants.certs; names in tenants.operators are the operator; a certificate that names no
  tenant is the default tenant's, or refused without one. With tenants.certs empty, every
  certificate the CA signed is the operator's, as it was before tenants.
- **Read-only listeners** (plaintext, or TLS without a client certificate): no one is
  authenticated, so the default tenant, or refused without one.
- **A tenant's own socket** (tenants.sockets): that tenant; the kernel admits only its uids and
  gids (kvcached.tenants.socket_acl), since gRPC cannot tell Unix callers apart.

A tenant caller may name itself in the header, never another tenant. Every refusal is
PERMISSION_DENIED (an unknown tenant in the operator's header: INVALID_ARGUMENT) and counted by
reason (:class:`Refusals`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import grpc

from kvcached.errors import InvalidArgument, PermissionDenied
from kvcached.tenants import Scope, Tenant, TenantMap

__all__ = ["BoundTenant", "Caller", "Callers", "OPERATOR", "OperatorOrCertificate", "Refusals", "TENANT_HEADER",
           "Unauthenticated"]

TENANT_HEADER = "kvcached-tenant"
_SAME = Scope(None)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a call acts as: a tenant, or the operator (``tenant`` None) acting on every
    tenant's blocks under the digests as sent. ``operator``: the caller is the operator, even
    when it acts as one tenant (named in the header)."""

    tenant: Tenant | None
    operator: bool = False

    @property
    def scope(self) -> Scope:
        return self.tenant.scope if self.tenant is not None else _SAME

    @property
    def name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    @property
    def tag(self) -> str | None:
        """Whose blocks the call reaches, as records say it (Tenant.tag); None: everyone's."""
        return self.tenant.tag if self.tenant is not None else None


OPERATOR = Caller(None, operator=True)
REASONS = ("no_tenant", "no_certificate_name", "other_tenant", "unknown_tenant", "operator_only")


@dataclass
class Refusals:
    """Calls refused for who they came from, by reason (metric labels from this fixed set)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def refuse(self, reason: str, message: str) -> PermissionDenied:
        self.counts[reason] += 1
        return PermissionDenied(message)


class Callers(Protocol):
    """How one server names the caller of each call."""

    def of(self, context: grpc.aio.ServicerContext) -> Caller: ...


def _header(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_HEADER:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class _Named:
    """The header's part, shared by every kind of listener."""

    def __init__(self, tenants: TenantMap, refusals: Refusals) -> None:
        self.tenants, self.refusals = tenants, refusals

    def _as(self, caller: Caller, context: grpc.aio.ServicerContext) -> Caller:
        named = _header(context)
        if named is None or named == caller.name:
            return caller
        if caller.tenant is not None:
            raise self.refusals.refuse("other_tenant", f"this connection acts as tenant {caller.name}; it cannot act "
                                       f"as {named!r} ({TENANT_HEADER})")
        tenant = self.tenants.named(named)
        if tenant is None:
            self.refusals.counts["unknown_tenant"] += 1
            raise InvalidArgument(f"{TENANT_HEADER}: no tenant called {named!r} is configured ([tenants])")
        return Caller(tenant, operator=True)

    def _default(self, why: str) -> Caller:
        if self.tenants.default is None:
            raise self.refusals.refuse("no_tenant", f"{why} and tenants.default is empty: no tenant to serve")
        return Caller(self.tenants.default)


class OperatorOrCertificate(_Named):
    """The full server: Unix callers are the operator, TLS callers are their certificate's."""

    def __init__(self, tenants: TenantMap, refusals: Refusals, *, by_certificate: bool, cert_field: str,
                 operators: Sequence[str]) -> None:
        super().__init__(tenants, refusals)
        self.by_certificate = by_certificate
        self.property = "x509_subject_alternative_name" if cert_field == "san" else "x509_common_name"
        self.field = "DNS subjectAltName" if cert_field == "san" else "common name"
        self.operators = frozenset(operators)

    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        if not self.by_certificate or context.peer().startswith("unix:"):
            return self._as(OPERATOR, context)
        names = [n.decode("utf-8", "replace") for n in context.auth_context().get(self.property, ())]
        if not names:
            raise self.refusals.refuse("no_certificate_name", f"the client certificate carries no {self.field} "
                                       "(tenants.cert_field), so it names no tenant")
        if self.operators.intersection(names):
            return self._as(OPERATOR, context)
        tenant = self.tenants.by_certificate(names)
        if tenant is None:
            raise self.refusals.refuse("no_tenant", f"the client certificate ({', '.join(names)}) names no tenant "
                                       "(tenants.certs) and tenants.default is empty")
        return self._as(Caller(tenant), context)


class Unauthenticated(_Named):
    """A read-only listener: nobody proved who they are, so the default tenant."""

    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        return self._as(self._default("this listener authenticates no one"), context)


class BoundTenant(_Named):
    """A tenant's own socket: that tenant, whoever the kernel let connect."""

    def __init__(self, tenants: TenantMap, refusals: Refusals, tenant: Tenant) -> None:
        super().__init__(tenants, refusals)
        self.caller = Caller(tenant)

    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        return self._as(self.caller, context)
