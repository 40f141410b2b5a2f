"""RAM tier: block bytes in the shared arenas, block states, eviction within the byte budget.

Contract (the rules of DESIGN.md, enforced here):

- Every block has a state: ``refs == WRITING`` (-1) while its bytes are being written,
  ``0`` when idle, ``n > 0`` while n readers hold it. Only idle blocks are ever evicted or
  deleted; only committed blocks are visible to :meth:`get`.
- The slabs are the budget: slots are carved from them, so resident bytes can never exceed
  ``kv.ram_gib``. Each tenant's blocks lie in an arena of its own (kvcached.tiers.arenas), one
  slab at a time: a slab is one owner's. When a class has no free slot in the tenant's slabs,
  the policy's candidates are tried in order; the first idle one of the same class and owner
  frees its slot, or, if a candidate sits in a slab of another class or owner whose blocks are
  all idle, that whole slab is emptied and changes class (and owner: its pages are punched out
  of the old owner's arena first). If no candidate works, :class:`RamFull` is raised and
  nothing was evicted.
- Blocks that leave by eviction or an operator's drop wait in an outbox, one list per
  eviction, until :meth:`RamTier.take_evicted` (the store's ledger, which tells the index):
  the tier calls nothing above it.
- What the tier keeps per block is a record: a dense id (kvcached.policies.links.KeyIds) and a
  few bytes in array columns indexed by it (slot, length, state, references), and the policy's
  few bytes under the same id: some 200 bytes a block with its key at a million blocks
  (bench_core figure 4), where an object per block cost 350. A :class:`RamBlock` is a *handle*
  to a record, made when asked for: it stays valid (:meth:`RamTier.holds`) until its block
  leaves the tier, and then reads as an idle clean-less block of its old key and length.
- A block is *clean* when evicting it loses nothing the tiers want kept: a copy is on SSD, or
  the SSD tier's own policy dropped that copy (TTL, capacity). *Dirty* blocks are waiting to be
  written back: only RAM has them. Dirty blocks are kept in the order they became dirty
  (:attr:`RamTier.dirty`, a :class:`DirtyList`, oldest first: a block dirtied again goes to the
  end) for the write-back demoter;
  with ``prefer_clean`` eviction looks a little further for a clean victim before it drops a
  dirty one (whose bytes are then gone).

Runs on the event loop thread only; no locks, no I/O besides memcpy into the arena.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from kvcached.policies import EvictionPolicy, PolicySnapshot, Steps
from kvcached.policies.links import KeyIds, column
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.arenas import Arenas, TenantArenas
from kvcached.tiers.ram_errors import BlockBusy, RamFull
from kvcached.tiers.ram_order import DirtyList, Victims
from kvcached.tiers.ram_shares import RamShares, owner_test
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import SlotDirectory

__all__ = ["RamBlock", "RamFull", "BlockBusy", "RamTier", "WRITING"]

WRITING = -1


class RamBlock:
    """A handle to one resident block: its record id, key, slot and length (fixed for the
    block's life), and its live state read from the tier: ``refs`` (WRITING, 0 idle, n
    readers), ``clean`` and ``hits_to_ssd`` (write_through_selective: hits still needed before
    it goes to SSD). Handles of the same block compare equal. Checksums and other metadata live
    in the index, not here."""

    __slots__ = ("tier", "id", "gen", "key", "slot", "length")

    def __init__(self, tier: RamTier, entry: int, gen: int, key: bytes, slot: int, length: int) -> None:
        self.tier = tier
        self.id = entry
        self.gen = gen
        self.key = key
        self.slot = slot
        self.length = length

    @property
    def refs(self) -> int:
        return self.tier.refs_of(self)

    @property
    def clean(self) -> bool:
        return self.tier.is_clean(self)

    @property
    def hits_to_ssd(self) -> int:
        return self.tier.hits_of(self)

    @hits_to_ssd.setter
    def hits_to_ssd(self, hits: int) -> None:
        self.tier.set_hits(self, hits)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RamBlock) and other.id == self.id and other.gen == self.gen
                and other.tier is self.tier)

    def __hash__(self) -> int:
        return hash((self.id, self.gen))

    def __repr__(self) -> str:
        return f"RamBlock(key={self.key.hex()[:16]}, slot={self.slot}, length={self.length})"


class RamTier:
    """``directory``: where the tier writes what each slot holds, so a successor can adopt the
    arena (kvcached.tiers.slot_directory; None: nothing outlives the process)."""

    def __init__(self, arenas: Arenas | SharedArena, slab_bytes: int, policy: EvictionPolicy,
                 directory: SlotDirectory | None = None, shares: Mapping[str, int] | None = None,
                 count_tenants: bool = False, owners: Sequence[str] = ()) -> None:
        """``arenas``: the tenants' arenas (a SharedArena: the default tenant's alone).
        ``shares``: bytes of the tier each tenant's (tag -> bytes; kvcached.tiers.ram_shares).
        None or empty: no shares, every block a victim in the policy's order. ``count_tenants``:
        count each tenant's blocks even so (several tenants configured; each has an arena of its
        own). ``owners``: the tags of the first owner ids, a predecessor's (its arenas')."""
        if isinstance(arenas, SharedArena):
            arenas = Arenas(arenas.size, {0: arenas})
        self.arenas = arenas
        several = bool(shares) or count_tenants
        self.slabs = SlabAllocator(arenas.size, slab_bytes, arenas.track(slab_bytes) if several else None)
        self.policy = policy
        self.directory = directory
        self._evicted: list[list[RamBlock]] = []   # evictions and drops not taken yet
        # A record per block, its id from _ids; the columns are indexed by id. Each record
        # holds a slot, so ids stay below the number of slots: the columns are laid out for
        # that many, and cost RAM for the ids in use only (kvcached.policies.links.column).
        slots = self.slabs.nslabs * self.slabs.slots_per_slab_max
        self._ids = KeyIds()                 # key <-> record id
        self._index = self._ids.index        # key -> record id, read directly on hot paths
        self._slot = column("q", slots)      # the record's slot
        self._length = column("q", slots)    # payload bytes
        self._refs = column("i", slots)      # WRITING, 0 idle, n readers
        self._clean = column("B", slots)     # 1: a copy is on SSD (or SSD dropped it on purpose)
        self._hits = column("i", slots)      # hits before it goes to SSD (write_through_selective)
        self._gen = column("I", slots)       # bumped when the record's block leaves: stale handles
        self._by_slot = column("i", slots)   # slot -> record id + 1 (0: free)
        policy.size_for(slots)
        self.shares = RamShares(shares or {}, slots, owners) if several else None
        self.owners = TenantArenas(arenas, self.shares, directory)
        self._bytes = arenas.slot_bytes(self.slabs)      # (slot, length) -> its bytes in its owner's arena
        self._enforce = bool(shares)         # shares set: victims by their rule; else the policy's alone
        self._victims = Victims(self.slabs, self._slot, self._refs, self._clean, self._by_slot)
        self.used_bytes = 0          # payload bytes of committed and in-flight blocks
        self.evictions = 0
        self.dirty_evictions = 0     # evicted with no copy on SSD: their bytes are gone
        self.dropped = 0             # dropped on an operator's request (Admin Evict, Drain)
        self.dirty = DirtyList(self._ids, slots)     # committed dirty blocks, oldest first
        self.dirty_bytes = 0
        self.prefer_clean = False

    # -- queries ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.slabs.capacity

    def agent_fds(self, tenant: str) -> list[int]:
        """The files ``tenant``'s agents are handed: the arena its blocks lie in (made now if
        it has none yet), and its slab generations where slabs change owner."""
        return self.arenas.agent_fds(self.owners.owner_for(tenant))

    @property
    def max_block_bytes(self) -> int:
        return self.slabs.slab_bytes

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: bytes) -> bool:
        entry = self._index.get(key)
        return entry is not None and self._refs[entry] != WRITING

    def _handle(self, entry: int) -> RamBlock:
        key = self._ids.keys[entry]
        assert key is not None
        return RamBlock(self, entry, self._gen[entry], key, self._slot[entry], self._length[entry])

    def get(self, key: bytes) -> RamBlock | None:
        """The committed block under ``key``, or None (absent or still being written)."""
        entry = self._index.get(key)
        if entry is None or self._refs[entry] == WRITING:
            return None
        return RamBlock(self, entry, self._gen[entry], key, self._slot[entry], self._length[entry])

    def clean_for_ssd(self, key: bytes) -> bool:
        """``key`` is a committed block that is clean and not held back from SSD
        (write_through_selective): what Lookup's SSD column asks per block, without a handle."""
        entry = self._index.get(key)
        return (entry is not None and self._refs[entry] != WRITING and self._clean[entry] == 1
                and self._hits[entry] == 0)

    def resident_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """How many of ``keys``, from the first, are committed blocks (the lookup hot path),
        ``tenant``'s alone where given (a Tenant.tag)."""
        get, refs = self._index.get, self._refs
        owned = owner_test(self.shares, tenant)
        n = 0
        for key in keys:
            entry = get(key)
            if entry is None or refs[entry] == WRITING or (owned is not None and not owned(entry)):
                break
            n += 1
        return n

    def tenant_of(self, key: bytes) -> str | None:
        """Whose block ``key`` is, committed or being written (a Tenant.tag; None: absent).
        Where tenants are not counted (no :attr:`shares`) the tier holds the default tenant's
        blocks alone: an adopted block of another is not taken up (kvcached.store.adoption)."""
        entry = self._index.get(key)
        return None if entry is None else self.shares.tag_of(entry) if self.shares is not None else ""

    def holds(self, block: RamBlock) -> bool:
        """``block``'s block (committed or not) is still in the tier."""
        return block.tier is self and self._gen[block.id] == block.gen

    # A handle's state, read from the tier's columns (0 / False once its block has left).

    def refs_of(self, block: RamBlock) -> int:
        return self._refs[block.id] if self._gen[block.id] == block.gen else 0

    def is_clean(self, block: RamBlock) -> bool:
        return self._gen[block.id] == block.gen and self._clean[block.id] == 1

    def hits_of(self, block: RamBlock) -> int:
        return self._hits[block.id] if self._gen[block.id] == block.gen else 0

    def set_hits(self, block: RamBlock, hits: int) -> None:
        if self._gen[block.id] == block.gen:
            self._hits[block.id] = hits

    def committed(self, block: RamBlock) -> bool:
        """``block``'s block is still in the tier and committed (what ``get(block.key) ==
        block`` says, without making a handle)."""
        entry = block.id
        return block.tier is self and self._gen[entry] == block.gen and self._refs[entry] != WRITING

    def busy_reason(self, key: bytes) -> str | None:
        """Why ``key`` cannot be removed now (None: absent or idle)."""
        entry = self._index.get(key)
        if entry is None or self._refs[entry] == 0:
            return None
        refs = self._refs[entry]
        return "being written" if refs == WRITING else f"{refs} readers"

    def blocks(self) -> Iterable[RamBlock]:
        """Every block in the tier, committed or not (do not change the tier while iterating)."""
        return (self._handle(entry) for entry in self._ids.entries())

    def keys(self) -> list[bytes]:
        """The keys of every block in the tier, committed or not."""
        return list(self._ids)

    def clean_keys(self) -> list[bytes]:
        """The keys of the committed blocks that are clean."""
        clean, refs = self._clean, self._refs
        return [key for key, e in self._ids.items() if clean[e] and refs[e] != WRITING]

    # -- writing ------------------------------------------------------------------------------

    def reserve(self, key: bytes, length: int, tenant: str = "") -> RamBlock:
        """A slot for ``length`` bytes under ``key``, in state WRITING, as ``tenant``'s block
        (a Tenant.tag; it matters where shares are set).

        Raises ValueError for a size outside 1..max_block_bytes or a key already present,
        RamFull when no room can be made.
        """
        if key in self._index:
            raise ValueError("block already present")
        cls = self.slabs.class_for(length)
        owner = self.owners.owner_for(tenant)
        slot = self.slabs.allocate(cls, owner)
        if slot is None:
            self._make_room(cls, tenant, length, owner)
            slot = self.slabs.allocate(cls, owner)
            assert slot is not None, "room was made but allocation failed"
        if self.directory is not None:
            self.directory.reserved(slot, key, length, cls, owner)
        return self._record(key, slot, length, tenant)

    def place(self, key: bytes, slot: int, cls: int, length: int, owner: int = 0) -> RamBlock:
        """A predecessor's block, at the slot it left it in owner ``owner``'s arena, in state
        WRITING until it is checked and committed (or aborted): kvcached.store.adoption. It is
        counted as the owner's tenant's. The slot directory is left as it is, so a crash before
        the check finds the same entry again. ValueError if the slot cannot be taken (see
        SlabAllocator.allocate_at), the owner has no arena, the key is present or the length
        does not fit the class."""
        if key in self._index:
            raise ValueError("block already present")
        classes = self.slabs.classes
        if not 0 <= cls < len(classes) or not 0 < length <= classes[cls]:
            raise ValueError(f"a block of {length} bytes does not fit size class {cls}")
        if not self.owners.has(owner):
            raise ValueError(f"owner {owner} has no arena here")
        self.slabs.allocate_at(slot, cls, owner)
        return self._record(key, slot, length, self.owners.tag_of(owner))

    def _record(self, key: bytes, slot: int, length: int, tenant: str = "") -> RamBlock:
        entry = self._ids.add(key)
        if self.shares is not None:
            self.shares.reserved(entry, tenant, length)
        self._slot[entry] = slot
        self._length[entry] = length
        self._refs[entry] = WRITING
        self._clean[entry] = 0
        self._hits[entry] = 0
        self._by_slot[slot] = entry + 1
        self.used_bytes += length
        return RamBlock(self, entry, self._gen[entry], key, slot, length)

    def write(self, block: RamBlock, data: bytes | memoryview) -> None:
        if block.refs != WRITING or not self.holds(block) or len(data) != block.length:
            raise ValueError("block is not reserved for writing this many bytes")
        self._bytes(block.slot, block.length)[:] = data

    def commit(self, block: RamBlock, clean: bool = False) -> None:
        """WRITING -> idle: the block becomes visible and evictable. ``clean``: its bytes are
        on SSD already (a promotion)."""
        entry = block.id
        if block.tier is not self or self._gen[entry] != block.gen or self._refs[entry] != WRITING:
            raise ValueError("block is not being written")
        self._refs[entry] = 0
        self._clean[entry] = clean
        if self.directory is not None:
            self.directory.committed(block.slot, clean)
        if not clean:
            self.dirty.queue.push(entry)
            self.dirty_bytes += block.length
        self.policy.insert(entry, block.key)
        if self.shares is not None:
            self.shares.committed(entry)

    def mark_clean(self, block: RamBlock) -> None:
        """The block's bytes are now on SSD too."""
        if not self.holds(block):
            return
        entry = block.id
        if not self._clean[entry] and self._refs[entry] != WRITING:
            self.dirty.queue.remove(entry)
            self.dirty_bytes -= block.length
        self._clean[entry] = 1
        self._hits[entry] = 0
        if self.directory is not None:
            self.directory.set_clean(block.slot, True)

    def mark_dirty(self, block: RamBlock) -> None:
        """The block's SSD copy is gone: RAM holds its only copy again."""
        entry = block.id
        if self.holds(block) and self._clean[entry] and self._refs[entry] != WRITING:
            self._hits[entry] = 0
            self._clean[entry] = 0
            self.dirty.queue.push(entry)
            self.dirty_bytes += block.length
            if self.directory is not None:
                self.directory.set_clean(block.slot, False)

    def slot_view(self, block: RamBlock) -> memoryview:
        """The block's slot, whole pages (page aligned): direct I/O reads and writes use it."""
        return self._bytes(block.slot, min(self.slabs.slot_size(block.slot), -(-block.length // 4096) * 4096))

    def abort(self, block: RamBlock) -> None:
        """Give back a reserved slot whose write failed."""
        if not self.holds(block) or self._refs[block.id] != WRITING:
            raise ValueError("block is not being written")
        self._drop(block.id)

    # -- reading ------------------------------------------------------------------------------

    def read(self, block: RamBlock) -> bytes:
        self.policy.touch(block.id)
        return self._bytes(block.slot, block.length).tobytes()

    def read_range(self, block: RamBlock, start: int, length: int) -> bytes:
        """A copy of up to ``length`` bytes of ``block`` from ``start`` (streaming)."""
        return self._bytes(block.slot, block.length)[start:start + length].tobytes()

    def view(self, block: RamBlock) -> memoryview:
        """The block's bytes in the arena, without a copy. Valid while the block is pinned."""
        return self._bytes(block.slot, block.length)

    def pin(self, block: RamBlock) -> None:
        """One more reader that uses the block (a Get, a stream, an agent's load): the policy
        is told (BlockBusy while it is being written). A block that left the tier has no
        readers to count: nothing happens."""
        if self.hold(block):
            self.policy.touch(block.id)

    def hold(self, block: RamBlock) -> bool:
        """One more reader that is not a use: the daemon's own work on the block (holding a
        new block until it is recorded or published, reading it to write it to SSD). The
        policy is not told: a block saved once and held by its own commit is still a block
        used once (tests/integration/test_trace_hit_rate.py). Whether it was held (False: it
        left the tier); BlockBusy while it is being written."""
        entry = block.id
        if self._gen[entry] != block.gen:
            return False
        refs = self._refs
        n = refs[entry]
        if n == WRITING:
            raise BlockBusy("block is being written")
        refs[entry] = n + 1
        return True

    def unpin(self, block: RamBlock) -> None:
        entry = block.id
        if self._gen[entry] != block.gen:
            return
        refs = self._refs
        n = refs[entry]
        if n <= 0:
            raise ValueError("block is not pinned")
        refs[entry] = n - 1

    # -- removal ------------------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove an idle block. False if absent; BlockBusy if being written or read."""
        entry = self._index.get(key)
        if entry is None:
            return False
        refs = self._refs[entry]
        if refs != 0:
            raise BlockBusy("block is being written" if refs == WRITING else f"block has {refs} readers")
        self._drop(entry)
        return True

    def drop(self, blocks: list[RamBlock]) -> None:
        """Drop idle blocks on request (not for room): counted apart from evictions, put in the
        outbox as evictions are (:meth:`take_evicted`), so the index learns the RAM copy is
        gone. Blocks that already left the tier are passed over."""
        held = [block for block in blocks if self.holds(block)]
        for block in held:
            refs = self._refs[block.id]
            if refs != 0:
                raise BlockBusy(f"block has {refs} readers" if refs > 0 else "block is being written")
        for block in held:
            self._drop(block.id)
        self.dropped += len(held)
        self._evicted.append(held)

    def _drop(self, entry: int, evicted: bool = False) -> None:
        key = self._ids.keys[entry]
        assert key is not None
        length = self._length[entry]
        if not self._clean[entry] and self._refs[entry] != WRITING:
            self.dirty.queue.remove(entry)
            self.dirty_bytes -= length
        if self._refs[entry] != WRITING:
            if evicted:
                self.policy.evicted(entry, key)
            else:
                self.policy.remove(entry)
        if self.shares is not None:
            self.shares.dropped(entry, length, committed=self._refs[entry] != WRITING)
        slot = self._slot[entry]
        if self.directory is not None:
            self.directory.freed(slot)
        self._by_slot[slot] = 0
        self._gen[entry] = (self._gen[entry] + 1) & 0xFFFFFFFF
        self._ids.discard(key)
        self.slabs.free(slot)
        self.used_bytes -= length

    def _make_room(self, cls: int, tenant: str = "", need: int = 0, owner: int = 0) -> None:
        """Evict what :meth:`Victims.choose` picks for a block of ``tenant`` (owner ``owner``)
        needing ``need`` bytes of class ``cls`` (one block, or one whole slab); RamFull if
        nothing may go."""
        victims = self._victims.choose(self.policy, cls, self.prefer_clean, self.shares if self._enforce else None,
                                       tenant, need, owner)
        if victims:
            self._evict(victims)
            return
        raise RamFull(f"RAM tier full: {len(self)} blocks, {self.used_bytes} bytes, none of them can be evicted now "
                      "(all in use" + (", or other tenants' within their shares)" if self._enforce else ")"))

    def held_by_tenant(self, tenant: str) -> tuple[int, int]:
        """(blocks, payload bytes) of ``tenant``'s (tenants not counted: all the tier's)."""
        return self.shares.held_by(tenant) if self.shares is not None else (len(self), self.used_bytes)

    def used_by_tenant(self) -> dict[str, int]:
        return self.shares.used_by() if self.shares is not None else {"": self.used_bytes}

    def _evict(self, victims: list[int]) -> None:
        blocks = [self._handle(entry) for entry in victims]
        for entry in victims:
            if not self._clean[entry]:
                self.dirty_evictions += 1
            self._drop(entry, evicted=True)
        self.evictions += len(victims)
        self._evicted.append(blocks)

    def take_evicted(self) -> list[list[RamBlock]]:
        """The blocks evicted or dropped since the last call, one list per eviction (a block,
        or a whole slab's), oldest first; the outbox is empty after."""
        if not self._evicted:
            return []
        taken, self._evicted = self._evicted, []
        return taken

    # -- policy state -------------------------------------------------------------------------

    def policy_state(self) -> "RamPolicyState":
        """The policy's state in keys, for kvcached.index.policy_state."""
        return RamPolicyState(self.policy, self._ids)


class RamPolicyState:
    """The RAM tier's policy as kvcached.index.policy_state sees it: snapshot and restore in keys
    (kvcached.policies.PolicyState), translated through the tier's record ids."""

    def __init__(self, policy: EvictionPolicy, ids: KeyIds) -> None:
        self._policy = policy
        self._ids = ids

    def snapshot(self) -> PolicySnapshot:
        return self._policy.snapshot(self._ids.key_getter)

    def snapshot_steps(self) -> Steps[PolicySnapshot]:
        """The policy copied now, with the tier's key table, and walked in steps while the
        tier serves (kvcached.policies.base.Steps)."""
        return self._policy.snapshot_steps(self._ids.frozen_keys())

    def restore(self, snapshot: PolicySnapshot, resident: Callable[[bytes], bool]) -> None:
        ids = self._ids
        self._policy.restore(snapshot, lambda key: ids.get(key) if resident(key) else None)
