"""The NIXL lane in peer tiers (kvcached.peers.nixl_holder, nixl_pull): over a real, verified
QUIC session a peer gets the holder's NIXL metadata and, for a NixlPull, where each block lies in
the holder's arena with its checksum; a real NIXL agent then reads the bytes, bit-exact (UCX over
TCP, in this process). The pins last until NixlDone, the lease's time, or the session's end;
what one peer can make the holder pin is bounded; a fetch reads over NIXL and publishes only
what matches its checksum (a payload changed in the holder's arena after its checksum was sent
is refused, counted, never served); a peer without the lane is pulled from over another
transport; real daemons pull over NIXL, or run without it where it cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import mmap
import os
from pathlib import Path
from typing import Any, Callable

import blake3
import pytest

from kvcached.peers import protocol as p
from tests.integration.test_peer_tier import SIZE, A, B, Cluster, address, get_exact, items, payload, until
from tests.netns import netns_usable

pytest.importorskip("nixl", reason="NIXL is not installed here: make nixl (make test installs it)")

from kvcached.peers.nixl_transfer import NixlEndpoint  # noqa: E402

TRANSPORTS = ("tcp",)
READERS = itertools.count()


class NixlCluster(Cluster):
    """The tiers named in ``serving`` run the NIXL lane over their arenas (A alone by default)."""

    serving: tuple[str, ...] = (A,)

    async def start(self, name: str) -> Any:
        if name in self.serving and name not in self.nixl:
            self.nixl[name] = NixlEndpoint(f"{name}-{id(self)}", self.nodes[name].arena.view, TRANSPORTS)
        return await super().start(name)


async def started(tmp_path: Path, serving: tuple[str, ...] = (A,), **settings: Any) -> NixlCluster:
    c = NixlCluster(tmp_path, (A, B), settings)
    c.serving = serving
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


def arena_of(pid: int) -> str:
    """The /proc path of daemon ``pid``'s arena (its memfd)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvcached-arena"):
                return f"/proc/{pid}/fd/{fd}"
    raise AssertionError(f"no arena memfd in process {pid}")


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


def test_daemons_pull_over_nixl_where_it_starts_and_run_without_it_where_it_cannot(tmp_path: Path) -> None:
    """Real daemons on one host with ``quic.nixl`` on: A's and B's NIXL start (UCX's shared
    memory for the bytes, TCP for its wire-up), C's cannot (a UCX transport this machine lacks):
    C says why and runs without it. B's Get of A's blocks reads them over NIXL (B's metrics count
    them); C's goes over the TCP lane; both bit-exact. B pulling from C falls back to the lane,
    counted; a payload changed in A's arena is refused by B, counted, never served. (Two hosts,
    UCX over TCP: the network namespace test below.)"""
    import urllib.request

    from tests.integration.conftest import wait_for
    from tests.integration.test_peers import Cluster as DaemonCluster
    from tests.integration.test_peers import blocks, connected, free_udp_port, lookup

    names = ("node-a", "node-b", "node-c")
    cluster = DaemonCluster(tmp_path, names)
    try:
        port = free_udp_port()
        a = cluster.daemon("node-a", "quic.nixl=true", 'quic.nixl_transports=["tcp", "sm"]')
        b = cluster.daemon("node-b", "quic.nixl=true", 'quic.nixl_transports=["tcp", "sm"]', "kv.mirror_pulls=false",
                           f'metrics.listen="127.0.0.1:{port}"')
        c = cluster.daemon("node-c", "quic.nixl=true", 'quic.nixl_transports=["nosuchtransport"]',
                           "kv.mirror_pulls=false")                 # A alone holds A's blocks
        for d, name in ((a, "node-a"), (b, "node-b"), (c, "node-c")):
            wait_for(lambda: connected(d, *(n for n in names if n != name)), text="peers connected")
        assert "NIXL lane served" in a.log() and "NIXL lane served" in b.log()
        assert "NIXL lane off" in c.log() and "NIXL could not start" in c.log()
        data = blocks(6)
        with a.client() as client:
            client.put(list(data.items()), model="llama")
        for d in (b, c):
            wait_for(lambda: lookup(d, data).peer == 6, text="the others learn a's blocks")
            with d.client() as client:
                got, missing = client.get(list(data))
            assert not missing and {f.address: f.payload for f in got} == data
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvcached_nixl_pulled_blocks_total 6.0" in text and "kvcached_nixl_refused_blocks_total 0.0" in text
        assert "kvcached_nixl_fallbacks_total 0.0" in text
        # A holder without NIXL (C): B's NixlOpen is refused, B counts a fallback and pulls over the lane.
        only_c = blocks(3, seed=7)
        with c.client() as client:
            client.put(list(only_c.items()), model="llama")
        wait_for(lambda: lookup(b, only_c).peer == 3, text="b learns c's blocks")
        with b.client() as client:
            got, missing = client.get(list(only_c))
        assert not missing and {f.address: f.payload for f in got} == only_c
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvcached_nixl_fallbacks_total 1.0" in text
        # A payload changed in A's arena (its memfd, as another process mapping it could): B reads
        # it over NIXL, refuses it against the checksum A sent, counts it and serves nothing.
        victim = next(iter(data))
        assert a.proc is not None
        with open(arena_of(a.proc.pid), "r+b") as f, mmap.mmap(f.fileno(), 0) as arena:
            at = arena.find(data[victim][:4096])
            assert at >= 0
            arena[at + 100] ^= 0xFF
        with b.client() as client:
            got, missing = client.get([victim], allow_partial=True)
        assert not got and len(missing) == 1
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvcached_nixl_refused_blocks_total 1.0" in text
        assert 'kvcached_integrity_failures_total{tier="peer"} 1.0' in text
        for d in (a, b, c):
            assert d.stop() == 0
    finally:
        cluster.stop()


