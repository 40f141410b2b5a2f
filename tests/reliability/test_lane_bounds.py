"""What a lane costs when nobody proves anything, and a pull whose lane cannot be had.

Real peer tiers in one process (the harness of test_peer_tier.py), real TCP and TLS, strangers
on other loopback source addresses (127.0.0.2 and up). Each test runs in both lane modes:

- a pull whose lane is reset, closed, left unanswered, answered with garbage or not listened
  for gets every block over QUIC, run after run (issue 37: one pull that met a reset lane
  answered misses, because uvloop's complaint about a closed transport escaped the fallback);
- strangers filling the handshake table do not keep a peer's lane out, and only verified lanes
  count against ``lane_max_connections``;
- under uvloop (the daemon's loop), lanes refused, timed out, displaced and served leave no
  reference cycle behind: their memory goes back when they end, not at the next full GC.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import uvloop

from kvcached.peers.handshakes import DISPLACED, FULL, HandshakeLimits
from kvcached.peers.session import PeerGone
from kvcached.store import PutItem
from tests.integration import test_peer_tier as peer_tier_module
from tests.integration.test_lane import Collect, grant, lane_client
from tests.integration.test_peer_tier import A, B, C, cluster, until
from tests.lane_flood import ended, stranger
from tests.unit.conftest import KIB, address, payload

from .conftest import report

ROOT = Path(__file__).resolve().parents[2]
MODES = pytest.mark.parametrize("mode", ["tls", "mac"])
STRANGERS = [f"127.0.0.{2 + i}" for i in range(8)]
BLOCKS = 320
SMALL = 2 * KIB


def small_items(n: int) -> list[PutItem]:
    return [PutItem(address(i), payload(i, SMALL), model="m") for i in range(n)]


# ---------------------------------------------------------------------------------------------
# a lane that cannot be had


async def _hostile_lane(how: str, port: int) -> AsyncIterator[None]:
    """Something other than a lane server on the lane's port, doing ``how`` to each connection."""
    held: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif how == "closed":
            writer.close()
        elif how == "garbage":
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 8)
            await writer.drain()
            writer.close()
        else:                                   # silent: accepted, never answered
            held.append(writer)

    if how == "not listening":
        yield
        return
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield
    finally:
        for writer in held:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


hostile_lane = contextlib.asynccontextmanager(_hostile_lane)


def pulls_whose_lane_cannot_be_had(tmp_path: Path, mode: str, runs: int) -> None:
    """``runs`` runs, 320 blocks each, five ways a lane can fail to open in turn: every block
    arrives, checked, every run; the lane failure is counted; no pull fails and the peer never
    goes down."""
    hows = ("reset", "closed", "silent", "garbage", "not listening")

    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane=mode) as c:
            a, b = c[A], c[B]
            assert a.t.lane_server is not None
            await a.t.lane_server.stop()
            await a.store.put(small_items(BLOCKS))
            await until(lambda: b.t.locator.directory.count(A) == BLOCKS, "announcements")
            b.store.mirror_pulls = False                    # every run pulls all 320 again
            wanted = [address(i) for i in range(BLOCKS)]
            for run in range(runs):
                how = hows[run % len(hows)]
                link = b.t.links[A]
                link.lane_retry_at = 0.0                    # the lane is tried again this run
                before = b.t.counters.lane_fallbacks
                async with hostile_lane(how, c.ports[A]):
                    found, misses = await b.store.get(wanted, allow_partial=True)
                assert not misses, f"run {run} ({how}): {len(misses)} misses"
                assert [f.payload for f in found] == [payload(i, SMALL) for i in range(BLOCKS)], f"run {run} ({how})"
                assert b.t.counters.lane_fallbacks > before, f"run {run} ({how}): the lane was not tried"
                if link.lane is not None:
                    await link.lane.close()
            assert b.t.counters.failed == 0 and b.t.counters.lane_pulls == 0
            assert b.t.links[A].health.usable(b.t.clock())
            report(f"lane-refused-{mode}", runs=runs, blocks_each=BLOCKS, fallbacks=b.t.counters.lane_fallbacks,
                   pulled=b.t.counters.pulled, missed=b.t.counters.missed, failed=b.t.counters.failed)
    asyncio.run(body())


@MODES
def test_a_pull_whose_lane_cannot_be_had_gets_every_block_over_quic(tmp_path: Path, mode: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_tier_module, "SLAB", 128 * KIB)      # arenas of 2 MiB: room for 320 blocks
    pulls_whose_lane_cannot_be_had(tmp_path, mode, runs=20)


@pytest.mark.soak
@MODES
def test_soak_pulls_whose_lane_cannot_be_had(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_tier_module, "SLAB", 128 * KIB)
    pulls_whose_lane_cannot_be_had(tmp_path, mode, runs=200)


# ---------------------------------------------------------------------------------------------
# strangers in the handshake table


