"""The NIXL lane's holder side in a peer tier (kvcached.peers.nixl_holder): over a real, verified
QUIC session a peer gets the holder's NIXL metadata and, for a NixlPull, where each block lies in
the holder's arena with its checksum; a real NIXL agent then reads the bytes, bit-exact (UCX over
TCP, in this process). The pins last until NixlDone, the lease's time, or the session's end;
what one peer can make the holder pin is bounded; and a payload changed in the holder's arena
after its checksum was sent does not match that checksum."""

from __future__ import annotations

import asyncio
import itertools
import mmap
from pathlib import Path
from typing import Any

import blake3
import pytest

from kvcached.peers import protocol as p
from tests.integration.test_peer_tier import SIZE, A, B, Cluster, address, items, payload, until

pytest.importorskip("nixl", reason="NIXL is not installed here: make nixl (make test installs it)")

from kvcached.peers.nixl_transfer import NixlEndpoint  # noqa: E402

TRANSPORTS = ("tcp",)
READERS = itertools.count()


class NixlCluster(Cluster):
    """A's tier serves the NIXL lane over its arena; B is a plain peer."""

    async def start(self, name: str) -> Any:
        if name == A and A not in self.nixl:
            self.nixl[A] = NixlEndpoint(f"holder-{id(self)}", self.nodes[A].arena.view, TRANSPORTS)
        return await super().start(name)


async def started(tmp_path: Path, **settings: Any) -> NixlCluster:
    c = NixlCluster(tmp_path, (A, B), settings)
    for name in (A, B):
        await c.start(name)
    await c.connected()
    return c


async def stopped(c: NixlCluster) -> None:
    for name in (A, B):
        await c.stop(name)
    await asyncio.sleep(0.05)
    for node in c.nodes.values():
        node.close()


def rows(ns: range) -> list[tuple[bytes, int]]:
    return [(address(i).digest, 0) for i in ns]


def read(agent: p.NixlAgent, spans: list[p.NixlSpan]) -> list[bytes]:
    """What a puller's NIXL agent reads of ``spans`` from the holder: the bytes of each."""
    region = mmap.mmap(-1, 4 << 20)
    reader = NixlEndpoint(f"reader-{next(READERS)}", region, TRANSPORTS)
    try:
        peer = reader.add_peer(agent.metadata, agent.base)
        at, jobs = 0, []
        for span in spans:
            jobs.append((span.offset, at, span.length))
            at += span.length
        reader.read(peer, jobs, 10.0)
        return [bytes(region[local:local + n]) for _, local, n in jobs]
    finally:
        reader.close()
        region.close()


def test_a_peer_reads_pinned_blocks_over_nixl_bit_exact_and_its_done_unpins_them(tmp_path: Path) -> None:
    async def body() -> None:
        c = await started(tmp_path)
        try:
            a, b, n = c[A], c[B], 4
            await a.store.put(items(range(n)))
            client = b.t.links[A].client
            assert client is not None
            agent = await client.nixl_open()
            assert agent.size == a.arena.size and agent.metadata
            answer = await client.nixl_pull(rows(range(n)) + [(b"\xee" * 32, 0)])
            found, unknown = answer.spans[:n], answer.spans[n]
            assert answer.lease and answer.hold_ms == 10_000 and all(s.found for s in found)
            assert unknown.missing == p.MissReason.NOT_FOUND
            assert a.store.pinned_bytes >= n * SIZE and len(a.t.nixl.leases) == 1
            got = await asyncio.get_running_loop().run_in_executor(None, read, agent, list(found))
            assert got == [payload(i, SIZE) for i in range(n)]
            assert all(blake3.blake3(data).digest() == s.checksum for data, s in zip(got, found))
            assert {s.model for s in found} == {"m"}
            client.nixl_done(answer.lease ^ 1)                  # not its lease: nothing happens
            client.nixl_done(answer.lease)
            await until(lambda: a.store.pinned_bytes == 0, "A to unpin on NixlDone")
            assert a.t.nixl_stats()["leases_done"] == 1 and a.t.nixl_stats()["leases"] == 0
        finally:
            await stopped(c)
    asyncio.run(body())


