"""Why an SSD block file was not published: the errors :meth:`kvcached.tiers.ssd.SsdTier.write_many`
reports per block. No I/O.

A block whose write is refused or fails leaves nothing on disk (the tier removes its temporary
file), so every error here means "not published, nothing of it left". :class:`SsdFull` and
:class:`SsdTooLarge` are the lack of room (the caller may evict, or must give up); anything else
is a failed write, fsync or rename.
"""

from __future__ import annotations

import errno

__all__ = ["NO_SPACE_ERRNOS", "SsdFull", "SsdTooLarge", "SsdWriteError", "write_error"]

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)     # a full filesystem, or a full quota


class SsdWriteError(OSError):
    """A block could not be published; nothing of it is left on disk."""


class SsdFull(SsdWriteError):
    """The filesystem (or quota) has no room for the block: it met a full disk while being
    written, or was refused before because even an empty tier would not make room."""


class SsdTooLarge(SsdWriteError):
    """Refused before anything was written or evicted: the block's file is bigger than the tier
    can ever hold (kv.ssd_gib, or the filesystem's size). Trying again cannot help."""


def write_error(exc: OSError, path: str) -> SsdWriteError:
    """The error a failed write, fsync or rename of ``path`` reports: SsdFull for a full disk
    or quota, SsdWriteError otherwise (with the system's words)."""
    if exc.errno in NO_SPACE_ERRNOS:
        return SsdFull(exc.errno, f"no space left for SSD block file ({exc.strerror})", path)
    return SsdWriteError(exc.errno or errno.EIO, f"SSD write failed: {exc.strerror or exc}", path)
