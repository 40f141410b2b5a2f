"""Membership and block location at 100, 300 and 1,000 daemons: the sans-I/O cluster logic
(kvcached.cluster) run for that many simulated daemons in one process, against a real etcd,
with the blocks and churn of a real trace, next to today's full-copy peer directory in the same run.

    python bench/bench_cluster.py [--quick] [--json PATH] [--nodes 100,300,1000] [--replicas 2] [--bits 18]
                                  [--lease-s 10] [--death-lease-s 3] [--deaths 3] [--minutes 30] [...]

Setup, per cluster size N (each flag has the default said here):

- Membership: one real etcd (tests/etcd_server.py, the Debian ``etcd`` binary) in a temp dir.
  Every simulated daemon registers ``{prefix}/members/{name}`` (kvcached.cluster.member.Member,
  encoded) on a lease of its own (``--lease-s`` 10: lease grant, then put) and refreshes it every
  lease_s / 3 (one keep-alive call each, as kvcached.cluster.etcd does; the first refresh of each
  at a random phase, as daemons that started at different times). The calls go over 4 etcd3aio
  clients (gRPC channels) rather than N: etcd does the same work per lease either way. 8 watchers
  (``--watchers``) each list the prefix and watch it through a kvcached.cluster.view.MembershipView,
  as a daemon does; they count watch events per membership change and tell when a dead daemon
  is out of their view. Registrations and watchers run in a process of their own (spawned): in
  the simulation's process, the simulation holding the GIL held the refreshes back (121
  keep-alives/s of the 300 due at 1,000 daemons) until leases ended.
- Placement: one kvcached.cluster.placement.Placement (``--replicas`` 2, ``--bits`` 18) built
  from the watchers' view, shared by every simulated daemon (they all see the same members).
- Daemons: each has a HomeRecords (its records as a home), a Publisher, a LookupPlan, a
  FrameDecoder (its inbound link) and an LRU set of the blocks it holds. Every message between
  two daemons is encoded by kvcached.peers.protocol.encode, then cut by the receiver's
  FrameDecoder and read by decode(): the bytes counted are real frames. Links are in memory and
  deliver whole frames at once, in order, so one decoder per receiver serves all its links.
- Blocks: the Mooncake conversation trace (``--trace``, ../shared/traces/conversation_trace.jsonl),
  its first ``--minutes`` 30 (the whole hour takes about twice as long: every frame goes
  through the Python codec, tens of microseconds each, and 1,000 daemons exchange about 4.4
  million in the half hour). A hash_id is a 512-token prefix block; its address is BLAKE3(id) at layer 0, its key
  the 36-byte wire key (digest | u32 layer, kvcached.peers.directory.wire_key). The trace is one
  service's traffic: N daemons serve ceil(N / ``--nodes-per-copy``) copies of it (100: a copy
  per 100 daemons), each copy with its own block ids (independent tenants), so the load and the
  population per daemon are the same at every N, and the growth from 100 to 1,000 shows the
  scheme, not a change of load. Copy k is replayed from k / copies of the way into the window
  (wrapping around): aligned copies would interleave in a fixed order, and round robin over a
  multiple of the copies would pin each copy to a fixed subset of the daemons.
- Routing: round robin over the live daemons, request by request. Not by a hash of the prefix:
  every request of this trace starts with the same block (id 0), so a hash of the first block
  sends them all to one daemon, and hashing a longer prefix would be a constant fitted to this
  trace. Round robin is the case the location service is for: a conversation's earlier turns
  are on other daemons, so nearly every request looks its prefix up.
- Holding: each daemon keeps at most ``capacity`` blocks, LRU, set so that the whole cluster
  could hold ``--cluster-share`` 0.5 of the distinct blocks replayed (a cache that holds
  everything never evicts, one that holds little is all misses; at half, the LRUs fill early
  and evict through the rest of the replay, so drops are exercised about as much as gains).
- Each request, at its daemon: the blocks of the request the daemon does not hold (the first
  ``--lookup-max`` 64) are looked up: LookupPlan.plan names the homes, one Locate frame goes to
  each, the home answers Located from its HomeRecords. The homes are asked in parallel: one
  round trip. Then the daemon holds all the request's blocks (pulled or computed), evicting
  the least recently used beyond its capacity; gains and drops go into its Publisher, and every
  ``--flush-ms`` 50 ms of trace time each daemon with news sends an Announce and/or a Drop frame
  to each home due some, applied to that home's HomeRecords. The clock is the trace's, passed
  in; no wall time enters the logic.
- Correctness: "truly holds" = held at the daemon's last announcement flush (a block gained
  since is not announced yet, by design). For each block looked up that live daemons truly
  hold, the answer must name every one of them (a block held by more than MAX_HOLDERS: a full
  answer naming some of them). Outside a membership change this must be 100%, and after the
  replay every record of every live holder is checked at every home of its bucket.
- Death (``--deaths`` 3 daemons at once, ``--kill-at`` 70% into the replay): each victim is
  registered anew on a ``--death-lease-s`` 3 s lease (how long a dead daemon lingers depends on
  its own lease alone; this keeps the run short), then never refreshed nor revoked: a SIGKILL
  right after a refresh, the worst case. Detection = wall time from that lease's grant to the
  last watcher's view without the victim. Meanwhile the replay goes on in trace time for as
  long as detection took, with the victims gone: Locates to them go unanswered (LookupPlan asks
  the first usable home, and the view still lists them). Then the change, at that trace time:
  Placement.set_members -> moves; every home forgets the dead (HomeRecords.forget); every
  LookupPlan takes the moves (LookupPlan.moved: the old homes are asked too for the grace);
  blocks of moved buckets are looked up before the holders re-publish (``--move-checks`` of
  them); then every holder queues its blocks of moved buckets for their new homes
  (Publisher.moved), sent at once, and every record of every live holder is checked at every
  current home of its bucket. Time to converge = detection + one flush interval (the
  re-publication goes out at the next flush) + the largest work of one daemon for the change
  (they work in parallel; the serial sum over every simulated daemon is printed too). The
  grace ends ``--grace-s`` later in trace time (LookupPlan.expire, and HomeRecords.keep_buckets
  on homes that lost buckets).

Baselines, in the same run:
- Today's scheme (kvcached.peers.directory.PeerDirectory): every daemon keeps every other
  daemon's blocks and announces each gain and drop to N - 1 peers. Memory per daemon: a
  PeerDirectory filled with every distinct block the cluster holds, measured as ours is (one
  daemon's worth; PeerDirectory takes at most 62 peers, so holders are folded onto 62 bits: at
  N > 62 the real masks would be wider, so this understates it). Messages: analytic, from the
  same churn: each gain and each drop x (N - 1) entries; frames: each daemon's flush with gains
  (with drops) x (N - 1); bytes: 36 per entry + 16 per frame. Lookup: PeerDirectory.holders of
  the same keys, local (no round trip).
- etcd: writes per second while replaying against the same with no block traffic, and against
  N x 3 / lease_s (one refresh per lease every third of it).

Measured how:
- Record bytes: tracemalloc around filling a fresh HomeRecords with exactly the records of a
  home (the busiest, and 16 sampled for the bytes of one record), each key made anew inside
  the traced span as the decoder makes it: Python's own allocations (dict, keys, holder
  tuples), not malloc's overhead. A dict's table grows in powers of two, so a home's bytes
  move in steps; the records are printed beside them.
- Lookup time: perf_counter around plan + encode of every Locate + each home's decode, locate
  and Located encode + the asker's decode of every answer: CPU work, one home after another
  here, no network time.
- etcd writes: every grant, put, keep-alive and revoke the fleet sent, at its answer's time.

Targets (issue 24):
- location memory per daemon at 1,000 daemons: the busiest <= 1.2x (distinct blocks held x
  replicas / N) x the bytes of one record (checked in bytes, and in records alone);
- messages per block gained <= replicas + 1, independent of N. Counted in entries (one block
  told to one home; a frame carries many): Announce entries per block gained, and the same
  bound for Drop entries per block dropped. Frames are printed beside them (at most the
  entries: at this trace's rate a daemon gets a request every half minute or so, so a flush
  carries about one request's news and batching saves little);
- a dead daemon out of every watcher's view within lease + 1 s;
- etcd writes per second independent of the block rate: within 15% of idle while replaying
  (nothing per block is ever written);
- every block truly held found by its lookup outside membership changes (100%), during a
  move every block of a bucket that kept a live old home, and no record missing after it.

Watch events are counted per watcher: a join is one put, a death one delete. The victims'
re-registration on the short lease is one put each that changes no view (a step of this bench,
not of a death); it is left out of the events per death.

--quick: 100 and 300 daemons, the first 10 minutes of the trace, 4 watchers (under a minute).
Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence, TypeVar

import blake3
from etcd3aio import Etcd3Client, prefix_range_end

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from bench_core import Row, progress  # noqa: E402

from kvcached.cluster.location import MOVE_GRACE_S, HomeRecords, LookupPlan, Publisher  # noqa: E402
from kvcached.cluster.member import Member, member_key, members_prefix  # noqa: E402
from kvcached.cluster.placement import Move, Placement  # noqa: E402
from kvcached.cluster.proof import RegistrationSigner, RegistrationVerifier  # noqa: E402
from kvcached.cluster.view import Change, MembershipView  # noqa: E402
from kvcached.peers.certs import CA_CERT, create_ca, issue_node  # noqa: E402
from kvcached.peers.directory import PeerDirectory, wire_key  # noqa: E402
from kvcached.peers.protocol import (  # noqa: E402
    HEADER,
    MAX_BATCH,
    MAX_HOLDERS,
    Announce,
    Drop,
    Frame,
    Locate,
    Located,
    Message,
    decode,
    encode,
)
from kvcached.peers.stream import FrameDecoder  # noqa: E402
from tests.etcd_server import EtcdServer, etcd_binary  # noqa: E402

T = TypeVar("T")

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
DIGEST_DOMAIN = b"kvcached-bench-block\x00"     # a block's digest: BLAKE3(domain | u64 trace id)
COPY_STRIDE = 1 << 32                            # block ids of trace copy k: k * stride + hash_id
ADDRESS_BYTES = 36                               # one entry of Announce / Drop / Locate: digest + u32 layer
FRAME_OVERHEAD = HEADER.size + 4                 # a frame's header and its u32 entry count
MEMORY_TARGET = 1.2                              # busiest daemon's records / the even share
WRITES_SPREAD = 0.15                             # etcd writes/s replaying vs idle
RECORD_SAMPLE = 16                               # homes whose records are measured for the mean record size
REGISTER_CLIENTS = 4                             # etcd3aio clients (gRPC channels) the registrations share
REGISTER_CONCURRENCY = 64
_LAYER = struct.Struct("<I")


def block_key(block: int) -> bytes:
    """The wire key of trace block ``block`` (layer 0)."""
    return wire_key(blake3.blake3(DIGEST_DOMAIN + block.to_bytes(8, "little")).digest(), 0)


def address_of(key: bytes) -> tuple[bytes, int]:
    """(digest, layer) of a wire key: an entry of Locate, Announce and Drop."""
    return key[:32], _LAYER.unpack_from(key, 32)[0]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank); nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# =============================================================================================
# the trace


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the replay."""

    at_s: float                  # trace time
    blocks: tuple[int, ...]      # prefix blocks, in order (ids made distinct per trace copy)


