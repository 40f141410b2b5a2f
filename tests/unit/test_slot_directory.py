"""The slot directory (what each RAM slot holds, in a memfd of its own) and taking it up again:
RamTier writes it as it changes, a successor places its blocks back (kvcached.store.adoption)."""

from __future__ import annotations

import os
import random

import pytest

from kvcached.host.shared_memory import MemfdFiles
from kvcached.lifecycle.systemd import LISTEN_FDS_START, listen_fds
from kvcached.policies.clock import ClockPolicy
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import SlotDirectory, owner_digest
from tests.unit.conftest import ARENA, KIB, SLAB, payload


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def tier(arena: SharedArena, directory: SlotDirectory | None = None) -> RamTier:
    geometry = SlabAllocator.geometry(arena.size, SLAB)
    return RamTier(arena, SLAB, ClockPolicy(), directory or SlotDirectory.create(geometry))


def put(ram: RamTier, n: int, size: int) -> None:
    block = ram.reserve(key(n), size)
    ram.write(block, payload(n, size))
    ram.commit(block)


def test_the_directory_follows_the_tier_and_a_successor_places_the_same_blocks() -> None:
    arena = SharedArena(ARENA)
    ram = tier(arena)
    rng = random.Random(7)
    sizes = {n: rng.choice([4 * KIB, 20 * KIB, 64 * KIB, SLAB]) for n in range(200)}
    for n, size in sizes.items():           # enough to evict, and slabs change class
        put(ram, n, size)
    writing = ram.reserve(key(999), 8 * KIB)                # in flight: never listed
    ram.mark_clean(ram.get(next(k for k in ram.keys() if k in ram)))   # type: ignore[arg-type]
    assert ram.directory is not None
    entries = list(ram.directory.committed_entries())
    resident = {k: ram.get(k) for k in ram.keys() if k in ram}
    assert {e.key for e in entries} == set(resident) and key(999) not in resident
    assert sum(e.clean for e in entries) == 1
    for e in entries:
        block = resident[e.key]
        assert block is not None and (e.slot, e.length) == (block.slot, block.length)

    # a successor over the same memfds (as systemd's fd store or a handover passes them)
    geometry = SlabAllocator.geometry(ARENA, SLAB)
    MemfdFiles().check(os.dup(arena.fd), ARENA)
    successor = SharedArena(ARENA, fd=os.dup(arena.fd))
    directory = SlotDirectory.adopt(os.dup(ram.directory.fd), geometry)
    ram2 = RamTier(successor, SLAB, ClockPolicy(), directory)
    for e in directory.committed_entries():
        placed = ram2.place(e.key, e.slot, e.cls, e.length)
        assert e.key not in ram2                          # WRITING until checked
        ram2.commit(placed, clean=e.clean)
        assert ram2.read(ram2.get(e.key)) == payload(int.from_bytes(e.key, "big"), e.length)  # type: ignore[arg-type]
    assert ram2.used_bytes == ram.used_bytes - writing.length
    # the successor's allocator knows which slots are taken: new blocks never land on them
    for n in range(1000, 1040):
        put(ram2, n, 16 * KIB)
    for e in entries:
        if e.key in ram2:
            assert ram2.read(ram2.get(e.key)) == payload(int.from_bytes(e.key, "big"), e.length)  # type: ignore[arg-type]


def test_place_refuses_what_a_sound_directory_never_holds() -> None:
    ram = tier(SharedArena(ARENA))
    ram.place(key(1), 0, 0, 4 * KIB)
    with pytest.raises(ValueError, match="already present"):
        ram.place(key(1), 1, 0, 4 * KIB)
    with pytest.raises(ValueError, match="taken"):
        ram.place(key(2), 0, 0, 4 * KIB)
    with pytest.raises(ValueError, match="another size class"):
        ram.place(key(3), 1, len(ram.slabs.classes) - 1, SLAB)
    with pytest.raises(ValueError, match="does not fit"):
        ram.place(key(4), 2, 0, 8 * KIB)
    with pytest.raises(ValueError, match="outside the arena"):
        ram.place(key(5), ram.slabs.nslabs * ram.slabs.slots_per_slab_max, 0, 4 * KIB)


def test_adopt_checks_geometry_and_kind() -> None:
    geometry = SlabAllocator.geometry(ARENA, SLAB)
    directory = SlotDirectory.create(geometry)
    with pytest.raises(ValueError, match="another arena"):
        SlotDirectory.adopt(directory.fd, SlabAllocator.geometry(2 * ARENA, SLAB))
    other = os.memfd_create("x")
    os.ftruncate(other, 8192)
    with pytest.raises(ValueError, match="not a slot directory"):
        SlotDirectory.adopt(other, geometry)
    with pytest.raises(ValueError, match="not sealed"):
        MemfdFiles().check(other, 8192)
    os.close(other)
    with pytest.raises(ValueError, match="wants"):
        MemfdFiles().check(SharedArena(ARENA).fd, 2 * ARENA)
    directory.close()


