"""The daemon's tenant key on disk: 32 random bytes, mode 0600, created at the first start.

Every node of a cluster needs the same file (copy it as the cluster CA's key material is
copied), so that a tenant's blocks have the same addresses everywhere and a pull finds them.
A file that exists is never rewritten: a key that changed would orphan every tenant's blocks.
"""

from __future__ import annotations

import os
import stat

from kvcached.tenants.identity import KEY_BYTES

__all__ = ["load_key"]


def load_key(path: str) -> bytes:
    """The key in ``path``, created (O_EXCL, 0600) if missing; OSError saying what is wrong with
    a file that is there but unfit (its size, or others may read it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    return _read(path)


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if info.st_mode & 0o077:
            raise OSError(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: others may read the tenant key "
                          "(chmod 600 it)")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise OSError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte tenant key")
    return key
