"""Blocks pulled coded for the wire ([quic] link_codec, issue 64) over real lanes, in both lane
modes, on the peer-tier harness of test_peer_tier.py (real certificates, real sockets): what
arrives is the holder's bytes exactly, whichever blocks the codec shrank; a holder that predates
coded pulls is pulled from raw. What coding buys on a slow link is bench/bench_link_codec.py's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvcached.peers import lane_server
from kvcached.peers import protocol as p
from kvcached.peers.link_coding import LinkCoding
from kvcached.store import PutItem
from tests.integration.test_peer_tier import A, B, Cluster, addrs, cluster, until
from tests.unit.conftest import address, payload
from tests.unit.test_link_codec import kv_like

KV = 32 << 10               # the harness arena holds 16 slabs of 64 KiB


@pytest.fixture(autouse=True, params=["tls", "mac"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(Cluster, "lane", request.param)
    return str(request.param)


def mixed(ns: range) -> dict[int, bytes]:
    """Even blocks KV-like (the codec shrinks them), odd ones random (it cannot)."""
    return {n: kv_like(n, KV) if n % 2 == 0 else payload(n, KV) for n in ns}


async def held_by_a(c: Cluster, n: int) -> dict[int, bytes]:
    """``n`` blocks (:func:`mixed`) put at A, and B told of them."""
    data = mixed(range(n))
    await c[A].store.put([PutItem(address(k), v, model="m") for k, v in data.items()])
    await until(lambda: c[B].t.locator.directory.count(A) == n, "announcements")
    return data


async def pulled_by_b(c: Cluster, n: int) -> None:
    """``n`` blocks put at A, then pulled by B: exactly A's bytes."""
    data = await held_by_a(c, n)
    found, misses = await c[B].store.get(addrs(range(n)))
    assert misses == [] and [f.payload for f in found] == list(data.values())


def test_a_coded_pull_brings_the_holders_bytes_exactly_coding_what_shrinks(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="planes-zstd") as c:
            a, b, n = c[A], c[B], 16
            await pulled_by_b(c, n)
            served = a.t.lane_server
            assert served is not None and served.counters.served_pulls >= 1
            assert served.counters.coded_blocks == n // 2              # the KV-like ones; the random went raw
            assert 0 < served.counters.coded_saved_bytes < n // 2 * KV
            assert b.t.connections.coding.coded_pulls >= 1
            assert b.t.counters.pulled == n and b.t.counters.corrupt == 0 and b.t.counters.lane_fallbacks == 0
            stats = b.t.server_stats()
            assert stats["lane_coded_pulls"] == b.t.connections.coding.coded_pulls
            assert a.t.server_stats()["lane_coded_blocks"] == n // 2
            assert a.t.counters.served == n                           # pinned and released as any pull's
    asyncio.run(body())


def test_link_codec_none_pulls_raw(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="none") as c:
            a, b, n = c[A], c[B], 8
            await pulled_by_b(c, n)
            assert a.t.lane_server is not None and a.t.lane_server.counters.coded_blocks == 0
            assert b.t.connections.coding.coded_pulls == 0
    asyncio.run(body())


def test_a_holder_that_predates_coded_pulls_is_pulled_from_raw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder of an earlier version knows no CodedPull: it answers Error UNKNOWN_TYPE before
    sending anything. The puller pulls the same blocks raw, on the same request's deadline, and
    never asks that peer coded again; nothing fails or falls back to QUIC."""
    monkeypatch.delitem(p.MESSAGES, p.CodedPull.TYPE)        # what an older holder decodes

    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="planes-zstd") as c:
            b, n = c[B], 8
            await pulled_by_b(c, n)
            link = b.t.connections.get(A)
            assert link is not None and link.lane is not None and link.lane.uncoded
            assert b.t.counters.failed == 0 and b.t.counters.lane_fallbacks == 0 and b.t.counters.pulled == n
            assert b.t.connections.coding.coded_pulls == 0
    asyncio.run(body())


def test_a_codec_the_holder_does_not_know_is_answered_raw(tmp_path: Path) -> None:
    """A puller of a later version asks for a codec this holder has no code for: the holder
    answers as to a Pull (every block raw) and the puller takes the blocks exactly."""
    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="planes-zstd") as c:
            a, b, n = c[A], c[B], 8
            b.t.connections.coding = LinkCoding(250, b.t.connections.clock, always=True)   # not registered here
            await pulled_by_b(c, n)
            assert a.t.lane_server is not None and a.t.lane_server.counters.coded_blocks == 0
            assert b.t.connections.coding.coded_pulls >= 1 and b.t.counters.corrupt == 0
    asyncio.run(body())


def test_coded_bytes_that_do_not_decode_as_their_block_are_refused_and_never_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder whose coded blocks are damaged after coding (a byte flipped, as a faulty NIC or
    a peer that lies would send them): each fails its check once decoded on the puller, is
    counted corrupt and is a miss, never served; the raw blocks of the same pull arrive; the
    puller keeps no reserved slot, the holder no pin."""
    honest = lane_server._encoded

    def damaged(codec, payload):  # type: ignore[no-untyped-def]
        form = honest(codec, payload)
        if form is None:
            return None
        flipped = bytearray(form)
        flipped[len(flipped) // 2] ^= 0x10
        return bytes(flipped)

    monkeypatch.setattr(lane_server, "_encoded", damaged)

    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="planes-zstd") as c:
            a, b, n = c[A], c[B], 8
            data = await held_by_a(c, n)
            found, misses = await b.store.get(addrs(range(n)), allow_partial=True)
            assert {f.address: f.payload for f in found} == {address(k): data[k] for k in range(1, n, 2)}
            assert sorted(m.address.digest for m in misses) == sorted(address(k).digest for k in range(0, n, 2))
            assert b.t.counters.corrupt == n // 2 and b.t.counters.pulled == n // 2
            assert a.t.lane_server is not None and a.t.lane_server.counters.coded_blocks == n // 2
            await until(lambda: a.store.pinned_bytes == 0 and b.store.pinned_bytes == 0, "pins and slots released")
            assert not any(address(k).key in b.ram for k in range(0, n, 2))           # B keeps none of them
    asyncio.run(body())


def test_a_puller_that_gives_up_while_the_holder_codes_leaves_nothing_pinned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder codes slowly (a busy machine) and the pull's deadline passes while runs of the
    part are still waiting to be coded, with raw blocks among them: the puller drops the lane,
    and the holder unpins every block, sent, coded or not yet coded."""
    honest = lane_server._encoded

    def slow(codec, payload):  # type: ignore[no-untyped-def]
        time.sleep(0.15)
        return honest(codec, payload)

    monkeypatch.setattr(lane_server, "_encoded", slow)

    async def body() -> None:
        async with cluster(tmp_path, (A, B), link_codec="planes-zstd", pull_timeout_s=0.3) as c:
            a, b, n = c[A], c[B], 16
            await held_by_a(c, n)
            found, misses = await b.store.get(addrs(range(n)), allow_partial=True)
            assert misses                                              # the deadline passed first
            assert a.t.lane_server is not None and a.t.lane_server.counters.served_pulls >= 1
            await until(lambda: a.store.pinned_bytes == 0, "A to release every pin", timeout=10)
            await until(lambda: b.store.pinned_bytes == 0, "B to give back every slot", timeout=10)
    asyncio.run(body())
