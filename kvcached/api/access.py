"""Who may call what, by listener (docs/admin.md).

- A Unix socket serves the whole API: its mode and group ([grpc] socket_mode, socket_group)
  decide who may open it.
- A TCP listener with mutual TLS ([grpc] tls = true) serves the whole API to clients whose
  certificate the CA signed: gRPC's TLS stack refuses every other client in the handshake.
- Every other TCP listener (plaintext, or [grpc] read_only_listen) serves read-only calls only:
  a call that changes state is answered PERMISSION_DENIED by :class:`ReadOnly`, before any
  handler runs.
- Where tenants other than the default one are configured, the Admin service is the
  operator's (:class:`OperatorOnly`): it names every tenant's agents, peers and blocks. Which
  tenant a call acts as: kvcached.api.callers.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import grpc

from kvcached.api.callers import Callers, Refusals
from kvcached.errors import InvalidArgument, KvError

__all__ = ["ADMIN_PREFIX", "STATE_CHANGING", "OperatorOnly", "ReadOnly"]

ADMIN_PREFIX = "/kvcached.v1.Admin/"

# Full method names of every call that changes what the daemon holds or how it runs. A new RPC
# that changes state must be added here (tests/integration/test_admin.py checks every method of
# the services is classified).
STATE_CHANGING = frozenset({
    "/kvcached.v1.KvCache/Put", "/kvcached.v1.KvCache/PutStream", "/kvcached.v1.KvCache/Delete",
    "/kvcached.v1.Admin/Evict", "/kvcached.v1.Admin/Drain", "/kvcached.v1.Admin/SetLogLevel",
})


class ReadOnly(grpc.aio.ServerInterceptor):
    """Answers state-changing calls PERMISSION_DENIED on a read-only listener."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in STATE_CHANGING:
            return handler
        message = (f"{method.rsplit('/', 1)[-1]} changes state: this listener serves read-only calls. Call it "
                   "through the daemon's Unix socket, or a TCP listener with mutual TLS (grpc.tls = true) and a "
                   "client certificate signed by the cluster CA")

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

        kind = ((handler.request_streaming and "stream") or "unary") + "_" + (
            (handler.response_streaming and "stream") or "unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class OperatorOnly(grpc.aio.ServerInterceptor):
    """Answers an Admin call PERMISSION_DENIED unless it acts as the operator (counted,
    ``operator_only``). Evict may still act on one tenant's blocks: the operator names it in the
    kvcached-tenant header."""

    def __init__(self, callers: Callers, refusals: Refusals) -> None:
        self.callers, self.refusals = callers, refusals

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(ADMIN_PREFIX) or handler.unary_unary is None:
            return handler
        method, behavior, callers, refusals = details.method, handler.unary_unary, self.callers, self.refusals

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                caller = callers.of(context)
            except KvError as exc:        # refused for who it is (counted), or an unknown tenant named
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, InvalidArgument)
                                    else grpc.StatusCode.PERMISSION_DENIED, str(exc))
            if not caller.operator:
                refusals.counts["operator_only"] += 1
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{method.rsplit('/', 1)[-1]} is the operator's: it names every tenant's agents, "
                                    f"peers or blocks, and this call acts as tenant {caller.name}")
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class Gate(grpc.aio.ServerInterceptor):
    """Holds every call until :meth:`open`: an upgrade's successor listens beside its
    predecessor before it can serve (kvcached.lifecycle.handover), so a client that connects then waits a
    moment instead of being refused."""

    def __init__(self) -> None:
        self._open = asyncio.Event()

    def open(self) -> None:
        self._open.set()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if not self._open.is_set():
            await self._open.wait()
        return await continuation(details)