@MODES
def test_strangers_holding_the_handshake_table_do_not_keep_a_peer_out(tmp_path: Path, mode: str) -> None:
    """Idle connections from eight addresses, re-opened as the server ends them, keep the
    lane server's handshake table full; a peer's new lanes still get in (the oldest stranger
    gives way) and its pulls go over them, none over QUIC."""
    limits = HandshakeLimits(max_handshakes=16, max_handshakes_per_source=2, handshake_timeout_s=1.0)

    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane=mode, limits=limits) as c:
            a, b = c[A], c[B]
            server = a.t.lane_server
            assert server is not None
            await a.store.put(small_items(64))
            await until(lambda: b.t.locator.directory.count(A) == 64, "announcements")
            b.store.mirror_pulls = False
            held: list[socket.socket] = []
            stop = asyncio.Event()

            async def keep_full() -> None:
                while not stop.is_set():
                    for sock in [s for s in held if s.fileno() < 0 or ended(s)]:
                        held.remove(sock)
                        sock.close()
                    while len(held) < 2 * limits.max_handshakes:
                        held.append(stranger(STRANGERS[len(held) % len(STRANGERS)], c.ports[A]))
                    await asyncio.sleep(0.02)

            keeper = asyncio.ensure_future(keep_full())
            try:
                await until(lambda: server.handshakes == limits.max_handshakes, "the table full of strangers")
                for round_ in range(5):
                    if b.t.links[A].lane is not None:
                        await b.t.links[A].lane.close()     # every round opens new lanes
                    found, misses = await b.store.get([address(i) for i in range(64)], allow_partial=True)
                    assert not misses and len(found) == 64, f"round {round_}"
                    assert server.handshakes <= limits.max_handshakes
            finally:
                stop.set()
                await keeper
                for sock in held:
                    sock.close()
            assert b.t.counters.lane_pulls >= 5 and b.t.counters.lane_fallbacks == 0
            assert server.table.refused.get(DISPLACED, 0) >= 1, server.table.refused       # the peer made room
    asyncio.run(body())


@MODES
def test_only_verified_lanes_count_against_the_lane_cap(tmp_path: Path, mode: str) -> None:
    """With room for one lane: strangers' idle connections take no place; the first peer's lane
    does, and a second peer's verified lane is then refused (counted as full) until it closes."""

    async def body() -> None:
        async with cluster(tmp_path, (A, B, C), lane=mode, lane_max_connections=1) as c:
            server = c[A].t.lane_server
            assert server is not None
            await c[A].store.put(small_items(4))
            rows = [(address(i).digest, 0) for i in range(4)]
            strangers = [stranger(STRANGERS[i % 8], c.ports[A]) for i in range(16)]
            await until(lambda: server.handshakes == 16, "strangers in handshake")
            first = lane_client(c, B, A, mode)
            got = Collect()
            await first.pull(rows, got, grant(c, A, B, mode))
            assert len(got.arrived_) == 4 and server.lanes == 1
            second = lane_client(c, C, A, mode)
            with pytest.raises((PeerGone, ConnectionError, OSError)):
                await second.pull(rows, Collect(), grant(c, A, C, mode))
            assert server.table.refused.get(FULL) == 1
            await first.close()
            await until(lambda: server.lanes == 0, "the first lane closed")
            again = Collect()
            await second.pull(rows, again, grant(c, A, C, mode))
            assert len(again.arrived_) == 4
            await second.close()
            for sock in strangers:
                sock.close()
    asyncio.run(body())


# ---------------------------------------------------------------------------------------------
# memory back when connections end


def _flood(port: int, kinds: str, count: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.lane_flood", "--port", str(port), "--count", str(count),
                          "--kind", kinds, "--hold", "10"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.splitlines()[-1])["total"])


LANE_TYPES = ("LaneConnection", "SSLProtocol", "_SSLProtocolTransport", "TCPTransport", "socket", "SSLObject",
              "FrameDecoder", "Task")


@MODES
def test_lanes_that_end_leave_no_reference_cycles(tmp_path: Path, mode: str) -> None:
    """On uvloop, with the cyclic collector off: 1,200 strangers' connections (refused at their
    source's limit, displaced, timed out, or refused for what they sent) and a peer's served lanes
    come and go; afterwards no lane object is left for a collector to find."""
    limits = HandshakeLimits(max_handshakes=16, max_handshakes_per_source=4, handshake_timeout_s=0.5)
    kinds = "hello,idle" if mode == "tls" else "mac,idle"

    async def body() -> None:
        async with cluster(tmp_path, (A, B), lane=mode, limits=limits) as c:
            server = c[A].t.lane_server
            assert server is not None
            await c[A].store.put(small_items(32))
            rows = [(address(i).digest, 0) for i in range(32)]
            loop = asyncio.get_running_loop()
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                counts = await loop.run_in_executor(None, _flood, c.ports[A], kinds, 1200)
                for _ in range(3):                      # served lanes, opened and closed
                    client = lane_client(c, B, A, mode, keep=0)
                    got = Collect()
                    await client.pull(rows, got, grant(c, A, B, mode))
                    assert len(got.arrived_) == 32
                    await client.close()
                await until(lambda: server.handshakes == 0 and server.lanes == 0, "every lane ended")
                await asyncio.sleep(0.2)
                gc.collect()
                left = [o for o in gc.garbage if type(o).__name__ in LANE_TYPES]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            assert counts["opened"] == 1200 and counts["held_to_the_end"] == 0, counts
            assert sum(server.table.refused.values()) + server.counters.refused >= 1200 - 16
            assert left == [], f"{len(left)} lane objects in reference cycles: {sorted({type(o).__name__ for o in left})}"
    uvloop.run(body())
