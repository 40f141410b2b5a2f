"""The read path: Get, pin and Lookup, and making blocks resident for them.

- :meth:`ReadPath.get` copies blocks out; :meth:`ReadPath.pin` holds them in the arena for a
  reader that copies itself (streams, agents) until :meth:`ReadPath.unpin`. Both first wait for
  agent-written blocks' records, then make the batch resident: blocks only on SSD are promoted
  (kvcached.store.ssd_mover), blocks no local tier holds are pulled from peers
  (kvcached.store.peer_pulls), as long as the prefetch policy lets the request wait.
- :meth:`ReadPath.lookup` follows SGLang's batch_exists: count from the first digest and stop at
  the first miss, per tier and across all tiers (a block in RAM and on SSD counts for both).
  Its hot path (a chain held in RAM) reads no index record per block.

Every read is counted in ``reads`` (kvcached.store.reads: per tier reached, latency). Runs on the
event loop; index reads block it briefly (RocksDB point reads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from kvcached.errors import InvalidArgument, NotFound, ResourceExhausted
from kvcached.index import Tier
from kvcached.policies.load_cost import LoadPlan, plan_loads
from kvcached.store.gpu_view import GpuView
from kvcached.store.parts import Room, StoreParts
from kvcached.store.peer_pulls import PeerPulls
from kvcached.store.reads import ReadStats, outcome
from kvcached.store.results import Fetched, LookupResult, Miss, Pinned, Presence, Reached
from kvcached.store.ssd_mover import SsdMover
from kvcached.store.write_path import WritePath
from kvcached.tiers.ram import RamBlock
from kvcached_agent.address import DIGEST_BYTES, BlockAddress, index_key

__all__ = ["LOOKUP_KEYS", "LOOKUP_LAYERS", "ReadPath", "prefix_length"]

log = logging.getLogger("kvcached.store")

# Engines look up the same prompt prefixes over and over (that is why they cache): the index keys
# of recent lookups are kept per layer, a dict hit instead of ~0.9 us of BLAKE3; a layer's cache is
# started afresh once it holds this many (about 6 MB), and at most a few layers are kept.
LOOKUP_KEYS = 1 << 15
LOOKUP_LAYERS = 4

# Every tier set that includes SSD: Lookup tests membership (~20 ns), not ``tier & Tier.SSD``
# (an enum flag operation, ~0.4 us: a quarter of a RAM-hit lookup of 64 blocks).
_ON_SSD = frozenset({Tier.SSD, Tier.RAM | Tier.SSD})


def prefix_length(held: Sequence[bool]) -> int:
    """How many of ``held``, from the first, are true."""
    return next((i for i, here in enumerate(held) if not here), len(held))


class ReadPath(Room):
    """Get, pin, unpin and Lookup (see the module). ``mover`` is None without an SSD tier;
    ``pulls`` reaches the peer tier (its ``peers`` is None while it is off)."""

    def __init__(self, parts: StoreParts, writer: WritePath, mover: SsdMover | None, pulls: PeerPulls, gpu: GpuView,
                 reads: ReadStats) -> None:
        super().__init__(parts)
        self.writer = writer
        self.mover = mover
        self.pulls = pulls
        self.gpu = gpu
        self.reads = reads
        self._lookup_keys: dict[int, dict[bytes, bytes]] = {}
        # Lookup's memory of SSD copies of blocks in RAM (see _ssd_prefix_in_ram): key -> the
        # ledger's ssd_losses when the index said the block is on SSD. Every SSD copy lost or
        # record deleted adds one there, voiding every entry at once.
        self._ssd_seen: dict[bytes, int] = {}

    # -- get and pin ---------------------------------------------------------------------------

    async def get(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  tenant: str = "") -> tuple[list[Fetched], list[Miss]]:
        """Fetch a batch (blocks only on SSD are promoted to RAM first). Without
        ``allow_partial`` any miss raises NotFound naming it. ``tenant``: whose blocks the
        addresses are (Tenant.tag), recorded for those pulled from peers and kept."""
        started = time.perf_counter()
        await self.inflight.hashed(a.key for a in addresses)
        held, reached = await self._make_resident(addresses, tenant=tenant)
        try:
            return self._get_resident(addresses, allow_partial, reached, started, tenant)
        finally:
            for block in held:
                self.unpin_block(block)

    def _get_resident(self, addresses: Sequence[BlockAddress], allow_partial: bool, reached: Reached,
                      started: float, tenant: str) -> tuple[list[Fetched], list[Miss]]:
        found: list[Fetched] = []
        misses: list[Miss] = []
        blocks: list[tuple[BlockAddress, RamBlock]] = []
        for address in addresses:
            block = self.ram.get(address.key)
            if block is None:
                misses.append(self.miss_of(address))
            else:
                blocks.append((address, block))
        checksums = self._checksums([b.key for _, b in blocks])
        for (address, block), checksum in zip(blocks, checksums):
            if checksum is None:
                misses.append(Miss(address, self.ledger.drop_unindexed(block)))
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
                  peers: bool = True, tenant: str = "") -> list[Pinned | Miss]:
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
                      started: float, tenant: str) -> list[Pinned | Miss]:
        resident = [(address, self.ram.get(address.key)) for address in addresses]
        checksums = self._checksums([b.key for _, b in resident if b is not None])
        found = iter(checksums)
        entries: list[tuple[BlockAddress, RamBlock | None, bytes | None]] = [
            (address, block, next(found) if block is not None else None) for address, block in resident]
        missing = [a for a, b, c in entries if b is None or c is None]
        inflight = self.inflight
        if missing and not allow_partial:
            self.counters.misses += len(missing)
            self.tally.read(tenant, 0, 0, len(missing))
            self._count_read(len(addresses), len(addresses) - len(missing), reached, started)
            more = f" (and {len(missing) - 1} more of {len(addresses)})" if len(missing) > 1 else ""
            raise NotFound(f"block {missing[0]}: {self.miss_reason(missing[0])}{more}")
        wanted = sum(b.length for _, b, c in entries if b is not None and c is not None)
        if inflight.held_bytes + wanted > inflight.max_held_bytes:
            raise ResourceExhausted(
                f"readers would pin {inflight.held_bytes + wanted} bytes, over half the RAM tier "
                f"({inflight.max_held_bytes} bytes; {inflight.held_bytes} pinned now): fetch fewer blocks per stream")
        out: list[Pinned | Miss] = []
        for address, block, checksum in entries:
            if block is None or checksum is None:
                out.append(self.miss_of(address) if block is None else Miss(address, self.ledger.drop_unindexed(block)))
                self.counters.misses += 1
                continue
            self.ram.pin(block)
            inflight.held_bytes += block.length
            self.writer.on_hit(block)
            self.counters.hits += 1
            self.counters.hit_bytes += block.length
            out.append(Pinned(address, block, checksum))
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

    def unpin_block(self, block: RamBlock) -> None:
        """Release one pin; a pulled block held only to be read once goes when its last
        reader is done."""
        self.ram.unpin(block)
        transient = self.pulls.transient
        if transient and block.refs == 0 and transient.pop(block.key, None) is not None:
            if self.ram.committed(block):      # read once, not mirrored: gone again
                self.ram.delete(block.key)

    def _checksums(self, keys: list[bytes]) -> list[bytes | None]:
        """Checksums of resident blocks: from the index, or for pulled blocks that are not
        mirrored (never indexed), from the pull."""
        checksums = self.index.checksums(keys)
        transient = self.pulls.transient
        if transient:
            checksums = [c if c is not None else transient.get(k) for k, c in zip(keys, checksums)]
        return checksums

    def stored_bytes(self, addresses: Sequence[BlockAddress]) -> int:
        """Payload bytes of those of ``addresses`` that a Get would serve, from RAM or SSD
        (sizing an answer before fetching it)."""
        total = 0
        absent = []
        for a in addresses:
            block = self.ram.get(a.key)
            if block is not None:
                total += block.length
            else:
                absent.append(a.key)
        if self.mover is not None and absent:
            total += sum(r.nbytes for r in self.index.get_many(absent) if r is not None and r.tiers & Tier.SSD)
        return total

    def miss_of(self, address: BlockAddress) -> Miss:
        """Why ``address`` is not here: in words, and what the index says became of it."""
        record = self.index.get(address.key)
        if record is None:
            return Miss(address, "unknown block")
        if not record.present:
            return Miss(address, f"{record.gone_reason.text}; its metadata is kept until {self.settings.gone_ttl:.0f} s "
                        "after it went", record.gone_reason)
        return Miss(address, "not resident in any tier this daemon has")

    def miss_reason(self, address: BlockAddress) -> str:
        """Why ``address`` is not here, in words."""
        return self.miss_of(address).reason

    # -- making blocks resident ------------------------------------------------------------------

    async def _make_resident(self, addresses: Sequence[BlockAddress], peers: bool = True,
                             tenant: str = "") -> tuple[list[RamBlock], Reached]:
        """Promote the blocks of ``addresses`` that are only on SSD, then pull from peers those
        that no local tier holds. While it waits, the blocks already resident are pinned (so the
        batch's own promotions cannot evict them); returns every block it pinned, for the caller
        to unpin, and how many came from SSD and from peers (read accounting).

        How long it waits for those reads is the prefetch policy's call ([kv] prefetch_policy);
        the reads go on to the end either way. A peer's pull (``peers`` False) always waits:
        the peer has its own deadline."""
        tier = self.pulls.peers
        reached = Reached(peers=peers and tier is not None)
        absent = [a for a in addresses if a.key not in self.ram]
        if not absent:
            return [], reached
        tiers = self.index.tiers_of([a.key for a in absent]) if self.mover is not None else [Tier.NONE] * len(absent)
        wanted = list({a.key: a for a, t in zip(absent, tiers) if t & Tier.SSD}.values())
        remote: list[BlockAddress] = []
        if peers and tier is not None:
            may_hold = tier.may_hold()
            fetching = self.inflight.fetching
            remote = list({a.key: a for a, t in zip(absent, tiers)
                           if not t & Tier.SSD and (a.key in fetching or may_hold(a))}.values())
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
                pulled = await self.pulls.pull(remote, deadline, tenant)
                reached.pulled = len(pulled)
                held += pulled
        except BaseException:
            for block in held:
                self.unpin_block(block)
            raise
        return held, reached

    # -- lookup -------------------------------------------------------------------------------

    async def locate(self, digests: Sequence[bytes], layer: int) -> None:
        """In a cluster, before a Lookup: ask the home nodes where the blocks of a chain that
        RAM does not hold whole are, so the Lookup's peer column can count them (one round trip
        per home, within the pull deadline). With static peers, or no peers, nothing to do."""
        peers = self.pulls.peers
        if peers is None or not peers.asks_homes or not digests:
            return
        if set(map(len, digests)) != {DIGEST_BYTES}:
            return                                  # the Lookup itself says what is wrong
        try:
            keys = [index_key(d, layer) for d in digests]
        except ValueError:
            return                                  # a bad layer: the Lookup itself says what is wrong
        if self.ram.resident_prefix(keys) < len(digests):
            await peers.locate(digests, layer)

    def lookup(self, digests: Sequence[bytes], layer: int, agent: int | None = None, tenant: str = "") -> LookupResult:
        """Longest prefixes of a chain, each counted from the first digest: per tier what that
        tier holds (a block in RAM and on SSD counts for both), ``longest`` where each block is
        in some tier. ``agent`` (an agent session) asks for itself: ``gpu`` is what that agent
        holds, and it counts towards ``longest`` (the agent can use its own GPU blocks). Without
        it ``gpu`` is the longest prefix any one agent holds, and ``longest`` counts what a Get
        can return (RAM, SSD, peers). Counted as ``tenant``'s lookup (a Tenant.tag)."""
        started = time.perf_counter()
        self.counters.lookups += 1
        self.tally.lookup(tenant)
        self._check_digests(digests)
        gpu = self.gpu.prefix(agent, digests) if agent is not None else self.gpu.longest(digests) if self.gpu else 0
        cache = self._lookup_keys.get(layer)
        if cache is None or len(cache) > LOOKUP_KEYS:
            if len(self._lookup_keys) >= LOOKUP_LAYERS:
                self._lookup_keys.clear()
            cache = self._lookup_keys[layer] = {}
        keys = [cache.get(d) or cache.setdefault(d, index_key(d, layer)) for d in digests]
        ram = self.ram.resident_prefix(keys)
        ssd_on = self.mover is not None
        peers = self.pulls.peers
        if ram == len(keys) or (not ssd_on and agent is None and peers is None):
            ssd = self._ssd_prefix_in_ram(keys) if ssd_on and ram else 0
            peer = prefix_length(peers.held(digests, layer)) if peers is not None and ram else 0
            self.reads.took("gpu" if agent is not None and gpu >= len(keys) else "ram", outcome(len(keys), ram), started)
            return LookupResult(longest=ram, ram=ram, ssd=ssd, gpu=gpu, peer=peer)
        # Only the keys after the RAM prefix can extend ``longest``; SSD and peers are counted
        # from the start. ``longest`` counts a block a usable peer holds: a Get pulls it.
        on_ssd = [bool(t & Tier.SSD) for t in self.index.tiers_of(keys)] if ssd_on else [False] * len(keys)
        ssd = prefix_length(on_ssd)
        on_peer = peers.held(digests, layer) if peers is not None else [False] * len(keys)
        peer = prefix_length(on_peer)
        on_gpu = self.gpu.held(agent, digests) if agent is not None else None
        longest = ram
        while longest < len(keys) and (on_ssd[longest] or keys[longest] in self.ram or on_peer[longest]
                                       or (on_gpu is not None and digests[longest] in on_gpu)):
            longest += 1
        tier = ("gpu" if agent is not None and gpu >= max(longest, 1) else "peer" if peers is not None
                else "ssd" if ssd_on else "ram")
        self.reads.took(tier, outcome(len(keys), longest), started)
        return LookupResult(longest=longest, ram=ram, ssd=ssd, gpu=gpu, peer=peer)

    def plan(self, digests: Sequence[bytes], layer: int, recompute_s: float, block_bytes: int,
             agent: int | None = None, tenant: str = "") -> tuple[LoadPlan, int]:
        """Which of a chain's held blocks are worth loading (kvcached.policies.load_cost): each
        block's source from :meth:`present` (this agent's GPU and RAM count as RAM, then SSD, then
        a usable peer; counted as a lookup), what SSD reads and pulls deliver lately,
        ``recompute_s`` a block. Returns the plan and the prefix held; the blocks skipped as
        slower than recomputing are counted."""
        seen = self.present(digests, layer, agent, tenant)
        sources = ["ram" if g or r else "ssd" if s else "peer" if q else None
                   for g, r, s, q in zip(seen.gpu, seen.ram, seen.ssd, seen.peer)]
        needed = {s for s in sources if s is not None and s != "ram"}
        plan = plan_loads(sources, [block_bytes] * len(sources), recompute_s, self.delivery.current(needed))
        self.counters.loads_skipped_ssd += plan.skipped.get("ssd", 0)
        self.counters.loads_skipped_peer += plan.skipped.get("peer", 0)
        held = next((i for i, s in enumerate(sources) if s is None), len(sources))
        return plan, held

    def present(self, digests: Sequence[bytes], layer: int, agent: int | None = None, tenant: str = "") -> Presence:
        """Which tiers hold each block, each on its own (not a chain's prefix): the resume
        points of a hybrid model, whose sliding-window blocks and state snapshots exist at some
        positions only. Counted as a lookup (``tenant``'s); one batched index read for the SSD column."""
        started = time.perf_counter()
        self.counters.lookups += 1
        self.tally.lookup(tenant)
        self._check_digests(digests)
        keys = [index_key(d, layer) for d in digests]
        ram = [key in self.ram for key in keys]
        ssd = ([bool(t & Tier.SSD) for t in self.index.tiers_of(keys)] if self.mover is not None
               else [False] * len(keys))
        peers = self.pulls.peers
        peer = peers.held(digests, layer) if peers is not None else [False] * len(keys)
        on_gpu = self.gpu.held(agent, digests) if agent is not None else set()
        gpu = [d in on_gpu for d in digests]
        found = sum(map(any, zip(ram, ssd, peer, gpu)))
        # The slowest source asked, as Lookup labels its reads.
        self.reads.took("peer" if peers is not None else "ssd" if self.mover is not None else "ram",
                        outcome(len(keys), found), started)
        return Presence(gpu=gpu, ram=ram, ssd=ssd, peer=peer)

    @staticmethod
    def _check_digests(digests: Sequence[bytes]) -> None:
        if digests and set(map(len, digests)) != {DIGEST_BYTES}:
            i, digest = next((i, d) for i, d in enumerate(digests) if len(d) != DIGEST_BYTES)
            raise InvalidArgument(f"digests[{i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes (BLAKE3-256)")

    def _ssd_prefix_in_ram(self, keys: list[bytes]) -> int:
        """How many of ``keys``, all resident in RAM, from the first, also have an SSD copy
        (Lookup's hot path: a RAM hit must not pay an index read per block).

        The index says, once: that a block is on SSD stays in ``_ssd_seen`` until an SSD copy
        is lost or a record deleted anywhere (the ledger's ``ssd_losses``), so a block
        remembered is on SSD whatever happens to its RAM copy. Of the others, a dirty block (not
        written back yet) or one write_through_selective holds back has no SSD copy; a clean one
        may or may not (its SSD copy evicted, or refused by the SSD write budget: kept in RAM
        only). Only clean blocks before the first dirty or held one, and not remembered, are
        read (one batched read)."""
        clean_for_ssd = self.ram.clean_for_ssd
        seen, losses = self._ssd_seen, self.ledger.ssd_losses
        end = len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            if seen.get(key) == losses:
                continue
            if not clean_for_ssd(key):
                end = i
                break
            ask.append(i)
        if ask:
            if len(seen) > LOOKUP_KEYS:
                seen.clear()
            for i, tier in zip(ask, self.index.tiers_of([keys[i] for i in ask])):
                if tier not in _ON_SSD:
                    return i
                seen[keys[i]] = losses
        return end

    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int:
        """How long a prefix of the chain RAM and SSD hold (a peer's Exists)."""
        keys = [index_key(d, layer) for d in digests]
        ram = self.ram.resident_prefix(keys)
        if ram == len(keys) or self.mover is None:
            return ram
        tiers = self.index.tiers_of(keys[ram:])
        n = ram
        for key, tier in zip(keys[ram:], tiers):
            if not (tier & Tier.SSD or key in self.ram):
                break
            n += 1
        return n
