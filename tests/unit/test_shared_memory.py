"""The files behind the RAM tier (kvcached.host.shared_memory): memfds, and files on tmpfs or
hugetlbfs that a later process finds again (``kv.arena = "file"``)."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from kvcached.host.shared_memory import (
    ARENA_BACKINGS,
    HUGETLBFS_MAGIC,
    TMPFS_MAGIC,
    DirectoryFiles,
    MemfdFiles,
    file_system,
    shared_files,
)
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import SlotDirectory

MIB = 1 << 20


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    """A directory on a tmpfs (/dev/shm), removed after."""
    path = Path(tempfile.mkdtemp(prefix="kvt-shm-", dir="/dev/shm"))
    yield path / "arena"
    shutil.rmtree(path, ignore_errors=True)


def test_the_registry_is_what_the_configuration_offers() -> None:
    from kvcached.config.sections import KvSection

    assert set(ARENA_BACKINGS) == {"memfd", "file"}
    assert KvSection().arena == "memfd"
    assert isinstance(shared_files("memfd", ""), MemfdFiles)


def test_a_memfd_is_sealed_and_checked() -> None:
    files = MemfdFiles()
    fd = files.make("kvcached-test", 4 * MIB)
    try:
        files.check(fd, 4 * MIB)
        with pytest.raises(ValueError, match="wants"):
            files.check(fd, 8 * MIB)
        with pytest.raises(OSError):
            os.ftruncate(fd, MIB)                  # sealed: no one shrinks it under a mapping
        assert files.left(["kvcached-test"]) == {} and not files.persistent
    finally:
        os.close(fd)


def test_files_on_tmpfs_are_private_found_again_and_dropped(tmpfs_dir: Path) -> None:
    files = DirectoryFiles(str(tmpfs_dir))
    assert files.persistent and files.page_bytes == 1 and file_system(str(tmpfs_dir)) == TMPFS_MAGIC
    assert tmpfs_dir.stat().st_mode & 0o777 == 0o700
    fd = files.make("kvcached-arena", 4 * MIB)
    arena = SharedArena(4 * MIB, "kvcached-arena", fd, adopted=False)
    arena.write(4096, b"kept across processes")
    assert (tmpfs_dir / "kvcached-arena").stat().st_mode & 0o777 == 0o600
    arena.close()
    left = files.left(["kvcached-arena", "kvcached-arena.1", "kvcached-slots"])
    assert set(left) == {"kvcached-arena"}
    files.check(left["kvcached-arena"], 4 * MIB)
    again = SharedArena(4 * MIB, "kvcached-arena", left["kvcached-arena"])
    assert again.adopted and again.read(4096, 21) == b"kept across processes"
    again.release(0, 2 * MIB)                     # a punched hole reads zeros: the memory is the kernel's again
    assert again.read(4096, 21) == bytes(21)
    again.close()
    with pytest.raises(ValueError, match="kv.arena is file"):
        memfd = MemfdFiles().make("other", 4 * MIB)
        try:
            files.check(memfd, 4 * MIB)
        finally:
            os.close(memfd)
    files.drop("kvcached-arena")
    assert not (tmpfs_dir / "kvcached-arena").exists()


def test_a_file_another_can_read_or_of_another_size_is_not_taken_up(tmpfs_dir: Path) -> None:
    files = DirectoryFiles(str(tmpfs_dir))
    fd = files.make("kvcached-arena", 2 * MIB)
    with pytest.raises(ValueError, match="wants"):
        files.check(fd, 4 * MIB)
    os.fchmod(fd, 0o644)
    with pytest.raises(ValueError, match="not this daemon's alone"):
        files.check(fd, 2 * MIB)
    os.close(fd)
    (tmpfs_dir / "kvcached-slots").symlink_to("/etc/passwd")
    assert files.left(["kvcached-slots"]) == {}             # a link is never followed


def test_a_directory_on_a_disk_is_refused(tmp_path: Path) -> None:
    if file_system(str(tmp_path)) in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        pytest.skip("the test's temporary directory is on tmpfs here")
    with pytest.raises(ValueError, match="not tmpfs or hugetlbfs"):
        DirectoryFiles(str(tmp_path / "arena"))


def test_the_slot_directory_in_a_file_is_found_again(tmpfs_dir: Path) -> None:
    files = DirectoryFiles(str(tmpfs_dir))
    geometry = SlabAllocator.geometry(16 * MIB, MIB)
    directory = SlotDirectory.create(geometry, "kvcached-slots", files)
    directory.reserved(3, b"k" * 32, 1000, 1)
    directory.committed(3, clean=False)
    directory.close()
    fd = files.left(["kvcached-slots"])["kvcached-slots"]
    again = SlotDirectory.adopt(fd, geometry, files.page_bytes)
    assert [(e.slot, e.length) for e in again.committed_entries()] == [(3, 1000)]
    again.close()


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount with a few 2 MiB pages in the pool, where this machine lets root make
    one (the pool size is put back after)."""
    pool = Path("/proc/sys/vm/nr_hugepages")
    if os.geteuid() != 0 or not pool.exists():
        pytest.skip("hugetlbfs needs root and a huge page pool")
    before = pool.read_text()
    mount = tmp_path / "huge"
    mount.mkdir()
    try:
        pool.write_text(str(int(before) + 16))
        subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pool.write_text(before)
        pytest.skip(f"no hugetlbfs here: {exc}")
    try:
        yield mount
    finally:
        done = subprocess.run(["umount", str(mount)], capture_output=True, text=True)
        pool.write_text(before)
        assert done.returncode == 0, done.stderr


def test_arenas_on_hugetlbfs_are_whole_huge_pages(hugetlbfs: Path) -> None:
    files = DirectoryFiles(str(hugetlbfs / "arena"))
    assert files.page_bytes == 2 * MIB and file_system(str(hugetlbfs)) == HUGETLBFS_MAGIC
    fd = files.make("kvcached-arena", 8 * MIB)
    arena = SharedArena(8 * MIB, "kvcached-arena", fd, adopted=False)
    arena.write(2 * MIB + 5, b"huge")
    assert arena.read(2 * MIB + 5, 4) == b"huge"
    arena.release(2 * MIB, 2 * MIB)
    assert arena.read(2 * MIB + 5, 4) == bytes(4)
    arena.close()
    geometry = SlabAllocator.geometry(8 * MIB, MIB)
    directory = SlotDirectory.create(geometry, "kvcached-slots", files)    # rounded up to a huge page
    directory.close()
    slots = files.left(["kvcached-slots"])["kvcached-slots"]
    assert os.fstat(slots).st_size % (2 * MIB) == 0
    SlotDirectory.adopt(slots, geometry, files.page_bytes).close()
    left = files.left(["kvcached-arena"])["kvcached-arena"]
    files.check(left, 8 * MIB)
    with mmap.mmap(left, 8 * MIB) as m:
        assert m[2 * MIB + 5:2 * MIB + 9] == bytes(4)
    os.close(left)
