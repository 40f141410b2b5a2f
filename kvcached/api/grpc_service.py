"""The gRPC KvCache service (grpc.aio): a thin translation between protobuf and the Store.

Each handler converts the request, calls the store on the event loop thread and converts the
answer; store errors (kvcached.errors) and malformed addresses become gRPC status codes with the
store's message. No policy or tier logic lives here.

Every request is bounded (docs/api.md "Limits"): a list of more than ``grpc.max_batch`` entries
is refused with INVALID_ARGUMENT before any entry is read (the length of a repeated field is
known without decoding it). Below that, lists are decoded a slice at a time (``grpc.batch_slice``
addresses or blocks, ``grpc.lookup_slice`` digests), and Lookup, Get and GetStream also do their
work a slice at a time, other requests running between slices (:meth:`KvCacheService._slices`,
:func:`lookup_in_slices`): the largest allowed request delays a concurrent small one by a few
slices' work (bench/bench_hostile.py). The store's part of Put and Delete is one call: the
store checks a whole Put before storing any block and refuses a whole Delete if one block is
busy, which slices would break.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from kvcached import __version__
from kvcached.api import STREAM_CHUNK_BYTES
from kvcached.api.callers import OPERATOR, Caller, Callers
from kvcached.api.convert import address_from_pb, address_to_pb, curve_stats, tier_name
from kvcached.api.slices import lookup_in_slices
from kvcached.config import GrpcSection
from kvcached.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    KvError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvcached.index import BlockRecord, Tier
from kvcached.store import Miss, Pinned, PutItem, Store
from kvcached.store.results import TenantCounts
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import CROSS_LAYER, DIGEST_BYTES, BlockAddress

__all__ = ["KvCacheService", "check_batch", "check_digests", "errors_to_status", "lookup_in_slices"]

log = logging.getLogger("kvcached.api.grpc")


_STATUS: dict[type[KvError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}
_TIER_FILTER = {pb.TIER_UNSPECIFIED: "", pb.TIER_RAM: "ram", pb.TIER_SSD: "ssd", pb.TIER_GONE: "gone"}

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
E = TypeVar("E")
D = TypeVar("D")


def _status_of(exc: KvError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return grpc.StatusCode.INTERNAL


def errors_to_status(handler: F) -> F:
    """Turn store errors into gRPC statuses; anything unexpected is logged and INTERNAL.

    The call is aborted once the error is dropped and no reference to the request is left in
    this frame: the abort's exception holds the frame in its traceback and is freed only by
    Python's cyclic collector, so whatever the frame reaches lives until a collection runs.
    Kept that way, ten refused 34 MB Lookups left the daemon 740 MiB larger
    (tests/reliability/test_request_bounds.py)."""

    @functools.wraps(handler)
    async def wrapper(self: "KvCacheService", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except KvError as exc:
            status, message = _status_of(exc), str(exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", handler.__name__)
            status, message = grpc.StatusCode.INTERNAL, f"{handler.__name__}: internal error (see daemon log)"
        del request
        await context.abort(status, message)

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
        tiers=tiers, gone_reason="" if record.present else record.gone_reason.text, tenant=record.tenant)


def _peer_stats(store: Store) -> dict[str, Any]:
    if store.peers is None:
        return {}
    s = store.peers.stats()
    peers = [pb.PeerStats(name=name, up=p["up"], connected=p["connected"], blocks=p["blocks"],
                          last_error=p["last_error"]) for name, p in s.pop("peers").items()]
    cluster = s.pop("cluster", None)
    if cluster is not None:
        s["cluster"] = pb.ClusterStats(
            etcd_reachable=cluster.get("etcd_reachable", False), members=cluster.get("members", []),
            revision=cluster.get("revision", 0), registrations_refused=cluster.get("registrations_refused", 0),
            lease_losses=cluster.get("etcd_lease_losses", 0), home_records=cluster["home_records"],
            locates=cluster["locates"], locate_failures=cluster["locate_failures"],
            served_locates=cluster["served_locates"], republished=cluster["republished"],
            forgotten=cluster["forgotten"], last_error=cluster.get("etcd_last_error", ""),
            restorations=cluster.get("etcd_restorations", 0))
    return {"peers": peers, **s}


# -- request bounds ---------------------------------------------------------------------------


def check_batch(method: str, count: int, what: str, limit: int) -> None:
    """InvalidArgument if a request's list is longer than ``limit`` (``grpc.max_batch``). Call it
    with the length of the repeated field, before decoding any entry."""
    if count > limit:
        raise InvalidArgument(f"{method}: {count} {what} in one request, over the limit of {limit} "
                              f"(grpc.max_batch); split it into requests of at most {limit}")


def check_digests(digests: Sequence[bytes], start: int = 0) -> None:
    """InvalidArgument naming the first digest that is not 32 bytes, by its index in the request
    (``digests`` are the request's from ``start`` on)."""
    if digests and set(map(len, digests)) != {DIGEST_BYTES}:
        i, digest = next((i, d) for i, d in enumerate(digests) if len(d) != DIGEST_BYTES)
        raise InvalidArgument(f"digests[{start + i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes "
                              "(BLAKE3-256)")


def _addresses_from_pb(entries: Sequence[pb.BlockAddress], start: int) -> list[BlockAddress]:
    return [address_from_pb(a, f"addresses[{i}]") for i, a in enumerate(entries, start)]


def _put_items(entries: Sequence[pb.Block], start: int) -> list[PutItem]:
    return [PutItem(address_from_pb(b.address, f"blocks[{i}].address"), b.payload, b.model, b.checksum)
            for i, b in enumerate(entries, start)]


def _digests(entries: Sequence[bytes], start: int) -> list[bytes]:
    digests = list(entries)
    check_digests(digests, start)
    return digests


def _named(address: BlockAddress, as_sent: dict[BlockAddress, BlockAddress] | None) -> BlockAddress:
    """``address`` as the caller named it (``as_sent``: stored address -> sent; None: the same)."""
    return address if as_sent is None else as_sent[address]


def _stopped_at(exc: NotFound, start: int, end: int, count: int) -> NotFound:
    """A slice's NotFound, saying which slice of the request it counted: the call stopped there."""
    if (start, end) == (0, count):
        return exc
    return NotFound(f"{exc}; in addresses[{start}:{end}] of {count}, where the call stopped")


class _Operator:
    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        return OPERATOR


def _scoped_addresses(caller: Caller, addresses: list[BlockAddress]) -> list[BlockAddress]:
    """The addresses the caller's blocks are stored under (kvcached.tenants.Scope)."""
    scope = caller.scope
    if scope.identity:
        return addresses
    return [BlockAddress(scope.digest(a.digest), a.layer) for a in addresses]


class KvCacheService(pb_grpc.KvCacheServicer):
    """Every call acts as its caller (kvcached.api.callers): the digests and addresses of a
    tenant's calls are mapped to its own, and answers name them as the caller sent them, so one
    tenant's call finds, fetches, deletes or times nothing of another's. Where other tenants
    are configured, a tenant's ListBlocks and Stats answer its own blocks and counts."""

    def __init__(self, store: Store, *, max_message_bytes: int, started_at: float | None = None,
                 grpc_config: GrpcSection | None = None, callers: Callers | None = None,
                 several_tenants: bool = False) -> None:
        """``max_message_bytes``: the server's message limit, so Get can refuse an answer that
        would not fit with a message that says what to do instead. ``grpc_config``: the [grpc]
        section, for ``max_batch``, ``batch_slice`` and ``lookup_slice`` (None: their defaults).
        ``callers``: who each call acts as (None: the operator, always); ``several_tenants``:
        whether tenants other than the default one are configured."""
        self.store = store
        self.callers: Callers = callers or _Operator()
        self.several_tenants = several_tenants
        self.max_message_bytes = max_message_bytes
        self.started_at = time.time() if started_at is None else started_at
        limits = grpc_config or GrpcSection()
        self.max_batch = limits.max_batch
        self.batch_slice = limits.batch_slice
        self.lookup_slice = limits.lookup_slice

    async def _slices(self, count: int, size: int | None = None) -> AsyncIterator[tuple[int, int]]:
        """(start, end) of consecutive slices of ``count`` entries, ``size`` (default
        ``batch_slice``) long; before each slice but the first, other requests get the event
        loop (a request of one slice never gives it up)."""
        size = size or self.batch_slice
        for start in range(0, count, size):
            if start:
                await asyncio.sleep(0)
            yield start, min(start + size, count)

    async def _decoded(self, method: str, entries: Sequence[E], what: str,
                       decode: Callable[[Sequence[E], int], list[D]], size: int | None = None) -> list[D]:
        """A request's list (a repeated field), refused past ``max_batch`` before any entry is
        read, then ``decode(slice, start)`` slice by slice (:meth:`_slices`)."""
        check_batch(method, len(entries), what, self.max_batch)
        out: list[D] = []
        async for start, end in self._slices(len(entries), size):
            out += decode(entries[start:end], start)
        return out

    async def _addresses(self, method: str, request: pb.GetRequest | pb.DeleteRequest) -> list[BlockAddress]:
        return await self._decoded(method, request.addresses, "addresses", _addresses_from_pb)

    @errors_to_status
    async def Put(self, request: pb.PutRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        caller = self.callers.of(context)
        scope, tag = caller.scope, caller.tag or ""
        items = await self._decoded("Put", request.blocks, "blocks", _put_items)
        if not scope.identity:
            items = [PutItem(BlockAddress(scope.digest(i.address.digest), i.address.layer), i.payload, i.model, i.checksum,
                             tag) for i in items]
        result = await self.store.put(items)
        return pb.PutResponse(stored=result.stored, already_present=result.present, declined=result.declined)

    @errors_to_status
    async def PutStream(self, request_iterator: AsyncIterator[pb.PutChunk], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        limit = self.store.max_block_bytes
        caller = self.callers.of(context)
        scope, tag = caller.scope, caller.tag or ""
        stored = present = declined = 0
        head: pb.PutChunk | None = None
        buf = bytearray()
        n = 0

        async def finish() -> None:
            nonlocal stored, present, declined
            assert head is not None
            if len(buf) != head.total_length:
                raise InvalidArgument(f"block {n - 1}: got {len(buf)} payload bytes, total_length said {head.total_length}")
            address = address_from_pb(head.address, f"block {n - 1}")
            address = BlockAddress(scope.digest(address.digest), address.layer)
            result = await self.store.put([PutItem(address, bytes(buf), head.model, head.checksum, tag)])
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
        """Sliced (:meth:`_slices`): sized, then fetched. Without ``allow_partial`` it stops at the
        first slice with a miss, and NOT_FOUND says which slice."""
        caller = self.callers.of(context)
        sent = await self._addresses("Get", request)
        addresses = _scoped_addresses(caller, sent)
        as_sent = dict(zip(addresses, sent)) if addresses is not sent else None
        count = len(addresses)
        total = 128 * count
        async for start, end in self._slices(count):
            total += self.store.stored_bytes(addresses[start:end], caller.tag)
        if total > self.max_message_bytes:
            raise ResourceExhausted(f"the {count} blocks make a response of about {total} bytes, over the "
                                    f"message limit of {self.max_message_bytes} bytes (grpc.max_message_mib); "
                                    "use GetStream or smaller batches")
        response = pb.GetResponse()
        async for start, end in self._slices(count):
            try:
                found, misses = await self.store.get(addresses[start:end], allow_partial=request.allow_partial,
                                                     tenant=caller.tag)
            except NotFound as exc:
                raise _stopped_at(exc, start, end, count) from None
            response.blocks.extend(pb.Block(address=address_to_pb(_named(f.address, as_sent)), payload=f.payload,
                                            checksum=f.checksum) for f in found)
            response.misses.extend(pb.Miss(address=address_to_pb(_named(m.address, as_sent)), reason=m.reason)
                                   for m in misses)
        return response

    def _unpin_all(self, entries: Sequence[Pinned | Miss]) -> None:
        for entry in entries:
            if isinstance(entry, Pinned):
                self.store.unpin(entry)

    async def GetStream(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetChunk]:
        """The batch is pinned up front, slice by slice (a snapshot no eviction or Delete can
        break once its slice is pinned; the store caps how much readers may pin) and each block
        is released once sent, or when the stream ends early. Without ``allow_partial`` a miss
        stops the pinning at its slice and releases what earlier slices pinned. No view of the
        arena is held across a yield: every chunk is a copy."""
        entries: list[Pinned | Miss] = []
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            caller = self.callers.of(context)
            sent = await self._addresses("GetStream", request)
            addresses = _scoped_addresses(caller, sent)
            as_sent = dict(zip(addresses, sent)) if addresses is not sent else None
            async for start, end in self._slices(len(addresses)):
                try:
                    entries += await self.store.pin(addresses[start:end], allow_partial=request.allow_partial,
                                                    tenant=caller.tag)
                except NotFound as exc:
                    raise _stopped_at(exc, start, end, len(addresses)) from None
        except KvError as exc:
            refusal = _status_of(exc), str(exc)
        except BaseException:          # the client gone between slices
            self._unpin_all(entries)
            raise
        if refusal is not None:        # aborted as errors_to_status does, the request out of reach
            self._unpin_all(entries)
            del request, entries
            await context.abort(*refusal)
        held = [e for e in entries if isinstance(e, Pinned)]
        done = 0
        try:
            for entry in entries:
                if isinstance(entry, Miss):
                    yield pb.GetChunk(miss=pb.Miss(address=address_to_pb(_named(entry.address, as_sent)),
                                                   reason=entry.reason))
                    continue
                length = entry.block.length
                yield pb.GetChunk(address=address_to_pb(_named(entry.address, as_sent)), checksum=entry.checksum, total_length=length,
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
        caller = self.callers.of(context)
        digests = await self._decoded("Lookup", request.digests, "digests", _digests, self.lookup_slice)
        digests = list(caller.scope.digests(digests))
        layer = request.layer if request.HasField("layer") else CROSS_LAYER
        r = await lookup_in_slices(self.store, digests, layer, self.lookup_slice, tenant=caller.tag)
        return pb.LookupResponse(longest=r.longest, gpu=r.gpu, ram=r.ram, ssd=r.ssd, peer=r.peer)

    @errors_to_status
    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        caller = self.callers.of(context)
        addresses = _scoped_addresses(caller, await self._addresses("Delete", request))
        deleted, missing = await self.store.delete(addresses, tenant=caller.tag)
        return pb.DeleteResponse(deleted=deleted, not_found=missing)

    @errors_to_status
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        caller = self.callers.of(context)
        if caller.tenant is not None and self.several_tenants:
            return self._tenant_stats(caller.tag or "")
        s = self.store.stats()
        ram = pb.TierStats(tier=pb.TIER_RAM, blocks=s["ram_blocks"], bytes=s["ram_bytes"],
                           reserved_bytes=s["ram_reserved_bytes"], capacity_bytes=s["ram_capacity_bytes"],
                           evictions=s["ram_evictions"])
        tiers = [ram]
        if "ssd_blocks" in s:
            tiers.append(pb.TierStats(tier=pb.TIER_SSD, blocks=s["ssd_blocks"], bytes=s["ssd_bytes"],
                                      reserved_bytes=s["ssd_file_bytes"], capacity_bytes=s["ssd_capacity_bytes"],
                                      evictions=s["ssd_evictions_ttl"] + s["ssd_evictions_capacity"]))
        if self.store.curves is not None:
            self.store.curves.drain()          # the sampled uses still queued (kvcached.store.curves), here on the loop
        curves = await asyncio.to_thread(curve_stats, self.store.curves) if self.store.curves is not None else None
        return pb.StatsResponse(
            version=__version__, uptime_seconds=time.time() - self.started_at, tiers=tiers, curves=curves,
            index_entries=s["index_entries"], puts=s["puts"], put_bytes=s["put_bytes"], hits=s["hits"],
            hit_bytes=s["hit_bytes"], misses=s["misses"], lookups=s["lookups"], deletes=s["deletes"],
            promotions=s["promotions"], demotions=s["demotions"], ram_dirty_bytes=s["ram_dirty_bytes"],
            dirty_dropped=s["ram_dirty_evictions"] if "ssd_blocks" in s else 0, ssd_corrupt=s.get("ssd_corrupt", 0),
            ssd_write_errors=s.get("ssd_write_errors", 0), ssd_reconciled=bool(s.get("ssd_reconciled", 0)),
            agents=s["agents"], agent_held_bytes=s["held_bytes"], gpu_blocks=s["gpu_blocks"],
            loads_skipped_ssd=s["loads_skipped_ssd"], loads_skipped_peer=s["loads_skipped_peer"],
            hash_threads=s["hash_threads"], ssd_io_threads=s.get("ssd_io_threads", 0), **_peer_stats(self.store))

    def _tenant_stats(self, tag: str) -> pb.StatsResponse:
        """A tenant's own Stats: its blocks in RAM and on SSD and its own puts and reads; what
        counts the whole store (the index, peers, agents) stays zero."""
        blocks, nbytes = self.store.ram.held_by_tenant(tag)
        c = self.store.tally.by.get(tag) or TenantCounts()
        tiers = [pb.TierStats(tier=pb.TIER_RAM, blocks=blocks, bytes=nbytes, capacity_bytes=self.store.ram.capacity)]
        ssd = self.store.ssd
        if ssd is not None:
            blocks, nbytes = ssd.held_by_tenant(tag)
            tiers.append(pb.TierStats(tier=pb.TIER_SSD, blocks=blocks, bytes=nbytes, capacity_bytes=ssd.capacity))
        return pb.StatsResponse(version=__version__, uptime_seconds=time.time() - self.started_at, tiers=tiers,
                                puts=c.puts, put_bytes=c.put_bytes, hits=c.hits, hit_bytes=c.hit_bytes, misses=c.misses,
                                lookups=c.lookups)

    @errors_to_status
    async def Overlap(self, request: pb.OverlapRequest, context: grpc.aio.ServicerContext) -> pb.OverlapResponse:
        caller = self.callers.of(context)
        digests = await self._decoded("Overlap", request.digests, "digests", _digests, self.lookup_slice)
        overlap = self.store.gpu.overlap(caller.scope.digests(digests), tenant=caller.tag)
        return pb.OverlapResponse(agents=[pb.AgentOverlap(session=info.session, agent_id=info.agent_id, pid=info.pid,
                                                          prefix=prefix) for info, prefix in overlap])

    @errors_to_status
    async def ListBlocks(self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext) -> pb.ListBlocksResponse:
        caller = self.callers.of(context)
        tier = _TIER_FILTER.get(request.tier)
        if tier is None:
            raise InvalidArgument(f"cannot filter by tier {tier_name(request.tier)}; use TIER_RAM, TIER_SSD, TIER_GONE or none")
        records, token = self.store.list_blocks(model=request.model, tier=tier, page_token=request.page_token,
                                                page_size=request.page_size, tenant=caller.tag)
        return pb.ListBlocksResponse(blocks=[block_info(r) for r in records], next_page_token=token)
