"""Shares of the RAM tier by tenant (tenants.ram_shares, docs/security.md "Capacity"): which
blocks a new block of one tenant may evict. No I/O; kvcached.tiers.ram asks it.

A tenant's share is bytes of the tier that are its own; a tenant without one has 0, so all it
holds is lent. Room is lent freely: a tenant may fill whatever nobody uses. When a block of
tenant T needs room:

1. T over its share (counting the new block): T's own blocks go first, then those of tenants
   over their shares (borrowers).
2. T within its share: borrowers' blocks go first (the lent room is taken back), then T's own.

A block of another tenant within its share is never evicted for T: a noisy tenant cannot flush
a quiet one below its share. Within each set the victim is the first the tier's policy offers
among its next :data:`SEARCH` candidates; past those, the set's oldest block (a queue per
tenant, so a rare eligible block costs no scan of the whole tier).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

from kvcached.policies.links import IdLinks, IdQueue, column

__all__ = ["MAX_OWNERS", "SEARCH", "Preference", "RamShares", "owner_test"]

#: a set of victims: (a test on a record id, the tenants whose blocks pass it)
Preference = tuple[Callable[[int], bool], Callable[[], list[int]]]

SEARCH = 512           # policy candidates looked at for an eligible victim before the queues
MAX_OWNERS = 255       # tenants counted apart; past that, more are counted together (OVERFLOW)
OVERFLOW = "\x00more"  # the owner of blocks of tenants past MAX_OWNERS: no caller's tag (reads miss them)


class RamShares:
    """Each block's tenant (by record id), bytes used and the share of each tenant, and the
    victim preferences that follow. ``shares``: tenant tag -> bytes ("" the default tenant)."""

    def __init__(self, shares: Mapping[str, int], slots: int, owners: Sequence[str] = ()) -> None:
        """``owners``: the tags of the first owner ids, in order (a predecessor's numbering,
        which its arenas keep; kvcached.tiers.arenas); the default tenant's is always 0."""
        self._ids: dict[str, int] = {}
        self.names: list[str] = []
        self.share: list[int] = []
        self.used: list[int] = []
        self.blocks: list[int] = []
        self._owner = column("B", slots)
        self._links = IdLinks()
        self._links.size_for(slots)
        self._queues: list[IdQueue] = []
        self._sets: dict[int, tuple[Preference, Preference]] = {}
        self._id("")
        for tag in owners[1:]:
            self._id(tag)
        for tag, share in shares.items():
            self.share[self._id(tag)] = share

    def _id(self, tag: str) -> int:
        found = self._ids.get(tag)
        if found is not None:
            return found
        if len(self.names) >= MAX_OWNERS - 1 and tag != OVERFLOW:
            return self._id(OVERFLOW)
        new = self._ids[tag] = len(self.names)
        self.names.append(tag)
        self.share.append(0)
        self.used.append(0)
        self.blocks.append(0)
        self._queues.append(IdQueue(self._links, new + 1))
        return new

    def owner_id(self, tag: str) -> int:
        """The owner id of ``tag``'s blocks (the arena they lie in); made on first use. Tags
        past :data:`MAX_OWNERS` share :data:`OVERFLOW`'s, which no block may be stored under."""
        return self._id(tag)

    def used_by(self) -> dict[str, int]:
        """Bytes held, by tenant tag."""
        return dict(zip(self.names, self.used))

    def held_by(self, tag: str) -> tuple[int, int]:
        """(blocks, bytes) ``tag`` holds."""
        owner = self._ids.get(tag)
        return (0, 0) if owner is None else (self.blocks[owner], self.used[owner])

    # -- what the tier tells it ------------------------------------------------------------------

    def reserved(self, entry: int, tag: str, length: int) -> None:
        owner = self._owner[entry] = self._id(tag)
        self.used[owner] += length
        self.blocks[owner] += 1

    def committed(self, entry: int) -> None:
        self._queues[self._owner[entry]].push(entry)

    def dropped(self, entry: int, length: int, committed: bool) -> None:
        owner = self._owner[entry]
        self.used[owner] -= length
        self.blocks[owner] -= 1
        if committed:
            self._queues[owner].remove(entry)

    def tag_of(self, entry: int) -> str:
        return self.names[self._owner[entry]]

    def owned_by(self, tag: str) -> Callable[[int], bool]:
        """A test of whether a record id's block is ``tag``'s (for a read's hot loop). The
        blocks of tenants past :data:`MAX_OWNERS` are nobody's here: their reads find them
        through the index, never another's through this test."""
        owner = self._ids.get(tag) if tag != OVERFLOW else None
        if owner is None:
            return lambda entry: False
        column_ = self._owner
        return lambda entry: column_[entry] == owner

    # -- victims -----------------------------------------------------------------------------------

    def preferences(self, tag: str, need: int) -> tuple[Preference, Preference]:
        """For a new block of ``tag`` needing ``need`` bytes: the sets a victim may come from,
        in order, each as (test on a record id, the tenants whose queues hold it: a callable,
        asked only when the policy's candidates held none). Runs at every eviction: the tests
        are made once per tenant."""
        me = self._id(tag)
        mine, theirs = self._sets.get(me) or self._make_sets(me)
        return (mine, theirs) if self.used[me] + need > self.share[me] else (theirs, mine)

    def _make_sets(self, me: int) -> tuple[Preference, Preference]:
        owner, used, share = self._owner, self.used, self.share

        def own(entry: int) -> bool:
            return owner[entry] == me

        def lent(entry: int) -> bool:
            o = owner[entry]
            return o != me and used[o] > share[o]

        def borrowers() -> list[int]:          # the most over first
            return sorted((o for o in range(len(used)) if o != me and used[o] > share[o]),
                          key=lambda o: share[o] - used[o])

        sets = self._sets[me] = ((own, lambda: [me]), (lent, borrowers))
        return sets

    def oldest(self, owners: list[int]) -> Iterator[int]:
        """The blocks of ``owners``, each tenant's oldest first."""
        for o in owners:
            yield from self._queues[o]


def _nobody(entry: int) -> bool:
    return False


def owner_test(shares: RamShares | None, tenant: str | None) -> Callable[[int], bool] | None:
    """A test of whether a record id's block is ``tenant``'s (a Tenant.tag), for a read of the
    tier; None where no test is needed (``tenant`` None: the operator, anyone's). Without
    ``shares`` (tenants not counted) every block in the tier is the default tenant's."""
    if tenant is None or (shares is None and tenant == ""):
        return None
    return _nobody if shares is None else shares.owned_by(tenant)
