"""Plain file operations of the SSD tier, run on its I/O threads: vectored reads and writes that
finish short transfers, directory fsyncs, renames and unlinks in batches. No asyncio, no state.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

__all__ = ["fsync_dir", "preadv_all", "probe_direct", "pwritev_all", "rename_all", "remaining", "subdirs", "unlink_all",
           "unlink_all_sized", "unlink_quietly", "unlink_sized"]

PAGE = 4096


def probe_direct(path: str) -> str | None:
    """Whether the filesystem of ``path`` (a file name free to use) takes O_DIRECT reads and
    writes of one page: None if it does, else why not, in the system's words."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    buf = mmap.mmap(-1, PAGE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, buf, 0)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        buf.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return None


def subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def remaining(parts: list[Any], done: int) -> list[memoryview]:
    """What is left of ``parts`` after the first ``done`` bytes (views: release them)."""
    out = []
    for part in parts:
        size = len(part)
        if done >= size:
            done -= size
            continue
        out.append(memoryview(part)[done:])
        done = 0
    return out


def pwritev_all(fd: int, parts: list[Any], total: int) -> None:
    done = os.pwritev(fd, parts, 0)
    while done < total:     # a short write (rare on regular files): go on from where it stopped
        rest = remaining(parts, done)
        try:
            n = os.pwritev(fd, rest, done)
        finally:
            for view in rest:
                view.release()
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += n


def preadv_all(fd: int, parts: list[Any], total: int, offset: int = 0) -> int:
    """Bytes read into ``parts`` from ``offset``, up to ``total`` (fewer only at end of file)."""
    done = os.preadv(fd, parts, offset)
    while 0 < done < total:
        rest = remaining(parts, done)
        try:
            n = os.preadv(fd, rest, offset + done)
        finally:
            for view in rest:
                view.release()
        if n <= 0:
            break
        done += n
    return done


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_all(pairs: list[tuple[str, str]]) -> list[OSError | None]:
    out: list[OSError | None] = []
    for tmp, final in pairs:
        try:
            os.rename(tmp, final)
            out.append(None)
        except OSError as exc:
            out.append(exc)
    return out


def unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def unlink_all(paths: list[str]) -> list[bool]:
    return [unlink_quietly(p) for p in paths]


def unlink_sized(path: str) -> int:
    """Unlink ``path``; the size it had (-1: there was none). A block file's size is the one
    true count of what it held on disk (a coded block's is its own)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return -1


def unlink_all_sized(paths: list[str]) -> list[int]:
    return [unlink_sized(p) for p in paths]
