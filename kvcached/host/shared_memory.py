"""Where the RAM tier's shared memory lives (``kv.arena``): the files behind its arenas and slot
directory, made, checked, found again and dropped here, whatever backs them.

- ``memfd``: anonymous memory files. They outlive the process only where someone holds them:
  a successor they are handed to (``kvcached upgrade``) or systemd's file descriptor store.
- ``file``: files in a directory (``kv.arena_dir``) on a tmpfs or hugetlbfs mount. They outlive
  the process wherever the mount does: a daemon that crashes, or a Kubernetes pod replaced on
  the same node (a hostPath), finds its arenas there and takes their blocks up, every block
  checked against its checksum first (kvcached.store.adoption). A directory on a disk file
  system is refused: the arena's pages would be written back to the disk.

On hugetlbfs every file is a whole number of huge pages and every page is a huge page from the
node's pool (``vm.nr_hugepages``), taken as a slot is first written; ftruncate takes no size
that is not one, and write(2) is refused there (the tier only maps its files).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
from typing import Callable, Protocol

__all__ = ["ARENA_BACKINGS", "DirectoryFiles", "MemfdFiles", "SharedFiles", "file_system", "shared_files"]

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_FS_NAMES = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs", 0xEF53: "ext4", 0x58465342: "xfs",
             0x9123683E: "btrfs", 0x794C7630: "overlayfs", 0x6969: "nfs"}


class SharedFiles(Protocol):
    """The files behind the RAM tier's shared memory (one per arena, and the slot directory)."""

    #: Whether the files outlive this process by themselves (a later start finds them: :meth:`left`).
    persistent: bool
    #: Every file's size is a multiple of this (the huge page size on hugetlbfs, else 1).
    page_bytes: int

    def make(self, name: str, size: int) -> int:
        """A new file called ``name`` of ``size`` bytes (rounded up to :attr:`page_bytes`),
        sealed against resizing where it can be; any older one of that name is replaced (a
        process still mapping it keeps its own copy). The descriptor is the caller's."""
        ...

    def check(self, fd: int, size: int) -> None:
        """ValueError unless ``fd`` is one of these files, of ``size`` bytes (rounded up as
        :meth:`make` does): one a previous process left is taken up only if it fits."""
        ...

    def left(self, names: list[str]) -> dict[str, int]:
        """The files of these ``names`` a previous process left, opened (the caller's)."""
        ...

    def drop(self, name: str) -> None:
        """Forget the file called ``name``: its memory goes back once nobody maps it."""
        ...


def _round_up(size: int, page: int) -> int:
    return -(-size // page) * page


class MemfdFiles:
    """``kv.arena = "memfd"``: anonymous memfds, sealed against resizing (a shrunk file under a
    live mapping turns reads of its tail into SIGBUS). Nothing is left for a later start but
    what systemd's fd store or an upgrade's handover holds."""

    persistent = False
    page_bytes = 1

    def __init__(self, directory: str = "") -> None:
        pass

    def make(self, name: str, size: int) -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def check(self, fd: int, size: int) -> None:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ValueError(f"not a sealed memfd ({exc.strerror}); kv.arena is memfd") from None
        if seals & SEALS != SEALS:
            raise ValueError("the memfd is not sealed against resizing")
        _check_size(fd, size)

    def left(self, names: list[str]) -> dict[str, int]:
        return {}

    def drop(self, name: str) -> None:
        pass


class DirectoryFiles:
    """``kv.arena = "file"``: files (0600, in a 0700 directory this process owns) in
    ``directory``, which must be on tmpfs or hugetlbfs (ValueError otherwise, saying why)."""

    persistent = True

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{directory} is not a directory")
        if info.st_uid != os.geteuid():
            raise ValueError(f"{directory} belongs to uid {info.st_uid}, not to this daemon's ({os.geteuid()})")
        if info.st_mode & 0o077:
            os.chmod(directory, 0o700)      # the arenas are every tenant's KV bytes: the daemon's alone
        kind = file_system(directory)
        if kind not in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
            raise ValueError(f"{directory} is on {_FS_NAMES.get(kind, hex(kind))}, not tmpfs or hugetlbfs: the arena's "
                             "pages would be written to that disk (mount a tmpfs there, or use kv.arena = \"memfd\")")
        self.hugetlbfs = kind == HUGETLBFS_MAGIC
        self.page_bytes = os.statvfs(directory).f_bsize if self.hugetlbfs else 1
        self._device = info.st_dev

    def _path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"not a file name: {name!r}")
        return os.path.join(self.directory, name)

    def make(self, name: str, size: int) -> int:
        path = self._path(name)
        self.drop(name)                 # one a mapping still holds stays that mapping's
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _round_up(size, self.page_bytes))
        except BaseException:
            os.close(fd)
            self.drop(name)
            raise
        return fd

    def check(self, fd: int, size: int) -> None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_dev != self._device:
            raise ValueError(f"not a file in {self.directory}; kv.arena is file")
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ValueError(f"the file is not this daemon's alone (uid {info.st_uid}, mode {info.st_mode & 0o777:o})")
        _check_size(fd, _round_up(size, self.page_bytes))

    def left(self, names: list[str]) -> dict[str, int]:
        found = {}
        for name in names:
            try:
                found[name] = os.open(self._path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
        return found

    def drop(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass


def _check_size(fd: int, size: int) -> None:
    have = os.fstat(fd).st_size
    if have != size:
        raise ValueError(f"the file is {have} bytes; this configuration wants {size}")


ARENA_BACKINGS: dict[str, Callable[[str], SharedFiles]] = {"memfd": MemfdFiles, "file": DirectoryFiles}


def shared_files(kind: str, directory: str) -> SharedFiles:
    """The backing ``kv.arena`` names, over ``kv.arena_dir`` where it takes one (ValueError if
    that directory cannot hold arenas)."""
    return ARENA_BACKINGS[kind](directory)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def file_system(path: str) -> int:
    """The magic number of the file system ``path`` is on (statfs(2)'s f_type)."""
    buf = ctypes.create_string_buffer(256)      # struct statfs: f_type is its first word
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
