"""Shares of the SSD tier by tenant (tenants.ssd_shares, docs/security.md "Shares of SSD"): whose
blocks the SSD tier's capacity eviction may take. No I/O; kvcached.store.ssd_evictor asks it.

A tenant's share is file bytes of the tier that are its own; a tenant without one has 0, so
all it holds is lent. Writes to SSD are never refused for a share: room nobody uses is lent
freely, and the tier may pass its capacity until the evictor runs. When it does (the tier is
over capacity, or a full disk asks for room), it takes blocks in its usual order but only those
of tenants over their shares, each tenant's until it is back within its share. So the lent
room is taken back from the borrowers, a tenant that fills more than its share evicts its own
blocks, and a block of a tenant within its share is never evicted for room (its own TTL still
applies). With shares adding up to no more than the tier, a tier over capacity always has a
tenant over its share.
"""

from __future__ import annotations

from typing import Callable, Mapping

from kvcached.tiers.ssd_usage import SsdUsage

__all__ = ["EvictionRound", "SsdShares"]


class EvictionRound:
    """One step of an eviction: which tenants' blocks may still go, counting the victims this
    step has chosen but not yet removed."""

    def __init__(self, shares: Mapping[str, int], used_by: Callable[[str], int]) -> None:
        self._shares = shares
        self._used_by = used_by
        self._chosen: dict[str, int] = {}

    def over(self, tenant: str) -> int:
        """File bytes ``tenant`` holds past its share, less what this step chose of its."""
        return self._used_by(tenant) - self._chosen.get(tenant, 0) - self._shares.get(tenant, 0)

    def take(self, tenant: str, size: int) -> bool:
        """May a block of ``tenant`` (``size`` file bytes) go for room? If so it is counted as
        chosen."""
        if self.over(tenant) <= 0:
            return False
        self.chose(tenant, size)
        return True

    def chose(self, tenant: str, size: int) -> None:
        """A block of ``tenant`` goes anyway (its TTL passed): count it."""
        self._chosen[tenant] = self._chosen.get(tenant, 0) + size


class SsdShares:
    """``shares``: tenant tag -> file bytes of the tier ("" the default tenant), weighed against
    what ``usage`` counts each tenant holding now."""

    def __init__(self, shares: Mapping[str, int], usage: SsdUsage) -> None:
        self.shares = dict(shares)
        self._usage = usage

    def round(self) -> EvictionRound:
        """The test for one step of an eviction."""
        return EvictionRound(self.shares, self._usage.used_by)

    def anyone_over(self) -> bool:
        """Does any tenant hold more than its share (is there anything capacity may take)?"""
        return any(use.file_bytes > self.shares.get(t, 0) for t, use in self._usage.tenants.items())
