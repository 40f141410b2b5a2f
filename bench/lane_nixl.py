"""bench_lane's NIXL figures (issue 43): the NIXL lane against a bare NIXL transfer of the same bytes.

    python bench/lane_nixl.py --transports tcp [--quick] --json OUT     # one UCX transport set, one process

bench_lane runs this once per UCX transport set ("tcp"; "tcp,sm": the bytes over shared memory,
TCP for wire-up), each in a process of its own (UCX reads its transports when a process's first
NIXL agent starts). In that process, the same run, interleaved rounds of:

- "NIXL lane": a ``kvcached serve`` subprocess A (RAM only, ``quic.nixl = true`` on those
  transports) holds 64 blocks of 1 MiB put through gRPC; an in-process PeerTier with node-b's
  certificate and its own NIXL agent over a 64 MiB region pulls them with ``PeerTier.fetch``:
  NixlPull over QUIC, one NIXL READ of the 64 spans into the region, every block's BLAKE3 checked
  against the checksum from the session, NixlDone.
- "bare NIXL": a holder subprocess (this file with ``--bare-holder``: NIXL's own API for every
  call, no kvcached code on the transfer path) registers a region holding the same 64 payloads
  back to back; a reader here, also NIXL's API, READs the 64 spans into its own region, polling
  until done. No checksum. Both agents are built as the daemon's are, their progress threads
  sleeping 10 us between polls: with NIXL's default (no sleep) each idle agent spins a core, and
  on two cores the agents of one side would starve the other side's rounds.
- "bare NIXL + BLAKE3": the same, then each payload's BLAKE3 computed: the floor of what the
  lane must do.

GB/s of the median round; a ratio is the median over rounds of the two sides within the round.
Target (issue 43): the NIXL lane >= 0.8x the bare NIXL transfer over each transport set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
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

import bench_peers  # noqa: E402
from bench_core import MiB, progress  # noqa: E402
from bench_peers import LoopThread, _StubStore, digest_of, free_port, payload_of, quic_options  # noqa: E402

BLOCKS, SIZE = 64, 1 * MiB
POLL_S = 0.0002


def _nixl_api(transports: str) -> Any:
    os.environ["UCX_TLS"] = transports
    from nixl import _api
    return _api


def nixl_agent(api: Any, name: str) -> Any:
    """A NIXL agent built as the daemon's is (kvcached.peers.nixl_transfer.nixl_agent: its
    progress thread sleeps 10 us between polls); every transfer call on it is NIXL's own."""
    from kvcached.peers.nixl_transfer import nixl_agent as build
    return build(api, name)


def _read_all(agent: Any, local: Any, remote: Any, peer: str) -> None:
    """One READ of every span, polled until done: what a bare NIXL reader does."""
    handle = agent.initialize_xfer("READ", local, remote, peer)
    try:
        state = agent.transfer(handle)
        while state == "PROC":
            time.sleep(POLL_S)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"bare NIXL read failed: {state}")
    finally:
        agent.release_xfer_handle(handle)


def bare_holder_main(args: argparse.Namespace) -> int:
    api = _nixl_api(args.transports)
    region = mmap.mmap(-1, BLOCKS * SIZE)
    for i in range(BLOCKS):
        region[i * SIZE:(i + 1) * SIZE] = payload_of(SIZE, i)
    agent = nixl_agent(api, "bare-holder")
    base = _address(region)
    agent.register_memory([(base, len(region), 0, "")], "DRAM")
    Path(args.ready).write_text(json.dumps({"metadata": bytes(agent.get_agent_metadata()).hex(), "base": base}))
    while True:                            # until the benchmark stops it (SIGTERM)
        time.sleep(3600)


def _address(buffer: Any) -> int:
    import ctypes
    view = (ctypes.c_char * 1).from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class BareReader:
    """NIXL's API only: an agent over a region of its own, reading the holder's 64 spans."""

    def __init__(self, api: Any, offer: dict[str, Any]) -> None:
        self.region = mmap.mmap(-1, BLOCKS * SIZE)
        self.agent = nixl_agent(api, "bare-reader")
        base = _address(self.region)
        self.agent.register_memory([(base, len(self.region), 0, "")], "DRAM")
        peer = self.agent.add_remote_agent(bytes.fromhex(offer["metadata"]))
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.local = self.agent.get_xfer_descs([(base + i * SIZE, SIZE, 0) for i in range(BLOCKS)], "DRAM")
        self.remote = self.agent.get_xfer_descs([(offer["base"] + i * SIZE, SIZE, 0) for i in range(BLOCKS)], "DRAM")

    def batch(self, checksums: Sequence[bytes] | None = None) -> float:
        import blake3
        t0 = time.perf_counter()
        _read_all(self.agent, self.local, self.remote, self.peer)
        if checksums is not None:
            view = memoryview(self.region)
            for i, want in enumerate(checksums):
                if blake3.blake3(view[i * SIZE:(i + 1) * SIZE]).digest() != want:
                    raise RuntimeError("bare NIXL: a payload read is not the one held")
        return time.perf_counter() - t0