def load_trace(path: Path, minutes: float) -> list[tuple[float, tuple[int, ...]]]:
    """(arrival s, hash_ids) of the trace's requests in its first ``minutes``, in time order."""
    rows = []
    limit_ms = minutes * 60_000
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            if doc["timestamp"] >= limit_ms:
                continue
            rows.append((doc["timestamp"] / 1000.0, tuple(doc["hash_ids"])))
    rows.sort(key=lambda row: row[0])
    return rows


def replay(rows: Sequence[tuple[float, tuple[int, ...]]], copies: int) -> list[Request]:
    """``copies`` copies of the trace, each with its own block ids, merged in time order. Copy k
    is replayed from k / copies of the way into the window, wrapping around: aligned copies
    would interleave in a fixed order, and round robin over a multiple of ``copies`` daemons
    would then pin each copy to a fixed 1 / copies of them."""
    start, end = rows[0][0], rows[-1][0]
    span = end - start + 1e-3
    out = []
    for copy in range(copies):
        shift = copy * span / copies
        for at, ids in rows:
            out.append(Request(start + (at - start - shift) % span, tuple(copy * COPY_STRIDE + i for i in ids)))
    out.sort(key=lambda r: r.at_s)
    return out


# =============================================================================================
# etcd: N registrations, their leases kept alive, and W watching views (a process of their own)


def member_of(index: int) -> Member:
    """Simulated daemon ``index``'s registration (its name is its certificate name)."""
    return Member(f"node-{index:04d}", f"10.{index >> 16}.{(index >> 8) & 255}.{index & 255}", 7400, 7401,
                  64 << 30, "bench")


@dataclass
class Write:
    at: float                    # time.monotonic() of the answer
    kind: str                    # grant, put, keepalive, revoke


