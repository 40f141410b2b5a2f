"""The gRPC KvCache service (grpc.aio): a thin translation between protobuf and the Store.

Each handler converts the request, calls the store on the event loop thread and converts the
answer; store errors (kvcached.errors) and malformed addresses become gRPC status codes with the
store's message. No policy or tier logic lives here.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from kvcached import __version__
from kvcached.api import STREAM_CHUNK_BYTES
from kvcached.api.convert import address_from_pb, address_to_pb, tier_name
from kvcached.errors import (DataLoss, FailedPrecondition, InvalidArgument, KvError, NotFound, ResourceExhausted,
                             Unavailable)
from kvcached.index import BlockRecord, Tier
from kvcached.store import Miss, Pinned, PutItem, Store
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import CROSS_LAYER, DIGEST_BYTES, BlockAddress
from kvcached_agent.protocol import MAX_BATCH

__all__ = ["KvCacheService", "errors_to_status"]

log = logging.getLogger("kvcached.api.grpc")


_STATUS: dict[type[KvError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}
_TIER_FILTER = {pb.TIER_UNSPECIFIED: "", pb.TIER_RAM: "ram", pb.TIER_SSD: "ssd", pb.TIER_GONE: "gone"}

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _status_of(exc: KvError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


def errors_to_status(handler: F) -> F:
    """Turn store errors into gRPC statuses; anything unexpected is logged and INTERNAL."""

    @functools.wraps(handler)
    async def wrapper(self: "KvCacheService", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except KvError as exc:
            await context.abort(_status_of(exc), str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__}: internal error (see daemon log)")

    return wrapper  # type: ignore[return-value]


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def block_info(record: BlockRecord) -> pb.BlockInfo:
    tiers = [pb.TIER_RAM] if record.tiers & Tier.RAM else []
    if record.tiers & Tier.SSD:
        tiers.append(pb.TIER_SSD)
    return pb.BlockInfo(
        address=address_to_pb(BlockAddress(record.digest, record.layer)), model=record.model, nbytes=record.nbytes,
        checksum=record.checksum, created=_timestamp(record.created), last_seen=_timestamp(record.last_seen),
        tiers=tiers, gone_reason="" if record.present else record.gone_reason.text)


def _peer_stats(store: Store) -> dict[str, Any]:
    if store.peers is None:
        return {}
    s = store.peers.stats()       # type: ignore[attr-defined]
    peers = [pb.PeerStats(name=name, up=p["up"], connected=p["connected"], blocks=p["blocks"],
                          last_error=p["last_error"]) for name, p in s.pop("peers").items()]
    return {"peers": peers, **s}


class KvCacheService(pb_grpc.KvCacheServicer):
    def __init__(self, store: Store, *, max_message_bytes: int, started_at: float | None = None) -> None:
        """``max_message_bytes``: the server's message limit, so Get can refuse an answer that
        would not fit with a message that says what to do instead."""
        self.store = store
        self.max_message_bytes = max_message_bytes
        self.started_at = time.time() if started_at is None else started_at

    @errors_to_status
    async def Put(self, request: pb.PutRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        items = [PutItem(address_from_pb(b.address, f"blocks[{i}].address"), b.payload, b.model, b.checksum)
                 for i, b in enumerate(request.blocks)]
        result = await self.store.put(items)
        return pb.PutResponse(stored=result.stored, already_present=result.present, declined=result.declined)

    @errors_to_status
    async def PutStream(self, request_iterator: AsyncIterator[pb.PutChunk], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        limit = self.store.max_block_bytes
        stored = present = declined = 0
        head: pb.PutChunk | None = None
        buf = bytearray()
        n = 0

        async def finish() -> None:
            nonlocal stored, present, declined
            assert head is not None
            if len(buf) != head.total_length:
                raise InvalidArgument(f"block {n - 1}: got {len(buf)} payload bytes, total_length said {head.total_length}")
            result = await self.store.put([PutItem(address_from_pb(head.address, f"block {n - 1}"), bytes(buf), head.model, head.checksum)])
            stored += result.stored
            present += result.present
            declined += result.declined

        async for chunk in request_iterator:
            if chunk.HasField("address"):
                if head is not None:
                    await finish()
                if chunk.total_length == 0 or chunk.total_length > limit:
                    raise InvalidArgument(f"block {n}: total_length {chunk.total_length} is outside 1..{limit} (kv.max_block_mib)")
                address_from_pb(chunk.address, f"block {n}")
                head, buf, n = chunk, bytearray(), n + 1
            elif head is None:
                raise InvalidArgument("the first PutStream chunk must carry an address")
            if len(buf) + len(chunk.data) > head.total_length:
                raise InvalidArgument(f"block {n - 1}: more payload bytes than total_length {head.total_length}")
            buf += chunk.data
        if head is not None:
            await finish()
        return pb.PutResponse(stored=stored, already_present=present, declined=declined)

    @errors_to_status
    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> pb.GetResponse:
        addresses = [address_from_pb(a, f"addresses[{i}]") for i, a in enumerate(request.addresses)]
        total = self.store.stored_bytes(addresses) + 128 * len(addresses)
        if total > self.max_message_bytes:
            raise ResourceExhausted(f"the {len(addresses)} blocks make a response of about {total} bytes, over the "
                                    f"message limit of {self.max_message_bytes} bytes (grpc.max_message_mib); "
                                    "use GetStream or smaller batches")
        found, misses = await self.store.get(addresses, allow_partial=request.allow_partial)
        return pb.GetResponse(
            blocks=[pb.Block(address=address_to_pb(f.address), payload=f.payload, checksum=f.checksum) for f in found],
            misses=[pb.Miss(address=address_to_pb(m.address), reason=m.reason) for m in misses])

    async def GetStream(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetChunk]:
        """The batch is pinned up front (a snapshot no eviction or Delete can break; the store
        caps how much readers may pin) and each block is released once sent, or when the
        stream ends early. No view of the arena is held across a yield: every chunk is a copy."""
        try:
            addresses = [address_from_pb(a, f"addresses[{i}]") for i, a in enumerate(request.addresses)]
            entries = await self.store.pin(addresses, allow_partial=request.allow_partial)
        except KvError as exc:
            await context.abort(_status_of(exc), str(exc))
        held = [e for e in entries if isinstance(e, Pinned)]
        done = 0
        try:
            for entry in entries:
                if isinstance(entry, Miss):
                    yield pb.GetChunk(miss=pb.Miss(address=address_to_pb(entry.address), reason=entry.reason))
                    continue
                length = entry.block.length
                yield pb.GetChunk(address=address_to_pb(entry.address), checksum=entry.checksum, total_length=length,
                                  data=self.store.read(entry, 0, STREAM_CHUNK_BYTES))
                for pos in range(STREAM_CHUNK_BYTES, length, STREAM_CHUNK_BYTES):
                    yield pb.GetChunk(data=self.store.read(entry, pos, STREAM_CHUNK_BYTES))
                self.store.unpin(entry)
                done += 1
        except Exception:
            log.exception("GetStream failed")
            await context.abort(grpc.StatusCode.INTERNAL, "GetStream: internal error (see daemon log)")
        finally:   # a cancelled or failed stream releases what it still holds
            for entry in held[done:]:
                self.store.unpin(entry)

    @errors_to_status
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        layer = request.layer if request.HasField("layer") else CROSS_LAYER
        r = self.store.lookup(list(request.digests), layer)
        return pb.LookupResponse(longest=r.longest, gpu=r.gpu, ram=r.ram, ssd=r.ssd, peer=r.peer)

    @errors_to_status
    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        addresses = [address_from_pb(a, f"addresses[{i}]") for i, a in enumerate(request.addresses)]
        deleted, missing = await self.store.delete(addresses)
        return pb.DeleteResponse(deleted=deleted, not_found=missing)

    @errors_to_status
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        s = self.store.stats()
        ram = pb.TierStats(tier=pb.TIER_RAM, blocks=s["ram_blocks"], bytes=s["ram_bytes"],
                           reserved_bytes=s["ram_reserved_bytes"], capacity_bytes=s["ram_capacity_bytes"],
                           evictions=s["ram_evictions"])
        tiers = [ram]
        if "ssd_blocks" in s:
            tiers.append(pb.TierStats(tier=pb.TIER_SSD, blocks=s["ssd_blocks"], bytes=s["ssd_bytes"],
                                      reserved_bytes=s["ssd_file_bytes"], capacity_bytes=s["ssd_capacity_bytes"],
                                      evictions=s["ssd_evictions_ttl"] + s["ssd_evictions_capacity"]))
        return pb.StatsResponse(
            version=__version__, uptime_seconds=time.time() - self.started_at, tiers=tiers,
            index_entries=s["index_entries"], puts=s["puts"], put_bytes=s["put_bytes"], hits=s["hits"],
            hit_bytes=s["hit_bytes"], misses=s["misses"], lookups=s["lookups"], deletes=s["deletes"],
            promotions=s["promotions"], demotions=s["demotions"], ram_dirty_bytes=s["ram_dirty_bytes"],
            dirty_dropped=s["ram_dirty_evictions"] if "ssd_blocks" in s else 0, ssd_corrupt=s.get("ssd_corrupt", 0),
            ssd_write_errors=s.get("ssd_write_errors", 0), ssd_reconciled=bool(s.get("ssd_reconciled", 0)),
            agents=s["agents"], agent_held_bytes=s["held_bytes"], gpu_blocks=s["gpu_blocks"],
            **_peer_stats(self.store))

    @errors_to_status
    async def Overlap(self, request: pb.OverlapRequest, context: grpc.aio.ServicerContext) -> pb.OverlapResponse:
        digests = list(request.digests)
        if len(digests) > MAX_BATCH:
            raise InvalidArgument(f"{len(digests)} digests; at most {MAX_BATCH} per Overlap")
        for i, digest in enumerate(digests):
            if len(digest) != DIGEST_BYTES:
                raise InvalidArgument(f"digests[{i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes (BLAKE3-256)")
        return pb.OverlapResponse(agents=[pb.AgentOverlap(session=info.session, agent_id=info.agent_id, pid=info.pid,
                                                          prefix=prefix)
                                          for info, prefix in self.store.gpu.overlap(digests)])

    @errors_to_status
    async def ListBlocks(self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext) -> pb.ListBlocksResponse:
        tier = _TIER_FILTER.get(request.tier)
        if tier is None:
            raise InvalidArgument(f"cannot filter by tier {tier_name(request.tier)}; use TIER_RAM, TIER_SSD, TIER_GONE or none")
        records, token = self.store.list_blocks(model=request.model, tier=tier, page_token=request.page_token,
                                                page_size=request.page_size)
        return pb.ListBlocksResponse(blocks=[block_info(r) for r in records], next_page_token=token)
