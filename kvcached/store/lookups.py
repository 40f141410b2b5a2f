"""What the tiers hold, without serving a byte: Lookup, Present and load plans.

- :meth:`Lookups.lookup` follows SGLang's batch_exists: count from the first digest and stop at
  the first miss, per tier and across all tiers (a block in RAM and on SSD counts for both).
  Its hot path (a chain held in RAM) reads no index record per block.
- :meth:`Lookups.present` says which tiers hold each block on its own (a hybrid model's resume
  points); :meth:`Lookups.plan` which of them are worth loading (kvcached.policies.load_cost).

Only the caller's tenant's blocks count (``tenant``, a Tenant.tag; None the operator's, every
block): another tenant's block answers as one never stored, whatever address was sent
(docs/security.md), the RAM column by the RAM tier's owner of each block (no index read), the
SSD column by the record's. The peer column counts what peers announce by address (a pull of
another tenant's block is refused by its holder, kvcached.peers.store_link). Runs on the event
loop; index reads block it briefly (RocksDB point reads).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from kvcached.errors import InvalidArgument
from kvcached.index import Tier
from kvcached.policies.load_cost import LoadPlan, PlanScan
from kvcached.store.gpu_view import GpuView
from kvcached.store.parts import Room, StoreParts
from kvcached.store.peer_pulls import PeerPulls
from kvcached.store.reads import ReadStats, outcome
from kvcached.store.results import Counters, LookupResult, Presence
from kvcached.store.ssd_mover import SsdMover
from kvcached_agent.address import DIGEST_BYTES, index_key

__all__ = ["LOOKUP_KEYS", "LOOKUP_LAYERS", "ChainPlan", "Lookups", "prefix_length"]

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


class ChainPlan:
    """A load plan being made a part at a time (:meth:`Lookups.plan_scan`): :meth:`step` until
    it says done, then :meth:`result`, which counts the blocks skipped as slower to load."""

    def __init__(self, sources: list[str | None], block_bytes: int, scan: PlanScan, counters: Counters) -> None:
        self._sources = sources
        self._bytes = block_bytes
        self._scan = scan
        self._counters = counters

    def step(self, blocks: int) -> bool:
        """Scan up to ``blocks`` more of the chain; True once the plan is made."""
        scan = self._scan
        if not scan.held_ended and scan.i < len(self._sources):
            part = self._sources[scan.i:scan.i + blocks]
            scan.add(part, [self._bytes] * len(part))
        return scan.held_ended or scan.i >= len(self._sources)

    def result(self) -> tuple[LoadPlan, int]:
        """The plan and the prefix held."""
        plan = self._scan.plan()
        self._counters.loads_skipped_ssd += plan.skipped.get("ssd", 0)
        self._counters.loads_skipped_peer += plan.skipped.get("peer", 0)
        return plan, self._scan.held


class Lookups(Room):
    """Lookup, Present, load plans and the peers' Exists (see the module). ``mover`` is None
    without an SSD tier; ``pulls`` reaches the peer tier (its ``peers`` is None while it is off)."""

    def __init__(self, parts: StoreParts, mover: SsdMover | None, pulls: PeerPulls, gpu: GpuView,
                 reads: ReadStats) -> None:
        super().__init__(parts)
        self.mover = mover
        self.pulls = pulls
        self.gpu = gpu
        self.reads = reads
        self._lookup_keys: dict[int, dict[bytes, bytes]] = {}
        # Lookup's memory of SSD copies of blocks in RAM (see _ssd_prefix_in_ram): key -> the
        # ledger's ssd_losses when the index said the block is on SSD. Every SSD copy lost or
        # record deleted adds one there, voiding every entry at once.
        self._ssd_seen: dict[bytes, int] = {}

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

    def lookup(self, digests: Sequence[bytes], layer: int, agent: int | None = None,
               tenant: str | None = "") -> LookupResult:
        """Longest prefixes of a chain, each counted from the first digest: per tier what that
        tier holds (a block in RAM and on SSD counts for both), ``longest`` where each block is
        in some tier. ``agent`` (an agent session) asks for itself: ``gpu`` is what that agent
        holds, and it counts towards ``longest`` (the agent can use its own GPU blocks). Without
        it ``gpu`` is the longest prefix any one agent holds, and ``longest`` counts what a Get
        can return (RAM, SSD, peers). ``tenant``'s blocks alone count (a Tenant.tag; None the
        operator: everyone's), and it is counted as ``tenant``'s lookup."""
        started = time.perf_counter()
        self.counters.lookups += 1
        self.tally.lookup(tenant)
        self._check_digests(digests)
        gpu = self.gpu.prefix(agent, digests) if agent is not None else self.gpu.longest(digests, tenant) if self.gpu else 0
        cache = self._lookup_keys.get(layer)
        if cache is None or len(cache) > LOOKUP_KEYS:
            if len(self._lookup_keys) >= LOOKUP_LAYERS:
                self._lookup_keys.clear()
            cache = self._lookup_keys[layer] = {}
        keys = [cache.get(d) or cache.setdefault(d, index_key(d, layer)) for d in digests]
        ram = self.ram.resident_prefix(keys, tenant)
        if ram < len(keys) and tenant is not None and self.ram.tenant_of(keys[ram]) not in (None, tenant):
            self.counters.other_tenant += 1
        ssd_on = self.mover is not None
        peers = self.pulls.peers
        if ram == len(keys) or (not ssd_on and agent is None and peers is None):
            ssd = self._ssd_prefix_in_ram(keys, tenant) if ssd_on and ram else 0
            peer = prefix_length(peers.held(digests, layer)) if peers is not None and ram else 0
            self.reads.took("gpu" if agent is not None and gpu >= len(keys) else "ram", outcome(len(keys), ram), started)
            return LookupResult(longest=ram, ram=ram, ssd=ssd, gpu=gpu, peer=peer)
        # Only the keys after the RAM prefix can extend ``longest``; SSD and peers are counted
        # from the start. ``longest`` counts a block a usable peer holds: a Get pulls it.
        on_ssd = [bool(t & Tier.SSD) for t in self.index.tiers_of(keys, tenant)] if ssd_on else [False] * len(keys)
        ssd = prefix_length(on_ssd)
        on_peer = peers.held(digests, layer) if peers is not None else [False] * len(keys)
        peer = prefix_length(on_peer)
        on_gpu = self.gpu.held(agent, digests) if agent is not None else None
        longest = ram
        has = self._in_ram(tenant)
        while longest < len(keys) and (on_ssd[longest] or has(keys[longest]) or on_peer[longest]
                                       or (on_gpu is not None and digests[longest] in on_gpu)):
            longest += 1
        tier = ("gpu" if agent is not None and gpu >= max(longest, 1) else "peer" if peers is not None
                else "ssd" if ssd_on else "ram")
        self.reads.took(tier, outcome(len(keys), longest), started)
        return LookupResult(longest=longest, ram=ram, ssd=ssd, gpu=gpu, peer=peer)

    def plan(self, digests: Sequence[bytes], layer: int, recompute_s: float, block_bytes: int,
             agent: int | None = None, tenant: str | None = "") -> tuple[LoadPlan, int]:
        """Which of a chain's held blocks are worth loading (kvcached.policies.load_cost): each
        block's source from :meth:`present` (counted as a lookup), then :meth:`plan_for`."""
        return self.plan_for(self.present(digests, layer, agent, tenant), recompute_s, block_bytes)

    def plan_for(self, seen: Presence, recompute_s: float, block_bytes: int) -> tuple[LoadPlan, int]:
        """The plan for a chain whose blocks are where ``seen`` says (:meth:`plan_scan`, at once)."""
        scan = self.plan_scan(seen, recompute_s, block_bytes)
        scan.step(len(seen.ram))
        return scan.result()

    def plan_scan(self, seen: Presence, recompute_s: float, block_bytes: int) -> ChainPlan:
        """The plan for a chain whose blocks are where ``seen`` says, to be made a part at a time:
        this agent's GPU and RAM count as RAM, then SSD, then a usable peer; what SSD reads and
        pulls deliver lately, ``recompute_s`` a block."""
        sources = ["ram" if g or r else "ssd" if s else "peer" if q else None
                   for g, r, s, q in zip(seen.gpu, seen.ram, seen.ssd, seen.peer)]
        needed = {s for s in sources if s is not None and s != "ram"}
        return ChainPlan(sources, block_bytes, PlanScan(len(sources), recompute_s, self.delivery.current(needed)),
                         self.counters)

    def present(self, digests: Sequence[bytes], layer: int, agent: int | None = None,
                tenant: str | None = "") -> Presence:
        """Which tiers hold each block, each on its own (not a chain's prefix): the resume
        points of a hybrid model, whose sliding-window blocks and state snapshots exist at some
        positions only. ``tenant``'s blocks alone count; counted as its lookup; one batched
        index read for the SSD column."""
        started = time.perf_counter()
        self.counters.lookups += 1
        self.tally.lookup(tenant)
        self._check_digests(digests)
        keys = [index_key(d, layer) for d in digests]
        has = self._in_ram(tenant)
        ram = [has(key) for key in keys]
        ssd = ([bool(t & Tier.SSD) for t in self.index.tiers_of(keys, tenant)] if self.mover is not None
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

    def _in_ram(self, tenant: str | None) -> Callable[[bytes], bool]:
        """A test of whether a key is a committed RAM block of ``tenant``'s (None: anyone's)."""
        ram = self.ram
        if tenant is None:
            return ram.__contains__
        return lambda key: key in ram and ram.tenant_of(key) == tenant

    @staticmethod
    def _check_digests(digests: Sequence[bytes]) -> None:
        if digests and set(map(len, digests)) != {DIGEST_BYTES}:
            i, digest = next((i, d) for i, d in enumerate(digests) if len(d) != DIGEST_BYTES)
            raise InvalidArgument(f"digests[{i}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes (BLAKE3-256)")

    def _ssd_prefix_in_ram(self, keys: list[bytes], tenant: str | None) -> int:
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
            for i, tier in zip(ask, self.index.tiers_of([keys[i] for i in ask], tenant)):
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
