"""The NIXL lane's puller side: one holder's share of a fetch read over NIXL (issue 43;
docs/peers.md, "The NIXL lane").

Over the verified QUIC session the puller asks the holder's NIXL metadata once per session
(NixlOpen) and, per batch, where the blocks lie (NixlPull -> NixlSpans, the blocks pinned there
under a lease). It reserves a slot in its own arena for each found block, READs every span at
once from the holder's arena into those slots by NIXL (in a worker thread: NIXL's calls block),
then checks each payload against the checksum that came over the session. A payload that does
not match (changed in the holder's arena after it answered, or damaged on the way) is dropped,
counted and never published; a matching one is handed to the fetch as any pulled block. The
lease ends with NixlDone whatever happened.

A slot NIXL may still be writing into is never given back early: if the fetch is cancelled
while a read is in flight, the read (bounded by its own deadline) is waited out first.

Where the holder runs no NIXL lane, or NIXL fails here, :class:`NixlUnusable` says so: the
caller pulls what is left over the TCP lane or QUIC and leaves NIXL to that peer alone for a
while (kvcached.peers.links, ``lane_retry_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from kvcached.peers import protocol as p
from kvcached.peers.nixl_transfer import NixlTransferError
from kvcached_agent.integrity import payload_checksum

__all__ = ["NixlPuller", "NixlPullCounters", "NixlUnusable"]

log = logging.getLogger("kvcached.peers")

PIPELINE_BYTES = 8 << 20     # one READ's share of a batch: the next run is read while this one is checked


class NixlUnusable(Exception):
    """NIXL cannot be used with this peer now (it runs no NIXL lane, its metadata was refused,
    or a read failed): pull over another transport."""


@dataclass
class NixlPullCounters:
    pulled: int = 0          # blocks read over NIXL and published
    pulled_bytes: int = 0
    corrupt: int = 0         # read, did not match the checksum from the session: dropped, never served
    fallbacks: int = 0       # pulls that went over the TCP lane or QUIC instead


class NixlPuller:
    """Reads pinned blocks from peers' arenas into this daemon's (``endpoint``: its NixlEndpoint,
    over the RAM tier's arena)."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.counters = NixlPullCounters()
        # peer -> (the session its metadata came over, its NIXL name, the size of its registered arena)
        self._agents: dict[str, tuple[Any, str, int]] = {}

    async def pull(self, peer: str, client: Any, rows: Sequence[tuple[bytes, int]], keys: Sequence[bytes],
                   fetch: Any, tenant: str, timeout_s: float) -> None:
        """Read ``rows`` (their wire ``keys``) of ``tenant`` from ``peer`` over ``client``'s
        session into slots ``fetch`` reserves; what arrives intact goes into ``fetch.got``.
        NixlUnusable where NIXL cannot be used with this peer; PeerGone and ProtocolError pass."""
        agent, size = await self._agent(peer, client)
        try:
            answer = await client.nixl_pull(rows, tenant)
        except p.ProtocolError as exc:
            if exc.code == p.ErrorCode.UNAVAILABLE:
                raise NixlUnusable(str(exc)) from None
            raise
        try:
            await self._read(agent, size, answer.spans, keys, fetch, timeout_s)
        finally:
            client.nixl_done(answer.lease)

    def forget(self, peer: str) -> None:
        """``peer``'s NIXL agent is to be asked again (its session ended)."""
        known = self._agents.pop(peer, None)
        if known is not None:
            self.endpoint.remove_peer(known[1])

    async def _agent(self, peer: str, client: Any) -> tuple[str, int]:
        known = self._agents.get(peer)
        if known is not None and known[0] is client:
            return known[1], known[2]
        self.forget(peer)                       # a new session: the holder may have restarted
        try:
            offer = await client.nixl_open()
        except p.ProtocolError as exc:
            if exc.code == p.ErrorCode.UNAVAILABLE:
                raise NixlUnusable(str(exc)) from None
            raise
        try:
            name = self.endpoint.add_peer(offer.metadata, offer.base, offer.bases, offer.size)
        except NixlTransferError as exc:
            raise NixlUnusable(str(exc)) from None
        self._agents[peer] = (client, name, offer.size)
        return name, offer.size

    async def _read(self, agent: str, size: int, spans: Sequence[p.NixlSpan], keys: Sequence[bytes], fetch: Any,
                    timeout_s: float) -> None:
        slots: list[tuple[bytes, p.NixlSpan, Any, memoryview]] = []
        jobs: list[tuple[int, int, int]] = []
        try:
            for key, span in zip(keys, spans):
                if not span.found or key in fetch.got or span.length > fetch.settings.max_payload:
                    continue
                if span.offset + span.length > size:       # outside the arena the holder registered: a wrong answer
                    self._refuse(key, fetch, "a span outside the holder's arena")
                    continue
                reserved = fetch.reserve(fetch.wanted[key], span.length)
                if reserved is None:
                    continue
                handle, view = reserved
                view = view[:span.length]
                slots.append((key, span, handle, view))
                jobs.append((span.offset, self.endpoint.offset_of(view), span.length))
            matches = await self._read_and_check(agent, jobs, slots, timeout_s)
        except NixlTransferError as exc:
            for _, _, handle, _ in slots:
                fetch.abort(handle)
            raise NixlUnusable(str(exc)) from None
        except BaseException:
            for _, _, handle, _ in slots:
                fetch.abort(handle)
            raise
        self._settle(slots, matches, fetch)

    async def _read_and_check(self, agent: str, jobs: list[tuple[int, int, int]],
                              slots: list[tuple[bytes, p.NixlSpan, Any, memoryview]], timeout_s: float) -> list[bool]:
        """READ ``jobs`` in runs of about PIPELINE_BYTES, each run's checksums computed in a
        worker thread while the next run is read (BLAKE3 and NIXL's progress both leave the
        GIL): the pull takes about the longer of reading and hashing, not their sum. Whether
        each slot matches its checksum, in order."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.001)
        matches: list[bool] = []
        checking: asyncio.Future[list[bool]] | None = None
        try:
            for lo, hi in _runs([n for _, _, n in jobs]):
                await _uninterrupted(loop.run_in_executor(None, self.endpoint.read, agent, jobs[lo:hi],
                                                          max(deadline - loop.time(), 0.001)))
                if checking is not None:
                    matches += await _uninterrupted(checking)
                checking = loop.run_in_executor(None, _checksums_match, slots[lo:hi])
            if checking is not None:
                matches += await _uninterrupted(checking)
                checking = None
        finally:
            if checking is not None:             # a read failed or was cancelled: the check ends first
                with contextlib.suppress(BaseException):
                    await checking
        return matches

    def _settle(self, slots: list[tuple[bytes, p.NixlSpan, Any, memoryview]], matches: list[bool], fetch: Any) -> None:
        """Each slot read: published to the fetch if it matched its checksum, else dropped."""
        for (key, span, handle, view), matched in zip(slots, matches):
            if key in fetch.got:
                fetch.abort(handle)
                continue
            if not matched:
                self._refuse(key, fetch, "failed its checksum")
                fetch.abort(handle)
                continue
            self.counters.pulled += 1
            self.counters.pulled_bytes += span.length
            fetch.counters.pulled += 1
            fetch.counters.pulled_bytes += span.length
            address = fetch.wanted[key]
            fetch.got[key] = (address, handle, p.Block(address.digest, address.layer, span.model, span.length,
                                                       span.checksum))


    def _refuse(self, key: bytes, fetch: Any, why: str) -> None:
        """A block the holder's answer or its bytes do not vouch for: dropped, counted, never served."""
        self.counters.corrupt += 1
        fetch.counters.corrupt += 1
        log.warning("block over NIXL dropped", extra={"fields": {"digest": key[:32].hex(), "reason": why}})


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive index ranges of ``lengths``, each about PIPELINE_BYTES (at least one span)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        total += n
        if total >= PIPELINE_BYTES:
            runs.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(lengths):
        runs.append((start, len(lengths)))
    return runs


def _checksums_match(slots: Sequence[tuple[bytes, p.NixlSpan, Any, memoryview]]) -> list[bool]:
    return [payload_checksum(view) == span.checksum for _, span, _, view in slots]


async def _uninterrupted(future: "asyncio.Future[Any]") -> Any:
    """Await ``future`` (a read in a worker thread); a cancel waits for it to end first, so that
    no slot it writes into is given back while it still may."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        try:
            await future
        except Exception:
            pass
        raise


