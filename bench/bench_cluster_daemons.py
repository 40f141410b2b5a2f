"""A Lookup's round trip to the homes, with real daemons: four ``kvcached serve`` processes in a
cluster on one real etcd, loopback, against a single pull round trip on the same link.

    python bench/bench_cluster_daemons.py [--quick] [--json PATH] [--logs DIR]

Issue 24's target: "lookup of a 64-block prefix held remotely: one round trip per home, p50 <= 2x
a single pull round trip on the same link".

Setup: a cluster CA and four node certificates (kvcached.peers.certs.make_cluster, what ``kvcached
certs`` does) and a real etcd (tests/etcd_server.py, the Debian ``etcd`` binary) in a temp dir;
four daemons node-a .. node-d (bench_core.start_kvcached: ``config/kvcached.toml``, all state in
the temp dir, gRPC on a Unix socket, RAM only) with ``cluster.etcd`` that etcd,
``cluster.lease_s=10``, a prefix of their own, the default ``cluster.replicas`` (2) and
``placement_bits`` (18), ``quic.listen`` on a free port of 127.0.0.1,
``quic.max_datagram_size=16000``, ``quic.lane="tls"``; the asking daemon B (node-b) also
``kv.mirror_pulls=false``, so a pulled block is dropped once read and every Get pulls again.
The benchmark waits until every daemon sees the four members, then puts, through gRPC: on A
(node-a), 200 chains (--quick: 80) of 64 blocks of 4 KiB (kvcached_agent.address.chain_digests,
cross-layer), as many single blocks whose first home is A, and SINGLES other single blocks; on
B, one chain of 64 blocks. It waits until the home records of all four daemons add up to every
block put x 2 replicas (A's announcements are in), and until the membership moves of the start
are past the lookup plan's grace (MOVE_GRACE_S: a moved bucket is asked of its old home too), so
each Lookup asks the blocks' first homes only.

Measured, one blocking gRPC client in this process (requests built before the clock starts;
the clock runs around the call only), on B:

- "Lookup 64 remote": a Lookup of a chain of 64 blocks only A holds, none of whose locations
  B has asked for in the last 2.5 s (a daemon keeps an answer of the homes
  LOCATION_TTL_S = 2 s): the chains are cycled, and a chain looked up less than 2.5 s before is
  waited for (the waits are counted). Each answer must say ``peer`` = 64 (all found), and
  B's ``Stats.cluster.locates`` must have grown (B asked homes): the growth per Lookup is the
  number of Locate requests (homes asked), set against the chain's first homes other than B
  computed with kvcached.cluster.placement.Placement as the daemons compute them.
- "single pull": a Get of one 4 KiB block only A holds, its location cached by an untimed
  one-block Lookup just before (so the Get asks no home: it is a pure pull over the tls lane);
  B's Stats must show one block pulled and no Locate for it. The answer is checked byte for
  byte (after the clock).
- "Lookup 1 remote, home A": a Lookup of one block only A holds whose first home is A, not
  asked for in the last 2.5 s (cycled as the chains): one Locate to A, the peer the pull goes
  to (B's locates must grow by 1, peer = 1). One Locate round trip against one pull round trip
  on the same link.
- "Lookup 64 remote, cached": the chain of the last "Lookup 64 remote" again (looked up less
  than 2 s before): the same Lookup without the Locates (B's locates must not grow).
- "Lookup 64 in B's RAM": a Lookup of B's own chain (ram = 64): no home is asked (the chain is
  whole in RAM); what gRPC and the Lookup itself cost, the floor of the first row.
- "Get 1 in B's RAM": a Get of one of B's own blocks: the floor of the single pull.

The six sides alternate call by call (in order, then reversed), after WARMUP untimed rounds.
Stats of B are read before and after each timed call of the first four sides, off the clock. Printed: p50 and p99 of
each side, the ratio Lookup 64 remote / single pull (target <= 2x), the same without gRPC's own
cost (each side's p50 minus its floor's p50), and the Locate requests per Lookup against the
homes the plan asks (figure 2). Figure 3, where the time goes: each side alone for as many calls
as there are chains (no Stats between them), the CPU time (user + system, /proc, 10 ms ticks) each daemon spent per
call, its idle rate subtracted.

--quick: 80 chains, 150 calls per side (about 45 s). Full: 200 chains, 800 calls per side
(about 55 s on 2 cores; about 30 s of either is starting the daemons and waiting out the grace).
Progress goes to stderr, the table to stdout; --logs DIR keeps the daemons' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import KiB, Proc, Row, percentile, print_fitted, proc_times, progress, start_kvcached  # noqa: E402
from bench_peers import free_port  # noqa: E402

NODES = ("node-a", "node-b", "node-c", "node-d")
HOLDER, ASKER = "node-a", "node-b"
BLOCK = 4 * KiB
CHAIN = 64                      # blocks a chain: the 64-block prefix
BLOCK_TOKENS = 16
SINGLES = 64                    # single blocks on A for the pull baseline, used in turn (each one 2.5 s apart)
LEASE_S = 10
PREFIX = "/kvcbench-cluster"
REPLICAS, BITS = 2, 18          # the daemons' defaults ([cluster] replicas, placement_bits)
FRESH_S = 2.5                   # a chain is looked up again only this long after (LOCATION_TTL_S = 2 s)
WARMUP = 10
TARGET = 2.0                    # Lookup 64 remote p50 / single pull p50
SIDES = ("Lookup 64 remote", "single pull", "Lookup 1 remote, home A", "Lookup 64 remote, cached", "Lookup 64 in B's RAM",
         "Get 1 in B's RAM")


def chain_of(owner: str, n: int) -> list[bytes]:
    from kvcached_agent.address import chain_digests

    base = NODES.index(owner) * 100_000_000 + n * CHAIN * BLOCK_TOKENS
    return chain_digests([(base + i) & 0xFFFFFFFF for i in range(CHAIN * BLOCK_TOKENS)], BLOCK_TOKENS,
                         model=f"bench/cluster-{owner}-{n}", dtype="bfloat16")


def payload_of(digest: bytes) -> bytes:
    import blake3

    return blake3.blake3(b"payload" + digest).digest(length=BLOCK)


def single_digest(i: int) -> bytes:
    import blake3

    return blake3.blake3(f"bench-cluster-single-{i}".encode()).digest()


def first_home() -> Callable[[bytes], str]:
    """The first home of a cross-layer block, as the daemons compute it (four members)."""
    from kvcached.cluster.placement import Placement
    from kvcached.peers.directory import wire_key
    from kvcached_agent.address import CROSS_LAYER

    placement = Placement(REPLICAS, BITS)
    placement.set_members(NODES)
    return lambda digest: placement.homes_of(placement.bucket_of_key(wire_key(digest, CROSS_LAYER)))[0]


def expected_homes(chains: Sequence[Sequence[bytes]], home: Callable[[bytes], str]) -> list[int]:
    """Per chain, the homes B asks: the distinct first homes of its blocks other than B."""
    return [len({home(d) for d in chain} - {ASKER}) for chain in chains]


def homed_at_holder(n: int, home: Callable[[bytes], str]) -> list[bytes]:
    """``n`` single blocks whose first home is A, the holder: one Locate to A says where each is."""
    import blake3

    out: list[bytes] = []
    i = 0
    while len(out) < n:
        digest = blake3.blake3(f"bench-cluster-homed-{i}".encode()).digest()
        if home(digest) == HOLDER:
            out.append(digest)
        i += 1
    return out


class Daemon:
    def __init__(self, name: str, proc: Proc, channel: Any) -> None:
        from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

        self.name, self.proc = name, proc
        self.stub = pb_grpc.KvCacheStub(channel)

    def stats(self) -> Any:
        from kvcached.v1 import kvcache_pb2 as pb

        return self.stub.Stats(pb.StatsRequest(), timeout=30)

    def put(self, digests: Sequence[bytes]) -> None:
        from kvcached.v1 import kvcache_pb2 as pb

        blocks = [pb.Block(address=pb.BlockAddress(digest=d), payload=payload_of(d), model="bench/cluster") for d in digests]
        result = self.stub.Put(pb.PutRequest(blocks=blocks), timeout=60)
        if result.stored + result.already_present != len(digests):
            raise RuntimeError(f"{self.name} stored {result.stored} of {len(digests)} blocks")


def start_cluster(stack: contextlib.ExitStack, tmp: Path, etcd_endpoint: str, certs: Path) -> dict[str, Daemon]:
    daemons: dict[str, Daemon] = {}
    for name in NODES:
        state = tmp / name
        state.mkdir()
        sets = ["kv.ssd_gib=0", 'kv.write_policy="write_back"',
                f'quic.listen="127.0.0.1:{free_port(socket.SOCK_DGRAM)}"', f'quic.ca="{certs / "ca.pem"}"',
                f'quic.cert="{certs / f"{name}.pem"}"', f'quic.key="{certs / f"{name}-key.pem"}"',
                "quic.max_datagram_size=16000", 'quic.lane="tls"',
                f'cluster.etcd=["{etcd_endpoint}"]', f'cluster.name="{name}"', f"cluster.lease_s={LEASE_S}",
                f'cluster.prefix="{PREFIX}"']
        if name == ASKER:
            sets.append("kv.mirror_pulls=false")
        progress(f"starting {name}")
        proc, channel = start_kvcached(stack, state, 0.5, sets)
        daemons[name] = Daemon(name, proc, channel)
    return daemons


def wait_until(what: str, ok: Callable[[], bool], timeout: float, daemons: dict[str, Daemon]) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {d.name}\n{d.proc.tail(8)}" for d in daemons.values())
            raise RuntimeError(f"not within {timeout:.0f} s: {what}\n{tails}")
        time.sleep(0.1)


def run(quick: bool) -> tuple[list[Row], list[str], dict[str, Any]]:
    from kvcached.peers.certs import make_cluster
    from kvcached.v1 import kvcache_pb2 as pb
    from tests.etcd_server import EtcdServer, etcd_binary

    if etcd_binary() is None:
        raise SystemExit("etcd not installed (make system-deps installs etcd-server)")
    n_chains, calls = (80, 150) if quick else (200, 800)
    notes: list[str] = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcbench-cluster-") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        logs: dict[str, str] = {}
        # registered first, so run last: the daemons' logs once they are stopped (shutdown lines included)
        stack.callback(lambda: logs.update({d.name: d.proc.log.read_text(errors="replace") for d in daemons.values()}))
        certs = tmp / "certs"
        certs.mkdir()
        make_cluster(certs, list(NODES))
        etcd = EtcdServer(tmp / "etcd")
        progress(f"starting etcd ({etcd.endpoint})")
        etcd.start()
        stack.callback(etcd.stop)
        daemons: dict[str, Daemon] = {}
        daemons.update(start_cluster(stack, tmp, etcd.endpoint, certs))
        a, b = daemons[HOLDER], daemons[ASKER]
        wait_until("every daemon sees the four members",
                   lambda: all(set(d.stats().cluster.members) == set(NODES) for d in daemons.values()), 30, daemons)
        converged = time.monotonic()
        progress(f"cluster formed; putting {n_chains} chains of {CHAIN} x {BLOCK // KiB} KiB and {SINGLES} single "
                 f"blocks on {HOLDER}, one chain on {ASKER}")
        chains = [chain_of(HOLDER, n) for n in range(n_chains)]
        for chain in chains:
            a.put(chain)
        singles = [single_digest(i) for i in range(SINGLES)]
        a.put(singles)
        home = first_home()
        homed = homed_at_holder(n_chains, home)
        a.put(homed)
        own = chain_of(ASKER, 0)
        b.put(own)
        total = n_chains * (CHAIN + 1) + SINGLES + CHAIN
        wait_until("the homes hold a record of every block put",
                   lambda: sum(d.stats().cluster.home_records for d in daemons.values()) >= total * REPLICAS, 60, daemons)
        records = {d.name: d.stats().cluster.home_records for d in daemons.values()}
        progress(f"home records: {records} (blocks x replicas = {total * REPLICAS})")
        grace = 10.0 + 0.5 - (time.monotonic() - converged)     # kvcached.cluster.location.MOVE_GRACE_S
        if grace > 0:
            progress(f"waiting {grace:.1f} s: the start's membership moves past the lookup plan's grace")
            time.sleep(grace)

        lookups = [pb.LookupRequest(digests=chain) for chain in chains]
        own_lookup = pb.LookupRequest(digests=own)
        single_lookups = [pb.LookupRequest(digests=[d]) for d in singles]
        single_gets = [pb.GetRequest(addresses=[pb.BlockAddress(digest=d)]) for d in singles]
        own_get = pb.GetRequest(addresses=[pb.BlockAddress(digest=own[0])])
        homed_lookups = [pb.LookupRequest(digests=[d]) for d in homed]
        homes = expected_homes(chains, home)
        last_used = [float("-inf")] * n_chains
        homed_used = [float("-inf")] * n_chains
        singles_used = [float("-inf")] * SINGLES
        state = {"chain": 0, "last": -1, "single": 0, "homed": 0, "waits": 0, "waited_s": 0.0}
        samples: dict[str, list[float]] = {side: [] for side in SIDES}
        locates: list[int] = []
        asked: list[int] = []
        anomalies: list[str] = []

        def timed(call: Callable[[], Any]) -> tuple[float, Any]:
            t0 = time.perf_counter()
            answer = call()
            return time.perf_counter() - t0, answer

        def fresh(used: list[float], i: int) -> None:
            """Wait until item ``i`` was last looked up FRESH_S ago (its location no longer cached)."""
            wait = used[i] + FRESH_S - time.monotonic()
            if wait > 0:
                state["waits"] += 1
                state["waited_s"] += wait
                time.sleep(wait)

        def remote() -> tuple[float, Any, Any, Any, int]:
            i = state["chain"]
            state["chain"] = (i + 1) % n_chains
            fresh(last_used, i)
            before = b.stats()
            dt, answer = timed(lambda: b.stub.Lookup(lookups[i], timeout=30))
            after = b.stats()
            last_used[i] = time.monotonic()
            state["last"] = i
            return dt, answer, before, after, i

        def side(name: str) -> float:
            if name == "Lookup 64 remote":
                dt, answer, before, after, i = remote()
                grown = after.cluster.locates - before.cluster.locates
                if answer.peer != CHAIN:
                    raise RuntimeError(f"a Lookup of chain {i} found {answer.peer} of {CHAIN} blocks on peers")
                if grown == 0:
                    raise RuntimeError(f"a Lookup of chain {i} asked no home (its locations were cached)")
                if after.cluster.locate_failures != before.cluster.locate_failures:
                    anomalies.append(f"chain {i}: {after.cluster.locate_failures - before.cluster.locate_failures} "
                                     f"Locate(s) failed")
                locates.append(grown)
                asked.append(homes[i])
                return dt
            if name == "Lookup 1 remote, home A":
                i = state["homed"]
                state["homed"] = (i + 1) % n_chains
                fresh(homed_used, i)
                before = b.stats()
                dt, answer = timed(lambda: b.stub.Lookup(homed_lookups[i], timeout=30))
                after = b.stats()
                homed_used[i] = time.monotonic()
                if answer.peer != 1 or after.cluster.locates - before.cluster.locates != 1:
                    raise RuntimeError(f"a Lookup of block {i} homed at A: peer {answer.peer}, "
                                       f"{after.cluster.locates - before.cluster.locates} Locates (want 1, 1)")
                return dt
            if name == "Lookup 64 remote, cached":
                i = state["last"]
                before = b.stats()
                dt, answer = timed(lambda: b.stub.Lookup(lookups[i], timeout=30))
                after = b.stats()
                if answer.peer != CHAIN or after.cluster.locates != before.cluster.locates:
                    raise RuntimeError(f"the cached Lookup of chain {i}: peer {answer.peer}, "
                                       f"{after.cluster.locates - before.cluster.locates} Locates")
                return dt
            if name == "single pull":
                j = state["single"]
                state["single"] = (j + 1) % SINGLES
                fresh(singles_used, j)          # its location no longer cached: the Lookup below asks anew
                found = b.stub.Lookup(single_lookups[j], timeout=30)       # the location, cached for the Get
                singles_used[j] = time.monotonic()
                if found.peer != 1:
                    raise RuntimeError(f"single block {j}: not found on a peer")
                before = b.stats()
                dt, answer = timed(lambda: b.stub.Get(single_gets[j], timeout=30))
                after = b.stats()
                pulled = after.peer_pulled - before.peer_pulled
                if len(answer.blocks) != 1 or answer.blocks[0].payload != payload_of(singles[j]):
                    raise RuntimeError(f"single block {j}: the Get did not return the bytes put")
                if pulled != 1 or after.cluster.locates != before.cluster.locates:
                    raise RuntimeError(f"single block {j}: {pulled} pulled, "
                                       f"{after.cluster.locates - before.cluster.locates} Locates (want 1, 0)")
                return dt
            if name == "Lookup 64 in B's RAM":
                dt, answer = timed(lambda: b.stub.Lookup(own_lookup, timeout=30))
                if answer.ram != CHAIN:
                    raise RuntimeError(f"B's own chain: ram {answer.ram} of {CHAIN}")
                return dt
            dt, answer = timed(lambda: b.stub.Get(own_get, timeout=30))
            if len(answer.blocks) != 1:
                raise RuntimeError("B's own block: the Get missed")
            return dt

        progress(f"warm-up: {WARMUP} untimed rounds")
        for _ in range(WARMUP):
            for name in SIDES:
                side(name)
        locates.clear()
        asked.clear()
        base = b.stats()
        base_a = a.stats()
        progress(f"timing: {calls} calls per side, the sides alternating")
        t_start = time.monotonic()
        for n in range(calls):
            for name in SIDES if n % 2 == 0 else reversed(SIDES):
                samples[name].append(side(name))
        elapsed = time.monotonic() - t_start
        end = b.stats()
        end_a = a.stats()
        for d in daemons.values():
            if not d.proc.alive():
                raise RuntimeError(f"{d.name} died:\n{d.proc.tail()}")

        c0, c1 = base.cluster, end.cluster
        notes.append(f"B during the timed calls: {c1.locates - c0.locates} Locates sent, "
                     f"{c1.locate_failures - c0.locate_failures} failed, {end.peer_pulled - base.peer_pulled} blocks pulled, "
                     f"{end.peer_hedged - base.peer_hedged} pulls hedged, {end.peer_failed - base.peer_failed} pulls failed, "
                     f"{end.peer_lane_pulls - base.peer_lane_pulls} lane pulls, "
                     f"{end.peer_lane_fallbacks - base.peer_lane_fallbacks} lane fallbacks")
        notes.append(f"A answered {end_a.cluster.served_locates - base_a.cluster.served_locates} Locates as a home and "
                     f"served {end_a.peer_served - base_a.peer_served} blocks")
        notes.append(f"chains reused after {FRESH_S:g} s: {state['waits']} waits, {state['waited_s']:.1f} s in all; "
                     f"timed section {elapsed:.1f} s")
        extra.update(home_records=records, locates_per_lookup=locates, homes_per_lookup=asked, anomalies=anomalies)
        notes += anomalies[:10]

        p50 = {s: statistics.median(v) * 1e6 for s, v in samples.items()}
        p99 = {s: percentile(v, 0.99) * 1e6 for s, v in samples.items()}
        remote_p50, pull_p50 = p50["Lookup 64 remote"], p50["single pull"]
        rows = [
            Row(1, "Lookup 64 remote, p50", "us", remote_p50, "single pull (Get 1x 4 KiB from A)", pull_p50, False,
                f"<= {TARGET:g}x", remote_p50 / pull_p50 <= TARGET, {"calls": calls}),
            Row(1, "Lookup 64 remote, p99", "us", p99["Lookup 64 remote"], "single pull, p99", p99["single pull"], False),
            Row(1, "Lookup 64 remote - its gRPC floor, p50", "us", remote_p50 - p50["Lookup 64 in B's RAM"],
                "single pull - its gRPC floor, p50", pull_p50 - p50["Get 1 in B's RAM"], False),
            Row(1, "Lookup 64 remote, p50", "us", remote_p50, "Lookup 1 remote, home A", p50["Lookup 1 remote, home A"],
                False),
            Row(1, "Lookup 1 remote, home A, p50", "us", p50["Lookup 1 remote, home A"], "single pull (from A)", pull_p50,
                False),
            Row(1, "Lookup 64 remote, p50", "us", remote_p50, "Lookup 64 remote, cached", p50["Lookup 64 remote, cached"],
                False),
            Row(1, "Lookup 64 remote, cached, p50", "us", p50["Lookup 64 remote, cached"], "Lookup 64 in B's RAM",
                p50["Lookup 64 in B's RAM"], False),
            Row(1, "single pull, p50", "us", pull_p50, "Get 1 in B's RAM", p50["Get 1 in B's RAM"], False),
            Row(1, "single pull, p99", "us", p99["single pull"], "Get 1 in B's RAM, p99", p99["Get 1 in B's RAM"], False),
        ]
        one_per_home = all(n == h for n, h in zip(locates, asked))
        rows.append(Row(2, "Locates per Lookup 64 remote, mean", "Locates", statistics.fmean(locates),
                        "remote first homes of the chain, mean", statistics.fmean(asked), False, "one per home",
                        one_per_home, {"max": max(locates), "min": min(locates),
                                       "lookups_off": sum(n != h for n, h in zip(locates, asked))}))
        extra["samples_us"] = {s: [x * 1e6 for x in v] for s, v in samples.items()}
        extra["p50_us"], extra["p99_us"] = p50, p99

        progress(f"CPU per call: {n_chains} calls of each side alone")

        def lookup(request: Any, peer: int | None = None, ram: int | None = None) -> None:
            answer = b.stub.Lookup(request, timeout=30)
            if (peer is not None and answer.peer != peer) or (ram is not None and answer.ram != ram):
                raise RuntimeError(f"CPU phase: a Lookup answered peer {answer.peer}, ram {answer.ram}")

        def get(request: Any) -> None:
            if len(b.stub.Get(request, timeout=30).blocks) != 1:
                raise RuntimeError("CPU phase: a Get missed")

        def nothing() -> None:
            pass

        chain0 = state["chain"]
        cached = lookups[(chain0 + n_chains - 1) % n_chains]   # the last chain the remote side looks up
        cpu_sides: dict[str, tuple[Callable[[], None], Callable[[int], None], int, int]] = {
            "Lookup 64 remote": (nothing, lambda i: lookup(lookups[(chain0 + i) % n_chains], CHAIN), n_chains,
                                 sum(homes)),
            "Lookup 64 remote, cached": (nothing, lambda i: lookup(cached, CHAIN), n_chains, 0),   # right after it
            "single pull": (lambda: lookup(single_lookups[0], 1), lambda i: get(single_gets[0]), n_chains, 0),
            "Lookup 1 remote, home A": (nothing, lambda i: lookup(homed_lookups[i], 1), n_chains, n_chains),
            "Lookup 64 in B's RAM": (nothing, lambda i: lookup(own_lookup, ram=CHAIN), n_chains, 0),
            "Get 1 in B's RAM": (nothing, lambda i: get(own_get), n_chains, 0)}

        def cpu_check(name: str, before: Any, after: Any) -> None:
            want = cpu_sides[name][3]
            grown = after.cluster.locates - before.cluster.locates
            if grown != want:
                raise RuntimeError(f"CPU phase, {name}: {grown} Locates, {want} expected")
            if name == "single pull" and after.peer_pulled - before.peer_pulled != n_chains:
                raise RuntimeError(f"CPU phase: {after.peer_pulled - before.peer_pulled} of {n_chains} Gets pulled")

        cpu = cpu_phase(daemons, cpu_sides, cpu_check)
        extra["cpu_us_per_call"] = cpu
        for name, per in cpu.items():
            notes.append(f"CPU per call, {name}: " + ", ".join(f"{d[-1].upper()} {per[d]:,.0f} us" for d in NODES))
        rows += [Row(3, "B: Lookup 64 remote", "us", cpu["Lookup 64 remote"][ASKER], "B: single pull",
                     cpu["single pull"][ASKER], False),
                 Row(3, "B: Lookup 1 remote, home A", "us", cpu["Lookup 1 remote, home A"][ASKER], "B: single pull",
                     cpu["single pull"][ASKER], False),
                 Row(3, "B: Lookup 64 remote, cached", "us", cpu["Lookup 64 remote, cached"][ASKER], "B: Lookup 64 in B's RAM",
                     cpu["Lookup 64 in B's RAM"][ASKER], False),
                 Row(3, "A: a Locate answered (Lookup 1, home A)", "us", cpu["Lookup 1 remote, home A"][HOLDER],
                     "A: a single pull served", cpu["single pull"][HOLDER], False),
                 Row(3, "A+C+D: Lookup 64 remote", "us", sum(cpu["Lookup 64 remote"][n] for n in NODES if n != ASKER),
                     "A: a single pull served", cpu["single pull"][HOLDER], False)]
    extra["logs"] = logs
    return rows, notes, extra


def cpu_phase(daemons: dict[str, Daemon], sides: dict[str, tuple[Callable[[], None], Callable[[int], None], int, int]],
              check: Callable[[str, Any, Any], None]) -> dict[str, dict[str, float]]:
    """Per side, each daemon's CPU time per call (user + system, /proc; 10 ms ticks), the side
    run alone; each daemon's idle CPU rate (measured first) subtracted. ``sides``: name ->
    (prep, call(i), calls, Locates expected per call): ``prep`` runs before the count, ``call``
    makes the i-th call (no Stats between calls); B's Stats before and after the count must show
    the Locates expected (``check``)."""
    def now() -> dict[str, float]:
        return {n: sum(proc_times(d.proc.proc.pid)[:2]) for n, d in daemons.items()}

    b = daemons[ASKER]
    time.sleep(FRESH_S)                       # every location the timed calls asked for has expired
    c0, t0 = now(), time.monotonic()
    time.sleep(2.0)
    idle = {n: (c - c0[n]) / (time.monotonic() - t0) for n, c in now().items()}
    out: dict[str, dict[str, float]] = {}
    for name, (prep, call, calls, _) in sides.items():
        prep()
        before = b.stats()
        c0, t0 = now(), time.monotonic()
        for i in range(calls):
            call(i)
        c1, spent = now(), time.monotonic() - t0
        check(name, before, b.stats())
        out[name] = {n: max(0.0, (c1[n] - c0[n] - idle[n] * spent) / calls * 1e6) for n in daemons}
    return out


TITLES = {1: "1. On daemon B (4 daemons, loopback, tls lane), one call in flight; latency, lower is better",
          2: "2. Homes asked per Lookup (B's Stats.cluster.locates) against the chain's first homes other than B",
          3: "3. CPU time per call of one daemon (/proc: 10 ms ticks; each side run alone, idle rate subtracted)"}


def fmt(value: float, unit: str) -> str:
    return f"{value:,.0f} us" if unit == "us" else f"{value:.2f}"


def print_figures(rows: list[Row], header: str) -> None:
    print_fitted(rows, header, TITLES, fmt,
                 ["ratio = kvcached / baseline; p50 and p99 over every call of a side (the sides alternate call by call)."])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test (about 45 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--logs", metavar="DIR", help="keep the daemons' logs in DIR")
    args = parser.parse_args(argv)
    rows, notes, extra = run(args.quick)
    print_figures(rows, f"kvcached cluster Lookup benchmark ({os.uname().nodename}, {os.cpu_count()} CPUs)")
    for note in notes:
        print("note: " + note)
    logs = extra.pop("logs", {})
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        for name, text in logs.items():
            (Path(args.logs) / f"{name}.log").write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r.__dict__ for r in rows], "notes": notes, **extra},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
