"""Cluster membership against a real etcd (kvcached.cluster.etcd): register, watch, leave, die,
etcd away and back, unproven registrations refused, mutual TLS (a replaced registration put back:
tests/reliability/test_membership.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import pytest

from kvcached.cluster.etcd import EtcdMembership, EtcdSettings
from kvcached.cluster.member import Member, member_fields, member_key
from kvcached.cluster.view import Change, MembershipView
from kvcached.peers.certs import make_cluster
from tests.certificates import Registrar
from tests.etcd_server import EtcdServer, etcd_binary

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (make system-deps)")]

LEASE_S = 2
PREFIX = "/kvcached-test"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


async def until(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> float:
    """Seconds until ``cond()`` holds; fails the test with ``what`` after ``timeout``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


class Node:
    """One daemon's membership, as the daemon keeps it, with every change it was told of."""

    def __init__(self, endpoint: str, name: str, registrar: Registrar, **tls: bytes) -> None:
        self.changes: list[Change] = []
        self.membership = EtcdMembership(EtcdSettings((endpoint,), prefix=PREFIX, lease_s=LEASE_S, **tls),
                                         Member(name, "127.0.0.1", 7400, 7400, 1 << 30, "test"),
                                         registrar.signer(name), MembershipView(PREFIX, registrar.verifier()),
                                         self.changes.append)

    @property
    def names(self) -> frozenset[str]:
        return self.membership.view.names


Start = Callable[[str], Awaitable[Node]]


@contextlib.asynccontextmanager
async def cluster(etcd: EtcdServer) -> AsyncIterator[Start]:
    """Start nodes on ``etcd`` as the test asks; each is stopped (lease revoked) at the end."""
    started: list[Node] = []
    registrar = Registrar(etcd.data.parent / "member-certs")

    async def start(name: str) -> Node:
        node = Node(etcd.endpoint, name, registrar)
        assert await node.membership.start(wait_s=10)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            await node.membership.stop()


def run(body: Callable[[Start], Awaitable[None]], etcd: EtcdServer) -> None:
    async def main() -> None:
        async with cluster(etcd) as start:
            await body(start)

    asyncio.run(main())


def test_daemons_register_and_see_each_other_join_and_leave(etcd: EtcdServer) -> None:
    async def body(nodes: Start) -> None:
        a = await nodes("node-a")
        b = await nodes("node-b")
        await until(lambda: a.names == {"node-a", "node-b"}, "a to see b join")
        await until(lambda: b.names == {"node-a", "node-b"}, "b to see a and itself")
        assert a.membership.view.members["node-b"] == b.membership.me
        started = time.monotonic()
        await b.membership.stop()                                   # a clean leave: the lease is revoked
        await until(lambda: a.names == {"node-a"}, "a to see b leave", timeout=LEASE_S)
        assert time.monotonic() - started < 1.0                     # at once, not a lease later
        assert [m.name for c in a.changes for m in c.left] == ["node-b"]

    run(body, etcd)


def test_a_dead_daemon_is_out_of_every_view_within_the_lease(etcd: EtcdServer) -> None:
    async def body(nodes: Start) -> None:
        a, b = await nodes("node-a"), await nodes("node-b")
        c = await nodes("node-c")
        await until(lambda: a.names == b.names == {"node-a", "node-b", "node-c"}, "all to see all")
        for task in c.membership._tasks:        # c dies: no refresh, no revoke, its client simply gone
            task.cancel()
        await c.membership._client.close()
        c.membership._client = None
        died = time.monotonic()
        await until(lambda: "node-c" not in a.names and "node-c" not in b.names, "c out of every view",
                    timeout=LEASE_S + 1)
        assert time.monotonic() - died <= LEASE_S + 1

    run(body, etcd)


def test_etcd_away_keeps_the_last_membership_and_recovers(etcd: EtcdServer) -> None:
    async def body(nodes: Start) -> None:
        a, b = await nodes("node-a"), await nodes("node-b")
        await until(lambda: a.names == b.names == {"node-a", "node-b"}, "a and b to see both")
        etcd.kill()
        await until(lambda: not a.membership.reachable, "a to notice etcd is away", timeout=LEASE_S * 3)
        await asyncio.sleep(LEASE_S * 1.5)                          # past the lease: nobody is dropped meanwhile
        assert a.names == b.names == {"node-a", "node-b"}
        etcd.start()
        await until(lambda: a.membership.reachable and b.membership.reachable, "etcd reachable again", timeout=15)
        c = await nodes("node-c")                                   # membership works again: a sees a newcomer
        await until(lambda: a.names == b.names == {"node-a", "node-b", "node-c"}, "a and b to see c", timeout=15)
        await until(lambda: c.names == {"node-a", "node-b", "node-c"}, "c to see all")

    run(body, etcd)