def test_a_fetch_reads_blocks_over_nixl_bit_exact_and_releases_the_holders_pins(tmp_path: Path) -> None:
    """Both tiers run the NIXL lane: B's Get of A's blocks reads them by NIXL into B's slots,
    checked against the checksums from the session, then published; A's lease ends at once."""
    async def body() -> None:
        c = await started(tmp_path, serving=(A, B))
        try:
            a, b, n = c[A], c[B], 8
            await a.store.put(items(range(n)))
            await until(lambda: b.t.locator.directory.count(A) == n, "announcements")
            lanes = b.t.counters.lane_pulls
            await get_exact(b, range(n))
            pulled = b.t.nixl_stats()
            assert pulled["pull_pulled"] == n and pulled["pull_pulled_bytes"] == n * SIZE and pulled["pull_corrupt"] == 0
            assert b.t.counters.pulled == n and b.t.counters.lane_pulls == lanes      # not a byte over the lane
            await until(lambda: a.t.nixl_stats()["leases_done"] == 1 and a.store.pinned_bytes == 0, "A unpinned")
        finally:
            await stopped(c)
    asyncio.run(body())


async def answered_otherwise(c: NixlCluster, monkeypatch: pytest.MonkeyPatch,
                             change: Callable[[Any, p.NixlSpans], p.NixlSpans]) -> tuple[Any, Any]:
    """Two blocks put on A and announced to B; from now on A's holder passes each NixlSpans it
    answers through ``change(A, spans)`` first. Returns A and B."""
    a, b = c[A], c[B]
    await a.store.put(items(range(2)))
    await until(lambda: b.t.locator.directory.count(A) == 2, "announcements")
    holder = a.t.nixl
    assert holder is not None
    answer = holder.pull

    async def changed(*args: Any) -> p.NixlSpans:
        return change(a, await answer(*args))

    monkeypatch.setattr(holder, "pull", changed)
    return a, b


def test_a_payload_changed_in_the_holders_arena_is_refused_counted_and_never_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's slot changes after A sent its checksum (between NixlSpans and B's read): B's check
    refuses what it read, counts it, and the block is a miss; nothing wrong is ever served."""
    def changed_after_answering(a: Any, spans: p.NixlSpans) -> p.NixlSpans:
        a.arena.view[spans.spans[1].offset] ^= 0xFF          # the second block's slot changes
        return spans

    async def body() -> None:
        c = await started(tmp_path, serving=(A, B))
        try:
            a, b = await answered_otherwise(c, monkeypatch, changed_after_answering)
            found, misses = await b.store.get([address(0), address(1)], allow_partial=True)
            assert [f.payload for f in found] == [payload(0, SIZE)] and len(misses) == 1
            assert b.t.nixl_stats()["pull_corrupt"] == 1 and b.t.counters.corrupt == 1
            assert b.store.lookup([address(1).digest], 0).ram == 0        # never published
        finally:
            await stopped(c)
    asyncio.run(body())


def test_a_span_outside_the_holders_arena_is_refused_before_any_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder whose NixlSpans names bytes past the arena it registered (a wrong or hostile
    answer): B reads none of it, counts it refused, and the block is a miss; the others arrive."""
    def past_the_arena(a: Any, spans: p.NixlSpans) -> p.NixlSpans:
        wrong = dataclasses.replace(spans.spans[1], offset=a.arena.size - 1)
        return dataclasses.replace(spans, spans=(spans.spans[0], wrong))

    async def body() -> None:
        c = await started(tmp_path, serving=(A, B))
        try:
            a, b = await answered_otherwise(c, monkeypatch, past_the_arena)
            found, misses = await b.store.get([address(0), address(1)], allow_partial=True)
            assert [f.payload for f in found] == [payload(0, SIZE)] and len(misses) == 1
            stats = b.t.nixl_stats()
            assert stats["pull_corrupt"] == 1 and stats["pull_pulled"] == 1 and stats["pull_fallbacks"] == 0
        finally:
            await stopped(c)
    asyncio.run(body())


