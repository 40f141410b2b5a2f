"""The gRPC Admin service: operating one daemon (docs/admin.md).

A thin translation, as grpc_service.py is: selectors and tiers from protobuf, the work in the
store (Store.delete, drop_from_ram, drop_from_ssd, demote) and the daemon (configuration,
reconcile reports, peers). Who may call the state-changing calls is decided before a call gets
here, by the listener it came in on (kvcached.api.access).

Evict takes at most ``grpc.max_batch`` digests and, like Drain, works ``grpc.batch_slice``
blocks at a time, letting other requests run between slices (docs/api.md "Limits").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Protocol

import grpc

from kvcached.api.callers import OPERATOR, Caller, Callers
from kvcached.api.grpc_service import check_batch, check_digests, errors_to_status
from kvcached.config import Config, to_toml
from kvcached.errors import FailedPrecondition, InvalidArgument
from kvcached.host.logs import set_level
from kvcached.store import Store
from kvcached.store.adoption import RamAdoption
from kvcached.tiers.ssd import SsdTier
from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc
from kvcached_agent.address import CROSS_LAYER, BlockAddress

__all__ = ["AdminService", "Operated"]

log = logging.getLogger("kvcached.admin")


class PeerStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


class Operated(Protocol):
    """What the Admin service reads of the daemon it operates (kvcached.lifecycle.daemon.Daemon is one),
    each read when a call needs it: SIGHUP replaces the configuration, the peer tier and the
    reconcile reports arrive after the service starts."""

    @property
    def config(self) -> Config: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def ssd(self) -> SsdTier | None: ...
    @property
    def peers(self) -> PeerStats | None: ...          # the peer tier, once it is up
    @property
    def index_reconcile(self) -> dict[str, Any]: ...
    @property
    def ssd_reconcile_summary(self) -> dict[str, Any]: ...
    @property
    def adoption(self) -> RamAdoption | None: ...     # the previous process's RAM tier, taken up
    @property
    def ram_adoption_summary(self) -> dict[str, Any]: ...


class AdminService(pb_grpc.AdminServicer):
    """The Admin RPCs over an :class:`Operated` daemon (see the module)."""

    def __init__(self, daemon: Operated, callers: Callers | None = None) -> None:
        """``callers``: which tenant an Evict acts as (the operator may name one; None: none)."""
        self.daemon = daemon
        self.callers = callers
        self.max_batch = daemon.config.grpc.max_batch
        self.batch_slice = daemon.config.grpc.batch_slice   # blocks evicted or dropped between yields to requests

    @property
    def store(self) -> Store:
        assert self.daemon.store is not None
        return self.daemon.store

    @errors_to_status
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        tier = {pb.TIER_UNSPECIFIED: "all", pb.TIER_RAM: "ram", pb.TIER_SSD: "ssd"}.get(request.tier)
        if tier is None:
            raise InvalidArgument(f"tier must be TIER_RAM, TIER_SSD or unset (every tier), got {pb.Tier.Name(request.tier)}")
        if tier == "ssd" and self.store.ssd is None:
            raise FailedPrecondition("this daemon has no SSD tier (kv.ssd_gib = 0)")
        if bool(request.model) == bool(request.digests):
            raise InvalidArgument("name either a model or digests (one of the two)")
        check_batch("Evict", len(request.digests), "digests", self.max_batch)
        caller = self.callers.of(context) if self.callers is not None else OPERATOR
        evicted = busy = absent = 0
        async for addresses in self._selected(request, caller):
            if tier == "all":
                deleted, missing = await self.store.delete(addresses, skip_busy=True, tenant=caller.tag)
                counts = (deleted, len(set(addresses)) - deleted - missing, missing)
            elif tier == "ram":
                counts = self.store.drop_from_ram([a.key for a in addresses])
            else:
                counts = await self.store.drop_from_ssd([a.key for a in addresses])
            evicted, busy, absent = evicted + counts[0], busy + counts[1], absent + counts[2]
            await asyncio.sleep(0)
        log.info("evicted on request", extra={"fields": {"model": request.model or None, "tier": tier,
                                                         "evicted": evicted, "busy": busy}})
        return pb.EvictResponse(evicted=evicted, busy=busy, not_found=absent)

    async def _selected(self, request: pb.EvictRequest, caller: Caller) -> AsyncIterator[list[BlockAddress]]:
        """The request's blocks in slices: its digests (mapped to the caller's tenant's), or every
        indexed block of its model (of the caller's tenant, where it names one)."""
        if request.digests:
            digests = list(request.digests)
            check_digests(digests)
            digests = list(caller.scope.digests(digests))
            layer = request.layer if request.HasField("layer") else CROSS_LAYER
            for i in range(0, len(digests), self.batch_slice):
                yield [BlockAddress(d, layer) for d in digests[i:i + self.batch_slice]]
            return
        token = b""
        while True:        # the listing is taken in pages first: evicting changes what it walks
            records, token = self.store.list_blocks(model=request.model, page_token=token, page_size=self.batch_slice,
                                                    tenant=caller.tag)
            if records:
                yield [BlockAddress(r.digest, r.layer) for r in records]
            if not token:
                return
            await asyncio.sleep(0)

    @errors_to_status
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        if request.tier != pb.TIER_RAM:
            raise InvalidArgument("only the RAM tier can be drained (TIER_RAM); to empty the SSD tier, Evict "
                                  "with tier TIER_SSD")
        store = self.store
        if store.ssd is None:
            raise FailedPrecondition("this daemon has no SSD tier: draining RAM would lose every block "
                                     "(use Evict or Delete to drop blocks on purpose)")
        written = await store.write_back_all()
        dropped = busy = 0
        keys = store.ram.keys()
        for i in range(0, len(keys), self.batch_slice):
            d, b, _ = store.drop_from_ram(keys[i:i + self.batch_slice])
            dropped, busy = dropped + d, busy + b
            await asyncio.sleep(0)
        log.info("RAM tier drained", extra={"fields": {"written_back": written, "dropped": dropped, "busy": busy}})
        return pb.DrainResponse(written_back=written, dropped=dropped, busy=busy)

    @errors_to_status
    async def GetConfig(self, request: pb.GetConfigRequest,
                        context: grpc.aio.ServicerContext) -> pb.GetConfigResponse:
        return pb.GetConfigResponse(toml=to_toml(self.daemon.config))

    @errors_to_status
    async def ListAgents(self, request: pb.ListAgentsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListAgentsResponse:
        return pb.ListAgentsResponse(agents=[
            pb.AgentInfo(session=a.session, agent_id=a.agent_id, pid=a.pid, gpu_blocks=len(a.blocks))
            for a in self.store.gpu.agents()])

    @errors_to_status
    async def ListPeers(self, request: pb.ListPeersRequest, context: grpc.aio.ServicerContext) -> pb.ListPeersResponse:
        peers = self.daemon.peers
        stats = peers.stats()["peers"] if peers is not None else {}
        out = []
        for entry in self.daemon.config.quic.peers:
            st = stats.get(entry["name"], {})
            out.append(pb.PeerInfo(name=entry["name"], address=entry["address"], state=st.get("state", ""),
                                   up=st.get("up", False), connected=st.get("connected", False),
                                   blocks=st.get("blocks", 0), last_error=st.get("last_error") or ""))
        return pb.ListPeersResponse(peers=out)

    @errors_to_status
    async def ReconcileStatus(self, request: pb.ReconcileStatusRequest,
                              context: grpc.aio.ServicerContext) -> pb.ReconcileStatusResponse:
        d = self.daemon
        summary = d.ssd_reconcile_summary
        return pb.ReconcileStatusResponse(
            index_records=d.index_reconcile.get("seen", 0), index_seconds=d.index_reconcile.get("elapsed_s", 0.0),
            ssd_enabled=d.ssd is not None, ssd_done=self.store.ssd_reconciled if d.ssd is not None else False,
            ssd_summary=" ".join(f"{k}={v}" for k, v in summary.items()),
            ram_taken_over=d.adoption is not None, ram_done=d.adoption is not None and d.adoption.report.done,
            ram_summary=" ".join(f"{k}={v}" for k, v in d.ram_adoption_summary.items()))

    @errors_to_status
    async def SetLogLevel(self, request: pb.SetLogLevelRequest,
                          context: grpc.aio.ServicerContext) -> pb.SetLogLevelResponse:
        try:
            previous = set_level(request.level, request.logger)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        log.warning("log level changed", extra={"fields": {"logger": request.logger or "root", "level": request.level,
                                                           "previous": previous}})
        return pb.SetLogLevelResponse(previous=previous)