class EtcdFleet:
    """The simulated daemons' side of etcd: their registrations and leases, and the watchers.
    It runs in a process of its own (:class:`FleetProcess`): in the simulation's process, the
    simulation holding the GIL held back the refreshes (121 keep-alives/s of the 300 due, at
    1,000 daemons) until leases ended. Its coroutines run on an event loop in a thread of that
    process; the public methods are synchronous (each runs one coroutine there and waits), and
    are the commands the simulation sends."""

    def __init__(self, endpoint: str, prefix: str, lease_s: int, watchers: int, seed: int) -> None:
        self.endpoint, self.prefix, self.lease_s = endpoint, prefix, lease_s
        self.members_prefix = members_prefix(prefix)
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="etcd-fleet", daemon=True)
        self.thread.start()
        self.clients: list[Any] = []
        self.watch_clients: list[Any] = []
        # Registrations prove themselves as the daemons' do (kvcached.cluster.proof): a cluster CA,
        # a certificate per simulated daemon (made when it first registers), a verifier per view.
        self.certs = Path(tempfile.mkdtemp(prefix="kvcbench-cluster-certs-"))
        create_ca(self.certs)
        self.signers: dict[str, RegistrationSigner] = {}
        ca_pem = (self.certs / CA_CERT).read_bytes()
        self.views = [MembershipView(prefix, RegistrationVerifier(ca_pem)) for _ in range(watchers)]
        self.events = [0] * watchers                             # watch events taken, per watcher
        self.deletes = [0] * watchers                            # ... of them deletes (a lease ended)
        self.changes = [0] * watchers                            # members joined + left + updated, per watcher
        self.left_at: list[dict[str, float]] = [{} for _ in range(watchers)]
        self.leases: dict[str, int] = {}
        self.members: dict[str, Member] = {}
        self.writes: list[Write] = []
        self.lost_leases = 0                                     # refreshes that found the lease gone (must be 0)
        self.errors: list[str] = []
        self._refresh: dict[str, asyncio.Task[None]] = {}
        self._watch: list[asyncio.Task[None]] = []
        self._listed = 0

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def _wrote(self, kind: str) -> None:
        self.writes.append(Write(time.monotonic(), kind))

    # -- the commands --

    def open(self) -> None:
        self._call(self._open())

    def register(self, count: int) -> None:
        self._call(self._register([member_of(i) for i in range(count)]))

    def wait_members(self, count: int, timeout: float) -> bool:
        return self._call(self._wait_members(count, timeout), timeout + 30)

    def counts(self) -> tuple[list[int], list[int], list[int]]:
        """(events, membership changes, delete events) per watcher, now."""
        return self._call(self._counts())

    def view_names(self, index: int = 0) -> frozenset[str]:
        return self._call(self._view_names(index))

    def kill(self, names: Sequence[str], lease_s: int) -> dict[str, float]:
        return self._call(self._kill(names, lease_s))

    def wait_gone(self, names: Sequence[str], timeout: float) -> dict[str, float]:
        return self._call(self._wait_gone(names, timeout), timeout + 30)

    def writes_between(self, start: float, end: float) -> int:
        """The writes (grant, put, keep-alive, revoke) answered in [start, end), monotonic time."""
        return sum(1 for w in list(self.writes) if start <= w.at < end)

    def close(self) -> dict[str, Any]:
        """Revoke what is left, stop; returns the fleet's counters."""
        revoked = self._call(self._close())
        return {"revoked_at_end": revoked, "lost_leases": self.lost_leases, "errors": self.errors[:10],
                "writes_by_kind": {k: sum(1 for w in self.writes if w.kind == k)
                                   for k in ("grant", "put", "keepalive", "revoke")}}

    # -- setup and teardown --

    async def _open(self) -> None:
        for _ in range(REGISTER_CLIENTS):
            client = Etcd3Client([self.endpoint], rpc_max_attempts=1)
            await client.connect()
            self.clients.append(client)
        for index in range(len(self.views)):
            client = Etcd3Client([self.endpoint], rpc_max_attempts=1)
            await client.connect()
            self.watch_clients.append(client)
            self._watch.append(asyncio.ensure_future(self._watch_loop(index)))
        while self._listed < len(self.views):
            await asyncio.sleep(0.01)

    async def _close(self) -> int:
        """Stop refreshing, revoke every lease left, stop the watchers; returns the revokes."""
        for task in list(self._refresh.values()):
            task.cancel()
        await asyncio.gather(*self._refresh.values(), return_exceptions=True)
        self._refresh.clear()
        leases = list(self.leases.values())
        self.leases.clear()
        gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

        async def revoke(index: int, lease: int) -> None:
            async with gate:
                try:
                    await self.clients[index % len(self.clients)].lease.revoke(lease, timeout=10)
                except Exception:       # gone already (expired): nothing to revoke
                    pass
        await asyncio.gather(*(revoke(i, lease) for i, lease in enumerate(leases)))
        for task in self._watch:
            task.cancel()
        await asyncio.gather(*self._watch, return_exceptions=True)
        for client in self.clients + self.watch_clients:
            await client.close()
        return len(leases)

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        shutil.rmtree(self.certs, ignore_errors=True)

    def _value(self, member: Member, lease: int) -> bytes:
        """``member``'s registration for ``lease``, signed with its own certificate's key."""
        signer = self.signers.get(member.name)
        if signer is None:
            cert, key = issue_node(self.certs, member.name)
            signer = self.signers[member.name] = RegistrationSigner(cert.read_bytes(), key.read_bytes())
        return signer.value(member, member_key(self.prefix, member.name), lease)

    # -- registrations and leases --

    async def _register(self, members: Sequence[Member]) -> None:
        """Each member: a lease of its own, its registration put on it, refreshed from then on."""
        gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

        async def one(index: int, member: Member) -> None:
            client = self.clients[index % len(self.clients)]
            async with gate:
                lease = await client.lease.grant(self.lease_s, timeout=10)
                self._wrote("grant")
                await client.kv.put(member_key(self.prefix, member.name), self._value(member, lease.ID), lease=lease.ID,
                                    timeout=10)
                self._wrote("put")
            self.leases[member.name], self.members[member.name] = lease.ID, member
            phase = self.rng.uniform(0, self.lease_s / 3)
            self._refresh[member.name] = asyncio.ensure_future(self._refresh_loop(client, member.name, lease.ID, phase))
        await asyncio.gather(*(one(i, m) for i, m in enumerate(members)))

    async def _refresh_loop(self, client: Any, name: str, lease: int, phase: float) -> None:
        """Refresh ``lease`` every lease_s / 3, as kvcached.cluster.etcd does (one keep-alive call each)."""
        await asyncio.sleep(phase)
        while True:
            call = client.lease.keep_alive(lease)
            ttl: int | None = None
            try:
                async with asyncio.timeout(self.lease_s / 3):
                    async for response in call:
                        ttl = int(response.TTL)
                        break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors.append(f"keep-alive of {name}: {exc}")
            finally:
                call.cancel()
            self._wrote("keepalive")
            if ttl is not None and ttl <= 0:      # etcd says the lease is gone
                self.lost_leases += 1
                return
            await asyncio.sleep(self.lease_s / 3)

    async def _kill(self, names: Sequence[str], lease_s: int) -> dict[str, float]:
        """Each of ``names`` registered anew on a ``lease_s`` lease, which is then never refreshed
        nor revoked (the old lease is revoked: the key is on the new one). Returns, per name,
        when the new lease was granted: its death, right after its last refresh."""
        died: dict[str, float] = {}

        async def one(name: str) -> None:
            task = self._refresh.pop(name)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            client = self.clients[0]
            lease = await client.lease.grant(lease_s, timeout=10)
            died[name] = time.monotonic()
            self._wrote("grant")
            await client.kv.put(member_key(self.prefix, name), self._value(self.members[name], lease.ID), lease=lease.ID,
                                timeout=10)
            self._wrote("put")
            try:
                await client.lease.revoke(self.leases.pop(name), timeout=10)
            except Exception as exc:          # the old lease ended already: nothing is attached to it now
                self.errors.append(f"revoke of {name}'s old lease: {exc}")
            self._wrote("revoke")
        await asyncio.gather(*(one(n) for n in names))
        return died

    # -- the watchers --

    async def _watch_loop(self, index: int) -> None:
        """List the members prefix, then watch it from the next revision, as kvcached.cluster.etcd does."""
        client, view = self.watch_clients[index], self.views[index]
        end = prefix_range_end(self.members_prefix.encode())
        listing = await client.kv.get(self.members_prefix, end, timeout=10)
        self._note(index, view.reset([(kv.key.decode(), kv.value, int(kv.lease)) for kv in listing.kvs],
                                     listing.header.revision))
        self._listed += 1
        async for response in client.watch.watch(self.members_prefix, end, start_revision=view.revision + 1,
                                                 progress_notify=True):
            for event in response.events:
                self.events[index] += 1
                kv = event.kv
                if event.type == event.DELETE:
                    self.deletes[index] += 1
                    change = view.delete(kv.key.decode(), kv.mod_revision)
                else:
                    change = view.put(kv.key.decode(), kv.value, int(kv.lease), kv.mod_revision)
                self._note(index, change)

    def _note(self, index: int, change: Change) -> None:
        self.changes[index] += len(change.joined) + len(change.left) + len(change.updated)
        now = time.monotonic()
        for member in change.left:
            self.left_at[index][member.name] = now

    async def _counts(self) -> tuple[list[int], list[int], list[int]]:
        return list(self.events), list(self.changes), list(self.deletes)

    async def _view_names(self, index: int = 0) -> frozenset[str]:
        return self.views[index].names

    async def _wait_members(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(len(v.members) == count for v in self.views):
                return True
            await asyncio.sleep(0.01)
        return False

    async def _wait_gone(self, names: Sequence[str], timeout: float) -> dict[str, float]:
        """Per name, when the last watcher saw it leave (missing: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(n in seen for seen in self.left_at for n in names):
            await asyncio.sleep(0.005)
        return {n: max(seen[n] for seen in self.left_at) for n in names if all(n in seen for seen in self.left_at)}


def fleet_main(conn: Connection, endpoint: str, prefix: str, lease_s: int, watchers: int, seed: int) -> None:
    """The fleet process: run the commands that come over ``conn`` until "stop" (or the pipe closes)."""
    fleet = EtcdFleet(endpoint, prefix, lease_s, watchers, seed)
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:
                break
            if command == "stop":
                break
            try:
                conn.send(("ok", getattr(fleet, command)(*args)))
            except Exception as exc:
                conn.send(("error", f"{command}: {type(exc).__name__}: {exc}"))
    finally:
        fleet.shutdown()


class FleetProcess:
    """An :class:`EtcdFleet` in a spawned process; :meth:`ask` runs one of its commands."""

    def __init__(self, endpoint: str, prefix: str, lease_s: int, watchers: int, seed: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.proc = context.Process(target=fleet_main, args=(child, endpoint, prefix, lease_s, watchers, seed),
                                    name="etcd-fleet", daemon=True)
        self.proc.start()
        child.close()

    def ask(self, command: str, *args: Any, timeout: float = 120.0) -> Any:
        self.conn.send((command, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"etcd fleet: no answer to {command} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"etcd fleet: {value}")
        return value

    def stop(self) -> None:
        try:
            self.conn.send(("stop", ()))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


# =============================================================================================
# the simulated cluster


@dataclass
class Traffic:
    """Location messages over the in-memory links: entries (one block told to one home), frames, bytes."""

    announce_entries: int = 0
    announce_frames: int = 0
    drop_entries: int = 0
    drop_frames: int = 0
    bytes: int = 0
    local_entries: int = 0       # the holder is itself a home of the block: applied in place, no message
    lost_entries: int = 0        # sent to a home that had died (still in the view)


@dataclass
class LookupStats:
    """Lookups of one phase: per lookup the remote homes asked, bytes, seconds; per key the check."""

    homes: list[int] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    seconds_full: list[float] = field(default_factory=list)     # lookups of a full --lookup-max prefix
    keys: int = 0
    held: int = 0                # keys some live daemon truly holds
    found: int = 0               # ... and the answer named every one of them (a full answer: MAX_HOLDERS of them)
    held_unanswered: int = 0     # ... and the only home asked had died (still in the view): no answer
    stale: int = 0               # names in answers that do not truly hold the key (a dead daemon not yet out)
    unanswered: int = 0          # keys asked of a home that had died (still in the view)

    @property
    def found_rate(self) -> float:
        return self.found / self.held if self.held else float("nan")

    @property
    def found_rate_answered(self) -> float:
        """Found, of the blocks held whose home answered."""
        answered = self.held - self.held_unanswered
        return self.found / answered if answered else float("nan")


@dataclass
class Churn:
    """What the daemons' LRUs did over the replay."""

    gains: int = 0               # blocks that came into a daemon's LRU
    drops: int = 0               # blocks evicted
    dropped_unannounced: int = 0  # ... of them gained since the last flush: a Drop goes out for a block never announced
    flushes_gaining: int = 0     # daemon flushes with at least one gain (the baseline's frames)
    flushes_dropping: int = 0
    requests: int = 0


class SimNode:
    """One simulated daemon: its blocks (LRU), its records as a home, its publisher and lookup plan."""

    __slots__ = ("index", "name", "alive", "held", "publisher", "plan", "records", "inbox", "unflushed")

    def __init__(self, index: int, name: str, placement: Placement, grace_s: float) -> None:
        self.index, self.name, self.alive = index, name, True
        self.held: OrderedDict[bytes, None] = OrderedDict()          # oldest first
        self.publisher = Publisher(name, placement)
        self.plan = LookupPlan(placement, grace_s)
        self.records = HomeRecords(placement.bucket_of_key)
        self.inbox = FrameDecoder()
        self.unflushed: dict[bytes, bool] = {}                      # since the last flush: key -> held


def carry(frame: bytes, inbox: FrameDecoder) -> Message:
    """Deliver one whole frame over an in-memory link: the receiver's decoder cuts it, decode() reads it."""
    inbox.feed(frame)
    event = inbox.next_event()
    if not isinstance(event, Frame) or inbox.buffered:
        raise RuntimeError(f"link: expected one whole frame, got {event!r} with {inbox.buffered} bytes left")
    return decode(event)


@dataclass
class ChangeReport:
    """One membership change (daemons died) as the simulation applied it."""

    moved_buckets: int
    forgotten: int                       # records the homes dropped (holders gone)
    republished: Traffic                 # Publisher.moved announcements to the new homes
    serial_s: float                      # the work of every daemon for the change, one after another
    max_node_s: float                    # the largest work of one daemon (they work in parallel)
    converged_violations: int            # (block, holder, home) records missing after re-publication
    records_checked: int


class Simulation:
    """N daemons driven by the trace, the clock passed in (trace seconds). See the module."""

    def __init__(self, names: Sequence[str], capacity: int, replicas: int, bits: int, flush_s: float,
                 grace_s: float, lookup_max: int) -> None:
        self.placement = Placement(replicas, bits)
        started = time.perf_counter()
        self.placement.set_members(names)
        self.placement_build_s = time.perf_counter() - started
        self.nodes = [SimNode(i, name, self.placement, grace_s) for i, name in enumerate(names)]
        self.by_name = {n.name: n for n in self.nodes}
        self.view: set[str] = set(names)                 # the members every daemon acts on
        self.capacity, self.flush_s, self.grace_s, self.lookup_max = capacity, flush_s, grace_s, lookup_max
        self.truth: dict[bytes, tuple[int, ...]] = {}     # key -> the live daemons that announced it (in order)
        self.keys: dict[int, bytes] = {}                 # trace block -> wire key
        self.dirty: dict[int, SimNode] = {}
        self.next_flush = flush_s
        self.route: list[SimNode] = list(self.nodes)
        self.turn = 0
        self.request_id = 0
        self.traffic = Traffic()
        self.churn = Churn()
        self.lookups: dict[str, LookupStats] = {}
        self.phase = "steady"
        self.recent_lookups: list[list[bytes]] = []      # key lists of some lookups, for the baseline's timing
        self.grace_due: float | None = None
        self.losers: set[str] = set()                    # homes that lost buckets in the last change

    # -- blocks --

    def key_of(self, block: int) -> bytes:
        key = self.keys.get(block)
        if key is None:
            key = self.keys[block] = block_key(block)
        return key

    def _truth(self, key: bytes, index: int, held: bool) -> None:
        have = self.truth.get(key, ())
        if held:
            if index not in have:
                self.truth[key] = have + (index,)
        elif index in have:
            rest = tuple(i for i in have if i != index)
            if rest:
                self.truth[key] = rest
            else:
                del self.truth[key]

    # -- the replay --

    def run(self, requests: Sequence[Request], until_s: float | None = None) -> int:
        """Replay requests from the front of ``requests`` while they arrive before ``until_s``;
        returns how many were replayed."""
        done = 0
        for request in requests:
            if until_s is not None and request.at_s >= until_s:
                break
            self.request(request)
            done += 1
        return done

    def request(self, request: Request) -> None:
        now = request.at_s
        self.advance(now)
        node = self.route[self.turn % len(self.route)]
        self.turn += 1
        self.churn.requests += 1
        keys = [self.key_of(b) for b in request.blocks]
        held = node.held
        missing = [k for k in keys if k not in held][:self.lookup_max]
        if missing:
            self.lookup(node, missing, now)
        changes: dict[bytes, bool] = {}
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
                changes[key] = True
                self.churn.gains += 1
        while len(held) > self.capacity:
            key, _ = held.popitem(last=False)
            if changes.get(key) or node.unflushed.get(key):
                self.churn.dropped_unannounced += 1
            changes[key] = False
            self.churn.drops += 1
        if changes:
            node.unflushed.update(changes)
            node.publisher.changed(changes)
            self.dirty[node.index] = node

    def advance(self, now: float) -> None:
        """Trace time is ``now``: the flushes due before it go out, the grace that ended expires."""
        if now >= self.next_flush:
            self.flush_all()
            self.next_flush = (math.floor(now / self.flush_s) + 1) * self.flush_s
        if self.grace_due is not None and now >= self.grace_due:
            self.expire(now)

    def flush_all(self) -> None:
        for node in self.dirty.values():
            if node.alive:
                self.flush(node, self.traffic)
        self.dirty.clear()

    def flush(self, node: SimNode, traffic: Traffic) -> None:
        gaining = dropping = False
        for key, held in node.unflushed.items():
            self._truth(key, node.index, held)
            gaining |= held
            dropping |= not held
        node.unflushed.clear()
        self.churn.flushes_gaining += gaining
        self.churn.flushes_dropping += dropping
        for home in node.publisher.due():
            self.deliver(node, home, node.publisher.take(home), traffic)

    def deliver(self, sender: SimNode, home_name: str, batch: dict[bytes, bool], traffic: Traffic) -> None:
        """``sender``'s news for one home: an Announce and/or a Drop frame (split at MAX_BATCH)."""
        home = self.by_name[home_name]
        gained = [k for k, held in batch.items() if held]
        dropped = [k for k, held in batch.items() if not held]
        if home is sender:
            home.records.gained(sender.name, gained)
            home.records.dropped(sender.name, dropped)
            traffic.local_entries += len(batch)
            return
        if not home.alive:
            traffic.lost_entries += len(batch)
            return
        for keys, announce in ((gained, True), (dropped, False)):
            for start in range(0, len(keys), MAX_BATCH):
                part = keys[start:start + MAX_BATCH]
                addresses = [address_of(k) for k in part]
                frame = encode(Announce(addresses) if announce else Drop(addresses))
                message = carry(frame, home.inbox)
                if not isinstance(message, (Announce, Drop)):
                    raise RuntimeError(f"link: sent an announcement, {type(message).__name__} came out")
                wire = [wire_key(d, layer) for d, layer in message.addresses]
                traffic.bytes += len(frame)
                if announce:
                    home.records.gained(sender.name, wire)
                    traffic.announce_entries += len(part)
                    traffic.announce_frames += 1
                else:
                    home.records.dropped(sender.name, wire)
                    traffic.drop_entries += len(part)
                    traffic.drop_frames += 1

    # -- lookups --

    def lookup(self, node: SimNode, keys: list[bytes], now: float) -> None:
        stats = self.lookups.setdefault(self.phase, LookupStats())
        started = time.perf_counter()
        asks = node.plan.plan(keys, self.view.__contains__, now)
        named: dict[bytes, set[str]] = {}
        silent: set[bytes] = set()
        remote = sent = 0
        for home_name, asked in asks.items():
            if home_name == node.name:
                answers: Sequence[Sequence[str]] = node.records.locate(asked)
            else:
                remote += 1
                self.request_id += 1
                request = encode(Locate([address_of(k) for k in asked]), self.request_id)
                sent += len(request)
                home = self.by_name[home_name]
                if not home.alive:                   # no answer: the asker times out on these keys
                    stats.unanswered += len(asked)
                    silent.update(asked)
                    continue
                message = carry(request, home.inbox)
                if not isinstance(message, Locate):
                    raise RuntimeError(f"link: sent a Locate, {type(message).__name__} came out")
                wanted = [wire_key(d, layer) for d, layer in message.addresses]
                holders = [h[:MAX_HOLDERS] for h in home.records.locate(wanted)]
                answer = encode(Located(holders), self.request_id)
                sent += len(answer)
                located = carry(answer, node.inbox)
                if not isinstance(located, Located):
                    raise RuntimeError(f"link: sent a Located, {type(located).__name__} came out")
                answers = located.holders
            for key, names in zip(asked, answers):
                if names:
                    named.setdefault(key, set()).update(names)
        elapsed = time.perf_counter() - started
        stats.homes.append(remote)
        stats.bytes.append(sent)
        stats.seconds.append(elapsed)
        if len(keys) == self.lookup_max:
            stats.seconds_full.append(elapsed)
        if len(self.recent_lookups) < 4096:
            self.recent_lookups.append(keys)
        self.check(keys, named, silent, stats)

    def check(self, keys: Sequence[bytes], named: dict[bytes, set[str]], silent: set[bytes], stats: LookupStats) -> None:
        """Compare the answers with what live daemons truly hold (announced at their last flush):
        found = every true holder named, or (more than MAX_HOLDERS of them) a full answer naming
        at least one. ``silent``: keys asked of a home that never answered."""
        nodes = self.nodes
        for key in keys:
            stats.keys += 1
            names = named.get(key, set())
            truly = {nodes[i].name for i in self.truth.get(key, ())}
            stats.stale += len(names - truly)
            if not truly:
                continue
            stats.held += 1
            if truly <= names or (len(truly) > MAX_HOLDERS and len(names) >= MAX_HOLDERS and names & truly):
                stats.found += 1
            elif key in silent and not names:
                stats.held_unanswered += 1

    # -- membership changes --

    def kill(self, names: Sequence[str], now: float) -> None:
        """``names`` die at trace time ``now``: their blocks and records are gone; they stay in
        the view (and in the placement) until etcd says they left."""
        self.advance(now)
        self.flush_all()
        for name in names:
            node = self.by_name[name]
            node.alive = False
            for key in node.held:
                self._truth(key, node.index, False)
            node.held.clear()
            node.unflushed.clear()
        self.route = [n for n in self.nodes if n.alive]

    def apply_change(self, members: frozenset[str], now: float, move_checks: int, rng: random.Random) -> ChangeReport:
        """The view is now ``members`` (at trace time ``now``): moves, forgets, the lookups during
        the move checked, re-publication to the new homes, then every record checked."""
        self.advance(now)
        self.flush_all()
        gone = self.view - members
        per_node: dict[int, float] = {}
        started = time.perf_counter()
        moves = self.placement.set_members(members)
        placement_s = time.perf_counter() - started
        self.view = set(members)
        live = [n for n in self.nodes if n.alive]
        forgotten = 0
        for node in live:
            t0 = time.perf_counter()
            for name in gone:
                forgotten += node.records.forget(name)
                node.publisher.forget_home(name)
            node.plan.moved(moves, now)
            per_node[node.index] = time.perf_counter() - t0
        self.losers = {h for m in moves for h in m.old if h not in m.new and h in self.view}
        self.grace_due = now + self.grace_s
        keyed = [(key, self.placement.bucket_of_key(key)) for key in self.truth]
        self.check_move_window(moves, keyed, now, move_checks, rng)
        republished = Traffic()
        for node in live:
            t0 = time.perf_counter()
            node.publisher.moved(moves, node.held.keys())
            for home in node.publisher.due():
                self.deliver(node, home, node.publisher.take(home), republished)
            per_node[node.index] += time.perf_counter() - t0
        violations, checked = self.check_records(keyed)
        serial = placement_s + sum(per_node.values())
        return ChangeReport(len(moves), forgotten, republished, serial, placement_s + max(per_node.values()),
                            violations, checked)

    def check_move_window(self, moves: Sequence[Move], keyed: Sequence[tuple[bytes, int]], now: float, limit: int,
                          rng: random.Random) -> None:
        """Lookups of blocks of moved buckets before the holders re-published: from random live
        daemons, in lookups of up to lookup_max keys. Phase "move": buckets that kept a live old
        home; phase "orphaned": buckets whose every old home died (their records are back only
        once the holders re-publish)."""
        orphaned = {m.bucket for m in moves if not any(self.by_name[h].alive for h in m.old)}
        moved = {m.bucket for m in moves}
        keys = [key for key, bucket in keyed if bucket in moved]
        rng.shuffle(keys)
        keys = keys[:limit]
        buckets = dict(keyed)
        phase = self.phase
        live = [n for n in self.nodes if n.alive]
        for name, wanted in (("move", [k for k in keys if buckets[k] not in orphaned]),
                             ("orphaned", [k for k in keys if buckets[k] in orphaned])):
            self.phase = name
            for start in range(0, len(wanted), self.lookup_max):
                asker = rng.choice(live)
                group = [k for k in wanted[start:start + self.lookup_max] if k not in asker.held]
                if group:
                    self.lookup(asker, group, now)
        self.phase = phase

    def check_records(self, keyed: Sequence[tuple[bytes, int]]) -> tuple[int, int]:
        """Every (block, live holder) at every current home of its bucket; returns (missing, checked)."""
        missing = checked = 0
        nodes, homes_of = self.nodes, self.placement.homes_of
        for key, bucket in keyed:
            truly = {nodes[i].name for i in self.truth[key]}
            for home in homes_of(bucket):
                checked += len(truly)
                missing += len(truly - set(self.by_name[home].records.holders(key, limit=None)))
        return missing, checked

    def expire(self, now: float) -> None:
        """The move's grace is over: the plans forget it, homes drop buckets they no longer home."""
        for node in self.nodes:
            if not node.alive:
                continue
            node.plan.expire(now)
            if node.name in self.losers:
                name, homes_of = node.name, self.placement.homes_of
                node.records.keep_buckets(lambda bucket: name in homes_of(bucket))
        self.grace_due = None

    # -- what a home keeps --

    def record_contents(self, homes: Sequence[str]) -> dict[str, list[tuple[bytes, tuple[int, ...]]]]:
        """The records ``homes`` should have, from the truth (checked against their sizes by the caller)."""
        wanted = set(homes)
        out: dict[str, list[tuple[bytes, tuple[int, ...]]]] = {h: [] for h in homes}
        homes_of, bucket_of = self.placement.homes_of, self.placement.bucket_of_key
        for key, holders in self.truth.items():
            for home in homes_of(bucket_of(key)):
                if home in wanted:
                    out[home].append((key, holders))
        return out


def measure_records(contents: list[tuple[bytes, tuple[int, ...]]], names: Sequence[str],
                    bucket_of: Callable[[bytes], int]) -> int:
    """Bytes (tracemalloc) of a fresh HomeRecords filled with ``contents``. Each key is made
    anew inside the traced span (as the decoder makes it, and the records keep it), so the
    figure is the dict, the keys and the holder tuples."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        records = HomeRecords(bucket_of)
        for key, holders in contents:
            for holder in holders:
                records.gained(names[holder], (wire_key(key[:32], 0),))
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    if len(records) != len(contents):
        raise RuntimeError(f"records: {len(records)} after filling {len(contents)}")
    return size


def measure_full_copy(truth: dict[bytes, tuple[int, ...]]) -> tuple[int, PeerDirectory]:
    """Today's scheme on one daemon: a PeerDirectory with every block of the cluster (holders
    folded onto its 62 peer bits), keys made anew inside the traced span as for ours. Returns
    (bytes by tracemalloc, the directory)."""
    peers = [f"peer-{i}" for i in range(62)]
    grouped: list[list[bytes]] = [[] for _ in peers]
    for key, holders in truth.items():
        for holder in holders:
            grouped[holder % 62].append(key)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        directory = PeerDirectory(peers, max_entries=len(truth) + 1)
        for name, keys in zip(peers, grouped):
            for start in range(0, len(keys), 4096):
                directory.announce(name, [wire_key(k[:32], 0) for k in keys[start:start + 4096]])
        size = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return size, directory


def time_full_copy_lookups(directory: PeerDirectory, lookups: Sequence[Sequence[bytes]]) -> list[float]:
    usable = directory.mask(directory.names)
    out = []
    for keys in lookups:
        started = time.perf_counter()
        for key in keys:
            directory.holders(key, usable)
        out.append(time.perf_counter() - started)
    return out


# =============================================================================================
# one cluster size


@dataclass
class Settings:
    """The run's parameters (the flags; see the module for each default and why)."""

    nodes: tuple[int, ...]
    replicas: int
    bits: int
    lease_s: int
    death_lease_s: int
    deaths: int
    watchers: int
    flush_ms: float
    minutes: float
    nodes_per_copy: int
    cluster_share: float
    lookup_max: int
    grace_s: float
    move_checks: int
    kill_at: float
    idle_s: float
    seed: int
    trace: Path


