"""Requests of many digests done a slice at a time, other requests running between slices: the
gRPC Lookup and the agent socket's Lookup, Present and PlanLoads (docs/security.md, "Bounded
work per request"). Each slice is one call of the store, so the largest allowed request delays a
concurrent small one by a slice's work (a few milliseconds), not the whole batch's (the store's
Lookup of 65,536 digests on SSD takes about 0.4 s). The answers are the ones a single call gives
on a store nobody changes meanwhile: under concurrent saves and evictions each slice sees the
store as it is when its turn comes (a Lookup is a hint either way).

``scope`` maps the caller's digests to its tenant's addresses slice by slice too (a keyed
BLAKE3 a digest: 65,536 of them take about 50 ms).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from kvcached.policies.load_cost import LoadPlan
from kvcached.store import LookupResult, Store
from kvcached.store.gpu_view import GpuView
from kvcached.store.results import Presence
from kvcached.tenants import Scope

__all__ = ["SLICE", "lookup_in_slices", "plan_in_slices", "present_in_slices"]

SLICE = 512          # digests a slice of the agent socket's requests (as grpc.lookup_slice's default)
PLAN_SLICE = 8192    # blocks of a load plan scanned at a time (about 3 ms)


@dataclass(slots=True)
class _Run:
    """A count from the first digest of a chain, put together slice by slice: a slice's count
    adds to it while every earlier slice counted whole."""

    count: int = 0
    open: bool = True

    def add(self, count: int, length: int) -> None:
        if self.open:
            self.count += count
            self.open = count == length


class _AgentRun:
    """:meth:`GpuView.longest` (the longest prefix any one agent holds) slice by slice: after the
    first slice only the agents that held every earlier slice whole can make it longer."""

    def __init__(self, view: GpuView, tenant: str | None) -> None:
        self.view = view
        self.tenant = tenant
        self.count = 0
        self.holders: list[int] | None = None     # sessions that held every slice so far; None: no slice yet

    @property
    def open(self) -> bool:
        return self.holders is None or bool(self.holders)

    def add(self, part: Sequence[bytes]) -> None:
        if not self.open:
            return
        if self.holders is None:
            runs = [(info.session, held) for info, held in self.view.overlap(part, self.tenant)]
        else:
            runs = [(session, self.view.prefix(session, part)) for session in self.holders]
        self.count += max((held for _, held in runs), default=0)
        self.holders = [session for session, held in runs if held == len(part)]


def _mapped(scope: Scope | None, part: Sequence[bytes]) -> Sequence[bytes]:
    return part if scope is None else scope.digests(part)


async def _located(store: Store, digests: Sequence[bytes], layer: int,
                   scope: Scope | None) -> tuple[Sequence[bytes], Scope | None]:
    """In a cluster, the homes asked where the chain's remote blocks are first (about the whole
    chain, so its digests are mapped at once, and no more slice by slice); elsewhere nothing."""
    if not store.asks_homes:
        return digests, scope
    digests = _mapped(scope, digests)
    await store.locate(digests, layer)
    return digests, None


async def lookup_in_slices(store: Store, digests: Sequence[bytes], layer: int, size: int,
                           tenant: str | None = "", *, agent: int | None = None,
                           scope: Scope | None = None) -> LookupResult:
    """``store.lookup(digests, layer, agent)`` in slices of ``size`` digests; it stops after the
    first slice past which no count can grow, so a chain that misses early costs one slice.
    Each slice is one lookup in the store's counters (``lookups``, the read-latency histogram),
    ``tenant``'s (a Tenant.tag, whose blocks alone count; None: the operator's, everyone's).

    ``ram``, ``longest``, ``ssd`` and ``peer`` are runs from the first digest of a test on one
    block at a time (in RAM; in some tier; on SSD; held by a usable peer), which Store.lookup
    answers for any chain, so a slice's run adds to the chain's while the chain's run reached
    the slice (:class:`_Run`); so is ``gpu`` for an ``agent`` asking for itself. Without one
    ``gpu`` is the longest run of any one agent, not of a per-block test (:class:`_AgentRun`)."""
    digests, scope = await _located(store, digests, layer, scope)
    if len(digests) <= size:
        return store.lookup(_mapped(scope, digests), layer, agent, tenant)
    ram, longest, ssd, peer, own_gpu = _Run(), _Run(), _Run(), _Run(), _Run()
    gpu = _AgentRun(store.gpu, tenant)
    for start in range(0, len(digests), size):
        if start:
            await asyncio.sleep(0)
        part = _mapped(scope, digests[start:start + size])
        found = store.lookup(part, layer, agent, tenant)
        for run, count in ((ram, found.ram), (longest, found.longest), (ssd, found.ssd), (peer, found.peer)):
            run.add(count, len(part))
        if agent is None:
            gpu.add(part)
        else:
            own_gpu.add(found.gpu, len(part))
        if not any(run.open for run in (ram, longest, ssd, peer, own_gpu if agent is not None else gpu)):
            break
    return LookupResult(longest=longest.count, ram=ram.count, ssd=ssd.count,
                        gpu=own_gpu.count if agent is not None else gpu.count, peer=peer.count)


async def present_in_slices(store: Store, digests: Sequence[bytes], layer: int, size: int,
                            tenant: str | None = "", *, agent: int | None = None,
                            scope: Scope | None = None) -> Presence:
    """``store.present(digests, layer, agent, tenant)`` in slices of ``size`` digests (each
    block's tiers on its own: the slices' answers joined)."""
    digests, scope = await _located(store, digests, layer, scope)
    gpu: list[bool] = []
    ram: list[bool] = []
    ssd: list[bool] = []
    peer: list[bool] = []
    for start in range(0, len(digests), size):
        if start:
            await asyncio.sleep(0)
        seen = store.present(_mapped(scope, digests[start:start + size]), layer, agent, tenant)
        gpu += seen.gpu
        ram += seen.ram
        ssd += seen.ssd
        peer += seen.peer
    return Presence(gpu=gpu, ram=ram, ssd=ssd, peer=peer)


async def plan_in_slices(store: Store, digests: Sequence[bytes], layer: int, recompute_s: float, block_bytes: int,
                         size: int, tenant: str | None = "", *, agent: int | None = None,
                         scope: Scope | None = None) -> tuple[LoadPlan, int]:
    """``store.plan(...)``: which held blocks are worth loading, from the presence of each block
    asked in slices (:func:`present_in_slices`), then planned a part at a time."""
    seen = await present_in_slices(store, digests, layer, size, tenant, agent=agent, scope=scope)
    scan = store.plan_scan(seen, recompute_s, block_bytes)
    while not scan.step(PLAN_SLICE):
        await asyncio.sleep(0)
    return scan.result()
