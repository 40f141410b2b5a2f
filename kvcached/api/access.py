"""Who may call what, by listener (docs/admin.md).

- A Unix socket serves the whole API: its mode and group ([grpc] socket_mode, socket_group)
  decide who may open it.
- A TCP listener with mutual TLS ([grpc] tls = true) serves the whole API to clients whose
  certificate the CA signed: gRPC's TLS stack refuses every other client in the handshake.
- Every other TCP listener (plaintext, or [grpc] read_only_listen) serves read-only calls only:
  a call that changes state is answered PERMISSION_DENIED by :class:`ReadOnly`, before any
  handler runs.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import grpc

__all__ = ["STATE_CHANGING", "ReadOnly"]

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