class LanePuller:
    """A PeerTier with node-b's certificate whose NIXL agent reads into a region of its own."""

    def __init__(self, lt: LoopThread, transports: str) -> None:
        from kvcached.peers.nixl_transfer import NixlEndpoint

        self.lt = lt
        self.region = mmap.mmap(-1, BLOCKS * SIZE)
        self.endpoint = NixlEndpoint("lane-puller", self.region, tuple(transports.split(",")))
        self.tier: Any = None

    async def open(self, port_a: int, certs: Path) -> None:
        from kvcached.peers.tier import PeerSettings, PeerTier
        from kvcached.peers.tls import PeerAuth

        auth = PeerAuth.from_files(str(certs / "ca.pem"), str(certs / "node-b.pem"), str(certs / "node-b-key.pem"),
                                   ["node-a"])
        settings = PeerSettings(listen=None, peers={"node-a": ("127.0.0.1", port_a)}, options=quic_options(16000),
                                pull_timeout_s=30.0, max_payload=16 * MiB, lane="quic")
        self.tier = PeerTier(_StubStore(), auth, settings, nixl=self.endpoint)
        await self.tier.start()
        deadline = time.monotonic() + 20
        while not (self.tier.links["node-a"].client is not None and self.tier.links["node-a"].client.verified):
            if time.monotonic() > deadline:
                raise RuntimeError("the in-process PeerTier did not connect to node-a")
            await asyncio.sleep(0.02)
        self.tier.locator.directory.announce("node-a", [bench_peers.wire(digest_of(SIZE, i)) for i in range(BLOCKS)])

    async def batch(self) -> float:
        from kvcached_agent.address import BlockAddress

        addresses = [BlockAddress(digest_of(SIZE, i)) for i in range(BLOCKS)]
        view = memoryview(self.region)
        slot = {a.key: i for i, a in enumerate(addresses)}

        def reserve(address: Any, length: int) -> tuple[Any, memoryview]:
            i = slot[address.key]
            return i, view[i * SIZE:i * SIZE + length]

        t0 = time.perf_counter()
        got = await self.tier.fetch(addresses, reserve, lambda handle: None)
        dt = time.perf_counter() - t0
        if len(got) != BLOCKS:
            raise RuntimeError(f"the NIXL lane got {len(got)} of {BLOCKS} blocks: {self.tier.nixl_stats()}")
        return dt

    async def close(self) -> None:
        if self.tier is not None:
            await self.tier.stop()             # closes the endpoint too