def test_listen_fds_reads_what_systemd_passes_and_only_for_this_process() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    assert listen_fds(env) == {} and env == {}          # another process's: ignored, and cleared
    saved = [os.dup(LISTEN_FDS_START + i) if _open(LISTEN_FDS_START + i) else None for i in range(2)]
    try:
        fds = [os.memfd_create(n) for n in ("a", "b")]
        for i, fd in enumerate(fds):
            os.dup2(fd, LISTEN_FDS_START + i)
            os.close(fd)
        env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "kvcached-arena:"}
        got = listen_fds(env)
        assert got == {"kvcached-arena": LISTEN_FDS_START, "unknown": LISTEN_FDS_START + 1}
        assert not os.get_inheritable(LISTEN_FDS_START)
    finally:
        for i, fd in enumerate(saved):
            if fd is not None:
                os.dup2(fd, LISTEN_FDS_START + i)
                os.close(fd)
            else:
                try:
                    os.close(LISTEN_FDS_START + i)
                except OSError:
                    pass


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_adoption_settles_what_a_request_names_first_and_checks_every_byte(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A predecessor's blocks are placed (WRITING, invisible), settled on demand or by the
    background pass, each checked against its record's checksum: a flipped byte, a record that
    does not say RAM, or a missing record drop the block and leave a tombstone."""
    import asyncio

    from kvcached.index import BlockIndex, BlockRecord, GoneReason, Tier
    from kvcached.store.adoption import RamAdoption
    from kvcached_agent.integrity import payload_checksum

    arena = SharedArena(ARENA)
    ram = tier(arena)
    index = BlockIndex(tmp_path / "index")
    sizes = [4 * KIB, 8 * KIB, 16 * KIB, 4 * KIB, 8 * KIB, 16 * KIB]
    for n, size in enumerate(sizes):
        put(ram, n, size)
        tiers = Tier.RAM | Tier.SSD if n == 1 else Tier.RAM
        record = BlockRecord(key(n), 0, "m", size, payload_checksum(payload(n, size)), 1.0, float(n), tiers)
        if n != 4:                                  # 4: its record never reached the index
            index.write([(key(n), record if n != 3 else BlockRecord(key(n), 0, "m", size, record.checksum, 1.0,
                                                                    3.0, Tier.SSD))])      # 3: not in RAM
    assert ram.directory is not None
    offset = ram.slabs.offset(ram.get(key(2)).slot)  # type: ignore[union-attr]
    arena.view[offset + 100] ^= 0xFF                 # 2: a flipped byte

    successor = RamTier(SharedArena(ARENA, fd=os.dup(arena.fd)), SLAB, ClockPolicy(),
                        SlotDirectory.adopt(os.dup(ram.directory.fd), SlabAllocator.geometry(ARENA, SLAB)))
    adoption = RamAdoption(successor, successor.directory.committed_entries(), trusted=False)  # type: ignore[union-attr]
    assert adoption.placed_keys == {key(n) for n in range(6)} and not any(key(n) in successor for n in range(6))
    adoption.settle([key(5), key(2)], index, lambda: 9.0)        # a request names 5 and 2
    assert key(5) in successor and key(2) not in successor and adoption.report.settled_on_demand == 2
    assert index.get(key(2)).gone_reason == GoneReason.LOST_AT_RESTART  # type: ignore[union-attr]
    report = asyncio.run(adoption.run(index, None, lambda: 9.0))
    assert (report.adopted, report.mismatched, report.unrecorded, report.done) == (3, 1, 2, True)
    assert {n for n in range(6) if key(n) in successor} == {0, 1, 5}
    assert successor.get(key(1)).clean and not successor.get(key(0)).clean  # type: ignore[union-attr]
    for n in (0, 1, 5):
        assert successor.read(successor.get(key(n))) == payload(n, sizes[n])  # type: ignore[arg-type]
    assert index.get(key(3)).tiers == Tier.SSD                   # 3 keeps its SSD copy, loses nothing else
    assert not adoption.pending
    index.close()


@pytest.mark.parametrize("counts_tenants", [False, True])
def test_an_adopted_block_is_taken_up_only_where_its_arena_is_its_records_tenants(
        tmp_path, counts_tenants: bool) -> None:  # type: ignore[no-untyped-def]
    """A predecessor with tenants keeps alice's block in alice's arena (owner 1). A successor
    that counts tenants takes it up there as alice's; one that does not (one tenant configured)
    has the default tenant's arena alone and drops it, its record losing RAM. A block whose
    record names another tenant than the arena its bytes lie in is never taken up (a torn or
    forged directory entry cannot move bytes between tenants)."""
    import asyncio

    from kvcached.index import BlockIndex, BlockRecord, Tier
    from kvcached.store.adoption import RamAdoption
    from kvcached.tiers.arenas import Arenas
    from kvcached_agent.integrity import payload_checksum

    geometry = SlabAllocator.geometry(ARENA, SLAB)
    ram = RamTier(Arenas(ARENA), SLAB, ClockPolicy(), SlotDirectory.create(geometry), count_tenants=True)
    index = BlockIndex(tmp_path / "index")
    for n, tenant, record_tenant in ((0, "", ""), (1, "alice", "alice"), (2, "alice", "bob")):
        block = ram.reserve(key(n), 4 * KIB, tenant)
        ram.write(block, payload(n, 4 * KIB))
        ram.commit(block)
        index.write([(key(n), BlockRecord(key(n), 0, "m", 4 * KIB, payload_checksum(payload(n, 4 * KIB)), 1.0, 1.0,
                                          Tier.RAM | Tier.SSD, tenant=record_tenant))])
    assert ram.directory is not None and ram.owners.owner_for("alice") == 1
    names = ram.directory.owner_names()
    directory = SlotDirectory.adopt(os.dup(ram.directory.fd), geometry)
    if counts_tenants:
        owners = ["", "alice"] if names[1] == owner_digest("alice") else []
        adopted = {o: SharedArena(ARENA, fd=os.dup(a.fd)) for o, a in ram.arenas.items()}
    else:
        owners, adopted = [""], {0: SharedArena(ARENA, fd=os.dup(ram.arenas.get(0).fd))}
    successor = RamTier(Arenas(ARENA, adopted), SLAB, ClockPolicy(), directory, count_tenants=counts_tenants,
                        owners=owners)
    adoption = RamAdoption(successor, directory.committed_entries(), trusted=False)
    report = asyncio.run(adoption.run(index, None, lambda: 9.0))
    assert successor.tenant_of(key(0)) == "" and key(2) not in successor
    if counts_tenants:
        assert (report.adopted, report.other_tenants) == (2, 1) and successor.tenant_of(key(1)) == "alice"
        assert successor.read(successor.get(key(1))) == payload(1, 4 * KIB)  # type: ignore[arg-type]
    else:
        assert report.adopted == 1 and key(1) not in successor
        assert index.get(key(1)).tiers == Tier.SSD, "its SSD copy stays alice's"   # type: ignore[union-attr]
    index.close()


def test_a_directory_of_the_version_before_arenas_is_read_as_the_default_tenants(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A daemon from before tenants had arenas left a version-1 directory (one arena, no owner
    column): its entries are the default tenant's (owner 0), and the successor writes them into
    a version-2 directory of its own, so an upgrade across the change keeps the RAM tier."""
    import struct

    from kvcached.config import load_config
    from kvcached.lifecycle.succession import SLOTS_FD_NAME, open_arenas
    from kvcached.lifecycle.systemd import Notifier
    from kvcached.tiers.slot_directory import CLEAN, HEADER, MAGIC, SlotEntry

    cfg = load_config(overrides=[f'kv.index_dir="{tmp_path}"', "kv.ram_gib=0.0625", "kv.max_block_mib=1"])
    geometry = SlabAllocator.geometry(cfg.ram_bytes, cfg.max_block_bytes)
    n = geometry.slots
    align = lambda k: -(-k // 8) * 8        # noqa: E731
    states_at, classes_at = 4096, 4096 + align(n)
    lengths_at = classes_at + align(2 * n)
    keys_at = lengths_at + 8 * n
    old = bytearray(keys_at + 32 * n)        # version 1: states, classes, lengths, keys
    HEADER.pack_into(old, 0, MAGIC, 1, 0, geometry.arena_bytes, geometry.slab_bytes, n)
    slot, key = 3, b"k".ljust(32, b".")
    old[states_at + slot] = CLEAN
    struct.pack_into("<H", old, classes_at + 2 * slot, 0)
    struct.pack_into("<Q", old, lengths_at + 8 * slot, 4096)
    old[keys_at + 32 * slot:keys_at + 32 * slot + 32] = key
    slots_fd = os.memfd_create("v1")
    os.write(slots_fd, bytes(old))
    arena = SharedArena(cfg.ram_bytes)
    arenas, directory, entries, owners = open_arenas(cfg, Notifier(), {SLOTS_FD_NAME: slots_fd,
                                                                        "kvcached-arena": os.dup(arena.fd)},
                                                     False, [""])
    assert entries == [SlotEntry(slot, 0, 4096, key, True, 0)] and owners == [""]
    assert directory.version == 2 and list(directory.committed_entries()) == entries
    assert directory.owner_names() == {0: owner_digest("")}
    assert os.fstat(arenas.get(0).fd).st_ino == os.fstat(arena.fd).st_ino, "the same memory"
    directory.close()
    arenas.close()
    arena.close()
