"""The RAM tier's slabs between tenants' arenas (kvcached.tiers.arenas, ram_order.Victims): one
budget for all of them, counted by the kernel, while two tenants save side by side; a tenant
that went quiet gives its room up, its pages back to the kernel."""

from __future__ import annotations

import os

from kvcached.policies.lru import LruPolicy
from kvcached.tiers.arenas import Arenas
from kvcached.tiers.ram import RamTier
from tests.unit.conftest import KIB, SLAB

BLOCK = 16 * KIB
TIER = 16 * SLAB
PER_SLAB = SLAB // BLOCK


def save(ram: RamTier, tenant: str, n: int) -> None:
    block = ram.reserve(f"{tenant}-{n}".encode().ljust(32, b"."), BLOCK, tenant)
    ram.write(block, os.urandom(BLOCK))
    ram.commit(block, clean=True)


def held_pages(ram: RamTier) -> int:
    """Bytes the kernel holds for all the tier's arenas."""
    return sum(os.fstat(arena.fd).st_blocks * 512 for _, arena in ram.arenas.items())


def slabs_of(ram: RamTier, tenant: str) -> int:
    owner = ram.owners.owner_for(tenant)
    return sum(ram.slabs.owner_of_slab(s) == owner for s in range(ram.slabs.nslabs))


def test_two_tenants_side_by_side_stay_within_one_budget() -> None:
    ram = RamTier(Arenas(TIER), SLAB, LruPolicy(), count_tenants=True)
    for n in range(20 * TIER // BLOCK):                 # in turns of 6 blocks each
        save(ram, "alice" if n // 6 % 2 else "bob", n)
        assert held_pages(ram) <= TIER, "the arenas together hold more than the tier"
    assert ram.slabs.released > 0 and slabs_of(ram, "alice") + slabs_of(ram, "bob") == TIER // SLAB
    assert abs(slabs_of(ram, "alice") - slabs_of(ram, "bob")) <= 2
    ram.arenas.close()


def test_a_quiet_tenant_gives_its_room_up() -> None:
    ram = RamTier(Arenas(TIER), SLAB, LruPolicy(), count_tenants=True)
    for n in range(TIER // BLOCK):                 # alice fills the tier, then goes quiet
        save(ram, "alice", n)
    for n in range(TIER // BLOCK):                 # bob's saves take her slabs, least recent first
        save(ram, "bob", n)
    assert slabs_of(ram, "alice") == 0 and ram.held_by_tenant("alice") == (0, 0)
    assert held_pages(ram) <= TIER
    assert os.fstat(ram.arenas.get(ram.owners.owner_for("alice")).fd).st_blocks == 0, "her pages went back to the kernel"
    ram.arenas.close()
