"""The store's timed work: every loop that keeps the store's state in order while it serves.

The store's request-driven half (kvcached.store's rooms) answers calls; this room runs the
other half, each job in a task of its own, started by :meth:`StoreKeeper.start` and ended by
:meth:`StoreKeeper.stop`:

- **write-back** (``ssd-demoter``): publish dirty blocks on SSD soon after they are put (woken
  by the write path's ``demote_wanted``) and at least once a second; on a clean stop, publish
  what is left (a handover leaves them dirty: the successor keeps them in RAM);
- **SSD eviction** (``ssd-evictor``): TTL and capacity, about once a second and when the tier is
  over (woken by ``evict_wanted``);
- **the SSD reconcile** (``ssd-reconcile``): the boot reconcile of the tier against the index,
  then the SSD policy's order rebuilt from the index, both in the scan thread;
- **maintenance**: last-seen times flushed every second; expired tombstones pruned now and
  then (found in the scan thread, deleted in slices that yield to requests);
- **index recovery**: an index that cannot be written (its disk full) is asked to recover every
  second, and the status line says puts are refused meanwhile;
- **the policy saver**: what the policies learned, every ``policy_save_s``: captured on the loop
  in slices of half a millisecond with rests between them (each policy copied in one step, then
  walked and encoded a few thousand keys a step), written in a worker thread a chunk at a time,
  the cyclic garbage collector held off meanwhile (kvcached.host.heap);
- **RAM adoption**: the blocks a predecessor left in the arena, checked and committed while
  serving (kvcached.store.adoption).

Every job whose work grows with the blocks held does it in a worker thread or in slices, never
in one step on the event loop (bench/bench_loop.py measures the loop's lag while they run). What
boot built, and the SSD policy once rebuilt, is frozen out of the cyclic collector's walks
(kvcached.host.heap): a full collection over a million blocks' key tables held the loop some
100 ms. ``status`` tells the service manager's status line (the daemon passes systemd's);
``clock`` is wall time (TTLs, tombstones).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvcached.host import heap
from kvcached.host.aio import SliceStats, cancel_and_wait, run_in_slices
from kvcached.host.logs import fields
from kvcached.index import BlockIndex, policy_state
from kvcached.policies import PolicySettings, Steps, finished
from kvcached.store import Store
from kvcached.store.adoption import RamAdoption
from kvcached.store.ssd_reconcile import reconcile_ssd

__all__ = ["StoreKeeper", "KeeperSettings", "SaveRecord"]

log = logging.getLogger("kvcached.daemon")

MAINTENANCE_PERIOD_S = 1.0  # last-seen flushes: one reads and writes a record per block read since the last
DEMOTE_PERIOD_S = 1.0
EVICT_PERIOD_S = 1.0
PRUNE_SLICE = 1_000        # tombstones deleted per slice (some 3 ms) before requests get the loop back
INDEX_CHECK_S = 1.0        # how often an unwritable index is asked to recover (it backs off by itself)
ROUNDS = ("ssd-demoter", "ssd-evictor")   # jobs whose round in progress a stop lets finish
SAVE_SLICE_S = 0.0005      # a policy save's slice on the loop (its steps are 2,048 keys, a few tenths of a ms)...
REST_S = 0.002             # ... and the rest after each (also between tombstone slices), in which requests run
SAVE_WRITE_BYTES_S = 64 << 20  # a save writes its chunks at this pace at most: the loop's own index writes
                               # wait for each, and a burst of 100 MB would outrun RocksDB's memtable flushes


@dataclass(frozen=True)
class KeeperSettings:
    """What the keeper takes of the configuration ([kv] and [grpc] keys of these names)."""

    policy_save_s: float = 0.0      # 0: the policies are saved at a clean stop only
    ram_policy: str = "slru"
    ssd_policy: str = "lru"
    slru_ratio: float = 0.0
    grace_s: float = 5.0            # a stop's grace for the write-back of what is dirty


@dataclass(frozen=True)
class SaveRecord:
    """A periodic save of the policies' state: when it ended (wall clock), how long it took in
    all and on the event loop (its slices together), and the bytes it wrote."""

    ended_at: float
    seconds: float
    loop_seconds: float
    bytes: int


class StoreKeeper:
    """See the module. Runs on the event loop; its scans run in its own scan thread."""

    def __init__(self, store: Store, index: BlockIndex, settings: KeeperSettings, *,
                 status: Callable[[str], object] = lambda text: None, clock: Callable[[], float] = time.time) -> None:
        self.store, self.index, self.settings = store, index, settings
        self.status, self.clock = status, clock
        self.scanner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-scan")
        self.stopping = threading.Event()              # the scans end within one batch once set
        self.winding_down = asyncio.Event()            # the loops end after their current round
        self.handing_over = False
        self.saving: asyncio.Future[int] | None = None  # a policy save in its worker thread
        self.ssd_reconcile_summary: dict[str, Any] = {}
        self.ram_adoption_summary: dict[str, Any] = {}
        self.saves = 0                                 # periodic policy saves done (metrics)
        self.last_save: SaveRecord | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --

    def start(self, adoption: RamAdoption | None = None) -> None:
        """Start every job this store has work for (``adoption``: a predecessor's arena)."""
        jobs: list[tuple[str, Any]] = []
        if adoption is not None:
            jobs.append(("ram-adoption", self._adopt_ram(adoption)))
        jobs += [("maintenance", self._maintenance()), ("index-recovery", self._index_recovery())]
        if self.settings.policy_save_s:
            jobs.append(("policy-saver", self._policy_saver(self.settings.policy_save_s)))
        if self.store.ssd is not None:
            jobs += [("ssd-reconcile", self._reconcile_ssd()), ("ssd-demoter", self._demoter()),
                     ("ssd-evictor", self._ssd_evictor())]
        self._tasks += [asyncio.create_task(coro, name=name) for name, coro in jobs]
        # What boot built (the RAM tier's key table among it) lives as long as the daemon: out
        # of the cyclic collector's walks (kvcached.host.heap).
        heap.freeze("booted", collect=True)

    async def stop(self, handing_over: bool = False) -> None:
        """End every job: the write-back and eviction rounds in progress finish their I/O, the
        write-back publishes what is dirty (not when ``handing_over``: the successor keeps it in
        RAM), background store work drains, a policy save in progress completes. The scan thread
        is stopped by :meth:`close`, once nothing needs it."""
        self.handing_over = handing_over
        self.winding_down.set()
        rounds = [t for t in self._tasks if t.get_name() in ROUNDS]
        if rounds:   # let a write-back or eviction round in progress finish its I/O first
            await asyncio.wait(rounds, timeout=self.settings.grace_s)
        await cancel_and_wait(self._tasks)
        await self.store.drain(self.settings.grace_s)
        if self.saving is not None:              # a periodic policy save still writing the index
            await asyncio.wait([self.saving])

    def close(self) -> None:
        """Stop the scan thread (its scans see ``stopping`` within one record batch)."""
        self.stopping.set()
        self.scanner.shutdown(wait=True)

    # -- the policies' state (kvcached.index.policy_state) --

    def restore_policies(self) -> None:
        """At boot, before any block is stored: what the policies learned before the restart.
        The SSD tier's order follows once its reconcile is done."""
        store, s = self.store, self.settings
        ram_keys = policy_state.restore_ram(self.index, store.ram.policy_state(), s.ram_policy)
        admission = policy_state.restore_admission(self.index, store.admission)
        store.load_budget()
        if ram_keys or admission:
            log.info("policy state restored", extra=fields(ram_policy=s.ram_policy, ram_keys=ram_keys,
                                                           admission=store.admission.name if admission else None))

    def capture_steps(self) -> Steps[policy_state.Captured]:
        """The policies' state, taken in steps on the loop (policy_state.capture_steps). The
        SSD policy is left out until it was rebuilt after the boot reconcile: before that it
        orders only blocks written since boot, and saving it would replace the whole saved
        order with that part."""
        store = self.store
        return policy_state.capture_steps(store.ram.policy_state(),
                                          store.ssd_order if store.ssd_order_ready else None, store.admission)

    def save_policies(self) -> int:
        """Capture and save the policies' state now, in one go (at a clean stop, the loop serving
        nothing any more); returns bytes written."""
        return policy_state.write_parts(self.index, finished(self.capture_steps()))

    async def _policy_saver(self, every_s: float) -> None:
        """Every ``every_s``: capture the policies' state on the loop in slices of SAVE_SLICE_S
        with REST_S between them, then write it in a worker thread, a chunk at a time."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            if not self.index.writable:
                continue
            try:
                t0 = time.monotonic()
                on_loop = SliceStats()
                with heap.paused():      # the snapshot's young lists of keys: not walked by every young collection
                    captured = await run_in_slices(self.capture_steps(), SAVE_SLICE_S, REST_S, on_loop)
                t1 = time.monotonic()
                # shielded: a stop cancels this task, never the thread's write (stop waits for it)
                self.saving = loop.run_in_executor(None, policy_state.write_parts, self.index, captured, _write_pause)
                written = await asyncio.shield(self.saving)
                self.saves += 1
                self.last_save = SaveRecord(time.time(), time.monotonic() - t0, on_loop.busy_s, written)
                log.debug("policy state saved", extra=fields(
                    bytes=written, capture_s=round(t1 - t0, 4), loop_s=round(on_loop.busy_s, 4),
                    longest_slice_s=round(on_loop.longest_s, 4), elapsed_s=round(time.monotonic() - t0, 4)))
            except Exception:
                log.exception("saving the policy state failed; will retry")

    # -- the SSD tier --

    async def _reconcile_ssd(self) -> None:
        """The SSD boot reconcile, in the scan thread, while the daemon serves; then the SSD
        policy's order, rebuilt from the index, before capacity eviction may start."""
        store, index, ssd = self.store, self.index, self.store.ssd
        assert ssd is not None
        loop = asyncio.get_running_loop()
        try:
            report = await loop.run_in_executor(self.scanner, reconcile_ssd, index, ssd, self.stopping.is_set,
                                                self._reconcile_status)
        except Exception:
            log.exception("SSD reconcile failed; capacity eviction stays off until a restart reconciles the tier")
            return
        if self.stopping.is_set():
            return
        if store.ssd_order is not None:
            kind = self.settings.ssd_policy
            t0 = time.monotonic()
            try:
                built = await loop.run_in_executor(
                    self.scanner, policy_state.build_ssd_order, index, kind, self.stopping.is_set,
                    lambda n: log.info("building the SSD policy", extra=fields(blocks=n)),
                    PolicySettings(slru_ratio=self.settings.slru_ratio))
            except Exception:
                log.exception("rebuilding the SSD policy failed; the index's LRU queue orders SSD eviction "
                              "until a restart")
            else:
                store.adopt_ssd_order(built)
                heap.freeze("SSD policy rebuilt")     # its key table: a reference per block on SSD
                log.info("SSD policy rebuilt", extra=fields(ssd_policy=kind, blocks=len(built),
                                                            elapsed_s=round(time.monotonic() - t0, 3)))
        while not index.writable:      # it writes the index: wait until it recovers
            await asyncio.sleep(INDEX_CHECK_S)
        store.finish_ssd_reconcile(report)
        self.ssd_reconcile_summary = report.summary()
        log.info("SSD tier reconciled", extra=fields(**self.ssd_reconcile_summary))
        self.status("serving")

    def _reconcile_status(self, phase: str, seen: int) -> None:
        self.status(f"serving; reconciling the SSD tier: {seen} {phase} checked")

    async def _demoter(self) -> None:
        """Write-back: publish dirty blocks on SSD soon after they are put (woken by puts), and
        at least once a second; after a round that failed, wait a second. On a clean stop,
        publish what is left."""
        store = self.store
        while not self.winding_down.is_set():
            await _woken_or_after(store.demote_wanted, DEMOTE_PERIOD_S, self.winding_down)
            if not self.index.writable:     # files it cannot record would only be orphans
                continue
            try:
                while store.ram.dirty and not self.winding_down.is_set() and await store.demote():
                    pass
            except Exception:
                log.exception("write-back round failed; will retry")
                await asyncio.sleep(DEMOTE_PERIOD_S)
        # A clean stop writes back what is still dirty, within the shutdown grace (stop() waits);
        # blocks agents committed last are checksummed first (only recorded blocks are written).
        # A handover leaves them dirty in RAM: the successor writes them back.
        if self.handing_over:
            return
        await store.drain(self.settings.grace_s)
        if not self.index.writable:
            log.error("the index cannot be written: dirty blocks are not written back and are lost at this stop",
                      extra=fields(bytes=store.ram.dirty_bytes))
            return
        before = store.counters.demotions
        while store.ram.dirty and await store.demote():
            pass
        flushed = store.counters.demotions - before
        if flushed:
            log.info("wrote back dirty blocks before stopping", extra=fields(blocks=flushed))

    async def _ssd_evictor(self) -> None:
        """SSD eviction by TTL and capacity, about once a second and when the tier is over."""
        store = self.store
        while not self.winding_down.is_set():
            await _woken_or_after(store.evict_wanted, EVICT_PERIOD_S, self.winding_down)
            if not self.index.writable:
                continue
            try:
                await store.evict_ssd()
            except Exception:
                log.exception("SSD eviction failed; will retry")

    # -- the index --

    async def _maintenance(self) -> None:
        """Every second: flush last-seen times (the flush's work grows with the blocks read since
        the last one: at 1,000 reads a second, flushed every 5 s, it held the loop 20-32 ms; every
        second, a fifth of that); now and then prune old tombstones.

        The tombstone scan runs in the scan thread (it reads raw records and stops early when
        the daemon stops); deletions run here in slices, yielding to requests in between."""
        store, index, clock = self.store, self.index, self.clock
        loop = asyncio.get_running_loop()
        next_prune = clock() + min(store.gone_ttl / 2, 600)
        while True:
            await asyncio.sleep(MAINTENANCE_PERIOD_S)
            if not index.writable:       # last-seen times wait in the store until it recovers
                continue
            try:
                store.flush_last_seen()
                ttl = store.gone_ttl         # a reload may change it
                if clock() >= next_prune:
                    keys = await loop.run_in_executor(self.scanner, index.expired_tombstones, clock(), ttl,
                                                      self.stopping.is_set)
                    pruned = 0
                    for i in range(0, len(keys), PRUNE_SLICE):
                        pruned += index.delete_expired(keys[i:i + PRUNE_SLICE], clock(), ttl)
                        await asyncio.sleep(REST_S)
                    if pruned:
                        log.info("pruned tombstones", extra=fields(count=pruned))
                    next_prune = clock() + min(ttl / 2, 600)
            except Exception:
                log.exception("maintenance failed; will retry")

    async def _index_recovery(self) -> None:
        """Every second: if the index cannot be written, ask it to recover (BlockIndex.recover
        decides when an attempt is due: once its disk has room, backing off after failures); tell
        the status line while puts are refused."""
        index = self.index
        refusing = False
        while True:
            await asyncio.sleep(INDEX_CHECK_S)
            if index.writable and not refusing:
                continue
            if not refusing:
                refusing = True
                self.status(f"serving reads; puts refused: the index cannot be written ({index.unwritable_reason})")
            try:
                recovered = index.recover(time.monotonic())
            except Exception:
                log.exception("index recovery attempt failed; will retry")
                continue
            if recovered:
                refusing = False
                self.status("serving")

    # -- the RAM tier a predecessor left --

    async def _adopt_ram(self, adoption: RamAdoption) -> None:
        """Check and commit the blocks the previous process left in the arena, while serving."""
        try:
            report = await adoption.run(self.index, None, self.clock, self.stopping.is_set)
        except Exception:
            log.exception("taking up the previous process's RAM tier failed; its blocks not yet checked are dropped")
            return
        self.ram_adoption_summary = report.summary()
        log.info("RAM tier taken over", extra=fields(**self.ram_adoption_summary))


def _write_pause(nbytes: int) -> None:
    time.sleep(nbytes / SAVE_WRITE_BYTES_S)


async def _woken_or_after(event: asyncio.Event, seconds: float, stop: asyncio.Event) -> None:
    """Wait until ``event`` or ``stop`` is set or ``seconds`` pass, then clear ``event``."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    event.clear()
