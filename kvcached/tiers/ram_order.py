"""The RAM tier's orders over its record ids (kvcached.tiers.ram): the dirty blocks oldest
first, which write-back takes (:class:`DirtyList`), and which blocks an eviction takes
(:class:`Victims`). Both read the tier's columns, shared and never copied. No I/O here.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator

from kvcached.policies import EvictionPolicy
from kvcached.policies.links import IdLinks, IdQueue, KeyIds
from kvcached.tiers.ram_shares import SEARCH, RamShares
from kvcached.tiers.slabs import SlabAllocator

__all__ = ["CLEAN_SEARCH", "DirtyList", "Victims"]

CLEAN_SEARCH = 32      # candidates looked at for a clean victim before a dirty one goes


class DirtyList:
    """The tier's dirty blocks, oldest first: an :class:`IdQueue` over the tier's record ids
    (8 bytes a block). Iterating gives their keys; do not change the tier while iterating."""

    def __init__(self, ids: KeyIds, capacity: int) -> None:
        self._ids = ids
        links = IdLinks()
        links.size_for(capacity)
        self.queue = IdQueue(links, 1)

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __iter__(self) -> Iterator[bytes]:
        return map(self._ids.key_of, self.queue)


class Victims:
    """Which blocks an eviction takes, over the tier's columns (shared, not copied)."""

    def __init__(self, slabs: SlabAllocator, slot: memoryview, refs: memoryview, clean: memoryview,
                 by_slot: memoryview) -> None:
        self.slabs, self.slot, self.refs, self.clean, self.by_slot = slabs, slot, refs, clean, by_slot

    def choose(self, policy: EvictionPolicy, cls: int, prefer_clean: bool, shares: RamShares | None,
               tenant: str, need: int, owner: int = 0) -> list[int] | None:
        """What to evict for a block of class ``cls`` in owner ``owner``'s arena: the policy's
        first workable candidate;
        with ``shares`` (enforced), the candidates a block of ``tenant`` needing ``need`` bytes
        may evict, in the order kvcached.tiers.ram_shares gives, each set's oldest past the
        policy's next :data:`SEARCH`. None: nothing may go."""
        if shares is None:
            return self.pick(policy.candidates(), cls, prefer_clean, owner=owner)
        for test, owners in shares.preferences(tenant, need):
            victims = (self.pick(itertools.islice(policy.candidates(), SEARCH), cls, prefer_clean, test, owner)
                       or self.pick(shares.oldest(owners()), cls, prefer_clean, test, owner))
            if victims:
                return victims
        return None

    def pick(self, entries: Iterable[int], cls: int, prefer_clean: bool,
             test: Callable[[int], bool] | None = None, owner: int = 0) -> list[int] | None:
        """The first workable victims among ``entries`` (each idle and passing ``test``): the
        block, or the whole slab it is in when that slab is of another size class or owner
        (a slot freed in another owner's slab is no room for ``owner``: that slab passes to
        ``owner``, kvcached.tiers.arenas); with ``prefer_clean``, the first clean ones among
        the next few, else the first. None: none."""
        fallback: list[int] | None = None
        looked = 0
        refs, clean, by_slot, slabs = self.refs, self.clean, self.by_slot, self.slabs
        for entry in entries:
            if refs[entry] != 0 or (test is not None and not test(entry)):
                continue
            slab = slabs.slab_of(self.slot[entry])
            if slabs.class_of_slab(slab) == cls and slabs.owner_of_slab(slab) == owner:
                victims = [entry]
            else:
                victims = [e - 1 for s in slabs.slots_of(slab) if (e := by_slot[s])]
                if any(refs[e] != 0 or (test is not None and not test(e)) for e in victims):
                    continue
            if not prefer_clean or all(clean[e] for e in victims):
                return victims
            fallback = fallback or victims
            looked += 1
            if looked >= CLEAN_SEARCH:
                break
        return fallback
