"""SSD eviction: which SSD copies go, and when.

:meth:`SsdEvictor.evict` drops SSD blocks past ``ssd_ttl`` (from the index's SSD queue) and, once
the boot reconcile has counted the tier, more while it is over capacity: least recently used
first from that queue, or in the order of an in-memory eviction policy (``order``, [kv]
ssd_policy). Where tenants have SSD shares (kvcached.tiers.ssd_shares), eviction for room takes
only blocks of tenants over their shares, in the same order; in ``order``'s, when none of its
next candidates may go, the index's queue gives the oldest that may. :meth:`make_room` is the
forced eviction a write that met a full disk asks for: it frees what the writes need and at
most ``FULL_DISK_EVICT_FACTOR`` times that. An operator's :meth:`drop` removes chosen SSD
copies. Blocks being read from SSD right now are skipped.

The index is always written before files are removed: a crash in between leaves an orphan file
(found by the next boot's reconcile), never a record that points at nothing. A copy in RAM stays
there and stays clean: the policy chose to drop its SSD copy, so write-back does not undo it.
Runs on the event loop; file removal awaits the SSD tier's I/O threads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from kvcached.index import BlockRecord, GoneReason, Tier, queue_entry, queue_time, raw_ssd_view, record_tenant
from kvcached.policies import KeyedPolicy
from kvcached.store.parts import Room, StoreParts
from kvcached.store.ssd_reconcile import ReconcileReport
from kvcached.tiers.ssd import SsdTier, SsdVictim
from kvcached.tiers.ssd_format import BlockHeader, file_bytes
from kvcached.tiers.ssd_shares import SsdShares

__all__ = ["EVICT_BATCH", "FULL_DISK_EVICT_FACTOR", "SsdEvictor", "header_of", "victim_of"]

log = logging.getLogger("kvcached.store")

EVICT_BATCH = 256               # SSD queue entries looked at per step
FULL_DISK_EVICT_FACTOR = 2      # a forced eviction drops at most this many times what its writes need


def header_of(record: BlockRecord) -> BlockHeader:
    """The SSD file header that describes ``record``'s block."""
    return BlockHeader(record.digest, record.layer, record.nbytes, record.checksum, record.created)


def victim_of(key: bytes, record: BlockRecord) -> SsdVictim:
    """``record``'s block as the SSD tier removes it: key, file header, tenant."""
    return key, header_of(record), record.tenant