def test_a_lost_lease_is_registered_again(etcd: EtcdServer) -> None:
    async def body(nodes: Start) -> None:
        a, b = await nodes("node-a"), await nodes("node-b")
        await until(lambda: a.names == {"node-a", "node-b"}, "a to see b")
        await a.membership._client.lease.revoke(b.membership.lease_id)     # as if etcd had expired it
        await until(lambda: b.membership.counters.lease_losses == 1, "b to notice", timeout=LEASE_S * 2)
        await until(lambda: "node-b" in a.names and b.membership.counters.registrations == 2, "b back", timeout=LEASE_S * 2)

    run(body, etcd)


def test_a_registration_that_cannot_be_used_is_refused_and_counted(etcd: EtcdServer) -> None:
    async def body(nodes: Start) -> None:
        a = await nodes("node-a")
        client = a.membership._client
        await client.kv.put(member_key(PREFIX, "impostor"),                     # names another
                            json.dumps(member_fields(Member("node-z", "h", 1, 1))).encode())
        await client.kv.put(member_key(PREFIX, "garbage"), b"{not json")
        await until(lambda: a.membership.view.refused == 2, "both refused")
        assert a.names == {"node-a"}
        assert "names 'node-z'" in a.membership.view.refusals[member_key(PREFIX, "impostor")]

    run(body, etcd)


def test_registrations_that_do_not_prove_themselves_never_count(etcd: EtcdServer, tmp_path: Path) -> None:
    """Whoever can write etcd but holds no cluster certificate adds nobody: an unsigned
    registration (the old format), one signed under another CA, a real member's registration
    copied to a key of its own without the lease, and one whose lease is not the one it names,
    are each refused with its reason, on every daemon; the real member stays."""
    async def body(nodes: Start) -> None:
        a, b = await nodes("node-a"), await nodes("node-b")
        await until(lambda: a.names == b.names == {"node-a", "node-b"}, "a and b to see both")
        client = a.membership._client
        stranger = Registrar(tmp_path / "another-ca")
        lease = await client.lease.grant(LEASE_S * 5)
        unproven = {
            "node-x": json.dumps({**member_fields(Member("node-x", "127.0.0.1", 9, 9)), "v": 1}).encode(),
            "node-y": stranger.value(Member("node-y", "127.0.0.1", 9, 9), PREFIX, lease.ID),
        }
        for name, value in unproven.items():
            await client.kv.put(member_key(PREFIX, name), value, lease=lease.ID)
        copied = (await client.kv.get(member_key(PREFIX, "node-b"))).kvs[0].value
        await client.kv.put(member_key(PREFIX, "node-c"), copied.replace(b'"node-b"', b'"node-c"'))
        await until(lambda: a.membership.view.refused >= 3 and b.membership.view.refused >= 3, "all refused")
        refusals = a.membership.view.refusals
        assert "format 1" in refusals[member_key(PREFIX, "node-x")]
        assert "certificate" in refusals[member_key(PREFIX, "node-y")]
        assert "lease" in refusals[member_key(PREFIX, "node-c")]
        assert a.names == b.names == {"node-a", "node-b"}

    run(body, etcd)


def test_membership_over_mutual_tls(tmp_path: Path) -> None:
    asyncio.run(_mutual_tls(tmp_path))


async def _mutual_tls(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_cluster(certs, ["etcd", "node-a", "node-b"], extra_names={"etcd": ["127.0.0.1"]})
    server = EtcdServer(tmp_path / "etcd-tls", tls=(certs / "ca.pem", certs / "etcd.pem", certs / "etcd-key.pem"))
    server.start()
    try:
        ca = (certs / "ca.pem").read_bytes()
        registrar = Registrar(certs)
        a = Node(server.endpoint, "node-a", registrar, ca=ca, cert=(certs / "node-a.pem").read_bytes(),
                 key=(certs / "node-a-key.pem").read_bytes())
        assert await a.membership.start(wait_s=10)
        try:
            await until(lambda: a.names == {"node-a"}, "a to see itself registered")
            # no client certificate: etcd refuses, nothing is registered, the daemon says why
            b = Node(server.endpoint, "node-b", registrar, ca=ca)
            assert not await b.membership.start(wait_s=2)
            assert not b.membership.reachable and b.membership.counters.errors
            await b.membership.stop()
            assert a.names == {"node-a"}
        finally:
            await a.membership.stop()
    finally:
        server.stop()
