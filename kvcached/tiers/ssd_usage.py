"""The SSD tier's bookkeeping: what it holds (:class:`SsdUsage`), what it has done
(:class:`SsdCounters`), and the room a block's file has on the filesystem (:class:`SsdSpace`).

Room is checked before anything is written or evicted for a block: one whose file the tier can
never hold (bigger than kv.ssd_gib or than the filesystem) is refused, and so is one that would
not fit even if every file of the tier were evicted (something else fills the disk). Sizes count
whole files (header and padding, :func:`kvcached.tiers.ssd_format.file_bytes`). No asyncio; the
only I/O is ``statvfs`` of the tier's directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from typing import Iterator

from kvcached.tiers.ssd_errors import SsdFull, SsdTooLarge, SsdWriteError
from kvcached.tiers.ssd_format import file_bytes

__all__ = ["SsdCounters", "SsdSpace", "SsdUsage", "TenantUse"]


@dataclass(frozen=True, slots=True)
class SsdSpace:
    """The room for block files at one moment (:meth:`SsdUsage.space`): what a block's file must
    fit in before anything is evicted for it. Sizes in bytes."""

    directory: str
    capacity: int       # kv.ssd_gib: the tier never holds more
    filesystem: int     # the filesystem's size
    free: int           # free on it now, for the daemon (statvfs f_bavail)
    tier: int           # the tier's own files, published or being written (what evicting them all frees)

    def refusal(self, nbytes: int) -> SsdWriteError | None:
        """Why a block of ``nbytes`` payload bytes must not be written, nothing evicted for it:
        SsdTooLarge when its file is bigger than the tier could ever be, SsdFull when it is
        bigger than the free space plus every file of the tier (something else fills the disk).
        None when it fits, or an eviction could make room for it. The message names the sizes."""
        size = file_bytes(nbytes)
        if size > self.capacity or size > self.filesystem:
            return SsdTooLarge(errno.EFBIG, f"a block of {nbytes} bytes needs a {size}-byte file, more than the SSD "
                               f"tier can ever hold (kv.ssd_gib is {self.capacity} bytes, the filesystem of "
                               f"{self.directory} {self.filesystem} bytes); nothing was evicted for it")
        if size > self.free + self.tier:
            return SsdFull(errno.ENOSPC, f"the filesystem of {self.directory} is full: a {size}-byte SSD block file "
                           f"does not fit in its {self.free} free bytes even with all {self.tier} bytes of the SSD "
                           "tier's files evicted (something else fills the disk); nothing was evicted for it")
        return None


@dataclass(slots=True)
class SsdCounters:
    writes: int = 0
    write_bytes: int = 0
    file_bytes_written: int = 0       # block files published, headers and padding included (drive wear)
    write_errors: int = 0             # blocks not published in the end (see SsdTier.write_many)
    no_space: int = 0                 # blocks that met a full disk or were refused for lack of room
    reads: int = 0
    read_bytes: int = 0
    corrupt: int = 0
    missing: int = 0
    removed: int = 0
    group_commits: int = 0
    coded: int = 0                    # blocks published in a codec's form (kv.ssd_codec)
    sealed: int = 0                   # blocks published sealed (tenants.seal_ssd)


@dataclass(slots=True)
class TenantUse:
    """One tenant's published blocks on the tier."""

    blocks: int = 0
    payload_bytes: int = 0
    file_bytes: int = 0

    def add(self, sign: int, payload: int, size: int) -> None:
        self.blocks = max(0, self.blocks + sign)
        self.payload_bytes = max(0, self.payload_bytes + sign * payload)
        self.file_bytes = max(0, self.file_bytes + sign * size)