@dataclass
class ClusterResult:
    """Every figure of one cluster size (the JSON holds them all)."""

    n: int
    copies: int
    capacity: int
    requests: int
    distinct_blocks: int = 0
    figures: dict[str, Any] = field(default_factory=dict)


def run_cluster(n: int, s: Settings, rows: Sequence[tuple[float, tuple[int, ...]]], endpoint: str) -> ClusterResult:
    """One cluster size, start to end (see the module): register ``n`` daemons on the etcd at
    ``endpoint``, replay the trace, kill ``s.deaths`` of them, then measure and compare."""
    copies = math.ceil(n / s.nodes_per_copy)
    requests = replay(rows, copies)
    distinct = len({b for r in requests for b in r.blocks})
    capacity = max(1, round(s.cluster_share * distinct / n))
    result = ClusterResult(n, copies, capacity, len(requests), distinct)
    f = result.figures
    rng = random.Random(s.seed + n)
    progress(f"N={n}: {copies} trace cop{'y' if copies == 1 else 'ies'}, {len(requests):,} requests, "
             f"{distinct:,} distinct blocks, {capacity} blocks a daemon")

    # -- membership on etcd --
    fleet = FleetProcess(endpoint, f"/kvcbench/n{n}", s.lease_s, s.watchers, s.seed + n)
    try:
        fleet.ask("open")
        started = time.monotonic()
        fleet.ask("register", n)
        if not fleet.ask("wait_members", n, 30.0, timeout=90):
            raise RuntimeError(f"the watchers did not see {n} members within 30 s")
        f["register_s"] = time.monotonic() - started
        events, changes, _ = fleet.ask("counts")
        f["join_events_per_change"] = statistics.mean(e / max(c, 1) for e, c in zip(events, changes))
        progress(f"N={n}: {n} daemons registered on {s.lease_s} s leases in {f['register_s']:.1f} s; "
                 f"{s.watchers} watchers see them all")

        # idle: no block traffic (the simulation is built meanwhile: no etcd, no blocks)
        idle_start = time.monotonic()
        names = sorted(fleet.ask("view_names"))
        sim = Simulation(names, capacity, s.replicas, s.bits, s.flush_ms / 1000, s.grace_s, s.lookup_max)
        time.sleep(max(0.0, idle_start + s.idle_s - time.monotonic()))
        idle_end = time.monotonic()
        f["etcd_writes_s_idle"] = fleet.ask("writes_between", idle_start, idle_end) / (idle_end - idle_start)
        f["placement_build_s"] = sim.placement_build_s
        progress(f"N={n}: idle {idle_end - idle_start:.1f} s: {f['etcd_writes_s_idle']:.0f} etcd writes/s; "
                 f"placement built in {sim.placement_build_s:.1f} s")

        # busy: the replay up to the deaths
        end_s = requests[-1].at_s
        kill_s = requests[0].at_s + s.kill_at * (end_s - requests[0].at_s)
        busy_start = time.monotonic()
        gains_before = sim.churn.gains
        done = sim.run(requests, kill_s)
        busy_end = time.monotonic()
        events_busy, _, _ = fleet.ask("counts")
        f["etcd_writes_s_busy"] = fleet.ask("writes_between", busy_start, busy_end) / (busy_end - busy_start)
        f["busy_gains_per_s"] = (sim.churn.gains - gains_before) / (busy_end - busy_start)
        f["etcd_writes_expected_s"] = n * 3 / s.lease_s
        f["etcd_writes_s_per_daemon"] = f["etcd_writes_s_busy"] / n
        f["keepalive_watch_events"] = sum(events_busy) - sum(events)
        progress(f"N={n}: replayed {done:,} requests in {busy_end - busy_start:.1f} s "
                 f"({f['busy_gains_per_s']:,.0f} blocks gained/s): {f['etcd_writes_s_busy']:.0f} etcd writes/s")

        # death
        victims = sorted(rng.sample(names, s.deaths))
        sim.kill(victims, kill_s)
        events_before, changes_before, deletes_before = fleet.ask("counts")
        died = fleet.ask("kill", victims, s.death_lease_s)
        gone = fleet.ask("wait_gone", victims, s.death_lease_s + 10.0, timeout=s.death_lease_s + 60.0)
        if len(gone) != len(victims):
            raise RuntimeError(f"victims never left every view: {sorted(set(victims) - gone.keys())}")
        detection = {v: gone[v] - died[v] for v in victims}
        f["detection_s"] = detection
        f["detection_max_s"] = max(detection.values())
        events_after, changes_after, deletes_after = fleet.ask("counts")
        # the victims' re-registration on the short lease is one put each, changing nothing (a bench step,
        # not part of a death); the death itself is the delete when the lease ends
        f["death_events_per_change"] = statistics.mean(
            (d1 - d0) / max(c1 - c0, 1) for d0, d1, c0, c1 in zip(deletes_before, deletes_after, changes_before, changes_after))
        f["death_changes_per_watcher"] = statistics.mean(c1 - c0 for c0, c1 in zip(changes_before, changes_after))
        f["release_put_events_per_watcher"] = statistics.mean(
            (e1 - e0) - (d1 - d0) for e0, e1, d0, d1 in zip(events_before, events_after, deletes_before, deletes_after))
        progress(f"N={n}: {s.deaths} daemons dead; out of every view after {f['detection_max_s']:.2f} s (lease {s.death_lease_s} s)")
        sim.phase = "detection"
        done += sim.run(requests[done:], kill_s + f["detection_max_s"])
        sim.phase = "after"
        members_now = fleet.ask("view_names")
        change = sim.apply_change(members_now, kill_s + f["detection_max_s"], s.move_checks, rng)
        f["change"] = asdict(change)
        f["converge_s"] = f["detection_max_s"] + s.flush_ms / 1000 + change.max_node_s
        progress(f"N={n}: change applied: {change.moved_buckets} buckets moved, {change.republished.announce_entries:,} "
                 f"records re-published, {change.converged_violations} missing of {change.records_checked:,} checked")
        done += sim.run(requests[done:])
        sim.advance(end_s + s.flush_ms / 1000)
        sim.flush_all()
        closed = fleet.ask("close")
        f["etcd_lost_leases"] = closed["lost_leases"]
        f["etcd_errors"] = closed["errors"]
        f["etcd_writes_by_kind"] = closed["writes_by_kind"]
        f["etcd_revoked_at_end"] = closed["revoked_at_end"]
    finally:
        fleet.stop()
    progress(f"N={n}: replay done ({done:,} requests)")

    # -- figures of the replay --
    live = [node for node in sim.nodes if node.alive]
    counts = [len(node.records) for node in live]
    held_keys = len(sim.truth)
    f["distinct_blocks_held"] = held_keys
    f["records_mean"] = statistics.mean(counts)
    f["records_max"] = max(counts)
    f["records_ideal"] = held_keys * min(s.replicas, len(live)) / len(live)
    f["final_violations"], f["final_checked"] = sim.check_records([(k, sim.placement.bucket_of_key(k)) for k in sim.truth])
    f["churn"] = asdict(sim.churn)
    f["traffic"] = asdict(sim.traffic)
    f["lookups"] = {phase: {"lookups": len(st.seconds), "keys": st.keys, "held": st.held, "found": st.found,
                            "found_rate": st.found_rate, "found_rate_answered": st.found_rate_answered,
                            "held_unanswered": st.held_unanswered, "stale": st.stale, "unanswered": st.unanswered,
                            "homes_mean": statistics.mean(st.homes) if st.homes else 0.0,
                            "homes_max": max(st.homes, default=0),
                            "round_trips_mean": statistics.mean(1 if h else 0 for h in st.homes) if st.homes else 0.0,
                            "bytes_mean": statistics.mean(st.bytes) if st.bytes else 0.0,
                            "p50_us": percentile(st.seconds, 0.5) * 1e6, "p99_us": percentile(st.seconds, 0.99) * 1e6,
                            "full_lookups": len(st.seconds_full),
                            "full_p50_us": percentile(st.seconds_full, 0.5) * 1e6,
                            "full_p99_us": percentile(st.seconds_full, 0.99) * 1e6}
                    for phase, st in sim.lookups.items()}

    # -- record bytes (tracemalloc), ours and the full copy's --
    progress(f"N={n}: measuring record memory (tracemalloc)")
    busiest = max(live, key=lambda node: len(node.records)).name
    sample = [node.name for node in rng.sample(live, min(RECORD_SAMPLE, len(live)))]
    wanted = list(dict.fromkeys([busiest, *sample]))
    contents = sim.record_contents(wanted)
    for home in wanted:
        if len(contents[home]) != len(sim.by_name[home].records):
            raise RuntimeError(f"{home}: {len(sim.by_name[home].records)} records, the truth says {len(contents[home])}")
    measured = {home: measure_records(contents[home], names, sim.placement.bucket_of_key) for home in wanted}
    sample_records = sum(len(contents[h]) for h in sample)
    f["record_bytes"] = sum(measured[h] for h in sample) / max(sample_records, 1)
    f["busiest_bytes"] = measured[busiest]
    f["busiest_records"] = len(contents[busiest])
    f["ideal_bytes"] = f["records_ideal"] * f["record_bytes"]
    del contents
    full_bytes, directory = measure_full_copy(sim.truth)
    f["full_copy_bytes"] = full_bytes
    f["full_copy_record_bytes"] = full_bytes / max(held_keys, 1)
    baseline_lookups = time_full_copy_lookups(directory, sim.recent_lookups)
    f["full_copy_lookup_p50_us"] = percentile(baseline_lookups, 0.5) * 1e6
    f["full_copy_lookup_p99_us"] = percentile(baseline_lookups, 0.99) * 1e6
    full = [keys for keys in sim.recent_lookups if len(keys) == s.lookup_max]
    full_times = time_full_copy_lookups(directory, full)
    f["full_copy_full_lookup_p50_us"] = percentile(full_times, 0.5) * 1e6
    del directory

    # -- messages per block, ours and the full copy's (analytic, same churn) --
    c, t = sim.churn, sim.traffic
    peers = n - 1
    f["announce_entries_per_gain"] = t.announce_entries / max(c.gains, 1)
    f["drop_entries_per_drop"] = t.drop_entries / max(c.drops, 1)
    f["announce_frames_per_gain"] = t.announce_frames / max(c.gains, 1)
    f["drop_frames_per_drop"] = t.drop_frames / max(c.drops, 1)
    f["bytes_per_gain"] = t.bytes / max(c.gains, 1)
    f["full_copy_entries_per_gain"] = f["full_copy_entries_per_drop"] = float(peers)
    f["full_copy_announce_frames_per_gain"] = c.flushes_gaining * peers / max(c.gains, 1)
    f["full_copy_drop_frames_per_drop"] = c.flushes_dropping * peers / max(c.drops, 1)
    f["full_copy_bytes_per_gain"] = ((c.gains + c.drops) * peers * ADDRESS_BYTES
                                     + (c.flushes_gaining + c.flushes_dropping) * peers * FRAME_OVERHEAD) / max(c.gains, 1)
    move = change.republished
    f["move_entries"] = move.announce_entries
    f["move_frames"] = move.announce_frames
    f["move_bytes"] = move.bytes
    f["move_entries_per_record"] = move.announce_entries / max(held_keys * s.replicas, 1)
    progress(f"N={n}: done")
    return result