def test_leases_end_by_time_and_with_the_session_and_a_peer_holds_a_bounded_number(tmp_path: Path) -> None:
    async def body() -> None:
        c = await started(tmp_path, nixl_hold_s=0.3, nixl_leases_per_peer=2)
        try:
            a, b = c[A], c[B]
            await a.store.put(items(range(6)))
            client = b.t.links[A].client
            assert client is not None
            first = await client.nixl_pull(rows(range(2)))
            second = await client.nixl_pull(rows(range(2, 4)))
            full = await client.nixl_pull(rows(range(4, 6)))
            assert first.lease and second.lease and not full.lease
            assert {s.missing for s in full.spans} == {p.MissReason.OVERLOADED}
            assert a.store.pinned_bytes == 4 * SIZE                 # the third pinned nothing
            await until(lambda: a.store.pinned_bytes == 0, "the leases to run out", timeout=5)
            assert a.t.nixl_stats()["leases_expired"] == 2
            kept = await client.nixl_pull(rows(range(2)))
            assert kept.lease and a.store.pinned_bytes == 2 * SIZE
            client.close()                                          # the session ends: so does its lease
            await until(lambda: a.store.pinned_bytes == 0, "the lease to end with the session")
            assert a.t.nixl_stats()["leases_ended"] + a.t.nixl_stats()["leases_expired"] == 3
        finally:
            await stopped(c)
    asyncio.run(body())


def test_a_payload_changed_after_its_checksum_was_sent_does_not_match_it(tmp_path: Path) -> None:
    """The holder vouches for the checksum it sent over the session, not for the bytes a reader
    finds: a slot changed after the answer reads as other bytes, which the checksum tells."""
    async def body() -> None:
        c = await started(tmp_path)
        try:
            a, b = c[A], c[B]
            await a.store.put(items(range(1)))
            client = b.t.links[A].client
            assert client is not None
            agent = await client.nixl_open()
            answer = await client.nixl_pull(rows(range(1)))
            span = answer.spans[0]
            a.arena.view[span.offset] ^= 0xFF                       # the holder's slot changes under the lease
            (got,) = await asyncio.get_running_loop().run_in_executor(None, read, agent, [span])
            assert got != payload(0, SIZE) and blake3.blake3(got).digest() != span.checksum
            client.nixl_done(answer.lease)
        finally:
            await stopped(c)
    asyncio.run(body())


def test_daemons_serve_the_nixl_lane_where_nixl_starts_and_run_without_it_where_it_cannot(tmp_path: Path) -> None:
    """Real daemons with ``quic.nixl`` on: A's NIXL starts (UCX over TCP) and A says it serves
    the lane and exports its metrics; B's cannot (a UCX transport this machine lacks), and B
    says why and runs without it. Pulls between them go on as before, bit-exact."""
    import urllib.request

    from tests.integration.conftest import wait_for
    from tests.integration.test_peers import Cluster as DaemonCluster
    from tests.integration.test_peers import blocks, connected, free_udp_port, lookup

    cluster = DaemonCluster(tmp_path, ("node-a", "node-b"))
    try:
        port = free_udp_port()
        a = cluster.daemon("node-a", "quic.nixl=true", 'quic.nixl_transports=["tcp"]', f'metrics.listen="127.0.0.1:{port}"')
        b = cluster.daemon("node-b", "quic.nixl=true", 'quic.nixl_transports=["nosuchtransport"]')
        wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="peers connected")
        assert "NIXL lane served" in a.log() and "NIXL lane off" not in a.log()
        assert "NIXL lane off" in b.log() and "NIXL could not start" in b.log()
        data = blocks(6)
        with a.client() as client:
            client.put(list(data.items()), model="llama")
        wait_for(lambda: lookup(b, data).peer == 6, text="b learns a's blocks")
        with b.client() as client:
            got, missing = client.get(list(data))
        assert not missing and {f.address: f.payload for f in got} == data
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvcached_nixl_leases 0.0" in text and 'kvcached_nixl_leases_ended_total{how="done"} 0.0' in text
        assert a.stop() == 0 and b.stop() == 0
    finally:
        cluster.stop()