class SsdUsage:
    """What the tier holds, counted as blocks are published and removed, and the room left.

    ``blocks``, ``payload_bytes`` and ``used_bytes`` (file bytes) count the published blocks this
    run knows of, and ``tenants`` the same by tenant tag ("" the default tenant; what
    tenants.ssd_shares weigh); the boot reconcile replaces them with its count of the whole tier
    (:meth:`reconciled`). Until then ``fresh`` holds the paths this run published or removed, so
    that the reconcile leaves them alone, and :meth:`space` takes all that is used on the
    filesystem for the tier's (its files of earlier runs are not counted yet), so nothing is
    refused for room that an eviction could still make."""

    def __init__(self, directory: str, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self.used_bytes = 0          # file bytes of published blocks this tier knows of
        self.payload_bytes = 0       # their payload bytes
        self.blocks = 0
        self.tenants: dict[str, TenantUse] = {}
        # Paths published or removed since boot, while the boot reconcile runs (it leaves them alone).
        self.fresh: set[str] | None = set()
        # File bytes of the blocks being written now, until their write_many returns (a block it
        # has published already counts in used_bytes too meanwhile: room is overestimated, never under).
        self.unsettled_bytes = 0

    # -- counting -------------------------------------------------------------------------------

    def added(self, nbytes: int, tenant: str = "", size: int | None = None) -> None:
        """A block of ``nbytes`` payload bytes, ``tenant``'s, was published in a file of
        ``size`` bytes (None: a plain block's, :func:`file_bytes`)."""
        self._account(nbytes, +1, tenant, size)

    def removed(self, nbytes: int, tenant: str = "", size: int | None = None) -> None:
        """A published block of ``nbytes`` payload bytes, ``tenant``'s, in a file of ``size``
        bytes (None: a plain block's) is gone (unlinked or quarantined)."""
        self._account(nbytes, -1, tenant, size)

    def _account(self, nbytes: int, sign: int, tenant: str, size: int | None) -> None:
        if size is None:
            size = file_bytes(nbytes)
        self.used_bytes = max(0, self.used_bytes + sign * size)
        self.payload_bytes = max(0, self.payload_bytes + sign * nbytes)
        self.blocks = max(0, self.blocks + sign)
        use = self.tenants.get(tenant)
        if use is None:
            use = self.tenants[tenant] = TenantUse()
        use.add(sign, nbytes, size)

    def used_by(self, tenant: str) -> int:
        """File bytes of ``tenant``'s published blocks."""
        use = self.tenants.get(tenant)
        return use.file_bytes if use is not None else 0

    @contextlib.contextmanager
    def unsettled(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` file bytes as the tier's while a write of them is under way."""
        self.unsettled_bytes += nbytes
        try:
            yield
        finally:
            self.unsettled_bytes -= nbytes

    # -- the boot reconcile -------------------------------------------------------------------

    def touched(self, path: str) -> None:
        """This run publishes or removes ``path``: the boot reconcile must not judge it."""
        if self.fresh is not None:
            self.fresh.add(path)

    def is_fresh(self, path: str) -> bool:
        """Published or removed by this run while the boot reconcile runs (it must not judge it)."""
        fresh = self.fresh
        return fresh is not None and path in fresh

    def reconciled(self, blocks: int, payload_bytes: int, file_bytes_: int,
                   tenants: dict[str, TenantUse] | None = None) -> None:
        """The boot reconcile is done: its count of the tier (every record on SSD with a file,
        taken at the end of its walk; ``tenants``, the same by tenant) replaces the one kept so
        far; stop tracking paths."""
        self.blocks = blocks
        self.payload_bytes = payload_bytes
        self.used_bytes = file_bytes_
        self.tenants = dict(tenants) if tenants is not None else {"": TenantUse(blocks, payload_bytes, file_bytes_)}
        self.fresh = None

    # -- room -----------------------------------------------------------------------------------

    def space(self) -> SsdSpace:
        """The room for block files now (one statvfs; raises OSError if the directory cannot be
        examined). Until the boot reconcile has counted the tier, all that is used on the
        filesystem is taken for the tier's (its files of earlier runs are not counted yet), so
        nothing is refused for room that an eviction could still make."""
        st = os.statvfs(self.directory)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        tier = self.used_bytes + self.unsettled_bytes if self.fresh is None else size - free
        return SsdSpace(self.directory, self.capacity, size, free, tier)

    def refusals(self, sizes: list[int]) -> list[SsdWriteError | None]:
        """:meth:`SsdSpace.refusal` for blocks of these payload sizes, against one look at the
        filesystem. If it cannot be examined, nothing is refused here (the writes will say)."""
        try:
            space = self.space()
        except OSError:
            return [None] * len(sizes)
        return [space.refusal(n) for n in sizes]

    def free_bytes(self) -> int:
        """Bytes free on the tier's filesystem for the daemon now (0 if it cannot be examined)."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize
