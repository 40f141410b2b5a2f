"""One fetch of blocks from peers: which holder is asked for which block, hedging, and the
slots the payloads land in (the peer tier's :meth:`~kvcached.peers.tier.PeerTier.fetch`).

A fetch plans each wanted block onto the first usable holder not asked yet (the locator says who
holds what), pulls each holder's share in batches of PULL_BATCH, over the holder's lane where it
has one (QUIC where it cannot be had, within the same deadline), and asks the next holder of
what has not arrived after ``hedge_s``: the first copy in wins and the others are stopped. A
payload is written straight into the arena slot the store reserved for it (:class:`_Sink`), and
its BLAKE3 checksum checked on arrival: a damaged copy is dropped, counted, and the next holder
asked. The caller bounds the whole fetch by its deadline; everything here is the event loop's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kvcached.codecs import codec_coded
from kvcached.peers import protocol as p
from kvcached.peers.directory import wire_key
from kvcached.peers.lane_client import LaneClient
from kvcached.peers.link_coding import LinkPull
from kvcached.peers.links import PeerLinks
from kvcached.peers.locator import Holders
from kvcached.peers.nixl_pull import NixlUnusable
from kvcached.peers.session import PeerGone, PullSink
from kvcached_agent.address import BlockAddress

__all__ = ["Fetch", "FetchSettings", "Reserve", "PULL_BATCH"]

log = logging.getLogger("kvcached.peers")

PULL_BATCH = 64              # addresses per Pull: big enough to keep the pipe full, small enough to hedge
Reserve = Callable[[BlockAddress, int], "tuple[Any, memoryview] | None"]


@dataclass(frozen=True)
class FetchSettings:
    pull_timeout_s: float = 2.0
    hedge_s: float = 0.05
    max_payload: int = 16 << 20


def split(key: bytes) -> tuple[bytes, int]:
    """A wire key's (digest, layer)."""
    return key[:32], int.from_bytes(key[32:36], "little")


