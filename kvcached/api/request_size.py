"""Requests refused by their size before they are parsed (docs/api.md "Limits", issue 37).

gRPC receives a whole message, up to the server's receive limit, before a handler sees it, and
parsing a 34 MB Lookup of a million digests took tens of milliseconds and its size again in
memory, only for the count check (``grpc.max_batch``) to refuse it: a client repeating it on the
read-only listener made other clients' p99 17x and the daemon's memory grow by 190 MiB. Every
request but a Put's is bounded by ``max_batch`` entries of at most :data:`ENTRY_BYTES` each, so
two cheaper refusals apply:

- **the read-only listener** receives at most :func:`largest_read_only_request` bytes per
  message (gRPC's own ``grpc.max_receive_message_length``): gRPC refuses anything larger from its
  5-byte length prefix, RESOURCE_EXHAUSTED, and no byte of it reaches Python;
- **every listener** measures each unary request before parsing it (:func:`bounded`, which
  wraps the services' request deserializers): one larger than its method's largest allowed
  request is answered INVALID_ARGUMENT, unparsed, with the sizes in the message. Put and
  PutStream are bounded by ``grpc.max_message_mib`` alone; streaming requests are not wrapped.

No interceptor: the wrapping is done once, when the services are registered, and costs a call
per request.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import grpc

__all__ = ["ENTRY_BYTES", "SMALL_REQUEST", "largest_request", "largest_read_only_request", "bounded"]

ENTRY_BYTES = 64             # one entry of a request's list, at most: a BlockAddress is 42 bytes, a digest 34
SMALL_REQUEST = 64 << 10     # a request without a list (names, a page token, a tier) fits in this
BATCHED = frozenset({        # requests that carry up to max_batch entries (digests or addresses)
    "/kvcached.v1.KvCache/Get", "/kvcached.v1.KvCache/GetStream", "/kvcached.v1.KvCache/Lookup",
    "/kvcached.v1.KvCache/Delete", "/kvcached.v1.KvCache/Overlap", "/kvcached.v1.Admin/Evict",
})
UNBOUNDED = frozenset({"/kvcached.v1.KvCache/Put", "/kvcached.v1.KvCache/PutStream"})   # grpc.max_message_mib
READ_ONLY_BATCHED = BATCHED - {"/kvcached.v1.KvCache/Delete", "/kvcached.v1.Admin/Evict"}


def largest_request(method: str, max_batch: int) -> int | None:
    """The largest request ``method`` (a full method name) is allowed, bytes; None: only the
    server's message limit bounds it (Put, PutStream)."""
    if method in UNBOUNDED:
        return None
    if method in BATCHED:
        return SMALL_REQUEST + max_batch * ENTRY_BYTES
    return SMALL_REQUEST


def largest_read_only_request(max_batch: int) -> int:
    """The largest request a read-only call may be: the read-only listener's receive limit."""
    return SMALL_REQUEST + max_batch * ENTRY_BYTES


class _Oversize:
    """What a bounded deserializer hands the handler instead of a request that is too large."""

    __slots__ = ("size", "limit")

    def __init__(self, size: int, limit: int) -> None:
        self.size, self.limit = size, limit


class _BoundedServer:
    """Stands in for a grpc.aio server while a generated ``add_*Servicer_to_server`` registers a
    service: each handler it registers is bounded first."""

    def __init__(self, server: Any, max_batch: int) -> None:
        self.server, self.max_batch = server, max_batch

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self.server.add_generic_rpc_handlers(tuple(_BoundedGeneric(h, self.max_batch) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.server.add_registered_method_handlers(
            service, {name: _bound(f"/{service}/{name}", handler, self.max_batch) for name, handler in handlers.items()})


class _BoundedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: Any, max_batch: int) -> None:
        self.inner, self.max_batch = inner, max_batch

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        handler = self.inner.service(details)
        return None if handler is None else _bound(details.method, handler, self.max_batch)


def bounded(server: Any, max_batch: int, register: Callable[[Any], None]) -> None:
    """``register(stand_in)`` (a generated ``add_*Servicer_to_server`` with its servicer bound)
    adds its service to ``server`` with every unary request measured before it is parsed."""
    register(_BoundedServer(server, max_batch))


def _bound(method: str, handler: Any, max_batch: int) -> Any:
    """``handler`` with its request measured before it is parsed (unary requests only)."""
    limit = largest_request(method, max_batch)
    if limit is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    name = method.rsplit("/", 1)[-1]

    def deserialize(raw: bytes) -> Any:
        return _Oversize(len(raw), limit) if len(raw) > limit else parse(raw)

    def refusal(request: _Oversize) -> str:
        return (f"{name}: a request of {request.size} bytes, over the {request.limit} bytes the largest allowed "
                f"one takes ({max_batch} entries, grpc.max_batch); split it")

    if handler.response_streaming:
        inner_stream = handler.unary_stream
        streams = inspect.isasyncgenfunction(inner_stream)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Oversize):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
            if streams:
                async for item in inner_stream(request, context):
                    yield item
            else:
                await inner_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=deserialize,
                                                    response_serializer=handler.response_serializer)
    inner_unary = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Oversize):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
        return await inner_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserialize,
                                               response_serializer=handler.response_serializer)
