"""The read path: Get and pin, and making blocks resident for them.

- :meth:`ReadPath.get` copies blocks out; :meth:`ReadPath.pin` holds them in the arena for a
  reader that copies itself (streams, agents) until :meth:`ReadPath.unpin`. Both first wait for
  agent-written blocks' records, then make the batch resident: blocks only on SSD are promoted
  (kvcached.store.ssd_mover), blocks no local tier holds are pulled from peers
  (kvcached.store.peer_pulls), as long as the prefetch policy lets the request wait.
- What tiers hold, without serving bytes (Lookup, Present, load plans), is
  kvcached.store.lookups'.

Every read checks whose block it serves (docs/security.md, "Tenants"): ``tenant`` is the
caller's (a Tenant.tag, "" the default tenant's; None the operator, who reaches every block). A
block whose record names another tenant is answered as one never stored, whatever address the
caller sent, and counted (``other_tenant``); it is neither promoted nor pulled for that caller.

Every read is counted in ``reads`` (kvcached.store.reads: per tier reached, latency). Runs on the
event loop; index reads block it briefly (RocksDB point reads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from kvcached.errors import NotFound, ResourceExhausted
from kvcached.index import FOREIGN, Tier
from kvcached.store.parts import Room, StoreParts
from kvcached.store.peer_pulls import PeerPulls
from kvcached.store.reads import ReadStats, outcome
from kvcached.store.results import Fetched, Miss, Pinned, Reached
from kvcached.store.ssd_mover import SsdMover
from kvcached.store.write_path import WritePath
from kvcached.tiers.ram import RamBlock
from kvcached_agent.address import BlockAddress

__all__ = ["ReadPath"]

log = logging.getLogger("kvcached.store")


class ReadPath(Room):
    """Get, pin and unpin (see the module). ``mover`` is None without an SSD tier; ``pulls``
    reaches the peer tier (its ``peers`` is None while it is off)."""

    def __init__(self, parts: StoreParts, writer: WritePath, mover: SsdMover | None, pulls: PeerPulls,
                 reads: ReadStats) -> None:
        super().__init__(parts)
        self.writer = writer
        self.mover = mover
        self.pulls = pulls
        self.reads = reads

    # -- get and pin ---------------------------------------------------------------------------

    async def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  tenant: str | None = "") -> tuple[list[Fetched], list[Miss]]:
        """Fetch a batch (blocks only on SSD are promoted to RAM first). Without
        ``allow_partial`` any miss raises NotFound naming it. ``tenant``: the caller (a
        Tenant.tag; None the operator), whose blocks alone are served, recorded for those
        pulled from peers and kept."""
        started = time.perf_counter()
        await self.inflight.hashed(a.key for a in addresses)
        held, reached = await self._make_resident(addresses, tenant=tenant)
        try:
            return self._get_resident(addresses, allow_partial, reached, started, tenant)
        finally:
            for block in held:
                self.unpin_block(block)

    def _get_resident(self, addresses: Sequence[BlockAddress], allow_partial: bool, reached: Reached,
                      started: float, tenant: str | None) -> tuple[list[Fetched], list[Miss]]:
        found: list[Fetched] = []
        misses: list[Miss] = []
        blocks: list[tuple[BlockAddress, RamBlock]] = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is None:
                misses.append(self.miss_of(address, tenant))
            else:
                blocks.append((address, block))
        checksums = self._checksums([b.key for _, b in blocks], tenant)
        for (address, block), checksum in zip(blocks, checksums):
            if checksum is None:
                misses.append(Miss(address, self.ledger.drop_unindexed(block)))
                continue
            if checksum == FOREIGN:
                misses.append(self._foreign(address))
                continue
            found.append(Fetched(address, self.ram.read(block), checksum))
            self.writer.on_hit(block)
        self.counters.hits += len(found)
        self.counters.misses += len(misses)
        self.counters.hit_bytes += sum(len(f.payload) for f in found)
        self.tally.read(tenant, len(found), sum(len(f.payload) for f in found), len(misses))
        self._count_read(len(addresses), len(found), reached, started)
        if misses and not allow_partial:
            first = misses[0]
            more = f" (and {len(misses) - 1} more of {len(addresses)})" if len(misses) > 1 else ""
            raise NotFound(f"block {first.address}: {first.reason}{more}")
        return found, misses

    async def pin(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  peers: bool = True, tenant: str | None = "") -> list[Pinned | Miss]:
        """Pin a batch for a reader that copies out of the arena itself (streams, agents), in
        request order: while pinned a block can be neither evicted nor deleted, so the batch is
        a snapshot however long the copy takes. Blocks only on SSD are promoted first. Without
        ``allow_partial`` a miss pins nothing and raises NotFound. Release every Pinned with
        :meth:`unpin`. ``peers=False`` leaves the peer tier out (serving a peer's pull).
        ``tenant``: as for :meth:`get`."""
        started = time.perf_counter()
        await self.inflight.hashed(a.key for a in addresses)
        held, reached = await self._make_resident(addresses, peers, tenant)
        try:
            return self._pin_resident(addresses, allow_partial, reached, started, tenant)
        finally:
            for block in held:
                self.unpin_block(block)

    def _pin_resident(self, addresses: Sequence[BlockAddress], allow_partial: bool, reached: Reached,
                      started: float, tenant: str | None) -> list[Pinned | Miss]:
        resident = [(address, self.ram.get(address.key)) for address in addresses]
        checksums = self._checksums([b.key for _, b in resident if b is not None], tenant)
        found = iter(checksums)
        entries: list[tuple[BlockAddress, RamBlock | None, bytes | None]] = [
            (address, block, next(found) if block is not None else None) for address, block in resident]
        missing = [a for a, b, c in entries if b is None or not c]
        inflight = self.inflight
        if missing and not allow_partial:
            self.counters.misses += len(missing)
            self.tally.read(tenant, 0, 0, len(missing))
            self._count_read(len(addresses), len(addresses) - len(missing), reached, started)
            more = f" (and {len(missing) - 1} more of {len(addresses)})" if len(missing) > 1 else ""
            raise NotFound(f"block {missing[0]}: {self.miss_of(missing[0], tenant).reason}{more}")
        wanted = sum(b.length for _, b, c in entries if b is not None and c)
        if inflight.held_bytes + wanted > inflight.max_held_bytes:
            raise ResourceExhausted(
                f"readers would pin {inflight.held_bytes + wanted} bytes, over half the RAM tier "
                f"({inflight.max_held_bytes} bytes; {inflight.held_bytes} pinned now): fetch fewer blocks per stream")
        out: list[Pinned | Miss] = []
        pin, on_hit = self.ram.pin, self.writer.on_hit
        for address, block, checksum in entries:
            if block is None or not checksum:
                out.append(self.miss_of(address, tenant) if block is None else self._foreign(address) if checksum == FOREIGN
                           else Miss(address, self.ledger.drop_unindexed(block)))
                continue
            pin(block)
            inflight.held_bytes += block.length
            on_hit(block)
            out.append(Pinned(address, block, checksum))
        counters = self.counters
        counters.misses += len(missing)
        counters.hits += len(out) - len(missing)
        counters.hit_bytes += wanted
        self.tally.read(tenant, len(out) - len(missing), wanted, len(missing))
        self._count_read(len(addresses), len(addresses) - len(missing), reached, started)
        return out

    def _count_read(self, asked: int, found: int, reached: Reached, started: float) -> None:
        tier = self.reads.blocks(asked, found, reached.promoted, reached.pulled, ssd=self.mover is not None,
                                 peers=reached.peers)
        self.reads.took(tier, outcome(asked, found), started)

    def read(self, pinned: Pinned, start: int, length: int) -> bytes:
        """A copy of up to ``length`` bytes of a pinned block from ``start``."""
        return self.ram.read_range(pinned.block, start, length)

    def unpin(self, pinned: Pinned) -> None:
        self.unpin_block(pinned.block)
        self.inflight.held_bytes -= pinned.block.length

    def unpin_many(self, pins: Sequence[Pinned]) -> None:
        """:meth:`unpin` of each of ``pins`` (an agent's Release), in one pass. Every one is
        released even if one fails; the first error is raised after."""
        unpin = self.unpin if self.pulls.transient else None
        ram_unpin, inflight = self.ram.unpin, self.inflight
        first: Exception | None = None
        for pinned in pins:
            try:
                if unpin is not None:
                    unpin(pinned)
                else:
                    block = pinned.block
                    ram_unpin(block)
                    inflight.held_bytes -= block.length
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def unpin_block(self, block: RamBlock) -> None:
        """Release one pin; a pulled block held only to be read once goes when its last
        reader is done."""
        self.ram.unpin(block)
        transient = self.pulls.transient
        if transient and block.refs == 0 and transient.pop(block.key, None) is not None:
            if self.ram.committed(block):      # read once, not mirrored: gone again
                self.ram.delete(block.key)

    def _foreign(self, address: BlockAddress) -> Miss:
        """The answer for a block of another tenant than the caller's: as one never stored."""
        self.counters.other_tenant += 1
        return Miss(address, "unknown block")

    def _checksums(self, keys: list[bytes], tenant: str | None) -> list[bytes | None]:
        """Checksums of resident blocks: from the index (FOREIGN for a block of another tenant
        than ``tenant``), or for pulled blocks that are not mirrored (never indexed), from the
        pull, which was made for the caller's tenant."""
        checksums = self.index.checksums(keys, tenant)
        transient = self.pulls.transient
        if transient:
            checksums = [c if c is not None else transient.get(k) for k, c in zip(keys, checksums)]
        return checksums

    def stored_bytes(self, addresses: Sequence[BlockAddress], tenant: str | None = "") -> int:
        """Payload bytes of those of ``addresses`` that a Get by ``tenant`` would serve, from
        RAM or SSD (sizing an answer before fetching it)."""
        total = 0
        absent = []
        for a in addresses:
            block = self.ram.get(a.key)
            if block is None:
                absent.append(a.key)
            elif tenant is None or self.ram.tenant_of(a.key) == tenant:
                total += block.length
        if self.mover is not None and absent:
            total += sum(r.nbytes for r in self.index.get_many(absent) if r is not None and r.tiers & Tier.SSD
                         and (tenant is None or r.tenant == tenant))
        return total

    def miss_of(self, address: BlockAddress, tenant: str | None = "") -> Miss:
        """Why ``address`` is not here for ``tenant``: in words, and what the index says became
        of it (a block of another tenant: as one never stored)."""
        record = self.index.get(address.key)
        if record is None:
            return Miss(address, "unknown block")
        if tenant is not None and record.tenant != tenant:
            return self._foreign(address)
        if not record.present:
            return Miss(address, f"{record.gone_reason.text}; its metadata is kept until {self.settings.gone_ttl:.0f} s "
                        "after it went", record.gone_reason)
        return Miss(address, "not resident in any tier this daemon has")

    # -- making blocks resident ------------------------------------------------------------------

    async def _make_resident(self, addresses: Sequence[BlockAddress], peers: bool = True,
                             tenant: str | None = "") -> tuple[list[RamBlock], Reached]:
        """Promote the blocks of ``addresses`` that are only on SSD, then pull from peers those
        that no local tier holds. While it waits, the blocks already resident are pinned (so the
        batch's own promotions cannot evict them); returns every block it pinned, for the caller
        to unpin, and how many came from SSD and from peers (read accounting).

        How long it waits for those reads is the prefetch policy's call ([kv] prefetch_policy);
        the reads go on to the end either way. A peer's pull (``peers`` False) always waits:
        the peer has its own deadline. A block another tenant holds here (``tenant``: the
        caller's) is neither promoted nor pulled."""
        tier = self.pulls.peers
        reached = Reached(peers=peers and tier is not None)
        absent = [a for a in addresses if a.key not in self.ram]
        if not absent:
            return [], reached
        pulling = peers and tier is not None
        if self.mover is None and not pulling:
            return [], reached
        keys = [a.key for a in absent]
        tiers: list[Tier | None]        # None: another tenant's block (without SSD, only RAM holds one: not absent)
        if self.mover is None:
            tiers = [Tier.NONE] * len(absent)
        else:
            tiers = list(self.index.tiers_of(keys)) if tenant is None else self.index.writable_tiers(keys, tenant)
        wanted = list({a.key: a for a, t in zip(absent, tiers) if t is not None and t & Tier.SSD}.values())
        remote: list[BlockAddress] = []
        if pulling:
            assert tier is not None
            may_hold = tier.may_hold()
            fetching = self.inflight.fetching
            remote = list({a.key: a for a, t in zip(absent, tiers)
                           if t is not None and not t & Tier.SSD and (a.key in fetching or may_hold(a))}.values())
        if not wanted and not remote:
            return [], reached
        wait_s = self.settings.prefetch.wait_s() if peers else None
        deadline = asyncio.get_running_loop().time() + wait_s if wait_s is not None else None
        held = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is not None:
                self.ram.pin(block)
                held.append(block)
        try:
            if wanted:
                assert self.mover is not None
                promoted = await self.mover.promote(wanted, deadline)
                reached.promoted = len(promoted)
                held += promoted
            if remote:
                pulled = await self.pulls.pull(remote, deadline, tenant or "")
                reached.pulled = len(pulled)
                held += pulled
        except BaseException:
            for block in held:
                self.unpin_block(block)
            raise
        return held, reached