# =============================================================================================
# the tables


TITLES = {1: "1. Location memory per daemon (records as a home) vs today's full copy on every daemon",
          2: "2. Messages and bytes per block gained (entries = one block told to one home)",
          3: "3. Lookups: homes asked in parallel (one round trip), bytes, CPU time plan + codec + home",
          4: "4. etcd: writes/s (leases only) and watch events",
          5: "5. A dead daemon: detection (real etcd), the move, convergence"}


def rows_of(r: ClusterResult, s: Settings) -> list[Row]:
    """The printed rows of one cluster size (ours against the baseline; targets where the issue sets one)."""
    f, n, rep = r.figures, r.n, s.replicas
    at_scale = n >= 1000
    lk = f["lookups"]
    steady = lk.get("steady", {})
    outside = [lk[p] for p in ("steady", "after") if p in lk]
    held = sum(p["held"] for p in outside)
    found = sum(p["found"] for p in outside)
    mem_target = f"<= {MEMORY_TARGET}x" if at_scale else f"({MEMORY_TARGET}x at 1,000)"
    rows = [Row(1, f"N={n} busiest daemon", "B", f["busiest_bytes"], "full copy, one daemon", f["full_copy_bytes"], False,
                details={"records": f["busiest_records"]})]
    row = Row(1, f"N={n} busiest vs even share, B", "B", f["busiest_bytes"], "held x r / N x record", f["ideal_bytes"],
              False, mem_target, details={"record_bytes": f["record_bytes"], "ideal_records": f["records_ideal"]})
    row.passed = row.ratio <= MEMORY_TARGET if at_scale else None
    rows.append(row)
    row = Row(1, f"N={n} busiest vs even share, recs", "records", f["records_max"], "held x r / N",
              f["records_ideal"], False, mem_target)
    row.passed = row.ratio <= MEMORY_TARGET if at_scale else None
    rows.append(row)
    rows.append(Row(1, f"N={n} records, mean", "records", f["records_mean"], "full copy, one daemon",
                    f["distinct_blocks_held"], False))
    rows.append(Row(1, f"N={n} bytes of one record", "B", f["record_bytes"], "full copy, one key",
                    f["full_copy_record_bytes"], False))

    for case, ours, base, unit, target in (
            ("Announce entries/gain", "announce_entries_per_gain", "full_copy_entries_per_gain", "entries", True),
            ("Drop entries/drop", "drop_entries_per_drop", "full_copy_entries_per_drop", "entries", True),
            ("Announce frames/gain", "announce_frames_per_gain", "full_copy_announce_frames_per_gain", "frames", False),
            ("Drop frames/drop", "drop_frames_per_drop", "full_copy_drop_frames_per_drop", "frames", False),
            ("bytes/gain (and its drop)", "bytes_per_gain", "full_copy_bytes_per_gain", "B", False)):
        row = Row(2, f"N={n} {case}", unit, f[ours], "full copy: N - 1 peers", f[base], False,
                  f"<= {rep + 1}" if target else "")
        row.passed = f[ours] <= rep + 1 if target else None
        rows.append(row)

    rows.append(Row(3, f"N={n} round trips/lookup", "rtt", steady.get("round_trips_mean", 0.0), "full copy: local", 0.0,
                    False, details={"homes_max": steady.get("homes_max")}))
    rows.append(Row(3, f"N={n} homes asked/lookup", "homes", steady.get("homes_mean", 0.0), "full copy: local", 0.0, False,
                    details={"max": steady.get("homes_max")}))
    rows.append(Row(3, f"N={n} bytes/lookup", "B", steady.get("bytes_mean", 0.0), "full copy: local", 0.0, False))
    rows.append(Row(3, f"N={n} lookup p50", "us", steady.get("p50_us", 0.0), "full copy holders()",
                    f["full_copy_lookup_p50_us"], False))
    rows.append(Row(3, f"N={n} lookup p99", "us", steady.get("p99_us", 0.0), "full copy holders()",
                    f["full_copy_lookup_p99_us"], False))
    rows.append(Row(3, f"N={n} {s.lookup_max}-block lookup p50", "us", steady.get("full_p50_us", 0.0),
                    "full copy holders()", f["full_copy_full_lookup_p50_us"], False,
                    details={"lookups": steady.get("full_lookups")}))
    row = Row(3, f"N={n} found, outside moves", "rate", found / held if held else float("nan"), "every block held", 1.0,
              True, "100%", details={"held": held, "found": found, "final_violations": f["final_violations"]})
    row.passed = held > 0 and found == held and f["final_violations"] == 0
    rows.append(row)

    row = Row(4, f"N={n} writes/s replaying", "writes/s", f["etcd_writes_s_busy"], "no block traffic",
              f["etcd_writes_s_idle"], False, f"within {WRITES_SPREAD:.0%}",
              details={"gains_per_s": f["busy_gains_per_s"], "lost_leases": f["etcd_lost_leases"]})
    row.passed = abs(row.ratio - 1) <= WRITES_SPREAD and f["etcd_lost_leases"] == 0
    rows.append(row)
    rows.append(Row(4, f"N={n} ... blocks gained/s meanwhile", "blocks/s", f["busy_gains_per_s"], "no block traffic", 0.0,
                    False))
    rows.append(Row(4, f"N={n} writes/s idle", "writes/s", f["etcd_writes_s_idle"], "N x 3 / lease_s",
                    f["etcd_writes_expected_s"], False))
    rows.append(Row(4, f"N={n} watch events/join", "events", f["join_events_per_change"], "one per watcher", 1.0, False))
    rows.append(Row(4, f"N={n} watch events/death", "events", f["death_events_per_change"], "one per watcher", 1.0,
                    False))
    rows.append(Row(4, f"N={n} watch events, steady", "events", f["keepalive_watch_events"], "no change: 0", 0.0, False))

    row = Row(5, f"N={n} dead out of every view", "s", f["detection_max_s"], "its lease", float(s.death_lease_s), False,
              "<= lease + 1 s", details=f["detection_s"])
    row.passed = f["detection_max_s"] <= s.death_lease_s + 1
    rows.append(row)
    ch = f["change"]
    rows.append(Row(5, f"N={n} time to converge", "s", f["converge_s"], "detection alone", f["detection_max_s"], False,
                    details={"serial_s": ch["serial_s"], "max_node_s": ch["max_node_s"]}))
    rows.append(Row(5, f"N={n} ... the change, serial", "s", ch["serial_s"], "(all daemons' work)", float("nan"), False))
    rows.append(Row(5, f"N={n} move: records re-sent", "entries", f["move_entries"], "records held x r",
                    f["distinct_blocks_held"] * s.replicas, False,
                    details={"frames": f["move_frames"], "bytes": f["move_bytes"], "buckets": ch["moved_buckets"]}))
    rows.append(Row(5, f"N={n} move: bytes", "B", f["move_bytes"], "full copy: none", 0.0, False))
    mv = lk.get("move", {})
    row = Row(5, f"N={n} found in move, old home up", "rate", mv.get("found_rate", float("nan")), "every block held",
              1.0, True, "100%", details=mv)
    row.passed = mv.get("held", 0) > 0 and mv.get("found") == mv.get("held")
    rows.append(row)
    orphan = lk.get("orphaned", {})
    rows.append(Row(5, f"N={n} found in move, homes all dead", "rate", orphan.get("found_rate", float("nan")),
                    f"({orphan.get('held', 0)} blocks)", float("nan"), True, details=orphan))
    dt = lk.get("detection", {})
    rows.append(Row(5, f"N={n} found before detection", "rate", dt.get("found_rate", float("nan")), "every block held",
                    1.0, True, details=dt))
    rows.append(Row(5, f"N={n} ... where the home answered", "rate", dt.get("found_rate_answered", float("nan")),
                    "every block held", 1.0, True, details=dt))
    row = Row(5, f"N={n} records after the move", "missing", ch["converged_violations"], "records checked",
              ch["records_checked"], False, "0 missing")
    row.passed = ch["converged_violations"] == 0
    rows.append(row)
    return rows


