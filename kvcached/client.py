"""A small blocking client of the KvCache gRPC API, for the CLI, tests and benchmarks.

Engines do not use this: they use the agent library over the Unix socket and shared memory.
Every payload fetched is checked against its BLAKE3 checksum before it is returned.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import grpc

from kvcached.api import STREAM_CHUNK_BYTES
from kvcached.api.convert import address_from_pb, address_to_pb
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import CROSS_LAYER, BlockAddress
from kvcached_agent.integrity import payload_checksum

__all__ = ["KvCacheClient", "ChecksumMismatch"]


class ChecksumMismatch(Exception):
    """A fetched payload does not match the checksum the daemon sent with it."""


def _verified(address: BlockAddress, payload: bytes, checksum: bytes) -> bytes:
    if payload_checksum(payload) != checksum:
        raise ChecksumMismatch(f"block {address}: payload does not match its BLAKE3 checksum")
    return payload


@dataclass(frozen=True, slots=True)
class Fetched:
    address: BlockAddress
    payload: bytes
    checksum: bytes


# gRPC's retry policy for every KvCache and Admin call (all are safe to repeat: a Put of a block
# present is a no-op). When a daemon hands over to its successor (docs/operations.md) its gRPC
# server stops: a call that reached its connection just as it went away ends UNAVAILABLE
# (GOAWAY) or CANCELLED (the server's shutdown), although the successor already listens; tried
# again, it reaches the successor. Calls the client itself cancels are never retried.
RETRY_POLICY = json.dumps({"methodConfig": [{
    "name": [{"service": "kvcached.v1.KvCache"}, {"service": "kvcached.v1.Admin"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.02s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]}}]})


_CUT = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


class _RetryServerCancelled(grpc.UnaryUnaryClientInterceptor):
    """Tries a unary call again when the server cancelled it or its connection went away under
    it. gRPC cancels the calls that reached a server but no handler yet when it stops
    (grpc/grpc#41785; a daemon handing over, see RETRY_POLICY), and a call whose stream a
    stopping server removed ends UNAVAILABLE ("Stream removed", GOAWAY) once its response had
    begun; gRPC's retry policy takes neither again. Every call of the API is safe to repeat
    (docs/api.md, Retries); a call this client cancels itself ends otherwise (an exception, a
    deadline)."""

    ATTEMPTS = 3

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        for attempt in range(self.ATTEMPTS):
            outcome = continuation(details, request)
            if attempt == self.ATTEMPTS - 1 or outcome.code() not in _CUT:
                return outcome
            time.sleep(0.02 * (attempt + 1))
        return outcome


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _ActAs(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Names a tenant in every call's ``kvcached-tenant`` header (honoured for the operator,
    kvcached.api.callers)."""

    def __init__(self, tenant: str) -> None:
        self.header = ("kvcached-tenant", tenant)

    def _details(self, details: Any) -> _Details:
        return _Details(details.method, details.timeout, [*(details.metadata or ()), self.header],
                        details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


class KvCacheClient:
    """Blocking client. ``target`` uses gRPC syntax: ``unix:PATH`` or ``HOST:PORT``. Calls are
    retried as :data:`RETRY_POLICY` says (unary calls the server cancelled too). ``tenant``:
    act as this tenant (the operator may name any; a tenant's connection, only itself)."""

    def __init__(self, target: str, *, max_message_mib: int = 64, timeout: float | None = 60.0,
                 tenant: str | None = None) -> None:
        limit = max_message_mib << 20
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.enable_retries", 1), ("grpc.service_config", RETRY_POLICY)])
        interceptors: list[Any] = [_RetryServerCancelled()] + ([_ActAs(tenant)] if tenant else [])
        channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = pb_grpc.KvCacheStub(channel)
        self.admin = pb_grpc.AdminStub(channel)
        self.timeout = timeout

    def __enter__(self) -> "KvCacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # -- calls --------------------------------------------------------------------------------

    def put(self, blocks: Iterable[tuple[BlockAddress, bytes]], model: str = "") -> pb.PutResponse:
        request = pb.PutRequest(blocks=[pb.Block(address=address_to_pb(a), payload=p, model=model) for a, p in blocks])
        return self.stub.Put(request, timeout=self.timeout)

    def put_stream(self, blocks: Iterable[tuple[BlockAddress, bytes]], model: str = "") -> pb.PutResponse:
        def chunks() -> Iterator[pb.PutChunk]:
            for address, payload in blocks:
                checksum = payload_checksum(payload)
                view = memoryview(payload)
                yield pb.PutChunk(address=address_to_pb(address), model=model, checksum=checksum,
                                  total_length=len(payload), data=view[:STREAM_CHUNK_BYTES].tobytes())
                for pos in range(STREAM_CHUNK_BYTES, len(payload), STREAM_CHUNK_BYTES):
                    yield pb.PutChunk(data=view[pos:pos + STREAM_CHUNK_BYTES].tobytes())
        return self.stub.PutStream(chunks(), timeout=self.timeout)

    def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
            verify: bool = True) -> tuple[list[Fetched], list[pb.Miss]]:
        response = self.stub.Get(pb.GetRequest(addresses=[address_to_pb(a) for a in addresses], allow_partial=allow_partial),
                                 timeout=self.timeout)
        out = []
        for block in response.blocks:
            address = address_from_pb(block.address)
            payload = _verified(address, block.payload, block.checksum) if verify else block.payload
            out.append(Fetched(address, payload, block.checksum))
        return out, list(response.misses)

    def get_stream(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False) -> tuple[list[Fetched], list[pb.Miss]]:
        out: list[Fetched] = []
        misses: list[pb.Miss] = []
        head: pb.GetChunk | None = None
        parts: list[bytes] = []

        def finish() -> None:
            assert head is not None
            address = address_from_pb(head.address)
            out.append(Fetched(address, _verified(address, b"".join(parts), head.checksum), head.checksum))

        stream = self.stub.GetStream(pb.GetRequest(addresses=[address_to_pb(a) for a in addresses], allow_partial=allow_partial),
                                     timeout=self.timeout)
        for chunk in stream:
            if chunk.HasField("miss"):
                misses.append(chunk.miss)
                continue
            if chunk.HasField("address"):
                if head is not None:
                    finish()
                head, parts = chunk, []
            parts.append(chunk.data)
        if head is not None:
            finish()
        return out, misses

    def lookup(self, digests: Sequence[bytes], layer: int = CROSS_LAYER) -> pb.LookupResponse:
        request = pb.LookupRequest(digests=list(digests))
        if layer != CROSS_LAYER:
            request.layer = layer
        return self.stub.Lookup(request, timeout=self.timeout)

    def overlap(self, digests: Sequence[bytes]) -> pb.OverlapResponse:
        return self.stub.Overlap(pb.OverlapRequest(digests=list(digests)), timeout=self.timeout)

    def delete(self, addresses: Sequence[BlockAddress]) -> pb.DeleteResponse:
        return self.stub.Delete(pb.DeleteRequest(addresses=[address_to_pb(a) for a in addresses]), timeout=self.timeout)

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=self.timeout)

    def evict(self, *, model: str = "", digests: Sequence[bytes] = (), layer: int | None = None,
              tier: "pb.Tier" = pb.TIER_UNSPECIFIED) -> pb.EvictResponse:
        """Admin Evict: drop a model's blocks, or these digests' (of ``layer``), from ``tier``
        (unset: every tier); as the client's tenant, that tenant's blocks alone."""
        request = pb.EvictRequest(model=model, digests=list(digests), tier=tier)
        if layer is not None:
            request.layer = layer
        return self.admin.Evict(request, timeout=self.timeout)

    def list_blocks(self, *, model: str = "", tier: "pb.Tier" = pb.TIER_UNSPECIFIED, page_size: int = 1000,
                    limit: int | None = None) -> Iterator[pb.BlockInfo]:
        """Every matching record, following page tokens (at most ``limit``)."""
        token = b""
        n = 0
        while True:
            page = self.stub.ListBlocks(pb.ListBlocksRequest(model=model, tier=tier, page_size=page_size,
                                                             page_token=token), timeout=self.timeout)
            for info in page.blocks:
                yield info
                n += 1
                if limit is not None and n >= limit:
                    return
            token = page.next_page_token
            if not token:
                return