def test_a_peer_without_the_nixl_lane_is_pulled_from_over_quic_counted_once(tmp_path: Path) -> None:
    """B runs NIXL, A does not: B's NixlOpen is answered UNAVAILABLE, B counts a fallback and
    pulls over QUIC (this cluster runs no TCP lane) in the same fetch, within its deadline; the
    next fetch does not ask NIXL again."""
    async def body() -> None:
        c = await started(tmp_path, serving=(B,))
        try:
            a, b = c[A], c[B]
            await a.store.put(items(range(4)))
            await until(lambda: b.t.locator.directory.count(A) == 4, "announcements")
            await get_exact(b, range(2))
            await get_exact(b, range(2, 4))
            assert b.t.nixl_stats()["pull_fallbacks"] == 1 and b.t.nixl_stats()["pull_pulled"] == 0
            assert b.t.counters.pulled == 4 and b.t.counters.failed == 0
        finally:
            await stopped(c)
    asyncio.run(body())


def test_a_holder_killed_mid_pull_over_nixl_leaves_the_other_holder_to_serve(tmp_path: Path) -> None:
    """A and C hold the same 48 MiB; B pulls it over NIXL. A is frozen as B's pull goes out, runs
    5 ms and is killed: B's fetch asks C (hedging) and gets every block bit-exact from it, within
    the pull deadline and some slack; nothing A left half-read is published."""
    from tests.integration.conftest import wait_for
    from tests.integration.test_peers import KIB, blocks, connected, get_while_killed, lookup
    from tests.integration.test_peers import Cluster as DaemonCluster

    names = ("node-a", "node-b", "node-c")
    cluster = DaemonCluster(tmp_path, names)
    try:
        nixl = ("quic.nixl=true", 'quic.nixl_transports=["tcp"]')
        a = cluster.daemon("node-a", *nixl)
        b = cluster.daemon("node-b", *nixl, "kv.mirror_pulls=false")
        c = cluster.daemon("node-c", *nixl)
        wait_for(lambda: connected(b, "node-a", "node-c"), text="b connected")
        data = blocks(48, size=1024 * KIB, seed=3)
        for d in (a, c):
            with d.client() as client:
                for i in range(0, 48, 8):
                    client.put(list(data.items())[i:i + 8])
        wait_for(lambda: lookup(b, data).peer == 48, text="b learns")
        outcome = get_while_killed(b, a, data)
        assert outcome["exact"] and outcome["missing"] == 0 and outcome["seconds"] < 2 + 1.5, outcome
        assert b.stop() == 0 and c.stop() == 0
    finally:
        cluster.stop()


@pytest.mark.skipif(not netns_usable(), reason="network namespaces need root and the ip tool")
def test_daemons_in_two_network_namespaces_pull_over_nixl_over_tcp(tmp_path: Path) -> None:
    """Two hosts (network namespaces on a bridge): UCX over TCP between them carries the NIXL
    READs, the QUIC session the control; the pull is bit-exact, read over NIXL."""
    from tests.integration.conftest import wait_for
    from tests.integration.test_peers import KIB, blocks, connected, lookup
    from tests.integration.test_peers import Cluster as DaemonCluster
    from tests.netns import Hosts

    hosts = Hosts(tag="kvn", subnet="10.251.11")
    try:
        a_ns, b_ns = hosts.add("a"), hosts.add("b")
        cluster = DaemonCluster(tmp_path, ("node-a", "node-b"))
        cluster.addresses = {"node-a": f"{hosts.hosts[a_ns]}:7600", "node-b": f"{hosts.hosts[b_ns]}:7601"}
        try:
            nixl = ("quic.nixl=true", 'quic.nixl_transports=["tcp"]', "kv.mirror_pulls=false")
            a = cluster.daemon("node-a", *nixl, start=False)
            b = cluster.daemon("node-b", *nixl, start=False)
            a.prefix, b.prefix = hosts.exec(a_ns), hosts.exec(b_ns)
            a.start(), b.start()
            wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), timeout=20, text="peers connected")
            data = blocks(16, size=256 * KIB, seed=4)
            with a.client() as client:
                client.put(list(data.items()))
            wait_for(lambda: lookup(b, data).peer == 16, text="b learns a's blocks")
            with b.client() as client:
                got, missing = client.get(list(data))
                stats = client.stats()
            assert not missing and {f.address: f.payload for f in got} == data
            assert stats.peer_lane_pulls == 0, "read over NIXL, not the TCP lane"
            assert "NIXL not usable" not in b.log()
        finally:
            cluster.stop()
    finally:
        hosts.close()