class SsdEvictor(Room):
    """Drops SSD copies (see the module). ``wanted`` is set when the tier is over capacity (the
    daemon's evictor loop waits on it)."""

    def __init__(self, parts: StoreParts, ssd: SsdTier, order: KeyedPolicy | None, *, order_ready: bool = True,
                 shares: SsdShares | None = None) -> None:
        super().__init__(parts)
        self.ssd = ssd
        self.shares = shares           # tenants.ssd_shares: whose blocks room may take (None: anyone's)
        # The SSD tier's eviction order ([kv] ssd_policy): None is "lru", the index's own queue
        # (no memory per block); a policy here orders the SSD blocks in memory.
        self.order = order
        self.order_ready = order_ready   # False while a rebuilt order is awaited (boot): the index queue decides
        self.reconciled = False        # capacity eviction waits for the boot reconcile's count
        self.wanted = asyncio.Event()

    def over_capacity(self) -> None:
        """Wake the evictor if the tier holds more than its capacity."""
        if self.ssd.used_bytes > self.ssd.capacity:
            self.wanted.set()

    async def evict(self, need_bytes: int = 0) -> int:
        """Drop SSD blocks unused for ``ssd_ttl``, then (once the boot reconcile has counted the
        tier) more while the tier is over capacity, and at least ``need_bytes`` more when asked
        (a full disk): least recently used first, or in ``order``'s order. Returns how many
        were dropped. Blocks in RAM stay there (RAM-only now, not written back again); others
        become tombstones."""
        over = max(0, self.ssd.used_bytes - self.ssd.capacity) if self.reconciled else 0
        dropped, freed = await self._evict_in_order(over, need_bytes)
        if dropped:
            log.info("SSD blocks evicted", extra={"fields": {"blocks": dropped, "bytes": freed,
                                                             "used_bytes": self.ssd.used_bytes}})
        return dropped

    async def _evict_in_order(self, over: int, need_bytes: int) -> tuple[int, int]:
        """Drop SSD blocks past ``ssd_ttl``, and more, least recently used first or in
        ``order``'s order, until max(``over``, ``need_bytes``) file bytes are freed (the last
        block may pass it). Returns (blocks, bytes)."""
        if self.order is None or not self.order_ready:
            return await self._evict_queue(over, need_bytes)
        dropped, freed = await self._evict_queue(0, 0)         # the TTL only
        more = await self._evict_ordered(max(over - freed, need_bytes - freed))
        return dropped + more[0], freed + more[1]

    async def make_room(self, need: int) -> None:
        """Forced eviction for blocks that met a full disk and need ``need`` file bytes: drop SSD
        blocks in eviction order until the filesystem has ``need`` bytes free, reading its free
        space before each step (something else may be filling the disk too), and never more
        than ``FULL_DISK_EVICT_FACTOR * need`` bytes (the last block may pass it): a request
        that cannot get room must not empty the tier. Never raises (an eviction that fails is
        logged; the writes are then tried again as things stand)."""
        limit = FULL_DISK_EVICT_FACTOR * need
        dropped = freed = 0
        free = self.ssd.free_bytes()
        try:
            while free < need and freed < limit:
                blocks, nbytes = await self._evict_in_order(0, min(need - free, limit - freed))
                if not blocks:
                    break
                dropped, freed = dropped + blocks, freed + nbytes
                free = self.ssd.free_bytes()
        except Exception:
            log.exception("forced SSD eviction failed")
        self.counters.ssd_full_disk_evictions += dropped
        fields = {"need_bytes": need, "evicted_blocks": dropped, "evicted_bytes": freed, "limit_bytes": limit,
                  "free_bytes": free, "tier_bytes": self.ssd.used_bytes}
        if free < need:
            log.warning("SSD filesystem full: a forced eviction could not make room", extra={"fields": fields})
        else:
            log.info("SSD filesystem full: blocks evicted to make room", extra={"fields": fields})

    def forget(self, keys: Sequence[bytes]) -> None:
        """These blocks left the SSD tier other than by its eviction: the SSD policy forgets
        them (no ghost: the policy did not choose it)."""
        if self.order is not None:
            for key in keys:
                self.order.remove(key)

    def published(self, keys: Sequence[bytes]) -> None:
        """These blocks were just published on SSD, oldest first: the SSD policy takes them."""
        if self.order is not None:
            for key in keys:
                if key not in self.order:
                    self.order.insert(key)

    def adopt_order(self, built: KeyedPolicy) -> None:
        """Take the SSD policy rebuilt after the boot reconcile (policy_state.build_ssd_order);
        blocks published since boot, which the interim policy holds, are added to it."""
        interim = self.order
        if interim is not None:
            for key in list(interim):
                if key not in built:
                    built.insert(key)
        self.order = built
        self.order_ready = True

    async def _evict_ordered(self, want: int) -> tuple[int, int]:
        """Capacity eviction in ``order``'s order until ``want`` file bytes are freed; returns
        (blocks, bytes). Keys the policy still holds but the index says are not on SSD any more
        (deleted, dropped by an operator, lost) are forgotten as they are met. With shares, a
        step whose candidates hold no block that may go hands the rest to the index's queue."""
        assert self.order is not None
        order = self.order
        fetching = self.inflight.fetching
        dropped = freed = 0
        while freed < want:
            victims: list[SsdVictim] = []
            stale: list[bytes] = []
            looked = 0
            round_ = self.shares.round() if self.shares is not None else None
            for key in order.candidates():
                looked += 1
                if looked > 4 * EVICT_BATCH:          # bounded work per step, even among stale keys
                    break
                if key in fetching:                   # being read right now: not this round
                    continue
                raw = self.index.raw(key)
                view = raw_ssd_view(raw) if raw is not None else None
                if view is None or not view[0] & Tier.SSD:
                    stale.append(key)
                    continue
                _, nbytes, _, checksum, digest, layer = view
                tenant = record_tenant(raw) if raw is not None else ""
                if round_ is not None and not round_.take(tenant, file_bytes(nbytes)):
                    continue                          # within its share: not for room
                victims.append((key, BlockHeader(digest, layer, nbytes, checksum, 0.0), tenant))
                freed += file_bytes(nbytes)
                if freed >= want or len(victims) >= EVICT_BATCH:
                    break
            for key in stale:
                order.remove(key)
            for key, _, _ in victims:
                order.evicted(key)
            keys = [k for k, _, _ in victims]
            self.index.write(self.ledger.without_ssd(keys, GoneReason.EVICTED, self.clock()))
            await self.ssd.remove_many(victims)
            dropped += len(victims)
            self.counters.ssd_evictions_capacity += len(victims)
            if not victims and not stale:
                if round_ is not None and freed < want:      # none of the policy's next may go
                    more = await self._evict_queue(0, want - freed)
                    return dropped + more[0], freed + more[1]
                break
            await asyncio.sleep(0)                     # let requests in between steps
        return dropped, freed

    async def _evict_queue(self, over: int, need_bytes: int) -> tuple[int, int]:
        """Walk the index's SSD queue, oldest first: drop blocks past the TTL, and (LRU, with a
        second chance for blocks used since they were queued) more until ``over`` and
        ``need_bytes`` are freed, with shares only blocks of tenants over theirs. Returns
        (blocks, bytes)."""
        ssd = self.ssd
        fetching = self.inflight.fetching
        now = self.clock()
        ttl_before = now - self.settings.ssd_ttl
        freed = dropped = 0
        after: bytes | None = None               # the walk goes on past the entries it left queued
        while True:
            victims: list[SsdVictim] = []
            queue: list[bytes] = []
            unqueue: list[bytes] = []
            expired_keys: list[bytes] = []
            done = False
            round_ = self.shares.round() if self.shares is not None else None
            room = round_ is None or self.shares.anyone_over()      # type: ignore[union-attr]
            entries = self.index.ssd_queue(EVICT_BATCH, after)
            for entry, key, raw in entries:
                view = raw_ssd_view(raw) if raw is not None else None
                if view is None or not view[0] & Tier.SSD:
                    unqueue.append(entry)            # stale: the block left SSD already
                    continue
                tiers, nbytes, last_seen, checksum, digest, layer = view
                if key in fetching:                 # being read right now: not this round
                    continue
                queued_at = queue_time(entry)
                wanted = room and (freed < over or freed < need_bytes)
                expired = last_seen < ttl_before
                tenant = record_tenant(raw) if raw is not None else ""
                size = file_bytes(nbytes)
                if expired or (wanted and last_seen <= queued_at + 1e-6
                               and (round_ is None or round_.take(tenant, size))):
                    unqueue.append(entry)
                    victims.append((key, BlockHeader(digest, layer, nbytes, checksum, 0.0), tenant))
                    if expired:
                        expired_keys.append(key)
                        if round_ is not None:
                            round_.chose(tenant, size)
                    freed += size
                elif wanted or queued_at < ttl_before:   # used since it was queued (second chance), or kept for its share
                    again = queue_entry(last_seen, key)
                    if again != entry:
                        unqueue.append(entry)
                        queue.append(again)
                else:
                    done = True
                    break
            if not entries:
                done = True
            else:
                after = entries[-1][0]
            keys = [k for k, _, _ in victims]
            puts = self.ledger.without_ssd(keys, GoneReason.EVICTED, now)
            self.index.write(puts, queue=queue, unqueue=unqueue)
            await ssd.remove_many(victims)
            dropped += len(victims)
            self.counters.ssd_evictions_ttl += len(expired_keys)
            self.counters.ssd_evictions_capacity += len(victims) - len(expired_keys)
            if self.order is not None:
                for key in keys:
                    self.order.remove(key)
            if done:
                break
        return dropped, freed

    async def drop(self, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Remove the SSD copies of these blocks (an operator's Evict); returns (dropped, busy,
        absent). A copy in RAM stays (RAM only from now on); blocks being read from SSD, pulled
        or written back count as busy."""
        keys = list(dict.fromkeys(keys))
        records = self.index.get_many(keys)
        victims: list[SsdVictim] = []
        busy = absent = 0
        for key, record in zip(keys, records):
            if record is None or not record.tiers & Tier.SSD:
                absent += 1
            elif key in self.inflight.fetching or key in self.inflight.publishing:
                busy += 1
            else:
                victims.append(victim_of(key, record))
        if victims:
            dropped = [k for k, _, _ in victims]
            self.index.write(self.ledger.without_ssd(dropped, GoneReason.EVICTED, self.clock()))
            self.forget(dropped)
            await self.ssd.remove_many(victims)
            self.counters.ssd_evictions_admin += len(victims)
        return len(victims), busy, absent

    def finish_reconcile(self, report: ReconcileReport) -> None:
        """Apply the boot reconcile's findings: records whose file was missing or bad lose the
        SSD tier (unless this run published the block again meanwhile), and their RAM copies
        are dirty again; the tier's size counts the good files; capacity eviction may start."""
        keys = report.lost
        for i in range(0, len(keys), EVICT_BATCH * 40):
            chunk = keys[i:i + EVICT_BATCH * 40]
            records = self.index.get_many(chunk)
            still = [k for k, r in zip(chunk, records) if r is not None and r.tiers & Tier.SSD
                     and not self.ssd.is_fresh(self.ssd.path_of(k, r.digest, r.layer))]
            self.index.write(self.ledger.without_ssd(still, GoneReason.FILE_MISSING, self.clock()))
            self.forget(still)
            for key in still:
                block = self.ram.get(key)
                if block is not None:
                    self.ram.mark_dirty(block)
        self.ssd.reconciled(report.on_ssd, report.on_ssd_bytes, report.on_ssd_file_bytes, report.by_tenant)
        self.reconciled = True
        self.over_capacity()