def fmt(value: float, unit: str) -> str:
    if value != value:                  # nan
        return "-"
    if unit == "rate":
        return f"{value:.4f}"
    if unit == "s":
        return f"{value:.2f} s"
    if unit in ("entries", "frames", "homes", "events", "rtt", "records") and abs(value) < 100:
        return f"{value:.2f}"
    if unit == "B" and value >= 1 << 20:
        return f"{value / (1 << 20):.1f} MiB"
    if unit == "B" and value >= 1 << 10:
        return f"{value / (1 << 10):.1f} KiB"
    return f"{value:,.0f} {unit}" if unit not in ("rate",) else f"{value:.3f}"


def print_rows(rows: Sequence[Row]) -> None:
    for figure in sorted({r.figure for r in rows}):
        print(TITLES[figure])
        print(f"  {'case':<36} {'ours':>16}  {'baseline':<24} {'':>16}  {'ratio':>8}  {'target':<16} verdict")
        for r in (x for x in rows if x.figure == figure):
            ratio = f"{r.kvcached / r.baseline:.3g}x" if r.baseline and r.baseline == r.baseline else "-"
            print(f"  {r.case:<36} {fmt(r.kvcached, r.unit):>16}  {r.baseline_name:<24} {fmt(r.baseline, r.unit):>16}  "
                  f"{ratio:>8}  {r.target or '-':<16} {r.verdict}")
        print()