def interleaved(sides: dict[str, Callable[[], float]], rounds: int, seconds: float) -> dict[str, list[float]]:
    """GB/s of each side per round, the sides in order, then reversed, each until its clocked time
    reaches ``seconds``."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            clocked, moved = 0.0, 0
            while clocked < seconds:
                clocked += sides[name]()
                moved += BLOCKS * SIZE
            out[name].append(moved / clocked / 1e9)
    return out


def side_main(args: argparse.Namespace) -> int:
    import blake3

    from kvcached.client import KvCacheClient
    from kvcached.peers.certs import make_cluster

    rounds, seconds = (1, 0.3) if args.quick else (5, 1.0)
    payloads = [payload_of(SIZE, i) for i in range(BLOCKS)]
    checksums = [blake3.blake3(p).digest() for p in payloads]
    with tempfile.TemporaryDirectory(prefix="kvcbench-nixl-") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        certs = tmp / "certs"
        make_cluster(certs, ["node-a", "node-b"])
        port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        transports = json.dumps(args.transports.split(","))
        progress(f"NIXL over {args.transports}: starting daemon A (quic.nixl on)")
        bench_peers.LANE = "quic"
        bench_peers.start_daemon(stack, tmp / "a", certs, "node-a", "node-b", port_a, port_b, 0.25, 16000,
                                 extra=["quic.nixl=true", f"quic.nixl_transports={transports}"])
        client = KvCacheClient(f"unix:{tmp}/a/kvcached.sock", max_message_mib=64, timeout=120)
        stack.callback(client.close)
        bench_peers.put_blocks(client, SIZE, BLOCKS, payloads)
        ready = tmp / "bare.ready"
        holder = bench_peers.Proc("bare NIXL holder", [sys.executable, str(Path(__file__).resolve()), "--bare-holder",
                                                       "--transports", args.transports, "--ready", str(ready)],
                                  cwd=tmp, log=tmp / "bare.log")
        stack.callback(holder.stop)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if not holder.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bare NIXL holder not up:\n{holder.tail()}")
            time.sleep(0.05)
        time.sleep(0.1)
        api = _nixl_api(args.transports)
        bare = BareReader(api, json.loads(ready.read_text()))
        lt = LoopThread()
        stack.callback(lt.close)
        lane = LanePuller(lt, args.transports)
        stack.callback(lambda: lt.call(lane.close(), 10))
        lt.call(lane.open(port_a, certs), 30)
        lt.call(lane.batch())                          # warm: the metadata, UCX's endpoints
        if bytes(lane.region[:SIZE * 2]) != payloads[0] + payloads[1]:
            raise RuntimeError("the NIXL lane did not bring back the bytes put")
        bare.batch(checksums)
        progress(f"NIXL over {args.transports}: {rounds} round(s) of {seconds:g} s per side")
        gbs = interleaved({"NIXL lane": lambda: lt.call(lane.batch()), "bare NIXL": bare.batch,
                           "bare NIXL + BLAKE3": lambda: bare.batch(checksums)}, rounds, seconds)
        stats = lane.tier.nixl_stats()
        Path(args.json).write_text(json.dumps({"gbs": gbs, "pulled": stats["pull_pulled"],
                                               "fallbacks": stats["pull_fallbacks"], "corrupt": stats["pull_corrupt"]}))
    return 0


def nixl_rows(quick: bool, figure: int) -> tuple[list[Any], list[str]]:
    """bench_lane's NIXL figure: one process per transport set (see the module)."""
    from bench_core import Row

    rows: list[Any] = []
    notes: list[str] = []
    try:
        import nixl  # noqa: F401
    except ImportError:
        return rows, ["NIXL is not installed here: no NIXL figures (make nixl installs it)"]
    for transports in ("tcp", "tcp,sm"):
        with tempfile.TemporaryDirectory(prefix="kvcbench-nixl-out-") as out_s:
            out = Path(out_s) / "out.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--transports", transports, "--json", str(out)]
            import subprocess
            done = subprocess.run(argv + (["--quick"] if quick else []), stdout=subprocess.DEVNULL, timeout=600)
            if done.returncode != 0 or not out.exists():
                notes.append(f"NIXL over {transports}: the run failed (exit {done.returncode}); no figures")
                continue
            result = json.loads(out.read_text())
        gbs = result["gbs"]
        med = {name: statistics.median(v) for name, v in gbs.items()}

        def paired(side: str, base: str) -> float:
            return statistics.median(a / b for a, b in zip(gbs[side], gbs[base]))

        name = f"{SIZE // MiB} MiB x{BLOCKS}, UCX {transports}"
        ratio = paired("NIXL lane", "bare NIXL")
        rows.append(Row(figure, f"NIXL lane, {name}", "GB/s", med["NIXL lane"], "bare NIXL", med["bare NIXL"], True,
                        ">= 0.8x", ratio >= 0.8, {"rounds": gbs}, paired_ratio=ratio))
        rows.append(Row(figure, f"NIXL lane, {name}", "GB/s", med["NIXL lane"], "bare NIXL + BLAKE3",
                        med["bare NIXL + BLAKE3"], True, details={"rounds": gbs},
                        paired_ratio=paired("NIXL lane", "bare NIXL + BLAKE3")))
        notes.append(f"NIXL over {transports}: {result['pulled']} blocks read over NIXL, {result['fallbacks']} "
                     f"fallbacks, {result['corrupt']} refused")
    return rows, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--bare-holder", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_holder:
        return bare_holder_main(args)
    if not args.json:
        parser.error("--json PATH is required")
    return side_main(args)


if __name__ == "__main__":
    sys.exit(main())
