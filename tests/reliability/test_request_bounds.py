"""Bounded gRPC requests (issue 20, part 4): no single request holds the daemon's event loop.

A hostile tester's Lookup of 1,000,000 digests (32 MB, under the message limit) blocked every
other client for 5-9 s. Now every list in a request is capped at ``grpc.max_batch`` (65,536, the
agent socket's limit) and refused past it with INVALID_ARGUMENT naming the limit and the key,
and the largest allowed Lookup, Get and GetStream work a slice at a time (``grpc.lookup_slice``
digests, ``grpc.batch_slice`` addresses), letting other requests run in between
(kvcached.api.grpc_service).

- In process: :func:`lookup_in_slices` gives exactly :meth:`Store.lookup`'s answer, for random
  chains over blocks in every mix of tiers (RAM, SSD, peers, agents' GPUs) and any slice size.
- Real daemons: each list-taking call refused one entry past the limit, the daemon serving on
  (through grpcurl too); the issue's request refused in well under a second, ten times, with
  RSS and descriptors staying put; the largest allowed Lookup, Get and GetStream answer
  correctly; while the largest allowed requests run back to back from one client, a small Get
  from another keeps a p99 under 1 s (a generous bound, not a timing test: the figures are
  printed, and bench/bench_hostile.py measures them against a quiet daemon); and the [grpc]
  keys, set, apply.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grpc
import pytest

from kvcached.api.request_size import largest_read_only_request, largest_request
from kvcached.api.slices import lookup_in_slices, plan_in_slices, present_in_slices
from kvcached.client import KvCacheClient
from kvcached.config import ConfigError, GrpcSection, load_config
from kvcached.index import BlockIndex
from kvcached.policies.clock import ClockPolicy
from kvcached.store import PutItem, Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent import protocol as ap
from kvcached_agent.address import BlockAddress
from kvcached_agent.agent import Agent
from kvcached_agent.protocol import MAX_BATCH
from tests.integration.conftest import DaemonProcess, grpcurl_binary
from tests.integration.test_operations import free_tcp_port
from tests.reliability.conftest import open_fds, report, rss_kib

LAYER = 0
SLAB = 64 << 10
BLOCK = 512                  # payload bytes of the daemon tests' blocks
RESIDENT = 3000              # blocks the daemon tests put: several slices of a chain, the last one partly
SLICE = GrpcSection().batch_slice
LOOKUP_SLICE = GrpcSection().lookup_slice


def digest(n: int) -> bytes:
    return n.to_bytes(4, "big") * 8


def payload(n: int, size: int = BLOCK) -> bytes:
    return n.to_bytes(4, "big") * (size // 4)


# =============================================================================================
# in process: slices add up to one Store.lookup


class HeldByPeers:
    """The peer tier as Store.lookup asks it (``held``): a usable peer holds these digests."""

    asks_homes = False          # static peers: what they hold is known here (no home to ask first)

    def __init__(self, digests: set[bytes]) -> None:
        self.digests = digests

    def held(self, digests: Sequence[bytes], layer: int) -> list[bool]:
        return [d in self.digests for d in digests]


class Pools:
    """Digests of blocks in each mix of RAM and SSD, made by real puts, write-backs and drops."""

    KINDS = ("ram_ssd", "ram", "ssd", "gone", "unknown")

    def __init__(self, per_kind: int, ssd: bool) -> None:
        kinds = self.KINDS if ssd else ("ram", "gone", "unknown")
        self.of: dict[str, list[bytes]] = {}
        n = 0
        for kind in kinds:
            self.of[kind] = [digest(n + i) for i in range(per_kind)]
            n += per_kind

    async def make(self, store: Store) -> None:
        def keys(*kinds: str) -> list[bytes]:
            return [BlockAddress(d, LAYER).key for k in kinds for d in self.of.get(k, [])]

        put = [d for kind in ("ram_ssd", "ram", "ssd", "gone") for d in self.of.get(kind, [])]
        await store.put([PutItem(BlockAddress(d, LAYER), payload(i, 1024), "m") for i, d in enumerate(put)])
        if store.ssd is not None:
            while store.ram.dirty and await store.demote():      # everything on SSD too
                pass
        dropped = store.drop_from_ram(keys("ssd", "gone"))
        assert dropped[0] == len(keys("ssd", "gone")), dropped
        if store.ssd is not None:
            dropped = await store.drop_from_ssd(keys("ram", "gone"))
            assert dropped[0] == len(keys("ram", "gone")), dropped

    def chain(self, rng: random.Random, length: int) -> list[bytes]:
        """Runs of one kind at a time, some long, so slices are often held whole by a tier."""
        out: list[bytes] = []
        while len(out) < length:
            kind = rng.choice(list(self.of))
            out += rng.choices(self.of[kind], k=rng.choice((1, 2, 5, 13)))
        return out[:length]


def with_agents(store: Store, rng: random.Random, pools: Pools) -> None:
    """Three agents on the GPU view, each holding a random part of the pools (a quarter, a half,
    three quarters), so the agent with the longest run in one slice is not always the one with the
    longest run of the chain."""
    everything = [d for ds in pools.of.values() for d in ds]
    for session in (1, 2, 3):
        store.gpu.add_agent(session, f"agent-{session}", 1000 + session)
        store.gpu.pinned(session, rng.sample(everything, k=len(everything) * session // 4))


@pytest.mark.parametrize("ssd, peers", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["ram", "ram+ssd", "ram+peers", "ram+ssd+peers"])
def test_slices_add_up_to_one_store_lookup(tmp_path: Path, ssd: bool, peers: bool) -> None:
    """For 300 random chains (with and without agents) and slice sizes 1 to 9, 16 and 40: the
    sliced answer equals one Store.lookup of the chain, field by field, for anyone and for an
    agent asking for itself (as the agent socket's long Lookups are); so do Present's and
    PlanLoads' answers."""

    async def run() -> int:
        arena = SharedArena(64 * SLAB, name="kvcached-bounds-test")
        index = BlockIndex(tmp_path / "index")
        tier = SsdTier(str(tmp_path / "ssd"), 1 << 30, durability="none", threads=2) if ssd else None
        try:
            if tier is not None:
                tier.open()
            store = Store(RamTier(arena, SLAB, ClockPolicy()), index, ssd=tier)
            store.ssd_reconciled = True
            pools = Pools(per_kind=12, ssd=ssd)
            await pools.make(store)
            rng = random.Random(20)
            if peers:
                everything = [d for ds in pools.of.values() for d in ds]
                held = set(rng.sample(everything, k=len(everything) // 2))
                store.peers = HeldByPeers(held)  # type: ignore[assignment]
            compared = 0
            for round_ in range(300):
                if round_ == 150:
                    with_agents(store, rng, pools)
                chain = pools.chain(rng, rng.choice((2, 7, 30, 41, 64)))
                if rng.random() < 0.3:        # a prefix RAM holds whole, then a miss: slices of both store paths
                    chain = rng.choices(pools.of["ram"], k=rng.choice((9, 17, 33))) + chain
                want = store.lookup(chain, LAYER)
                agent = 2 if round_ >= 150 else None          # an agent asking for itself (its own GPU counts)
                mine = store.lookup(chain, LAYER, agent)
                seen = store.present(chain, LAYER, agent)
                plan = store.plan(chain, LAYER, 0.001, 1024, agent)
                for size in (*range(1, 10), 16, 40):
                    got = await lookup_in_slices(store, chain, LAYER, size)
                    assert got == want, f"slice {size}, chain of {len(chain)}: {got} != {want}"
                    assert await lookup_in_slices(store, chain, LAYER, size, agent=agent) == mine
                    assert await present_in_slices(store, chain, LAYER, size, agent=agent) == seen
                    assert await plan_in_slices(store, chain, LAYER, 0.001, 1024, size, agent=agent) == plan
                    compared += 1
            return compared
        finally:
            if tier is not None:
                await tier.close()
            index.close()
            arena.close()

    compared = asyncio.run(run())
    report("slices_add_up", ssd=ssd, peers=peers, comparisons=compared)


def test_sliced_lookup_gives_the_loop_back(tmp_path: Path) -> None:
    """A chain of many slices lets another task run between them: a 1 ms ticker keeps ticking."""

    async def run() -> tuple[int, int]:
        arena = SharedArena(16 * SLAB, name="kvcached-bounds-test")
        index = BlockIndex(tmp_path / "index")
        try:
            store = Store(RamTier(arena, SLAB, ClockPolicy()), index)
            await store.put([PutItem(BlockAddress(digest(1), LAYER), payload(1), "m")])
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            before = ticks
            result = await lookup_in_slices(store, [digest(1)] * MAX_BATCH, LAYER, 1024)
            task.cancel()
            assert result.ram == result.longest == MAX_BATCH
            return ticks - before, MAX_BATCH // 1024
        finally:
            index.close()
            arena.close()

    ticks, slices = asyncio.run(run())
    assert ticks >= slices - 1, f"the ticker ran {ticks} times during {slices} slices"


# =============================================================================================
# real daemons


def raw_method(client: KvCacheClient, method: str) -> Callable[..., bytes]:
    """A unary method taking and returning serialized bytes (the client side costs nothing)."""
    service = "kvcached.v1.Admin" if method in ("Evict", "Drain") else "kvcached.v1.KvCache"
    return client.channel.unary_unary(f"/{service}/{method}")


def addresses_pb(digests: Sequence[bytes]) -> list[pb.BlockAddress]:
    return [pb.BlockAddress(digest=d, layer=LAYER) for d in digests]


def unknown(count: int, start: int = 10_000_000) -> list[bytes]:
    return [digest(start + i) for i in range(count)]


def put_resident(c: KvCacheClient, count: int = RESIDENT) -> list[bytes]:
    digests = [digest(n) for n in range(count)]
    for start in range(0, count, 1000):
        c.put([(BlockAddress(digest(n), LAYER), payload(n)) for n in range(start, min(start + 1000, count))])
    return digests


def assert_serving(c: KvCacheClient) -> None:
    """The daemon still answers: Stats, and a Get of block 0."""
    c.stats()
    found, _ = c.get([BlockAddress(digest(0), LAYER)])
    assert found[0].payload == payload(0)


OVER = MAX_BATCH + 1


def over_limit_requests() -> list[tuple[str, bytes, str]]:
    """(method, serialized request, what the message counts) for each call that takes a list,
    one entry past the limit."""
    digests = unknown(OVER)
    addresses = addresses_pb(digests)
    return [
        ("Lookup", pb.LookupRequest(digests=digests).SerializeToString(), "digests"),
        ("Overlap", pb.OverlapRequest(digests=digests).SerializeToString(), "digests"),
        ("Get", pb.GetRequest(addresses=addresses, allow_partial=True).SerializeToString(), "addresses"),
        ("GetStream", pb.GetRequest(addresses=addresses, allow_partial=True).SerializeToString(), "addresses"),
        ("Delete", pb.DeleteRequest(addresses=addresses).SerializeToString(), "addresses"),
        ("Put", pb.PutRequest(blocks=[pb.Block(address=a, payload=b"x") for a in addresses]).SerializeToString(),
         "blocks"),
        ("Evict", pb.EvictRequest(digests=digests, layer=LAYER).SerializeToString(), "digests"),
    ]


def call_raw(c: KvCacheClient, method: str, request: bytes) -> Any:
    if method == "GetStream":
        return list(c.channel.unary_stream("/kvcached.v1.KvCache/GetStream")(request, timeout=30))
    return raw_method(c, method)(request, timeout=30)


def test_one_entry_past_the_limit_is_refused_and_the_daemon_serves_on(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        put_resident(c, 10)
        for method, request, what in over_limit_requests():
            with pytest.raises(grpc.RpcError) as err:
                call_raw(c, method, request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
            assert err.value.details() == (
                f"{method}: {OVER} {what} in one request, over the limit of {MAX_BATCH} (grpc.max_batch); "
                f"split it into requests of at most {MAX_BATCH}"), method
            assert_serving(c)
        assert c.stats().deletes == 0 and c.stats().puts == 10, "a refused request changes nothing"


def test_grpcurl_sees_the_limit(daemon: DaemonProcess) -> None:
    """The real grpcurl: one digest past the limit is refused with the message naming the key;
    at the limit the Lookup answers (the JSON goes on stdin: it is megabytes)."""

    def lookup(count: int) -> subprocess.CompletedProcess[str]:
        body = json.dumps({"digests": [base64.b64encode(d).decode() for d in unknown(count)]})
        return subprocess.run([grpcurl_binary(), "-plaintext", "-unix", "-emit-defaults", "-d", "@", str(daemon.socket),
                               "kvcached.v1.KvCache/Lookup"], input=body, capture_output=True, text=True, timeout=60)

    refused = lookup(OVER)
    assert refused.returncode != 0
    assert "Code: InvalidArgument" in refused.stderr, refused.stderr
    assert f"Lookup: {OVER} digests in one request, over the limit of {MAX_BATCH} (grpc.max_batch)" in refused.stderr
    answered = lookup(MAX_BATCH)
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["longest"] == 0


def test_the_issues_lookup_of_a_million_digests_is_refused_quickly(daemon: DaemonProcess) -> None:
    """The reported request (1,000,000 digests, 32 MB) is refused before it is parsed (its size
    is over the largest Lookup allowed: kvcached.api.request_size); memory and descriptors stay
    put over ten of them."""
    request = pb.LookupRequest(digests=unknown(1_000_000)).SerializeToString()
    pid = daemon.proc.pid  # type: ignore[union-attr]
    with daemon.client() as c:
        put_resident(c, 10)
        lookup = raw_method(c, "Lookup")
        lookup(pb.LookupRequest(digests=unknown(MAX_BATCH)).SerializeToString())   # warm: allocator, arenas
        rss0, fds0 = rss_kib(pid), open_fds(pid)
        took = []
        for _ in range(10):
            started = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                lookup(request, timeout=30)
            took.append(time.perf_counter() - started)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (
                f"Lookup: a request of {len(request)} bytes, over the {largest_request('/kvcached.v1.KvCache/Lookup', 65536)} "
                "bytes the largest allowed one takes (65536 entries, grpc.max_batch); split it")
        assert_serving(c)
        rss1, fds1 = rss_kib(pid), open_fds(pid)
    report("million_digest_lookup", request_mb=round(len(request) / 1e6, 1),
           refused_ms_median=round(statistics.median(took) * 1000, 1), refused_ms_max=round(max(took) * 1000, 1),
           rss_kib_before=rss0, rss_kib_after=rss1, fds_before=fds0, fds_after=fds1)
    assert max(took) < 2.0, took
    assert rss1 - rss0 < 256 << 10, f"RSS grew by {rss1 - rss0} KiB over ten refused requests"
    assert fds1 <= fds0 + 2


def test_the_read_only_listener_refuses_over_limit_requests_from_their_length(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """On the read-only listener (no credentials) gRPC itself refuses a message larger than the
    largest read-only request allowed, RESOURCE_EXHAUSTED, from its length prefix: the daemon
    never parses it. The largest allowed Lookup and Get still answer there."""
    port = free_tcp_port()
    d = make_daemon(f'grpc.read_only_listen=["127.0.0.1:{port}"]')
    limit = largest_read_only_request(MAX_BATCH)
    big = pb.LookupRequest(digests=unknown(1_000_000)).SerializeToString()
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        lookup = channel.unary_unary("/kvcached.v1.KvCache/Lookup")
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                lookup(big, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert f"{len(big)} vs. {limit}" in (err.value.details() or ""), err.value.details()
        answer = pb.LookupResponse.FromString(lookup(pb.LookupRequest(digests=unknown(MAX_BATCH)).SerializeToString(),
                                                     timeout=30))
        assert answer.longest == 0
        get = channel.unary_unary("/kvcached.v1.KvCache/Get")
        largest_get = pb.GetRequest(addresses=[pb.BlockAddress(digest=x, layer=(1 << 32) - 1)
                                               for x in unknown(MAX_BATCH)], allow_partial=True)
        assert len(pb.GetResponse.FromString(get(largest_get.SerializeToString(), timeout=60)).misses) == MAX_BATCH
    with d.client() as c:
        put_resident(c, 10)
        assert_serving(c)


@pytest.fixture
def loaded(make_daemon) -> Iterator[tuple[DaemonProcess, list[bytes]]]:  # type: ignore[no-untyped-def]
    """A daemon whose RESIDENT blocks are in RAM and (write_through) on SSD, so every column of a
    Lookup is known exactly."""
    d = make_daemon("kv.write_policy=\"write_through\"", "kv.ssd_durability=\"none\"")
    with d.client() as c:
        resident = put_resident(c)
    yield d, resident


def test_largest_allowed_lookup_answers_exactly(loaded: tuple[DaemonProcess, list[bytes]]) -> None:
    d, resident = loaded
    with d.client() as c:
        assert RESIDENT // LOOKUP_SLICE >= 2
        whole = c.lookup(resident, LAYER)             # several slices, all in RAM and on SSD
        assert (whole.longest, whole.ram, whole.ssd, whole.peer, whole.gpu) == (RESIDENT, RESIDENT, RESIDENT, 0, 0)
        chain = resident + unknown(MAX_BATCH - RESIDENT)
        r = c.lookup(chain, LAYER)                    # the runs end in a later slice: the rest is not looked at
        assert (r.longest, r.ram, r.ssd, r.peer, r.gpu) == (RESIDENT, RESIDENT, RESIDENT, 0, 0)
        answer = pb.EvictResponse.FromString(raw_method(c, "Evict")(pb.EvictRequest(
            digests=resident[1500:1600], layer=LAYER, tier=pb.TIER_RAM).SerializeToString()))
        assert answer.evicted == 100
        r = c.lookup(chain, LAYER)
        assert (r.longest, r.ram, r.ssd, r.peer, r.gpu) == (RESIDENT, 1500, RESIDENT, 0, 0)
        same = c.lookup([resident[0]] * MAX_BATCH, LAYER)   # one block 65,536 times: every slice looked at
        assert (same.longest, same.ram, same.ssd) == (MAX_BATCH, MAX_BATCH, MAX_BATCH)
        miss_first = c.lookup(unknown(MAX_BATCH), LAYER)
        assert (miss_first.longest, miss_first.ram, miss_first.ssd) == (0, 0, 0)


@pytest.mark.slow
def test_largest_allowed_get_and_get_stream_answer_in_order(loaded: tuple[DaemonProcess, list[bytes]]) -> None:
    d, resident = loaded
    chain = resident + unknown(MAX_BATCH - RESIDENT)
    addresses = [BlockAddress(x, LAYER) for x in chain]
    with d.client() as c:
        found, misses = c.get(addresses, allow_partial=True)
        assert [f.address.digest for f in found] == resident
        assert all(f.payload == payload(n) for n, f in enumerate(found))
        assert [m.address.digest for m in misses] == chain[RESIDENT:]
        assert {m.reason for m in misses} == {"unknown block"}
        found, misses = c.get_stream(addresses, allow_partial=True)
        assert [f.address.digest for f in found] == resident and len(misses) == MAX_BATCH - RESIDENT
        start = RESIDENT // SLICE * SLICE                  # the first slice with a miss: the call stops there
        where = f"in addresses[{start}:{start + SLICE}] of {MAX_BATCH}"
        with pytest.raises(grpc.RpcError) as err:
            c.get(addresses)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == (
            f"block {BlockAddress(chain[RESIDENT], LAYER)}: unknown block (and {start + SLICE - RESIDENT - 1} more of "
            f"{SLICE}); {where}, where the call stopped"), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.get_stream(addresses)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and where in err.value.details()
        assert c.stats().agent_held_bytes == 0, "a refused stream leaves nothing pinned"


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def small_get_latencies(target: str, seconds: float) -> list[float]:
    """Latencies of back-to-back Gets of one 64 KiB block, on a channel of their own."""
    with KvCacheClient(target) as c:
        request = [BlockAddress(digest(99), LAYER)]
        c.get(request)
        out = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            c.get(request, verify=False)
            out.append(time.perf_counter() - started)
    return out


def test_small_get_p99_while_the_largest_requests_run(loaded: tuple[DaemonProcess, list[bytes]]) -> None:
    """One client sends the largest allowed Lookup (one resident block 65,535 times then a miss:
    every slice looked at, twice) and Get (65,536 unknown blocks, allow_partial) back to back;
    a small Get from another client keeps a p99 under 1 s. Before the bounds, one such
    request took seconds and the small Get waited for all of it."""
    d, resident = loaded
    pid = d.proc.pid  # type: ignore[union-attr]
    with d.client() as c:
        c.put([(BlockAddress(digest(99), LAYER), payload(99, 64 << 10))])
    lookup_request = pb.LookupRequest(digests=[resident[0]] * (MAX_BATCH - 1) + unknown(1), layer=LAYER)
    get_request = pb.GetRequest(addresses=addresses_pb(unknown(MAX_BATCH)), allow_partial=True)
    quiet = small_get_latencies(d.target, 1.0)
    rss0, fds0 = rss_kib(pid), open_fds(pid)
    stop = threading.Event()
    heavy: dict[str, list[float]] = {"Lookup": [], "Get": []}
    failures: list[BaseException] = []

    def hostile() -> None:
        try:
            with KvCacheClient(d.target) as c:
                calls = [("Lookup", raw_method(c, "Lookup"), lookup_request.SerializeToString()),
                         ("Get", raw_method(c, "Get"), get_request.SerializeToString())]
                while not stop.is_set():
                    for name, call, request in calls:
                        started = time.perf_counter()
                        call(request, timeout=60)
                        heavy[name].append(time.perf_counter() - started)
        except BaseException as exc:        # surfaced below: a failed load would pass vacuously
            failures.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        time.sleep(0.3)
        loaded_latencies = small_get_latencies(d.target, 3.0)
    finally:
        stop.set()
        thread.join(120)
    assert not failures, failures
    rss1, fds1 = rss_kib(pid), open_fds(pid)
    p99 = percentile(loaded_latencies, 0.99)
    report("small_get_under_largest_requests",
           quiet_p50_ms=round(statistics.median(quiet) * 1000, 2),
           quiet_p99_ms=round(percentile(quiet, 0.99) * 1000, 2),
           loaded_p50_ms=round(statistics.median(loaded_latencies) * 1000, 2), loaded_p99_ms=round(p99 * 1000, 2),
           small_gets=len(loaded_latencies),
           lookups=len(heavy["Lookup"]), lookup_ms_median=round(statistics.median(heavy["Lookup"]) * 1000),
           gets=len(heavy["Get"]), get_ms_median=round(statistics.median(heavy["Get"]) * 1000),
           rss_kib_before=rss0, rss_kib_after=rss1, fds_before=fds0, fds_after=fds1)
    assert heavy["Lookup"] and heavy["Get"], "the load did not run"
    assert p99 < 1.0, f"a small Get's p99 was {p99 * 1000:.0f} ms while the largest requests ran"
    assert fds1 <= fds0 + 2


@pytest.mark.parametrize("key", ["max_batch", "batch_slice", "lookup_slice"])
@pytest.mark.parametrize("value", [0, MAX_BATCH + 1])
def test_limits_outside_1_to_65536_are_refused(key: str, value: int) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"grpc.{key}={value}"], total_memory=1 << 40)
    assert str(err.value) == f"config: grpc.{key}: must be between 1 and {MAX_BATCH}, got {value}"


def test_configured_limits_apply(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """grpc.max_batch, batch_slice and lookup_slice from the configuration: the limit in the
    message is the configured one, and 7-entry slices still answer exactly."""
    d = make_daemon("grpc.max_batch=100", "grpc.batch_slice=7", "grpc.lookup_slice=7")
    with d.client() as c:
        resident = put_resident(c, 50)
        for method, digests in (("Lookup", 101), ("Evict", 101)):
            request = (pb.LookupRequest(digests=unknown(digests)) if method == "Lookup"
                       else pb.EvictRequest(digests=unknown(digests), layer=LAYER))
            with pytest.raises(grpc.RpcError) as err:
                raw_method(c, method)(request.SerializeToString())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(
                f"{method}: 101 digests in one request, over the limit of 100 (grpc.max_batch)")
        r = c.lookup(resident + unknown(50), LAYER)
        assert (r.longest, r.ram) == (50, 50)
        found, misses = c.get([BlockAddress(x, LAYER) for x in resident + unknown(50)], allow_partial=True)
        assert [f.address.digest for f in found] == resident and len(misses) == 50
        config = pb.GetConfigResponse.FromString(c.channel.unary_unary("/kvcached.v1.Admin/GetConfig")(b"")).toml
        assert "max_batch = 100" in config and "batch_slice = 7" in config and "lookup_slice = 7" in config


def small_agent_lookups(socket_path: str, seconds: float) -> list[float]:
    """Latencies of back-to-back 8-digest Lookups on an agent connection of their own."""
    with Agent.connect(socket_path, agent_id="small", model="m", dtype="bf16", block_tokens=16, num_layers=1,
                       layer_block_bytes=4096, timeout=30) as agent:
        digests = [digest(n) for n in range(8)]
        agent.lookup(digests, LAYER)
        out = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            agent.lookup(digests, LAYER)
            out.append(time.perf_counter() - started)
    return out


def test_small_agent_lookup_p99_while_the_largest_agent_requests_run(
        loaded: tuple[DaemonProcess, list[bytes]]) -> None:
    """One agent keeps 20 Presents and 20 PlanLoads of 65,536 digests each in flight (issue 59:
    another agent's 8-digest Lookup then had a p99 of 647 ms and a max of 1.36 s); they are done
    a slice at a time, so the small Lookup's p99 stays under 300 ms (a generous bound, not a
    timing test: bench/bench_hostile.py measures it against a quiet daemon), and every big
    answer is whole."""
    d, resident = loaded
    sock = str(d.state / "agent.sock")
    big = [resident[0]] * (MAX_BATCH - 1) + unknown(1)
    quiet = small_agent_lookups(sock, 1.0)
    stop = threading.Event()
    answers: list[Any] = []
    failures: list[BaseException] = []

    def hostile() -> None:
        try:
            with Agent.connect(sock, agent_id="big", model="m", dtype="bf16", block_tokens=16, num_layers=1,
                               layer_block_bytes=4096, timeout=120) as agent:
                client = agent.client
                assert client is not None
                while not stop.is_set():
                    ids = [client.submit(ap.Present(LAYER, big)) for _ in range(20)]
                    ids += [client.submit(ap.PlanLoads(LAYER, 0.001, 4096, big)) for _ in range(20)]
                    answers.extend(client.answer(i) for i in ids)
        except BaseException as exc:        # surfaced below
            failures.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        time.sleep(0.5)
        loaded_latencies = small_agent_lookups(sock, 3.0)
    finally:
        stop.set()
        thread.join(180)
    assert not failures, failures
    p99 = percentile(loaded_latencies, 0.99)
    report("small_agent_lookup_under_largest_agent_requests",
           quiet_p99_ms=round(percentile(quiet, 0.99) * 1000, 2),
           loaded_p50_ms=round(statistics.median(loaded_latencies) * 1000, 2), loaded_p99_ms=round(p99 * 1000, 2),
           loaded_max_ms=round(max(loaded_latencies) * 1000, 2), big_answers=len(answers))
    assert answers and all(type(a).__name__ in ("PresentResult", "LoadPlan") for a in answers), answers[:2]
    present = next(a for a in answers if type(a).__name__ == "PresentResult")
    assert len(present.held) == MAX_BATCH and present.held[0] and not present.held[-1]
    plan = next(a for a in answers if type(a).__name__ == "LoadPlan")
    assert plan.held == MAX_BATCH - 1
    assert p99 < 0.3, f"a small agent Lookup's p99 was {p99 * 1000:.0f} ms while the largest agent requests ran"


def rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_refused_large_requests_on_the_read_only_listener_grow_no_memory(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Eight senders, each on a connection of its own, repeat the 34 MB Lookup of a million
    digests on the read-only listener for 4 s (issue 59: anonymous memory 32 -> 257 MiB, as
    gRPC's BDP probing grew each connection's receive window with what its sender pushed). The
    listener's window is fixed now (kvcached.api.grpc_servers.READ_ONLY_HTTP2): each call is
    refused from its length prefix and the daemon's anonymous memory stays within 48 MiB."""
    port = free_tcp_port()
    d = make_daemon(f'grpc.read_only_listen=["127.0.0.1:{port}"]')
    pid = d.proc.pid
    big = pb.LookupRequest(digests=unknown(1_000_000)).SerializeToString()
    before = rss_anon_kib(pid)
    stop = threading.Event()
    refused = [0] * 8

    def sender(i: int) -> None:
        options = [("grpc.max_send_message_length", 64 << 20), ("kvcached.test.sender", i)]   # a connection each
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            lookup = channel.unary_unary("/kvcached.v1.KvCache/Lookup")
            while not stop.is_set():
                try:
                    lookup(big, timeout=30)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    refused[i] += 1

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(4.0)
    grown = (rss_anon_kib(pid) - before) / 1024
    stop.set()
    for thread in threads:
        thread.join(60)
    report("refused_read_only_lookups", senders=8, refused=sum(refused), anon_growth_mib=round(grown, 1))
    assert all(refused), refused
    assert grown < 48, f"anonymous memory grew {grown:.0f} MiB"
    with d.client() as c:
        put_resident(c, 10)
        assert_serving(c)
