"""RAM shares by tenant (kvcached.tiers.ram_shares) on a real arena: a noisy tenant never evicts
another's blocks within that tenant's share, room nobody uses is lent and taken back, and a
tenant over its share evicts its own blocks before anyone's."""

from __future__ import annotations

import pytest

from kvcached.policies.lru import LruPolicy
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamFull, RamTier
from tests.unit.conftest import KIB, SLAB, payload

BLOCK = 16 * KIB          # four to a slab: 16 in the test arena


def tier(arena: SharedArena, shares: dict[str, int]) -> RamTier:
    return RamTier(arena, SLAB, LruPolicy(), shares=shares)


def save(ram: RamTier, tenant: str, n: int) -> bytes:
    key = f"{tenant}-{n}".encode().ljust(32, b".")
    block = ram.reserve(key, BLOCK, tenant)
    ram.write(block, payload(n, BLOCK))
    ram.commit(block)
    ram.take_evicted()
    return key


def held(ram: RamTier, tenant: str) -> int:
    return ram.used_by_tenant().get(tenant, 0) // BLOCK


def test_a_noisy_tenant_never_evicts_a_quiet_ones_blocks_within_its_share(arena: SharedArena) -> None:
    ram = tier(arena, {"alice": 8 * BLOCK, "bob": 4 * BLOCK})
    quiet = [save(ram, "alice", i) for i in range(8)]
    for i in range(100):
        save(ram, "bob", i)
        assert all(key in ram for key in quiet), f"bob's write {i} evicted alice's blocks within her share"
    assert (held(ram, "alice"), held(ram, "bob")) == (8, 8), "bob borrowed what alice did not use, and no more"


def test_lent_room_is_taken_back_from_the_borrowers(arena: SharedArena) -> None:
    ram = tier(arena, {"alice": 8 * BLOCK, "bob": 4 * BLOCK})
    for i in range(16):
        save(ram, "carol", i)                     # no share: all of it lent
    assert held(ram, "carol") == 16
    mine = [save(ram, "alice", i) for i in range(8)]
    assert all(key in ram for key in mine) and held(ram, "carol") == 8, "alice took back her share from carol"
    for i in range(4):
        save(ram, "bob", i)
    assert (held(ram, "alice"), held(ram, "bob"), held(ram, "carol")) == (8, 4, 4)


def test_a_tenant_over_its_share_evicts_its_own_blocks_first(arena: SharedArena) -> None:
    ram = tier(arena, {"alice": 8 * BLOCK, "carol": 4 * BLOCK})
    theirs = [save(ram, "carol", i) for i in range(4)]       # the oldest blocks of the tier
    mine = [save(ram, "alice", i) for i in range(12)]         # her 8, then 4 borrowed
    save(ram, "alice", 12)
    assert all(key in ram for key in theirs), "carol's older blocks went before alice's own"
    assert mine[0] not in ram and held(ram, "alice") == 12, "alice's own oldest block made the room"


def test_when_only_protected_blocks_are_left_a_write_is_refused(arena: SharedArena) -> None:
    ram = tier(arena, {"alice": 12 * BLOCK, "bob": 4 * BLOCK})
    for i in range(12):
        save(ram, "alice", i)
    for i in range(4):
        save(ram, "bob", i)
    for i in range(4):                       # bob's own blocks make room for bob, one by one
        save(ram, "bob", 10 + i)
    assert held(ram, "alice") == 12
    for i in range(4):                       # every block of bob's in use: none of his can go
        ram.pin(ram.get(f"bob-{10 + i}".encode().ljust(32, b".")))      # type: ignore[arg-type]
    with pytest.raises(RamFull, match="within their shares"):
        save(ram, "bob", 99)
    assert held(ram, "alice") == 12, "bob's write evicted a block of alice's share"


def test_the_counts_follow_deletes_aborts_and_adoption(arena: SharedArena) -> None:
    ram = tier(arena, {"alice": 4 * BLOCK})
    key = save(ram, "alice", 0)
    block = ram.reserve(b"w".ljust(32, b"."), BLOCK, "alice")
    assert held(ram, "alice") == 2
    ram.abort(block)
    ram.delete(key)
    assert held(ram, "alice") == 0
    owner = ram.owners.owner_for("alice")     # a predecessor's block, placed in alice's arena: alice's
    placed = ram.place(b"p".ljust(32, b"."), ram.slabs.slots_per_slab_max * (ram.slabs.nslabs - 1),
                      ram.slabs.class_for(BLOCK), BLOCK, owner)
    assert (held(ram, "alice"), held(ram, "")) == (1, 0)
    ram.abort(placed)
    assert tier(arena, {}).used_by_tenant() == {"": 0}, "no shares: one count"


def test_blocks_of_tenants_past_the_counted_ones_are_nobodys_to_a_read(arena: SharedArena) -> None:
    """Past MAX_OWNERS tenants counted (tags from records of tenants no longer configured, say),
    the rest are counted together as an owner no caller's tag names: a read's test of whose a
    block is never takes one of theirs for the default tenant's (or for any tenant's)."""
    from kvcached.tiers.ram_shares import MAX_OWNERS, OVERFLOW, RamShares, owner_test
    shares = RamShares({}, 1024)
    for n in range(MAX_OWNERS + 10):
        shares.reserved(n, f"t{n}" if n else "", 1)
    late = MAX_OWNERS + 5                                # counted with the overflow
    assert shares.tag_of(late) == OVERFLOW and shares.tag_of(0) == ""
    for tag in ("", f"t{late}", OVERFLOW):
        test = owner_test(shares, tag)
        assert test is not None and not test(late), tag
    assert owner_test(shares, "")(0) and owner_test(shares, None) is None         # type: ignore[misc]
    assert owner_test(None, "") is None and not owner_test(None, "t1")(0)         # type: ignore[misc]
