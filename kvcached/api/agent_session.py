"""One agent connection's state and its answers to requests (no sockets here).

A session is what the daemon knows of one connected agent: who it is (Hello, and the peer
credentials the kernel vouches for), the slots it reserved and has not committed, the blocks it
loaded and has not released, and (in the store's GPU view) the blocks it holds on its GPU.
Handles are numbers private to the session, so an agent can commit or release only what it was
given. :meth:`AgentSession.close` gives everything back; it runs whenever the connection ends,
however it ends (EOF, SIGKILL of the agent, a heartbeat timeout, a protocol error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from itertools import count
from typing import Iterator, Sequence, TypeGuard, TypeVar, Union, cast

from kvcached.api.slices import SLICE, lookup_in_slices, plan_in_slices, present_in_slices
from kvcached.errors import DataLoss, FailedPrecondition, InvalidArgument, KvError, NotFound, ResourceExhausted, Unavailable
from kvcached.host import short_hash
from kvcached.host.pace import TokenBucket
from kvcached.policies.load_cost import LoadPlan
from kvcached.store import CommitOutcome, Miss, Pinned, Presence, SlotRefusal, Store
from kvcached.store.gpu_view import GpuViewFull
from kvcached.tenants import Scope, Tenant
from kvcached.tiers.ram import RamBlock
from kvcached_agent import protocol as p
from kvcached_agent.address import BlockAddress
from kvcached_agent.route import decode_routes

__all__ = ["LOCATING", "WAITING", "AgentSession", "PeerCredentials", "Waiting", "check_hello", "error_code", "scoped"]

log = logging.getLogger("kvcached.agent")

_SLOT_STATUS = {SlotRefusal.PRESENT: p.Status.PRESENT, SlotRefusal.BUSY: p.Status.BUSY, SlotRefusal.FULL: p.Status.FULL,
                SlotRefusal.INVALID: p.Status.INVALID, SlotRefusal.DECLINED: p.Status.DECLINED}
_COMMIT_STATUS = {None: p.Status.OK, CommitOutcome.FAILED: p.Status.FAILED, CommitOutcome.UNKNOWN: p.Status.UNKNOWN_HANDLE,
                  CommitOutcome.DECLINED: p.Status.DECLINED}
_CODES: list[tuple[type[KvError], p.ErrorCode]] = [
    (InvalidArgument, p.ErrorCode.INVALID_ARGUMENT), (NotFound, p.ErrorCode.NOT_FOUND),
    (ResourceExhausted, p.ErrorCode.RESOURCE_EXHAUSTED), (FailedPrecondition, p.ErrorCode.FAILED_PRECONDITION),
    (DataLoss, p.ErrorCode.DATA_LOSS), (Unavailable, p.ErrorCode.UNAVAILABLE)]


_M = TypeVar("_M", bound=p.Message)

WAITING = (p.Allocate, p.Commit, p.Load)    # requests answered by AgentSession.handle_waiting
LOCATING = (p.Lookup, p.Present, p.PlanLoads)   # ... and these in a cluster, once the homes are asked, or when long
Waiting = Union[p.Allocate, p.Commit, p.Load, p.Lookup, p.Present, p.PlanLoads, p.Route]
ROUTE_SLICE_BYTES = 16 << 10    # engine keys checked at a time; a Route frame of more is a task
ROUTE_BYTES_PER_S = 16 << 20    # engine keys one connection may send a second (a burst of as many); more wait


def route_bytes(message: p.Route) -> int:
    """The engine keys a Route carries, in bytes."""
    return sum(len(blob) for _, _, blob in message.entries)


def error_code(exc: KvError) -> p.ErrorCode:
    return next((code for cls, code in _CODES if isinstance(exc, cls)), p.ErrorCode.INTERNAL)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """What the kernel says about the process at the other end (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def check_hello(hello: p.Hello, max_block_bytes: int) -> str | None:
    """What is wrong with a Hello, or None."""
    if hello.version != p.VERSION:
        return f"agent speaks protocol version {hello.version}; this daemon speaks {p.VERSION}"
    if not hello.agent_id:
        return "agent_id must not be empty"
    if not hello.model or not hello.dtype:
        return "model and dtype must not be empty"
    if hello.block_tokens == 0 or hello.num_layers == 0 or hello.layer_block_bytes == 0:
        return "block_tokens, num_layers and layer_block_bytes must be positive"
    if hello.layer_block_bytes > max_block_bytes:
        return (f"a block of one layer is {hello.layer_block_bytes} bytes, over this daemon's limit of "
                f"{max_block_bytes} (kv.max_block_mib)")
    return None


def load_plan(plan: LoadPlan, held: int) -> p.LoadPlan:
    """A PlanLoads' answer."""
    return p.LoadPlan(plan.load, held, plan.loaded.get("ram", 0), plan.loaded.get("ssd", 0), plan.skipped.get("ssd", 0),
                      plan.skipped.get("peer", 0), plan.seconds, plan.load_all, plan.recompute_all)


def present_result(presence: Presence) -> p.PresentResult:
    """A Present's answer: the HELD_* flags of each block."""
    return p.PresentResult(bytes(
        (p.HELD_GPU if gpu else 0) | (p.HELD_RAM if ram else 0) | (p.HELD_SSD if ssd else 0) | (p.HELD_PEER if peer else 0)
        for gpu, ram, ssd, peer in zip(presence.gpu, presence.ram, presence.ssd, presence.peer)))


class AgentSession:
    def __init__(self, store: Store, session: int, hello: p.Hello, peer: PeerCredentials,
                 tenant: Tenant | None = None) -> None:
        self.store = store
        self.session = session
        self.hello = hello
        self.peer = peer
        #: The tenant the kernel's word on the agent names (kvcached.tenants): every digest the
        #: agent sends is mapped to this tenant's addresses first (None: the default tenant's).
        self.tenant = tenant
        self._scope = None if tenant is None or tenant.scope.identity else tenant.scope
        self._tag = tenant.tag if tenant is not None else ""     # whose blocks it saves and loads
        self.closed = False
        self._handles: Iterator[int] = count(1)
        self._writes: dict[int, tuple[BlockAddress, RamBlock]] = {}   # reserved, not committed
        self._reads: dict[int, Pinned] = {}                           # loaded, not released
        self._slicing = asyncio.Lock()                                # its long lookups, one at a time
        self._route_pace = TokenBucket(ROUTE_BYTES_PER_S, time.monotonic())   # the engine keys it sends
        store.gpu.add_agent(session, hello.agent_id, peer.pid, self._tag)

    def waits(self, message: p.Message, asks_homes: bool) -> TypeGuard[Waiting]:
        """Whether ``message`` is answered by :meth:`handle_waiting` (as a task, so the
        connection's next requests and other agents' are read meanwhile): Allocate, Commit and
        Load; Lookup, Present and PlanLoads in a cluster (the homes are asked first) or of more
        than :data:`kvcached.api.slices.SLICE` digests (done a slice at a time); a Route of
        more than :data:`ROUTE_SLICE_BYTES` of keys (checked a slice at a time), or one this
        connection's pace (:data:`ROUTE_BYTES_PER_S`) makes wait."""
        if isinstance(message, p.Route):
            size = route_bytes(message)
            return size > ROUTE_SLICE_BYTES or not self._route_pace.has(size, time.monotonic())
        return isinstance(message, WAITING) or (isinstance(message, LOCATING)
                                                and (asks_homes or len(message.digests) > SLICE))

    @property
    def held(self) -> tuple[int, int]:
        """(slots reserved, blocks pinned) right now."""
        return len(self._writes), len(self._reads)

    def handle(self, message: p.Message) -> p.Message | None:
        """The answer to a request that never waits (None for events); store errors become
        Error messages. Allocate, Commit and Load go to :meth:`handle_waiting`."""
        return self._answer(scoped(message, self._scope) if self._scope is not None else message)

    def _answer(self, message: p.Message) -> p.Message | None:
        """:meth:`handle` once the message names its tenant's addresses."""
        try:
            if isinstance(message, p.Lookup):
                r = self.store.lookup(message.digests, message.layer, agent=self.session, tenant=self._tag)
                return p.LookupResult(r.longest, r.gpu, r.ram, r.ssd, r.peer)
            if isinstance(message, p.Present):
                return present_result(self.store.present(message.digests, message.layer, agent=self.session,
                                                         tenant=self._tag))
            if isinstance(message, p.PlanLoads):
                return load_plan(*self.store.plan(message.digests, message.layer, message.recompute_s,
                                                  message.block_bytes, agent=self.session, tenant=self._tag))
            if isinstance(message, p.Release):
                return self._release(message)
            if isinstance(message, (p.Pinned, p.Evicted)):
                return self._gpu_event(message)
            if isinstance(message, p.Heartbeat):
                return None
            if isinstance(message, p.Route):
                return self._routes(message)
            if isinstance(message, p.Features):
                return p.FeatureSet(p.FeatureSet.ROUTE_KEYS if self.store.wants_routes else 0)
            if isinstance(message, p.Overlap):
                return overlap_result(self.store, message.digests, self._tag)
            if isinstance(message, p.Hello):
                return p.Error(p.ErrorCode.HANDSHAKE, "this connection has said Hello already")
            return p.Error(p.ErrorCode.UNKNOWN_TYPE, f"{type(message).__name__} is not a request an agent may send")
        except KvError as exc:
            return p.Error(error_code(exc), str(exc))

    async def handle_waiting(self, message: Waiting) -> p.Message | None:
        """The answer to an Allocate (it may wait for write-back back-pressure), a Commit or a
        Load (they may wait for checksums, the SSD, promotions), or a Lookup, Present or
        PlanLoads in a cluster or of many digests (:meth:`_locating`), or a long Route (None,
        or an Error)."""
        if isinstance(message, LOCATING):
            return await self._locating(message)
        if self._scope is not None:
            message = scoped(message, self._scope)
        if isinstance(message, p.Route):
            return await self._routes_in_slices(message)
        try:
            if isinstance(message, p.Allocate):
                await self.store.throttle_writes()
                if self.closed:      # the agent went away while it waited: reserve nothing for it
                    return p.Error(p.ErrorCode.UNAVAILABLE, "connection closed")
                return self._allocate(message)
            if isinstance(message, p.Commit):
                return await self._commit(message)
            return await self._load(message)
        except KvError as exc:
            return p.Error(error_code(exc), str(exc))

    async def _locating(self, message: p.Lookup | p.Present | p.PlanLoads) -> p.Message:
        """A Lookup, Present or PlanLoads a slice of digests at a time (kvcached.api.slices), the
        tenant's mapping too, other requests running between slices; in a cluster the homes are
        asked where remote blocks are first. An agent's long requests take their turns: so an
        agent with many in flight costs others a slice's wait, not one per request."""
        if len(message.digests) > SLICE:      # one long one at a time per agent: the others' slices wait their turn
            async with self._slicing:
                return await self._located(message)
        return await self._located(message)

    async def _located(self, message: p.Lookup | p.Present | p.PlanLoads) -> p.Message:
        store, scope, tag = self.store, self._scope, self._tag
        try:
            if isinstance(message, p.Lookup):
                r = await lookup_in_slices(store, message.digests, message.layer, SLICE, tag, agent=self.session,
                                           scope=scope)
                return p.LookupResult(r.longest, r.gpu, r.ram, r.ssd, r.peer)
            if isinstance(message, p.Present):
                return present_result(await present_in_slices(store, message.digests, message.layer, SLICE, tag,
                                                              agent=self.session, scope=scope))
            return load_plan(*await plan_in_slices(store, message.digests, message.layer, message.recompute_s,
                                                   message.block_bytes, SLICE, tag, agent=self.session, scope=scope))
        except KvError as exc:
            return p.Error(error_code(exc), str(exc))

    def _allocate(self, message: p.Allocate) -> p.Slots:
        asked = message.entries
        addresses = short_hash.addresses([e[0] for e in asked], [e[1] for e in asked])
        results = self.store.reserve([(a, e[2]) for a, e in zip(addresses, asked)], self._tag)
        entries: list[tuple[int, int, int]] = []
        for address, result in zip(addresses, results):
            if isinstance(result, SlotRefusal):
                entries.append((_SLOT_STATUS[result], 0, 0))
            else:
                handle = next(self._handles)
                self._writes[handle] = (address, result)
                entries.append((p.Status.OK, handle, self.store.offset_of(result)))
        return p.Slots(entries)

    async def _commit(self, message: p.Commit) -> p.Committed:
        found = [self._writes.pop(h, None) for h in message.handles]
        results = iter(await self.store.commit_written([w for w in found if w is not None], self.hello.model,
                                                       self._tag))
        return p.Committed([p.Status.UNKNOWN_HANDLE if w is None else _COMMIT_STATUS[next(results)] for w in found])

    async def _load(self, message: p.Load) -> p.Loaded:
        asked = message.entries
        addresses = short_hash.addresses([e[0] for e in asked], [e[1] for e in asked])
        results = await self.store.pin(addresses, allow_partial=True, tenant=self._tag)
        entries: list[tuple[int, int, int, int]] = []
        for result in results:
            if isinstance(result, Miss):
                entries.append((p.Status.MISS, 0, 0, 0))
            elif self.closed:          # the agent went away while its blocks were read
                self.store.unpin(result)
                entries.append((p.Status.MISS, 0, 0, 0))
            else:
                handle = next(self._handles)
                self._reads[handle] = result
                entries.append((p.Status.OK, handle, self.store.offset_of(result.block), result.block.length))
        return p.Loaded(entries)

    def _release(self, message: p.Release) -> p.Released:
        released = unknown = 0
        reads = self._reads
        pins = []
        try:
            for handle in message.handles:
                pinned = reads.pop(handle, None)
                if pinned is not None:
                    pins.append(pinned)
                    continue
                write = self._writes.pop(handle, None)
                if write is not None:
                    self.store.abort_reserved(write[1], write[0])
                    released += 1
                else:
                    unknown += 1
        finally:
            self.store.unpin_many(pins)       # the loads, in one pass
        return p.Released(released + len(pins), unknown)

    def _routes(self, message: p.Route) -> p.Error | None:
        """Keep the engine's keys of blocks about to be saved (their KV events carry them): each
        checked first, so no undecodable bytes are ever published; any bad one refuses the frame.
        A short frame the connection's pace allows (:meth:`waits`); the others go through
        :meth:`_routes_in_slices`."""
        if not self.store.wants_routes:
            return None
        self._route_pace.charge(route_bytes(message), time.monotonic())
        for digest, _, blob in message.entries:
            try:
                decode_routes(blob)
            except ValueError as exc:
                return p.Error(p.ErrorCode.INVALID_ARGUMENT, f"Route of block {digest.hex()[:16]}: {exc}")
        self.store.keep_routes(message.entries, self.session)
        return None

    async def _routes_in_slices(self, message: p.Route) -> p.Error | None:
        """:meth:`_routes` for a long frame, its keys checked :data:`ROUTE_SLICE_BYTES` at a
        time, other agents' requests running between slices (the connection sends nothing
        more meanwhile: kvcached.api.agent_server holds it)."""
        if not self.store.wants_routes:
            return None
        entries = message.entries
        start = 0
        while start < len(entries):
            end, size = start, 0
            while end < len(entries) and (end == start or size + len(entries[end][2]) <= ROUTE_SLICE_BYTES):
                size += len(entries[end][2])
                end += 1
            # Each connection's keys are checked at its pace at most: one sending without
            # pause costs the event loop a bounded share, and waits here, its connection held.
            await asyncio.sleep(self._route_pace.charge(size, time.monotonic()))
            for digest, _, blob in entries[start:end]:
                try:
                    decode_routes(blob)
                except ValueError as exc:
                    return p.Error(p.ErrorCode.INVALID_ARGUMENT, f"Route of block {digest.hex()[:16]}: {exc}")
            start = end
        if not self.closed:
            self.store.keep_routes(message.entries, self.session)
        return None

    def _gpu_event(self, message: p.Pinned | p.Evicted) -> p.Error | None:
        if isinstance(message, p.Evicted):
            self.store.gpu.evicted(self.session, message.digests)
            return None
        try:
            self.store.gpu.pinned(self.session, message.digests)
        except GpuViewFull as exc:
            return p.Error(p.ErrorCode.RESOURCE_EXHAUSTED, str(exc))
        return None

    def close(self) -> tuple[int, int, int]:
        """Give back everything the agent held: reserved slots, pinned blocks, its GPU view, the
        engine keys it offered for saves never reserved. Returns (slots, pins, gpu blocks)
        released. Safe to call twice."""
        if self.closed:
            return 0, 0, 0
        self.closed = True
        writes, reads = list(self._writes.values()), list(self._reads.values())
        self._writes.clear()
        self._reads.clear()
        for address, block in writes:
            try:
                self.store.abort_reserved(block, address)
            except Exception:       # one bad entry must not leak the rest
                log.exception("releasing a reserved slot failed", extra={"fields": {"session": self.session}})
        for pinned in reads:
            try:
                self.store.unpin(pinned)
            except Exception:
                log.exception("releasing a pinned block failed", extra={"fields": {"session": self.session}})
        gpu = self.store.gpu.drop_agent(self.session)
        self.store.drop_routes(self.session)
        return len(writes), len(reads), gpu


def scoped(message: _M, scope: Scope) -> _M:
    """``message`` with every digest it names mapped to ``scope``'s addresses (messages that
    name none are returned as they are)."""
    return cast(_M, _scoped(message, scope))


def _scoped(message: p.Message, scope: Scope) -> p.Message:
    if isinstance(message, p.Allocate):
        return p.Allocate([(scope.digest(d), layer, size) for d, layer, size in message.entries])
    if isinstance(message, p.Load):
        return p.Load([(scope.digest(d), layer) for d, layer in message.entries])
    if isinstance(message, (p.Lookup, p.Present)):
        return type(message)(message.layer, scope.digests(message.digests))
    if isinstance(message, (p.Overlap, p.Pinned, p.Evicted)):
        return type(message)(scope.digests(message.digests))
    if isinstance(message, p.Route):
        return p.Route([(scope.digest(d), layer, blob) for d, layer, blob in message.entries])
    if isinstance(message, p.PlanLoads):
        return p.PlanLoads(message.layer, message.recompute_s, message.block_bytes, scope.digests(message.digests))
    return message


def overlap_result(store: Store, digests: Sequence[bytes], tenant: str | None = None) -> p.OverlapResult:
    """Every connected agent (of ``tenant``, a Tenant.tag, where given) with the prefix of
    ``digests`` it holds on its GPU, longest first."""
    return p.OverlapResult([p.AgentPrefix(info.session, info.pid, prefix, info.agent_id)
                            for info, prefix in store.gpu.overlap(digests, tenant)])