class Fetch:
    """One fetch: which peer was asked for which block, what arrived, what is still wanted.
    ``holders``: the locator's (a fresh view for each plan); ``deadline``: by the links' clock;
    ``tenant``: whose blocks they all are (a Tenant.tag, named in each Pull)."""

    def __init__(self, links: PeerLinks, holders: Callable[[], Holders], settings: FetchSettings,
                 wanted: dict[bytes, BlockAddress], reserve: Reserve, abort: Callable[[Any], None],
                 deadline: float, tenant: str = "") -> None:
        self.links, self.holders, self.settings = links, holders, settings
        self.tenant = tenant                  # whose blocks: every Pull names it
        self.counters = links.counters
        self.wanted, self.reserve, self.abort = wanted, reserve, abort
        self.deadline = deadline
        self.got: dict[bytes, tuple[BlockAddress, Any, p.Block]] = {}
        self.tried: dict[bytes, set[str]] = {k: set() for k in wanted}
        self.sinks: list[_Sink] = []
        self.losers: set[asyncio.Future[None]] = set()   # attempts (tasks) cancelled because another won

    def _plan(self, keys: Iterable[bytes]) -> dict[str, list[bytes]]:
        """Each key not in yet to the first usable holder not asked yet."""
        holders = self.holders()
        plan: dict[str, list[bytes]] = {}
        for key in keys:
            if key in self.got:
                continue
            for name in holders(key):
                if name not in self.tried[key]:
                    plan.setdefault(name, []).append(key)
                    break
        return plan

    async def run(self) -> None:
        while True:
            plan = self._plan(self.wanted)
            if not plan:
                return
            pulls = [(name, keys[i:i + PULL_BATCH]) for name, keys in plan.items()
                     for i in range(0, len(keys), PULL_BATCH)]
            if len(pulls) == 1:            # the common case: awaited here, a loop turn sooner
                await self._hedged(*pulls[0])
            else:
                await asyncio.gather(*(self._hedged(name, keys) for name, keys in pulls))

    async def _hedged(self, name: str, keys: list[bytes]) -> None:
        """Pull ``keys`` from ``name`` in this task (no task of its own: none to start, none to
        wait on, a loop turn or two less per fetch). If that has not brought them all within
        ``hedge_s``, the keys still missing are asked of their next holders too, in tasks; the
        first to bring every key wins and the others are stopped (their streams closed). The
        attempt in this task is stopped by cancelling this task once, marked as a lost race:
        the cancel is taken back here, so a deadline's cancel still ends the fetch."""
        task = asyncio.current_task()
        assert task is not None
        hedges: set[asyncio.Future[None]] = set()
        first_running = True
        won = False                            # a hedge brought every key while the first attempt ran

        def settled(_: asyncio.Future[None]) -> None:
            nonlocal won
            if first_running and not won and all(k in self.got for k in keys):
                won = True                     # stop the first attempt
                self.losers.add(task)
                task.cancel()

        def hedge() -> None:
            for other, rest in self._plan(k for k in keys if k not in self.got).items():
                self.counters.hedged += 1
                attempt = asyncio.ensure_future(self._attempt(other, rest))
                attempt.add_done_callback(settled)
                hedges.add(attempt)

        timer = asyncio.get_running_loop().call_later(self.settings.hedge_s, hedge)
        try:
            try:
                await self._attempt(name, keys)
            except asyncio.CancelledError:
                if not won:
                    raise                      # the deadline: the fetch ends (the hedges too, below)
                task.uncancel()
            finally:
                first_running = False
                timer.cancel()
                self.losers.discard(task)
            pending = {h for h in hedges if not h.done()}
            while pending and not all(k in self.got for k in keys):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Hedges still running lost the race, or the deadline passed: stop their streams, and
            # wait until they have, so nothing is written into a slot once the fetch gave it back.
            pending = {h for h in hedges if not h.done()}
            for attempt in pending:
                if all(k in self.got for k in keys):
                    self.losers.add(attempt)
                attempt.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _attempt(self, name: str, keys: list[bytes]) -> None:
        links, counters, settings = self.links, self.counters, self.settings
        for key in keys:
            self.tried[key].add(name)
        link = links.get(name)
        if link is None:                       # the member left since the plan was made
            return
        sink = _Sink(self, name, set(keys))
        self.sinks.append(sink)
        try:
            client = await links.client(link, links.clock() + settings.pull_timeout_s)
            if links.nixl is not None and links.nixl_usable(link, client):
                try:                            # half of what is left: a NIXL that fails leaves the rest
                    await links.nixl.pull(name, client, [split(k) for k in keys], keys, self, self.tenant,
                                          (self.deadline - links.clock()) / 2)
                    keys = []                   # what the holder did not have is the next holder's to give
                except NixlUnusable as exc:
                    links.nixl_failed(link, exc)
                    keys = [k for k in keys if k not in self.got]
            lane_sink = sink
            lane_keys = keys

            async def over_lane(lane: LaneClient, key: tuple[bytes, bytes] | None, setup_s: float) -> bool:
                coding = links.coding
                asked = coding.codec_for(name)
                on_wire: list[LinkPull] = []       # measured from its first request out (its connection open)

                def out() -> None:
                    if not on_wire:
                        on_wire.append(coding.started(name, bool(asked)))

                codec, brought = 0, 0              # a pull that fails measures nothing
                try:
                    codec = await lane.pull([split(k) for k in lane_keys], lane_sink, key, setup_s, self.tenant, asked, out)
                    await lane_sink.settled()
                    brought = lane_sink.arrived_bytes
                finally:
                    if on_wire:
                        coding.took(on_wire[0], brought, bool(codec))
                coding.coded_pulls += bool(codec)
                return True

            # Half of what is left for opening a lane: a lane that cannot be had leaves QUIC the rest.
            laned = bool(keys) and bool(await links.over_lane(link, client, over_lane,
                                                              (self.deadline - links.clock()) / 2))
            if laned:
                counters.lane_pulls += 1
                keys = []
            elif keys:                          # no lane, or it failed: what it left goes over QUIC
                sink.close()                    # slots of payloads cut short on the lane go back
                keys = [k for k in keys if k not in self.got]
                sink = _Sink(self, name, set(keys))
                self.sinks.append(sink)
            if keys:
                await client.pull([split(k) for k in keys], sink, self.tenant)
        except (PeerGone, OSError, p.ProtocolError, asyncio.TimeoutError, RuntimeError) as exc:
            counters.failed += 1
            links.dial_failed(link, exc)
        except asyncio.CancelledError:
            if asyncio.current_task() not in self.losers:      # the deadline passed, not a lost hedge race
                counters.failed += 1
                links.dial_failed(link, TimeoutError(f"no answer within {settings.pull_timeout_s:g} s"))
            raise
        else:
            if link.health.succeeded():
                log.info("peer up", extra={"fields": {"peer": name}})
        finally:
            sink.close()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class _Sink(PullSink):
    """Answers of one pull from one peer: payloads into reserved slots, checked on arrival. A
    payload that came coded is decoded into its slot and checked on a worker thread (codec work
    stays off the event loop); its slot goes back only once that thread is done with it."""

    def __init__(self, fetch: Fetch, peer: str, keys: set[bytes]) -> None:
        self.fetch, self.peer, self.keys = fetch, peer, keys
        self.open: dict[bytes, tuple[Any, memoryview]] = {}   # reserved, payload not all in
        self.decoding: dict[bytes, asyncio.Future[bool]] = {}  # coded payloads being decoded and checked
        self.arrived_bytes = 0                                 # of the blocks that arrived verified
        self.closed = False

    def slot(self, block: p.Block) -> memoryview | None:
        key = wire_key(block.digest, block.layer)
        fetch = self.fetch
        if self.closed or key not in self.keys or key in fetch.got or key in self.open or key in self.decoding:
            return None
        if block.payload_length > fetch.settings.max_payload:
            return None
        reserved = fetch.reserve(fetch.wanted[key], block.payload_length)
        if reserved is None:
            return None
        self.open[key] = reserved
        return reserved[1][:block.payload_length]

    def arrived(self, block: p.Block) -> None:
        # Checked on the event loop. A worker thread (BLAKE3 releases the GIL) was tried and
        # dropped: in an ad-hoc timing on the 2-core machines here it was slower, taking CPU
        # from the peer's sending process and the loop's reads (no benchmark measures it).
        key = wire_key(block.digest, block.layer)
        handle, view = self.open.pop(key)
        self._settle(key, block, handle, key not in self.fetch.got and block.verify(view[:block.payload_length]))

    def arrived_coded(self, block: p.Block, coded: memoryview) -> None:
        key = wire_key(block.digest, block.layer)
        handle, view = self.open.pop(key)
        if key in self.fetch.got:
            self.fetch.abort(handle)
            return
        future = asyncio.get_running_loop().run_in_executor(None, _decoded, block, coded, view[:block.payload_length])
        self.decoding[key] = future
        future.add_done_callback(functools.partial(self._decoded, key, block, handle))

    def _decoded(self, key: bytes, block: p.Block, handle: Any, future: "asyncio.Future[bool]") -> None:
        del self.decoding[key]
        good = not future.cancelled() and future.exception() is None and future.result()
        if self.closed:                  # the fetch is over: the slot goes back now that no thread writes it
            self.fetch.abort(handle)
            return
        self._settle(key, block, handle, good)

    def _settle(self, key: bytes, block: p.Block, handle: Any, good: bool) -> None:
        fetch, counters = self.fetch, self.fetch.counters
        if key in fetch.got or not good:
            if key not in fetch.got:
                counters.corrupt += 1
                log.warning("pulled block failed its checksum; dropped",
                            extra={"fields": {"peer": self.peer, "digest": block.digest.hex(), "layer": block.layer}})
            fetch.abort(handle)
            return
        counters.pulled += 1
        counters.pulled_bytes += block.payload_length
        self.arrived_bytes += block.payload_length
        fetch.got[key] = (fetch.wanted[key], handle, block)

    async def settled(self) -> None:
        """Until every coded payload that arrived is decoded and checked (a cancel of the caller
        does not stop the threads: their slots go back as each ends)."""
        while self.decoding:
            await asyncio.shield(asyncio.gather(*self.decoding.values(), return_exceptions=True))

    def missed(self, miss: p.Miss) -> None:
        pass                     # another holder is asked in the next round, if there is one

    def close(self) -> None:
        """No more answers are taken; slots whose payload did not all arrive are given back (a
        slot still being decoded into, as its thread ends)."""
        self.closed = True
        for handle, _ in self.open.values():
            self.fetch.abort(handle)
        self.open.clear()


def _decoded(block: p.Block, coded: memoryview, out: memoryview) -> bool:
    """A worker thread's part of a coded arrival: ``coded`` decoded into ``out`` with the
    block's codec, and whether ``out`` is then the block its head announces. A payload that
    does not decode (damaged, or not what its head says) is a failed checksum."""
    try:
        codec_coded(block.codec).decode(coded, out)
    except Exception:            # a codec refusing its input, whatever it raises: the copy is bad, not the daemon
        return False
    return block.verify(out)
