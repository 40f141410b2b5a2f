"""The KV event publisher: the index's tier changes, as vLLM-schema batches, over ZMQ PUB, with a
replay ROUTER (docs/events.md). A thin asyncio layer over kvcached.events.stream.

One task wakes every batch interval: it takes the index's tier feed (each change carries its
block's record, and so the engine's keys of the block) and sends one batch per topic; between
batches, while replays are under way, it pumps the replay endpoint
(kvcached.events.replay_server) every few milliseconds. Every send is non-blocking, so nothing
here ever waits for a subscriber: a subscriber whose queue is at the high-water mark misses the
batch (ZMQ drops it for that subscriber alone; counted in :attr:`EventCounters.dropped_hwm`) and
can ask the replay endpoint for it.

Sequence numbers live in ``events.seq`` beside the index (kvcached.events.stream.SequenceLease):
they never go backwards across a crash, and continue without a gap across an upgrade (the
predecessor closes its publisher, then the successor binds the same endpoints).

A tenant's own stream (tenants.events) is a publisher with ``tenant`` set: it publishes the
changes of that tenant's blocks alone (as their records say, kvcached.index.format), numbered in
a sequence file of its own, on ipc endpoints (the stream and its replay) only the tenant's uids
and gids may open (bound at a temporary name, given their ACL, then renamed into place, so no
one else can connect first).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import zmq

from kvcached.events.endpoints import Bound, bind, unbind
from kvcached.events.replay_server import ReplayServer
from kvcached.events.schema import KVCacheEvent
from kvcached.events.stream import EventLog, EventMaker, EventNaming, SequenceLease, clear_event
from kvcached.host.logs import fields
from kvcached.index import Tier
from kvcached.index.format import record_tenant
from kvcached.index.presence import TierFeed

__all__ = ["EventCounters", "EventPublisher", "PublisherSettings", "SEQ_FILE"]

log = logging.getLogger("kvcached.events")

SEQ_FILE = "events.seq"
REPLAY_PUMP_S = 0.005            # how often answers under way go on (between batches)


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    endpoint: str
    replay_endpoint: str
    naming: EventNaming
    interval_s: float = 0.05
    hwm: int = 10_000
    replay_batches: int = 10_000
    replay_bytes: int = 64 << 20
    replay_clients_bytes: int = 64 << 20                  # what replay clients may make the daemon hold
    max_pending: int = 1 << 20
    tenant: str | None = None                             # one tenant's blocks only (Tenant.tag)
    admit: tuple[list[int], list[int]] | None = None      # the ipc endpoint's uids and gids (tenants)
    seq_file: str = "events.seq"


@dataclass(slots=True)
class EventCounters:
    events: int = 0              # events published
    batches: int = 0             # batches published
    dropped_hwm: int = 0         # times a subscriber's queue filled (each stall once, see _send)
    dropped_feed: int = 0        # tier changes lost before publishing (the feed was full)
    replays: int = 0             # replay requests answered
    replays_refused: int = 0     # replay requests malformed, asking for numbers not published or kept, or busy
    replays_cut: int = 0         # replay answers cut short (the client stopped reading, or the endpoint was reset)
    replay_resets: int = 0       # times the replay endpoint was reset to free what its clients held
    replay_held_bytes: int = 0   # what replay clients may hold now (an upper bound)
    replay_connections: int = 0  # replay connections open now
    replay_refused_connections: int = 0   # replay connections refused at their handshake (the caps)
    subscriptions: int = 0       # subscriptions open now (subscribe minus unsubscribe messages)
    seq_write_failures: int = 0  # writes of the sequence file that failed


class EventPublisher:
    """Publishes the index's tier changes. Build it before the index's boot reconcile (its
    :attr:`feed` goes on the index first, so the reconcile's changes are published too); then
    :meth:`start` binds and begins, :meth:`stop` sends the last changes and closes."""

    def __init__(self, settings: PublisherSettings, state_dir: str, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.feed = TierFeed(settings.max_pending)
        self.counters = EventCounters()
        self._clock = clock
        self._seq_path = os.path.join(state_dir, settings.seq_file)
        self._lease = SequenceLease(_read_seq(self._seq_path), self._persist)
        self.log = EventLog(self._lease.next, max_batches=settings.replay_batches, max_bytes=settings.replay_bytes)
        self._maker = EventMaker(settings.naming)
        self._started = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self.replay: ReplayServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending_clear: Tier | None = None
        self._bound: Bound = None

    # -- life --------------------------------------------------------------------------------------

    def start(self, *, ram_lost: bool) -> None:
        """Bind the endpoints (OSError saying why they cannot be) and publish what :attr:`feed`
        gets. ``ram_lost``: this daemon starts without its predecessor's RAM tier, which the first
        batch says with a RAM-scoped AllBlocksCleared."""
        s = self.settings
        self._started = True
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._ctx = ctx
        try:
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, s.hwm)
            pub.setsockopt(zmq.XPUB_NODROP, 1)        # a full subscriber shows as EAGAIN (see _send)
            pub.setsockopt(zmq.XPUB_VERBOSER, 1)      # every (un)subscription, not the first of each topic alone
            self._pub = pub
            self._bound = bind(pub, s.endpoint, "events.endpoint" if s.tenant is None else "tenants.events", s.admit)
            if s.replay_endpoint:
                self.replay = ReplayServer(ctx, s.replay_endpoint, "events.replay_endpoint" if s.tenant is None
                                           else "tenants.event_replays", self.log, budget=s.replay_clients_bytes,
                                           admit=s.admit)
                self.replay.open()
        except BaseException:
            self._close_sockets()
            raise
        if ram_lost:
            self._pending_clear = Tier.RAM
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")
        log.info("publishing KV events", extra=fields(endpoint=s.endpoint, replay=s.replay_endpoint or None,
                                                      first_seq=self._lease.next, ram_cleared=ram_lost))

    async def stop(self) -> None:
        """Publish what the feed holds, close the sockets, persist the next sequence number."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
            try:
                self.tick()
            except Exception:
                log.exception("KV events: the last batch could not be published")
        self._close_sockets()
        if self._started:
            self._lease.close()
            self._started = False

    def close_now(self) -> None:
        """Stop at once, publishing nothing more (a sibling stream could not start)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._close_sockets()
        if self._started:
            self._lease.close()
            self._started = False

    def _close_sockets(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
        self._pub = None
        unbind(self._bound)
        self._bound = None
        if self.replay is not None:
            self.replay.close()
            self._count_replays()
            self.replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        interval = self.settings.interval_s
        next_tick = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + interval
                try:
                    self.tick()
                except Exception:      # a bug costs a batch, not the daemon
                    log.exception("KV events: a tick failed")
            elif self.replay is not None:
                try:
                    self.replay.pump(now)
                    self._count_replays()
                except Exception:
                    log.exception("KV events: answering replays failed")
            wait = next_tick - time.monotonic()
            if self.replay is not None and self.replay.busy:
                wait = min(wait, REPLAY_PUMP_S)
            await asyncio.sleep(max(0.0, wait))

    # -- one tick ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Answer replays, then publish the changes the feed holds (one batch per topic)."""
        self._subscriptions()
        if self.replay is not None:
            self.replay.pump()
            self._count_replays()
        changes = self.feed.take()
        if self.settings.tenant is not None:
            tenant = self.settings.tenant
            changes = [change for change in changes if record_tenant(change[0]) == tenant]
        self.counters.dropped_feed = self.feed.dropped
        now = self._clock()
        if self._pending_clear is not None:
            clear = clear_event(self.settings.naming, self._pending_clear)
            self._pending_clear = None
            self._publish(self.settings.naming.topic_of(""), [clear], now)
        if changes:
            for topic, events in self._maker.events(changes).items():
                self._publish(topic, events, now)

    def _publish(self, topic: str, events: Sequence[KVCacheEvent], now: float) -> None:
        for frames in self.log.add(topic, events, now, self._lease.take):
            self._send(frames)
        self.counters.events = self.log.events
        self.counters.batches = self.log.batches

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        """Send to every subscriber without waiting. With XPUB_NODROP a send fails (EAGAIN) when
        a subscriber's queue has just filled: count it, then send again lossy, so the others get
        the batch and only the full ones miss it. libzmq then sets the full subscriber aside and
        drops its later batches without a word until it reads again, so each stall counts once
        (bench/bench_events.py measured 71 batches missed for one count)."""
        pub = self._pub
        if pub is None:
            return
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            self.counters.dropped_hwm += 1
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    def _subscriptions(self) -> None:
        """XPUB hands over (un)subscribe messages: count them, and keep its queue empty."""
        pub = self._pub
        if pub is None:
            return
        for _ in range(10_000):
            if not int(pub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:     # cheaper than a recv that raises
                return
            try:
                message = pub.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self.counters.subscriptions += 1
            elif message[:1] == b"\x00":
                self.counters.subscriptions = max(0, self.counters.subscriptions - 1)

    def _count_replays(self) -> None:
        assert self.replay is not None
        answers, c = self.replay.answers, self.counters
        c.replays, c.replays_refused, c.replays_cut = answers.counts.answered, answers.counts.refused, answers.counts.cut
        c.replay_resets, c.replay_held_bytes, c.replay_connections = (answers.counts.resets, answers.held_bytes,
                                                                      answers.connections)
        c.replay_refused_connections = answers.counts.refused_connections

    def _persist(self, value: int) -> None:
        """Keep ``value`` in the sequence file. A failed write (a full disk) is logged and
        publishing goes on: numbers stay increasing while this process runs; only a crash
        before the next successful write could repeat some."""
        try:
            _write_seq(self._seq_path, value)
        except OSError as exc:
            self.counters.seq_write_failures += 1
            log.warning("KV events: the sequence number cannot be kept", extra=fields(
                path=self._seq_path, error=exc.strerror or str(exc)))

    @property
    def next_seq(self) -> int:
        return self._lease.next


def _read_seq(path: str) -> int:
    try:
        with open(path, "rb") as f:
            text = f.read(64)
    except FileNotFoundError:
        return 0
    try:
        value = int(text.decode().strip())
    except ValueError:
        raise OSError(f"{path} does not hold a sequence number ({text[:32]!r}): remove it to start again at 0 "
                      "(subscribers then see numbers go backwards), or write a number above the last one published") from None
    return max(0, value)


def _write_seq(path: str, value: int) -> None:
    """Write ``value`` to ``path`` whole or not at all (a crash leaves the old value)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{value}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