GROWTH = (
    ("records per daemon, mean", "records_mean", "distinct_blocks_held"),
    ("records per daemon, max", "records_max", "distinct_blocks_held"),
    ("record bytes, busiest daemon", "busiest_bytes", "full_copy_bytes"),
    ("Announce entries per gain", "announce_entries_per_gain", "full_copy_entries_per_gain"),
    ("Announce frames per gain", "announce_frames_per_gain", "full_copy_announce_frames_per_gain"),
    ("bytes per gain", "bytes_per_gain", "full_copy_bytes_per_gain"),
    ("homes asked per lookup", ("lookups", "steady", "homes_mean"), None),
    ("bytes per lookup", ("lookups", "steady", "bytes_mean"), None),
    ("lookup p50 us", ("lookups", "steady", "p50_us"), "full_copy_lookup_p50_us"),
    ("lookup p99 us", ("lookups", "steady", "p99_us"), "full_copy_lookup_p99_us"),
    ("etcd writes/s", "etcd_writes_s_busy", None),
    ("etcd writes/s per daemon", "etcd_writes_s_per_daemon", None),
    ("watch events per join, a watcher", "join_events_per_change", None),
    ("watch events per death, a watcher", "death_events_per_change", None),
    ("dead out of every view, s", "detection_max_s", None),
    ("time to converge, s", "converge_s", None),
    ("move: records re-sent", "move_entries", None),
)


