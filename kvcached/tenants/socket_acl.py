"""A Unix socket only some uids and gids may open: a POSIX access ACL on the socket file.

gRPC's C core never reads a Unix peer's credentials (SO_PEERCRED; grpc/grpc#15511 and #28755),
so a gRPC socket cannot tell its callers apart. The kernel can refuse them at connect() instead:
connecting needs write permission on the socket file, and the kernel checks it against the
file's ACL. A tenant's socket is the daemon's (mode 0600), with an ACL entry granting read and
write to each uid and gid that tenants.uids and tenants.gids map to the tenant, so every call on
it comes from one of them (or root). The ACL is written as the ``system.posix_acl_access``
extended attribute (the layout of linux/posix_acl_xattr.h), which the file's owner may set
without any capability: the daemon runs as its own unprivileged user.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Sequence

__all__ = ["admit_only"]

_XATTR = "system.posix_acl_access"
_VERSION = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_RW, _NONE, _UNDEFINED = 6, 0, 0xFFFFFFFF


def acl_bytes(uids: Sequence[int], gids: Sequence[int]) -> bytes:
    """The xattr value: owner rw, each of ``uids`` and ``gids`` rw, no one else. The kernel
    wants the entries by tag, and named users and groups by id."""
    entries = [(_USER_OBJ, _RW, _UNDEFINED)] + [(_USER, _RW, uid) for uid in sorted(set(uids))]
    entries += [(_GROUP_OBJ, _NONE, _UNDEFINED)] + [(_GROUP, _RW, gid) for gid in sorted(set(gids))]
    entries += [(_MASK, _RW, _UNDEFINED), (_OTHER, _NONE, _UNDEFINED)]
    return _VERSION.pack(2) + b"".join(_ENTRY.pack(*entry) for entry in entries)


def admit_only(path: str, uids: Sequence[int], gids: Sequence[int]) -> None:
    """Let only the owner, ``uids`` and members of ``gids`` open the socket at ``path``.
    OSError saying why when the file system keeps no ACLs (mount it with ``acl``)."""
    os.chmod(path, 0o600)
    try:
        os.setxattr(path, _XATTR, acl_bytes(uids, gids), follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise OSError(exc.errno, f"the file system of {path} keeps no POSIX ACLs, so the socket cannot admit its "
                          "tenant alone (put it on one that does, such as tmpfs or ext4 with acl)") from None
        raise
