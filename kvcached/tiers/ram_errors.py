"""What the RAM tier refuses with (kvcached.tiers.ram), in a room of their own so that the
tier's parts (kvcached.tiers.arenas) raise them too."""

from __future__ import annotations

__all__ = ["BlockBusy", "RamFull"]


class RamFull(Exception):
    """No room can be made without evicting a block that is in use (or, for a tenant past the
    owners the tier counts, no arena to make room in)."""


class BlockBusy(Exception):
    """The block is being written or read; it cannot be removed now."""
