"""Pulling blocks from peers into this daemon's RAM (the read path's last resort).

:meth:`PeerPulls.pull` (the read path calls it for blocks no local tier holds) fetches through
the peer tier (kvcached.peers.tier.PeerTier.fetch, seen here only as :class:`PeerTierLike`)
straight into reserved arena slots, then commits what arrived verified: recorded and, under
write-back, headed for SSD when ``mirror_pulls`` is on; else held only until read
(``transient``: never indexed, its checksum kept here until the last reader unpins it). Serving
a peer's pull is the peer side's (kvcached.peers.store_link): the store speaks no peer wire.

Runs on the event loop; the fetch itself runs in a task no caller can cancel.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from kvcached.errors import Unavailable
from kvcached.index import BlockRecord, Tier
from kvcached.store.inflight import pin_arrived, release_view
from kvcached.store.parts import Room, StoreParts
from kvcached.tiers.ram import WRITING, RamBlock, RamFull
from kvcached_agent.address import BlockAddress

# A pull that brought nothing after this long timed out rather than missed (a holder answers a
# miss within a round trip): the delivery estimate counts it as one byte in that time.
SILENT_S = 0.25

if TYPE_CHECKING:
    from kvcached.store.ssd_mover import SsdMover
    from kvcached.store.write_path import WritePath

__all__ = ["PeerPulls", "PeerTierLike"]

log = logging.getLogger("kvcached.store")

Handle = tuple[RamBlock, memoryview]


class PeerTierLike(Protocol):
    """What the store asks of the peer tier (kvcached.peers.tier.PeerTier)."""

    def may_hold(self) -> Callable[[BlockAddress], bool]: ...
    def held(self, digests: Sequence[bytes], layer: int) -> list[bool]: ...
    @property
    def asks_homes(self) -> bool: ...
    async def locate(self, digests: Sequence[bytes], layer: int) -> None: ...
    async def fetch(self, addresses: Sequence[BlockAddress], reserve: Callable[[BlockAddress, int], Any],
                    abort: Callable[[Any], None], tenant: str = "") -> list[tuple[BlockAddress, Any, Any]]: ...
    def stats(self) -> dict[str, Any]: ...


class PeerPulls(Room):
    """Pulls from peers into this daemon's RAM (see the module). ``peers`` is the peer tier,
    None while [quic] is off (set by the daemon)."""

    def __init__(self, parts: StoreParts, writer: "WritePath", mover: "SsdMover | None") -> None:
        super().__init__(parts)
        self.writer = writer
        self.mover = mover
        self.peers: PeerTierLike | None = None
        self.transient: dict[bytes, bytes] = {}   # pulled, not mirrored: key -> checksum, dropped once read

    async def pull(self, addresses: list[BlockAddress], deadline: float | None = None,
                   tenant: str = "") -> list[RamBlock]:
        """Pull blocks from peers into RAM; returns them pinned. A block another request is
        pulling or promoting is waited for, not pulled twice. The work runs in a task no caller
        can cancel; the peer tier bounds it by its pull deadline. ``tenant``: whose blocks
        (Tenant.tag), as the records of those kept (``mirror_pulls``) say: the addresses are
        that tenant's own, so its blocks are the only ones they can name anywhere."""
        assert self.peers is not None
        loop = asyncio.get_running_loop()
        fetching = self.inflight.fetching
        mine: list[BlockAddress] = []
        waits: list[asyncio.Future[RamBlock | None]] = []
        futures: dict[bytes, asyncio.Future[RamBlock | None]] = {}
        for address in addresses:
            if address.key in fetching:
                waits.append(fetching[address.key])
            elif address.key not in self.ram:
                futures[address.key] = fetching[address.key] = loop.create_future()
                waits.append(futures[address.key])
                mine.append(address)
        if mine:
            self.inflight.spawn(self._pull_and_commit(mine, futures, tenant))
        return await pin_arrived(self.ram, waits, deadline)

    def _reserve(self, address: BlockAddress, length: int, tenant: str = "") -> tuple[Handle, memoryview] | None:
        if not 0 < length <= self.ram.max_block_bytes:
            return None
        try:
            block = self.ram.reserve(address.key, length, tenant)
        except (RamFull, ValueError):     # no room now, or someone is writing it: a miss
            return None
        self.ledger.reserved(address.key)
        view = self.ram.slot_view(block)
        return (block, view), view      # the handle the peer tier gives back, and where the payload goes

    def _abort(self, handle: Handle) -> None:
        block, view = handle
        release_view(view)
        if block.refs == WRITING and self.ram.holds(block):
            self.ram.abort(block)

    async def _pull_and_commit(self, mine: list[BlockAddress], futures: dict[bytes, asyncio.Future[RamBlock | None]],
                               tenant: str) -> None:
        """Fetch, then commit what arrived verified. Every future is resolved."""
        assert self.peers is not None
        got: list[tuple[BlockAddress, Any, Any]] = []
        try:
            started = time.perf_counter()
            got = await self.peers.fetch(mine, functools.partial(self._reserve, tenant=tenant), self._abort, tenant)
            took = time.perf_counter() - started
            if got:
                self.delivery.took("peer", sum(head.payload_length for _, _, head in got), took)
            elif took >= SILENT_S:
                self.delivery.nothing("peer", took)
            now = self.clock()
            mirror = self.settings.mirror_pulls
            for address, (block, view), head in got:
                release_view(view)
                if mirror:
                    if self.mover is None:
                        self.ram.commit(block, clean=True)
                    else:
                        self.writer.commit_new(block)
                    self.ledger.stage(block.key, BlockRecord(address.digest, address.layer, head.model, block.length,
                                                             head.checksum, now, now, Tier.RAM, tenant=tenant))
                else:
                    self.ram.commit(block, clean=True)
                    self.transient[block.key] = head.checksum
            try:
                self.ledger.commit()
            except Unavailable:
                pass                      # logged; the blocks left RAM again
            if mirror and self.mover is not None and got:
                self.mover.demote_wanted.set()
        except Exception:
            log.exception("pulling from peers failed")
            for _, handle, _ in got:
                self._abort(handle)
        finally:
            fetching = self.inflight.fetching
            for address in mine:
                future = futures[address.key]
                if fetching.get(address.key) is future:
                    del fetching[address.key]
                if not future.done():
                    block = self.ram.get(address.key)
                    future.set_result(block if block is not None and block.refs != WRITING else None)
