"""Block location in a cluster, for the peer tier: the I/O side of kvcached.cluster.location.

In a cluster (``[cluster] etcd`` set) no daemon keeps every other daemon's block list. Each
block has ``replicas`` home nodes (kvcached.cluster.placement); :class:`HomeLocator`, the
cluster's :class:`~kvcached.peers.locator.Locator`, plays the three roles of a daemon for the
peer tier:

- as a holder, it routes what the index gained and dropped to the homes of those blocks, as
  the same Announce and Drop frames a static cluster sends every peer, and on each (re)connection
  to a home sends it a full listing (Snapshot) of this daemon's blocks homed there;
- as a home, it keeps the records the holders send (:class:`HomeRecords`) and answers Locate;
- as an asker, it asks the homes of the blocks no local tier holds (one Locate per home, all at
  once) and keeps the answers for LOCATION_TTL_S, which Lookup's peer column and the fetch read.

On a membership change, the records of a holder that left are dropped at once; buckets that
moved are asked of their old homes too for the grace (LookupPlan), and this daemon's blocks in
the buckets that gained a home are announced to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvcached.cluster.location import HomeRecords, LookupPlan, Publisher
from kvcached.cluster.placement import Moves, Placement
from kvcached.peers import protocol as p
from kvcached.peers.directory import wire_key
from kvcached.peers.links import PeerLinks
from kvcached.peers.locator import Holders, Locator, apply_event

__all__ = ["HomeLocator", "LocatorCounters", "LOCATION_TTL_S"]

log = logging.getLogger("kvcached.peers")

LOCATION_TTL_S = 2.0         # an answer from the homes is used this long (a Lookup, then the Get after it)
CACHE_MAX = 1 << 20          # locations kept at most (the oldest go first)


@dataclass
class LocatorCounters:
    locates: int = 0             # Locate requests sent to homes
    located: int = 0             # keys asked of homes
    locate_failures: int = 0     # Locate requests that failed (timeout, connection, error answer)
    served_locates: int = 0      # Locate requests answered as a home
    republished: int = 0         # announcements made because a bucket gained a home
    forgotten: int = 0           # records dropped because their holder left


class HomeLocator(Locator):
    """See the module. ``me`` is this daemon's member name; ``present_keys`` lists this daemon's
    blocks (called in a worker thread); ``hedge_s`` and ``pull_timeout_s`` as the pulls'."""

    asks_homes = True

    def __init__(self, links: PeerLinks, me: str, replicas: int, bits: int, present_keys: Callable[[], list[bytes]],
                 hedge_s: float = 0.05, pull_timeout_s: float = 2.0) -> None:
        self.links, self.me, self.present_keys = links, me, present_keys
        self.hedge_s, self.pull_timeout_s = hedge_s, pull_timeout_s
        self.placement = Placement(replicas, bits)
        self.placement.set_members({me})
        self.records = HomeRecords(self.placement.bucket_of_key)
        self.publisher = Publisher(me, self.placement)
        self.plan = LookupPlan(self.placement)
        self.counters = LocatorCounters()
        self._cache: OrderedDict[bytes, tuple[tuple[str, ...], float]] = OrderedDict()

    # -- membership --

    def members_changed(self, names: set[str], gone: Sequence[str]) -> None:
        """The members are now ``names`` (this daemon among them or not), ``gone`` having left:
        their records go at once; the homes of the buckets that moved hear of this daemon's
        blocks there (:meth:`republish`, in a task)."""
        for name in gone:
            self.counters.forgotten += self.records.forget(name)
            self.publisher.forget_home(name)
        moves = self.placement.set_members(set(names) | {self.me})
        self.plan.moved(moves, self.links.clock())
        if len(moves):
            self.links.spawn(self.republish(moves))

    async def republish(self, moves: Moves) -> None:
        """Announce this daemon's blocks of the buckets that gained a home to that home (and
        record them here where the home gained is this daemon). The index is read, and each
        block's bucket found, in a worker thread: the event loop only queues the result."""
        if not moves.gains().any():
            return
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(None, self.present_keys)
        due = await loop.run_in_executor(None, self.publisher.announcements_for, moves, keys)
        for home, home_keys in due.items():
            self.publisher.pending[home].update(dict.fromkeys(home_keys, True))
            self.counters.republished += len(home_keys)
        self.distribute()

    def tick(self) -> None:
        """After a move's grace: drop the records of buckets this daemon no longer homes."""
        if self.plan.expire(self.links.clock()):
            placement, me = self.placement, self.me
            self.records.keep_buckets(lambda bucket: me in placement.homes_of(bucket))

    # -- as a holder --

    def changed(self, changes: dict[bytes, bool]) -> None:
        """What the index gained (True) and dropped (False), to the homes of those blocks."""
        self.publisher.changed(changes)
        self.distribute()

    def distribute(self) -> None:
        """Move what is due to each home into its link's pending announcements (sent by the
        tier's announcer); what is due to this daemon goes into its own records; what is due
        to a home not connected now is dropped: the listing sent on connection covers it."""
        links = self.links
        for home in self.publisher.due():
            batch = self.publisher.take(home)
            if home == self.me:
                self.records.gained(home, [k for k, held in batch.items() if held])
                self.records.dropped(home, [k for k, held in batch.items() if not held])
                continue
            link = links.get(home)
            if link is not None and link.verified:
                link.pending.update(batch)     # during a listing too: sent after it (it may predate them)

    def listing_for(self, peer: str, keys: Sequence[bytes]) -> list[bytes]:
        """Of this daemon's blocks (``keys``), those ``peer`` is a home of."""
        homes_of, bucket_of = self.placement.homes_of, self.placement.bucket_of_key
        return [key for key in keys if peer in homes_of(bucket_of(key))]

    async def start(self) -> None:
        """This daemon's own blocks homed here, as its own records (the index read in a worker
        thread)."""
        keys = await asyncio.get_running_loop().run_in_executor(None, self.present_keys)
        self.own_listing(keys)

    def own_listing(self, keys: Sequence[bytes]) -> None:
        """This daemon's own blocks homed here, as its own records."""
        homes_of, bucket_of, me = self.placement.homes_of, self.placement.bucket_of_key, self.me
        self.records.listing(me, 0, 0, True, [key for key in keys if me in homes_of(bucket_of(key))])

    # -- as a home --

    def event(self, peer: str, message: p.Announce | p.Drop | p.Snapshot, request_id: int) -> bool:
        """A holder's announcement or listing part; False for a listing part out of order."""
        r = self.records
        return apply_event(message, request_id, lambda keys: r.gained(peer, keys), lambda keys: r.dropped(peer, keys),
                           lambda listing, part, last, keys: r.listing(peer, listing, part, last, keys))

    def answer_locate(self, request: p.Locate) -> p.Located:
        self.counters.served_locates += 1
        live = self.links.links
        return p.Located([tuple(h for h in self.records.holders(wire_key(d, layer))
                                if h in live or h == self.me)[:p.MAX_HOLDERS] for d, layer in request.addresses])

    # -- as an asker --

    def known(self, key: bytes) -> tuple[str, ...] | None:
        """The holders the homes named for ``key`` (this daemon left out), or None where none
        was asked within LOCATION_TTL_S."""
        entry = self._cache.get(key)
        if entry is None or self.links.clock() - entry[1] > LOCATION_TTL_S:
            return None
        return entry[0]

    def holders(self) -> Holders:
        links, now = self.links, self.links.clock()
        return lambda key: [name for name in self.known(key) or () if links.usable(name, now)]

    def unasked(self, key: bytes) -> bool:
        """The homes of ``key`` were not asked within LOCATION_TTL_S: a fetch asks them."""
        return self.known(key) is None and bool(self.links.links)

    def blocks_of(self, peer: str) -> int:
        return 0                       # a cluster keeps no copy of what each peer holds

    async def locate(self, keys: Sequence[bytes]) -> None:
        """Ask the homes of ``keys`` not known now who holds them, and keep the answers: one
        Locate per home, all at once. A key is settled by the first answer that names a holder,
        or once every home asked for it has answered (a moved bucket's old and new homes both).
        A home that fails, or has not answered after ``hedge_s``, is replaced by the next home
        of its keys not settled yet (as a pull is hedged). Bounded by the caller's deadline: keys
        no home answered stay unknown."""
        wanted = [k for k in dict.fromkeys(keys) if self.known(k) is None]
        if not wanted:
            return
        asked: dict[bytes, set[str]] = {}                    # key -> homes asked for it in this locate
        outstanding = dict.fromkeys(wanted, 0)               # key -> asks in flight for it
        found: dict[bytes, set[str]] = {}
        answered: set[bytes] = set()
        tasks: dict[asyncio.Future[list[tuple[str, ...]]], tuple[str, list[bytes]]] = {}

        def settled(key: bytes) -> bool:
            return bool(found.get(key)) or (key in answered and not outstanding[key])

        def ask(ks: list[bytes]) -> None:
            for home, home_keys in self.plan.plan(ks, self._usable, self.links.clock(), asked).items():
                for key in home_keys:
                    outstanding[key] += 1
                tasks[asyncio.ensure_future(self._ask(home, home_keys))] = (home, home_keys)

        ask(wanted)
        loop = asyncio.get_running_loop()
        hedge_at: float | None = loop.time() + self.hedge_s
        try:
            while tasks and not all(settled(k) for k in wanted):
                if hedge_at is not None:
                    wait_s = hedge_at - loop.time()
                    done: set[asyncio.Future[list[tuple[str, ...]]]] = set()
                    if wait_s > 0:
                        done, _ = await asyncio.wait(tasks, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                    if not done:                               # slow homes: their keys go to the next homes too
                        hedge_at = None
                        ask([k for k in wanted if not settled(k)])
                        continue
                else:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                retry: list[bytes] = []
                for task in done:
                    home, home_keys = tasks.pop(task)
                    for key in home_keys:
                        outstanding[key] -= 1
                    if task.exception() is not None:
                        retry += [k for k in home_keys if not settled(k)]
                        continue
                    answered.update(home_keys)
                    for key, holders in zip(home_keys, task.result()):
                        found.setdefault(key, set()).update(holders)
                if retry:
                    ask(retry)
        finally:
            for task in tasks:
                task.cancel()
            now = self.links.clock()
            for key in wanted:
                if key in answered:
                    self._remember(key, tuple(sorted(found.get(key, set()) - {self.me})), now)

    async def _ask(self, home: str, keys: list[bytes]) -> list[tuple[str, ...]]:
        if home == self.me:
            return self.records.locate(keys)
        links = self.links
        link = links.links[home]
        self.counters.locates += 1
        self.counters.located += len(keys)
        addresses = [(k[:32], int.from_bytes(k[32:36], "little")) for k in keys]
        try:
            client = await links.client(link, links.clock() + self.pull_timeout_s)
            answer = await links.over_lane(link, client, lambda lane, key, setup_s: lane.locate(addresses, key, setup_s),
                                           self.pull_timeout_s / 2)
            if answer is None:                 # no lane (quic mode, or it failed a while ago): over QUIC
                answer = await client.locate(addresses)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters.locate_failures += 1
            links.dial_failed(link, exc)
            raise
        link.health.succeeded()
        return answer

    def _usable(self, name: str) -> bool:
        return name == self.me or self.links.usable(name, self.links.clock())

    def _remember(self, key: bytes, holders: tuple[str, ...], now: float) -> None:
        cache = self._cache
        cache[key] = (holders, now)
        cache.move_to_end(key)
        while len(cache) > CACHE_MAX:
            cache.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        return {"home_records": len(self.records), "location_cache": len(self._cache), **vars(self.counters)}
