"""Slab generations and the agent's page locks (kvcached.tiers.arenas.SlabGenerations,
kvcached_agent.slab_pins): a slab the daemon recycles between tenants is locked again by the
agent, stale locks are let go, and the table is the daemon's alone to write.

The locking itself is CUDA's (cudaHostRegister), which this machine has no device for: the
agent's copier passes it in, so here the calls are recorded instead, against the real table a
real RAM tier writes as its slabs change owner."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from kvcached.policies.lru import LruPolicy
from kvcached.tiers.arenas import Arenas
from kvcached.tiers.ram import RamTier
from kvcached_agent.copy import _Run, _split_at
from kvcached_agent.slab_pins import SlabGenerationsView, SlabPins
from tests.unit.conftest import KIB, SLAB

BLOCK = 16 * KIB
TIER = 4 * SLAB                    # four slabs: one tenant's saves soon take another's


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def save(ram: RamTier, tenant: str, n: int) -> int:
    block = ram.reserve(f"{tenant}-{n}".encode().ljust(32, b"."), BLOCK, tenant)
    ram.write(block, bytes([n % 256]) * BLOCK)
    ram.commit(block, clean=True)
    return ram.slabs.offset(block.slot)


def test_a_recycled_slab_is_locked_again_and_a_stale_lock_let_go() -> None:
    ram = RamTier(Arenas(TIER), SLAB, LruPolicy(), count_tenants=True)
    alice_fds = ram.agent_fds("alice")
    assert len(alice_fds) == 2, "where slabs change owner an agent gets the arena and its generations"
    view = SlabGenerationsView(os.dup(alice_fds[1]))
    assert view.slab_bytes == ram.slabs.slab_bytes and view.slabs == 4
    calls: list[tuple[str, int]] = []
    clock = Clock()
    pins = SlabPins(view, lambda at, n: calls.append(("lock", at)), lambda at: calls.append(("unlock", at)), clock)
    offsets = [save(ram, "alice", n) for n in range(SLAB // BLOCK)]       # one slab of alice's
    for at in offsets:
        pins.cover(at, BLOCK)
    slab = offsets[0] // SLAB
    assert calls == [("lock", slab * SLAB)] and pins.locked == {slab: 0}
    for n in range(8 * TIER // BLOCK):                                   # bob fills the tier: alice's slab is his
        save(ram, "bob", n)
    assert "alice-0".encode().ljust(32, b".") not in ram and view.generation[slab] == 1
    assert ram.arenas.released_bytes >= SLAB
    clock.now += 2                                                       # the sweep lets the stale lock go
    pins.sweep()
    assert calls[-1] == ("unlock", slab * SLAB) and pins.locked == {}
    calls.clear()
    at = save(ram, "alice", 99)                                            # alice's again: locked at its new generation
    pins.cover(at, BLOCK)
    assert calls == [("lock", (at // SLAB) * SLAB)] and pins.locked[at // SLAB] == view.generation[at // SLAB]
    pins.close()
    assert calls[-1][0] == "unlock" and pins.locked == {}
    view.close()
    ram.arenas.close()


def test_a_lock_taken_before_a_recycling_is_replaced_when_the_slab_is_used_again() -> None:
    ram = RamTier(Arenas(TIER), SLAB, LruPolicy(), count_tenants=True)
    view = SlabGenerationsView(os.dup(ram.agent_fds("alice")[1]))
    calls: list[tuple[str, int]] = []
    pins = SlabPins(view, lambda at, n: calls.append(("lock", at)), lambda at: calls.append(("unlock", at)))
    at = save(ram, "alice", 0)
    pins.cover(at, BLOCK)
    for n in range(2 * TIER // BLOCK):                    # until alice's quiet slab is bob's
        save(ram, "bob", n)
        if view.generation[at // SLAB]:
            break
    assert view.generation[at // SLAB] == 1
    # bob's blocks go, those in alice's old slab first: the first free slab is that one, and
    # alice's next block takes it (from bob's arena, punched out of it first)
    keys = [b.key for b in ram.blocks()]
    keys.sort(key=lambda k: ram.slabs.slab_of(ram.get(k).slot) != at // SLAB)   # type: ignore[union-attr]
    for key in keys:
        ram.delete(key)
    again = save(ram, "alice", 1000)
    assert again // SLAB == at // SLAB
    pins.cover(again, BLOCK)
    assert calls[-2:] == [("unlock", (at // SLAB) * SLAB), ("lock", (at // SLAB) * SLAB)] and pins.relocked == 1
    view.close()
    ram.arenas.close()


def test_the_generations_are_the_daemons_to_write_and_one_arena_has_none() -> None:
    ram = RamTier(Arenas(TIER), SLAB, LruPolicy(), count_tenants=True)
    fd = ram.agent_fds("alice")[1]
    with pytest.raises(OSError):
        mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.pwrite(fd, b"\xff", 64)
    ram.arenas.close()
    one = RamTier(Arenas(TIER), SLAB, LruPolicy())
    assert len(one.agent_fds("")) == 1, "one arena: nothing is ever recycled, nothing to lock again"
    one.arenas.close()


def test_gpu_runs_are_cut_at_slab_boundaries() -> None:
    tensor = torch.arange(100, dtype=torch.uint8)
    runs = _split_at([_Run(tensor, 90, 100)], 64)
    assert [(r.offset, r.nbytes) for r in runs] == [(90, 38), (128, 62)]
    assert torch.equal(torch.cat([r.tensor for r in runs]), tensor)
    assert [(r.offset, r.nbytes) for r in _split_at([_Run(tensor[:10], 0, 10)], 64)] == [(0, 10)]
