"""RAM tier: block bytes in the shared arena, block states, eviction within the byte budget.

Contract (the rules of DESIGN.md, enforced here):

- Every block has a state: ``refs == WRITING`` (-1) while its bytes are being written,
  ``0`` when idle, ``n > 0`` while n readers hold it. Only idle blocks are ever evicted or
  deleted; only committed blocks are visible to :meth:`get`.
- The arena is the budget: slots are carved from it, so resident bytes can never exceed
  ``kv.ram_gib``. When a class has no free slot, the policy's candidates are tried in order; the
  first idle one of the same class frees its slot, or, if a candidate sits in another class's
  slab whose blocks are all idle, that whole slab is emptied and changes class. If no candidate
  works, :class:`RamFull` is raised and nothing was evicted.
- Evicted blocks are handed to ``on_evict`` (the store keeps their metadata in the index).
- A block is *clean* when evicting it loses nothing the tiers want kept: a copy is on SSD, or
  the SSD tier's own policy dropped that copy (TTL, capacity). *Dirty* blocks are waiting to be
  written back: only RAM has them. Dirty blocks are kept in the order they became dirty
  (:attr:`RamTier.dirty`, a :class:`DirtyList`, oldest first) for the write-back demoter;
  with ``prefer_clean`` eviction looks a little further for a clean victim before it drops a
  dirty one (whose bytes are then gone).

Runs on the event loop thread only; no locks, no I/O besides memcpy into the arena.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from kvcached.policies import EvictionPolicy
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.slabs import SlabAllocator

__all__ = ["RamBlock", "RamFull", "BlockBusy", "RamTier", "WRITING"]

WRITING = -1
CLEAN_SEARCH = 32      # candidates looked at for a clean victim before a dirty one goes
LENGTHS_KEPT = 4096    # distinct block sizes whose int objects are shared between blocks


class RamFull(Exception):
    """No room can be made without evicting a block that is in use."""


class BlockBusy(Exception):
    """The block is being written or read; it cannot be removed now."""


@dataclass(slots=True, eq=False)
class RamBlock:
    """One resident block: where its bytes are and who holds it. Checksums and other metadata
    live in the index, not here (this object is paid for per resident block)."""

    key: bytes
    slot: int
    length: int
    refs: int = WRITING
    clean: bool = False
    hits_to_ssd: int = 0     # write_through_selective: hits still needed before it goes to SSD


class DirtyList:
    """The tier's dirty blocks, oldest first, as a deque of block references (8 bytes a block,
    where a dict entry costs some 60). A block cleaned, dropped or replaced leaves its entry
    behind: iteration skips such entries (and drops them at the front), and the deque is rebuilt
    once they outnumber the live ones. A block dirtied again comes up at its earlier place while
    that entry is still there, else at the end."""

    def __init__(self, blocks: dict[bytes, RamBlock]) -> None:
        self._blocks = blocks
        self._queue: deque[RamBlock] = deque()
        self._live = 0

    def _is_live(self, block: RamBlock) -> bool:
        return not block.clean and block.refs != WRITING and self._blocks.get(block.key) is block

    def add(self, block: RamBlock) -> None:
        self._queue.append(block)
        self._live += 1
        if len(self._queue) > 2 * self._live + 1024:
            self._queue = deque(self._live_blocks())

    def _live_blocks(self) -> Iterator[RamBlock]:
        seen: set[int] = set()
        for block in self._queue:
            if self._is_live(block) and id(block) not in seen:
                seen.add(id(block))
                yield block

    def removed(self) -> None:
        """A block of the list is clean or gone now (its entry goes stale)."""
        self._live -= 1

    def __len__(self) -> int:
        return self._live

    def __bool__(self) -> bool:
        return self._live > 0

    def __iter__(self) -> Iterator[bytes]:
        """The keys of the dirty blocks, oldest first. Do not change the tier while iterating."""
        queue = self._queue
        while queue and not self._is_live(queue[0]):
            queue.popleft()
        for block in self._live_blocks():
            yield block.key


class RamTier:
    def __init__(self, arena: SharedArena, slab_bytes: int, policy: EvictionPolicy,
                 on_evict: Callable[[list[RamBlock]], None] = lambda blocks: None) -> None:
        self.arena = arena
        self.slabs = SlabAllocator(arena.size, slab_bytes)
        self.policy = policy
        self.on_evict = on_evict
        self._blocks: dict[bytes, RamBlock] = {}
        self._lengths: dict[int, int] = {}
        self._by_slot: list[RamBlock | None] = [None] * (self.slabs.nslabs * self.slabs.slots_per_slab_max)
        self.used_bytes = 0          # payload bytes of committed and in-flight blocks
        self.evictions = 0
        self.dirty_evictions = 0     # evicted with no copy on SSD: their bytes are gone
        self.dropped = 0             # dropped on an operator's request (Admin Evict, Drain)
        self.dirty = DirtyList(self._blocks)   # committed dirty blocks, oldest first
        self.dirty_bytes = 0
        self.prefer_clean = False

    # -- queries ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.slabs.capacity

    @property
    def max_block_bytes(self) -> int:
        return self.slabs.slab_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.refs != WRITING

    def get(self, key: bytes) -> RamBlock | None:
        """The committed block under ``key``, or None (absent or still being written)."""
        block = self._blocks.get(key)
        if block is None or block.refs == WRITING:
            return None
        return block

    def resident_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are committed blocks (the lookup hot path)."""
        blocks = self._blocks
        n = 0
        for key in keys:
            block = blocks.get(key)
            if block is None or block.refs == WRITING:
                break
            n += 1
        return n

    def holds(self, block: RamBlock) -> bool:
        """``block`` (this very object, committed or not) is in the tier."""
        return self._blocks.get(block.key) is block

    def busy_reason(self, key: bytes) -> str | None:
        """Why ``key`` cannot be removed now (None: absent or idle)."""
        block = self._blocks.get(key)
        if block is None or block.refs == 0:
            return None
        return "being written" if block.refs == WRITING else f"{block.refs} readers"

    def blocks(self) -> Iterable[RamBlock]:
        return self._blocks.values()

    # -- writing ------------------------------------------------------------------------------

    def reserve(self, key: bytes, length: int) -> RamBlock:
        """A slot for ``length`` bytes under ``key``, in state WRITING.

        Raises ValueError for a size outside 1..max_block_bytes or a key already present,
        RamFull when no room can be made.
        """
        if key in self._blocks:
            raise ValueError("block already present")
        cls = self.slabs.class_for(length)
        slot = self.slabs.allocate(cls)
        if slot is None:
            self._make_room(cls)
            slot = self.slabs.allocate(cls)
            assert slot is not None, "room was made but allocation failed"
        # Blocks come in few sizes: one int object per size, not one per block (32 bytes each).
        if len(self._lengths) < LENGTHS_KEPT:
            length = self._lengths.setdefault(length, length)
        else:
            length = self._lengths.get(length, length)
        block = RamBlock(key, slot, length)
        self._blocks[key] = block
        self._by_slot[slot] = block
        self.used_bytes += length
        return block

    def write(self, block: RamBlock, data: bytes | memoryview) -> None:
        if block.refs != WRITING or len(data) != block.length:
            raise ValueError("block is not reserved for writing this many bytes")
        self.arena.write(self.slabs.offset(block.slot), data)

    def commit(self, block: RamBlock, clean: bool = False) -> None:
        """WRITING -> idle: the block becomes visible and evictable. ``clean``: its bytes are
        on SSD already (a promotion)."""
        if block.refs != WRITING:
            raise ValueError("block is not being written")
        block.refs = 0
        block.clean = clean
        if not clean:
            self.dirty.add(block)
            self.dirty_bytes += block.length
        self.policy.insert(block.key)

    def mark_clean(self, block: RamBlock) -> None:
        """The block's bytes are now on SSD too."""
        if not block.clean and block.refs != WRITING and self._blocks.get(block.key) is block:
            self.dirty.removed()
            self.dirty_bytes -= block.length
        block.clean = True
        block.hits_to_ssd = 0

    def mark_dirty(self, block: RamBlock) -> None:
        """The block's SSD copy is gone: RAM holds its only copy again."""
        if block.clean and block.refs != WRITING and self._blocks.get(block.key) is block:
            block.hits_to_ssd = 0
            block.clean = False
            self.dirty.add(block)
            self.dirty_bytes += block.length

    def slot_view(self, block: RamBlock) -> memoryview:
        """The block's slot, whole pages (page aligned): direct I/O reads and writes use it."""
        offset = self.slabs.offset(block.slot)
        return self.arena.view[offset:offset + min(self.slabs.slot_size(block.slot), -(-block.length // 4096) * 4096)]

    def abort(self, block: RamBlock) -> None:
        """Give back a reserved slot whose write failed."""
        if block.refs != WRITING:
            raise ValueError("block is not being written")
        self._drop(block)

    # -- reading ------------------------------------------------------------------------------

    def read(self, block: RamBlock) -> bytes:
        self.policy.touch(block.key)
        return self.arena.read(self.slabs.offset(block.slot), block.length)

    def read_range(self, block: RamBlock, start: int, length: int) -> bytes:
        """A copy of up to ``length`` bytes of ``block`` from ``start`` (streaming)."""
        end = min(block.length, start + length)
        offset = self.slabs.offset(block.slot)
        return self.arena.read(offset + start, max(0, end - start))

    def view(self, block: RamBlock) -> memoryview:
        """The block's bytes in the arena, without a copy. Valid while the block is pinned."""
        offset = self.slabs.offset(block.slot)
        return self.arena.view[offset:offset + block.length]

    def pin(self, block: RamBlock) -> None:
        if block.refs == WRITING:
            raise BlockBusy("block is being written")
        block.refs += 1
        self.policy.touch(block.key)

    def unpin(self, block: RamBlock) -> None:
        if block.refs <= 0:
            raise ValueError("block is not pinned")
        block.refs -= 1

    # -- removal ------------------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove an idle block. False if absent; BlockBusy if being written or read."""
        block = self._blocks.get(key)
        if block is None:
            return False
        if block.refs != 0:
            raise BlockBusy("block is being written" if block.refs == WRITING else f"block has {block.refs} readers")
        self._drop(block)
        return True

    def drop(self, blocks: list[RamBlock]) -> None:
        """Drop idle blocks on request (not for room): counted apart from evictions, reported to
        ``on_evict`` as evictions are, so the index learns the RAM copy is gone."""
        for block in blocks:
            if block.refs != 0:
                raise BlockBusy(f"block has {block.refs} readers" if block.refs > 0 else "block is being written")
        for block in blocks:
            self._drop(block)
        self.dropped += len(blocks)
        self.on_evict(blocks)

    def _drop(self, block: RamBlock, evicted: bool = False) -> None:
        if not block.clean and block.refs != WRITING:
            self.dirty.removed()
            self.dirty_bytes -= block.length
        del self._blocks[block.key]
        self._by_slot[block.slot] = None
        if evicted:
            self.policy.evicted(block.key)
        else:
            self.policy.remove(block.key)
        self.slabs.free(block.slot)
        self.used_bytes -= block.length

    def _make_room(self, cls: int) -> None:
        """Evict the policy's first workable candidate (one block, or one whole slab); with
        ``prefer_clean``, the first clean one among the next few, else that first one."""
        fallback: list[RamBlock] | None = None
        looked = 0
        for key in self.policy.candidates():
            block = self._blocks[key]
            if block.refs != 0:
                continue
            slab = self.slabs.slab_of(block.slot)
            if self.slabs.class_of_slab(slab) == cls:
                victims = [block]
            else:
                victims = [b for s in self.slabs.slots_of(slab) if (b := self._by_slot[s]) is not None]
                if any(b.refs != 0 for b in victims):
                    continue
            if not self.prefer_clean or all(v.clean for v in victims):
                self._evict(victims)
                return
            fallback = fallback or victims
            looked += 1
            if looked >= CLEAN_SEARCH:
                break
        if fallback:
            self._evict(fallback)
            return
        raise RamFull(f"RAM tier full: {len(self._blocks)} blocks, {self.used_bytes} bytes, "
                      "none of them can be evicted now (all in use)")

    def _evict(self, victims: list[RamBlock]) -> None:
        for victim in victims:
            if not victim.clean:
                self.dirty_evictions += 1
            self._drop(victim, evicted=True)
        self.evictions += len(victims)
        self.on_evict(victims)