def pick(figures: dict[str, Any], path: str | tuple[str, ...]) -> float:
    value: Any = figures
    for part in (path,) if isinstance(path, str) else path:
        value = value.get(part, float("nan")) if isinstance(value, dict) else float("nan")
    return float(value)


def growth_table(results: Sequence[ClusterResult]) -> list[dict[str, Any]]:
    """Each figure at every N, and its growth from the smallest N to the largest (ours; the full copy's)."""
    first, last = results[0], results[-1]
    header = "".join(f"{'N=' + str(r.n):>12}" for r in results)
    print(f"6. Growth from {first.n} to {last.n} daemons (load per daemon held the same)")
    print(f"  {'figure':<36}{header}  {'growth':>8}  {'full copy growth':>16}")
    out = []
    for label, ours, base in GROWTH:
        values = [pick(r.figures, ours) for r in results]
        growth = values[-1] / values[0] if values[0] else float("nan")
        base_growth = float("nan")
        if base is not None:
            b0, b1 = pick(first.figures, base), pick(last.figures, base)
            base_growth = b1 / b0 if b0 else float("nan")
        cells = "".join(f"{v:>12,.2f}" if abs(v) < 100 else f"{v:>12,.0f}" for v in values)
        print(f"  {label:<36}{cells}  {growth:>7.2f}x  {'-' if base_growth != base_growth else f'{base_growth:.2f}x':>16}")
        out.append({"figure": label, "values": values, "growth": growth, "full_copy_growth": base_growth})
    print()
    return out


# =============================================================================================


def parse(argv: Sequence[str] | None) -> tuple[Settings, bool, str | None]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 and 300 daemons, 10 minutes of the trace, 4 watchers")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--nodes", help="cluster sizes, comma-separated (default 100,300,1000; --quick 100,300)")
    parser.add_argument("--replicas", type=int, default=2, help="homes per block")
    parser.add_argument("--bits", type=int, default=18, help="placement buckets: 2**bits")
    parser.add_argument("--lease-s", type=int, default=10, help="the daemons' etcd lease, steady state")
    parser.add_argument("--death-lease-s", type=int, default=3, help="the lease the dying daemons die on")
    parser.add_argument("--deaths", type=int, default=3, help="daemons killed at once")
    parser.add_argument("--watchers", type=int, help="MembershipViews watching etcd (default 8; --quick 4)")
    parser.add_argument("--flush-ms", type=float, default=50.0, help="announcement batching, trace time")
    parser.add_argument("--minutes", type=float, help="minutes of the trace replayed (default 30; --quick 10)")
    parser.add_argument("--nodes-per-copy", type=int, default=100, help="daemons per copy of the trace's traffic")
    parser.add_argument("--cluster-share", type=float, default=0.5,
                        help="the share of the replay's distinct blocks the whole cluster can hold")
    parser.add_argument("--lookup-max", type=int, default=64, help="blocks looked up per request, at most")
    parser.add_argument("--grace-s", type=float, default=MOVE_GRACE_S, help="LookupPlan's grace after a move")
    parser.add_argument("--move-checks", type=int, default=4096, help="blocks of moved buckets looked up during the move")
    parser.add_argument("--kill-at", type=float, default=0.7, help="when the daemons die: this far into the replay")
    parser.add_argument("--idle-s", type=float, help="the no-block-traffic window for etcd writes/s (default lease_s)")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--trace", type=Path, default=TRACE)
    a = parser.parse_args(argv)
    nodes = tuple(int(x) for x in (a.nodes or ("100,300" if a.quick else "100,300,1000")).split(","))
    if a.deaths >= min(nodes) - a.replicas:
        parser.error("--deaths must leave more than --replicas daemons")
    s = Settings(nodes=nodes, replicas=a.replicas, bits=a.bits, lease_s=a.lease_s, death_lease_s=a.death_lease_s,
                 deaths=a.deaths, watchers=a.watchers or (4 if a.quick else 8), flush_ms=a.flush_ms,
                 minutes=a.minutes or (10.0 if a.quick else 30.0), nodes_per_copy=a.nodes_per_copy,
                 cluster_share=a.cluster_share, lookup_max=a.lookup_max, grace_s=a.grace_s, move_checks=a.move_checks,
                 kill_at=a.kill_at, idle_s=a.idle_s if a.idle_s is not None else float(a.lease_s), seed=a.seed,
                 trace=a.trace)
    return s, a.quick, a.json


def main(argv: Sequence[str] | None = None) -> int:
    s, quick, json_path = parse(argv)
    if not etcd_binary():
        print("etcd is not installed (make system-deps installs etcd-server)", file=sys.stderr)
        return 2
    started = time.time()
    rows = load_trace(s.trace, s.minutes)
    progress(f"trace: {len(rows):,} requests in the first {s.minutes:g} minutes of {s.trace.name}")
    results: list[ClusterResult] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-cluster-") as tmp:
        server = EtcdServer(Path(tmp) / "etcd")
        server.start()
        try:
            for n in s.nodes:
                results.append(run_cluster(n, s, rows, server.endpoint))
        finally:
            server.stop()
    table = [row for r in results for row in rows_of(r, s)]
    print(f"kvcached cluster benchmark ({'quick' if quick else 'full'}): {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s; "
          f"replicas {s.replicas}, 2**{s.bits} buckets, leases {s.lease_s} s (deaths on {s.death_lease_s} s), "
          f"flush {s.flush_ms:g} ms, {s.minutes:g} min of trace per copy, one copy per {s.nodes_per_copy} daemons\n")
    for r in results:
        print(f"  N={r.n}: {r.copies} cop{'y' if r.copies == 1 else 'ies'}, {r.requests:,} requests, {r.distinct_blocks:,} "
              f"distinct blocks, {r.capacity} blocks a daemon, {r.figures['distinct_blocks_held']:,} held at the end; "
              f"{r.figures['churn']['gains']:,} gains, {r.figures['churn']['drops']:,} drops "
              f"({r.figures['churn']['dropped_unannounced']:,} before their gain was announced)")
    print()
    print_rows(table)
    growth = growth_table(results)
    if json_path:
        Path(json_path).write_text(json.dumps({"settings": {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in asdict(s).items()},
                                               "figures": [asdict(r) for r in table],
                                               "clusters": [asdict(r) for r in results], "growth": growth},
                                              indent=2, default=str) + "\n")
    failed = [r.case for r in table if r.passed is False]
    if failed:
        progress(f"below target: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
