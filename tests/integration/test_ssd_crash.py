"""Crash loop: a write-through daemon under a stream of Puts is killed with SIGKILL at random
moments, many times over, on the same index and SSD directory.

What is checked, and why:

- Under ``kv.write_policy = "write_through"`` a Put's OK means its new blocks are published on
  SSD under ``kv.ssd_durability``. Every mode ("always", "batch", "none") promises that a
  *process* crash loses nothing published (SIGKILL is a process crash: what the kernel has, it
  keeps). So after each restart every block acknowledged in any earlier iteration must be served,
  bit-exact (the client checks the BLAKE3 checksum the daemon sends; the test compares bytes
  too), with ``allow_partial=False``: a missing acknowledged block is a failure.
- A Put in flight at the kill was not acknowledged: its blocks may or may not be there, but a
  block that is served must be bit-exact. Later iterations put such batches again, as a client
  retrying would (the same address, the same bytes, often over an orphan file of the same name).
- Nothing corrupt is ever served, and a SIGKILL never leaves a damaged file behind: the boot
  reconcile finds no bad files (``bad_files=0``), nothing is quarantined, no daemon logs an error
  or a traceback (neither the gRPC Stats nor /metrics export the SSD corrupt counter, so the
  quarantine directory and the logs, where every quarantine is an error line, stand in for it).
  Temporary files of interrupted writes are removed by the reconcile.
- At the end, a daemon that is not killed serves everything acknowledged, its index lists each
  acknowledged block on SSD, the directory holds exactly one file per SSD record (no orphan, no
  temporary file), and it stops cleanly.
- Some iterations kill the daemon early: the writer hammers the socket before the daemon is
  started, so Puts race the boot reconcile, and the kill lands before ``ready``, during the
  reconcile or just after it.

The RAM arena is small (32 MiB) so most blocks read after a restart come from SSD files (after a
restart nothing is in RAM anyway) and promotions evict each other. Block sizes are mixed, 1 KiB to
1 MiB, page multiples and not. Payloads derive from (seed, serial number), so the test keeps no
bytes. The seed is printed; ``KVCACHED_CRASH_SEED`` replays one, ``KVCACHED_CRASH_ITERATIONS``
sets the iteration count of the main (batch) case for soak runs (the others get a third of it).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import blake3
import grpc
import pytest

from kvcached.client import ChecksumMismatch, KvCacheClient
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import CROSS_LAYER, BlockAddress

from .conftest import DaemonProcess

pytestmark = pytest.mark.integration

# 10 kills in `make test` (a new seed each run, so runs add up; its side cases 3 each); `make soak` runs 200.
MAIN_ITERATIONS = int(os.environ.get("KVCACHED_CRASH_ITERATIONS", "10"))
SIDE_ITERATIONS = max(2, MAIN_ITERATIONS // 3)
MAX_BLOCK = 1 << 20               # kv.max_block_mib = 1
# Per verifying Get. The blocks a Get promotes stay pinned until it answers, and each size class
# (28 of them up to 1 MiB) fills slabs of its own: 3 MiB of payload needs at most ~32 slabs even
# when every block is of another class, so a Get never asks more of the 32-slab arena than it has.
GET_CHUNK_BYTES = 3 << 20
GET_CHUNK_BLOCKS = 64
TMP_MARK = ".tmp-"
RECONCILED = "SSD tier reconciled"

CASES = [
    pytest.param("batch", "auto", MAIN_ITERATIONS, id="batch"),
    pytest.param("always", "off", SIDE_ITERATIONS, id="always-buffered"),
    pytest.param("none", "auto", SIDE_ITERATIONS, id="none"),
]


# -- the workload: blocks derived from (seed, serial) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    """One block of the workload; its address and payload are functions of (seed, serial)."""

    seed: int
    serial: int
    size: int

    @property
    def address(self) -> BlockAddress:
        digest = blake3.blake3(b"crash-loop address" + struct.pack("<QQ", self.seed, self.serial)).digest()
        layer = CROSS_LAYER if self.serial % 4 == 0 else self.serial % 61
        return BlockAddress(digest, layer)

    def payload(self) -> bytes:
        seed = b"crash-loop payload" + struct.pack("<QQ", self.seed, self.serial)
        return blake3.blake3(seed).digest(length=self.size)


Batch = list[Block]


class Workload:
    """Batches of 1..4 blocks of mixed sizes: mostly small, some page multiples, a few up to 1 MiB."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed ^ 0x5EED)
        self.serial = 0

    def _size(self) -> int:
        r = self.rng.random()
        if r < 0.55:
            return self.rng.randint(1000, 32 << 10)             # small, rarely a page multiple
        if r < 0.88:
            return 4096 * self.rng.randint(1, 16)               # page multiples up to 64 KiB
        if r < 0.98:
            return self.rng.randint(32 << 10, 256 << 10)
        return self.rng.choice([MAX_BLOCK, self.rng.randint(256 << 10, MAX_BLOCK)])

    def batch(self) -> Batch:
        out = []
        for _ in range(self.rng.randint(1, 4)):
            self.serial += 1
            out.append(Block(self.seed, self.serial, self._size()))
        return out


# -- the writer: a stream of Puts until the daemon is killed ---------------------------------------


class Writer(threading.Thread):
    """Puts batches back to back (first the ``retry`` batches of earlier iterations, then new ones)
    until :attr:`killed` is set and a Put fails. Records which batches were acknowledged (the Put
    returned OK) and which are in doubt (in flight at the kill, or not attempted again yet)."""

    def __init__(self, target: str, workload: Workload, retry: list[Batch], *, connected: bool) -> None:
        super().__init__(name="crash-loop-writer", daemon=True)
        self.target = target
        self.workload = workload
        self.pending = list(retry)
        self.connected = connected      # False: connection errors before the first OK are retried
        self.killed = threading.Event()
        self.acked: list[Batch] = []
        self.in_doubt: list[Batch] = []
        self.unexpected: list[str] = []
        self.cut = 0                    # Puts that failed because of the kill (0 or 1)

    def run(self) -> None:
        try:
            with KvCacheClient(self.target, timeout=15.0) as client:
                while not self.killed.is_set():
                    batch = self.pending.pop(0) if self.pending else self.workload.batch()
                    if not self._put(client, batch):
                        self.in_doubt.append(batch)
                        break
        except Exception as exc:    # a bug in the test itself: say so instead of dying silently
            self.unexpected.append(f"writer crashed: {exc!r}")
        finally:
            self.in_doubt += self.pending
            self.pending = []

    def _put(self, client: KvCacheClient, batch: Batch) -> bool:
        blocks = [(b.address, b.payload()) for b in batch]
        while True:
            try:
                client.put(blocks, model="crash-loop")
            except grpc.RpcError as exc:
                if self.killed.is_set():
                    self.cut += 1
                    return False
                if not self.connected and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.005)      # the daemon is not listening yet
                    continue
                self.unexpected.append(f"Put failed while the daemon was alive: {exc.code().name}: {exc.details()}")
                return False
            self.connected = True
            self.acked.append(batch)
            return True


# -- checks ------------------------------------------------------------------------------------------


@dataclass
class Tally:
    iterations: int = 0
    verified_restarts: int = 0
    blocks_checked: int = 0           # acknowledged blocks read back bit-exact, summed over restarts
    bytes_checked: int = 0
    doubtful_served: int = 0          # checks of in-doubt blocks that found them served (bit-exact)
    doubtful_absent: int = 0          # ... that found them absent
    corrupt_served: int = 0
    kills: dict[str, int] = field(default_factory=lambda: {"before ready": 0, "during reconcile": 0, "serving": 0})
    puts_acked: int = 0
    puts_cut: int = 0                 # Puts in flight at a kill (not acknowledged)
    verify_s: float = 0.0             # time spent reading blocks back


def _pair(address: BlockAddress | pb.BlockAddress) -> tuple[bytes, int]:
    """(digest, layer) of a client-side or a protobuf address."""
    if isinstance(address, BlockAddress):
        return address.digest, address.layer
    return address.digest, address.layer if address.HasField("layer") else CROSS_LAYER


def _chunks(blocks: Sequence[Block]) -> Iterator[list[Block]]:
    chunk: list[Block] = []
    nbytes = 0
    for b in blocks:
        if chunk and (nbytes + b.size > GET_CHUNK_BYTES or len(chunk) >= GET_CHUNK_BLOCKS):
            yield chunk
            chunk, nbytes = [], 0
        chunk.append(b)
        nbytes += b.size
    if chunk:
        yield chunk


def verify_acknowledged(client: KvCacheClient, blocks: Sequence[Block], tally: Tally) -> None:
    """Every block in ``blocks`` is served and bit-exact (Get with allow_partial=False)."""
    for chunk in _chunks(blocks):
        addresses = [b.address for b in chunk]
        try:
            fetched, _ = client.get(addresses, allow_partial=False)
        except ChecksumMismatch as exc:
            tally.corrupt_served += 1
            raise AssertionError(f"corrupt block served: {exc}") from None
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            _, misses = client.get(addresses, allow_partial=True)
            lost = {_pair(m.address): m.reason for m in misses}
            detail = "\n".join(f"  serial {b.serial} ({b.size} B) {b.address}: {lost[_pair(b.address)]}"
                               for b in chunk if _pair(b.address) in lost)
            raise AssertionError(f"{len(lost)} acknowledged block(s) not served after a restart:\n{detail}") from None
        assert [f.address for f in fetched] == addresses, "Get answered other blocks than asked"
        for b, f in zip(chunk, fetched):
            if f.payload != b.payload():
                tally.corrupt_served += 1
                raise AssertionError(f"block serial {b.serial} ({b.address}) served with other bytes")
            tally.blocks_checked += 1
            tally.bytes_checked += b.size


def verify_in_doubt(client: KvCacheClient, blocks: Sequence[Block], tally: Tally) -> None:
    """Blocks of unacknowledged Puts: absent is fine, served must be bit-exact."""
    for chunk in _chunks(blocks):
        try:
            fetched, _ = client.get([b.address for b in chunk], allow_partial=True)
        except ChecksumMismatch as exc:
            tally.corrupt_served += 1
            raise AssertionError(f"corrupt block served: {exc}") from None
        by_address = {f.address: f for f in fetched}
        for b in chunk:
            f = by_address.get(b.address)
            if f is None:
                tally.doubtful_absent += 1
            elif f.payload != b.payload():
                tally.corrupt_served += 1
                raise AssertionError(f"unacknowledged block serial {b.serial} ({b.address}) served with other bytes")
            else:
                tally.doubtful_served += 1


def tmp_files(ssd_dir: Path) -> set[Path]:
    blocks = ssd_dir / "blocks"
    return {p for p in blocks.glob("*/*/*") if TMP_MARK in p.name} if blocks.exists() else set()


def block_files(ssd_dir: Path) -> set[Path]:
    blocks = ssd_dir / "blocks"
    return set(blocks.glob("*/*/*.kvb")) if blocks.exists() else set()


def wait_for(condition: Callable[[], bool], timeout: float, what: str, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s:\n{log()[-4000:]}")
        time.sleep(0.01)


def check_logs(state: Path) -> int:
    """No daemon run logged a traceback or an error, every finished reconcile found no bad file,
    and nothing was quarantined. Returns how many reconciles finished."""
    reconciles = 0
    for path in sorted(state.glob("daemon-*.log")):
        text = path.read_text(errors="replace")
        assert "Traceback" not in text, f"{path.name} has a traceback:\n{text[-4000:]}"
        errors = [line for line in text.splitlines() if "level=error" in line or "level=critical" in line]
        assert not errors, f"{path.name} logged errors:\n" + "\n".join(errors[:20])
        for line in text.splitlines():
            if RECONCILED in line:
                reconciles += 1
                assert " bad_files=0 " in line, f"{path.name}: the reconcile found damaged files: {line}"
    quarantined = list((state / "ssd" / "quarantine").iterdir())
    assert not quarantined, f"files were quarantined (corrupt): {quarantined[:10]}"
    return reconciles


# -- the loop ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("durability", "direct_io", "iterations"), CASES)
@pytest.mark.slow
@pytest.mark.timeout(60 + 12 * MAIN_ITERATIONS)
def test_sigkill_loop_loses_no_acknowledged_block(make_daemon: Callable[..., DaemonProcess], tmp_path: Path,
                                                  durability: str, direct_io: str, iterations: int) -> None:
    """SIGKILL a write-through daemon ``iterations`` times under a stream of Puts; after every
    restart each acknowledged block is served bit-exact and nothing corrupt is served."""
    seed = int(os.environ.get("KVCACHED_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\ncrash loop ({durability}, direct_io={direct_io}): seed {seed} (KVCACHED_CRASH_SEED={seed} replays it)")
    rng = random.Random(seed)
    workload = Workload(seed)
    overrides = ['kv.write_policy="write_through"', f'kv.ssd_durability="{durability}"',
                 f'kv.ssd_direct_io="{direct_io}"', "kv.ram_gib=0.03125", "kv.max_block_mib=1", "kv.ssd_gib=4",
                 "grpc.grace_s=1"]
    state = tmp_path
    ssd_dir = state / "ssd"
    acked: dict[int, Block] = {}          # serial -> block, acknowledged in some iteration
    in_doubt: list[Batch] = []            # batches in flight at a kill, put again later
    tally = Tally()
    t0 = time.monotonic()

    def start(early: bool) -> DaemonProcess:
        return make_daemon(*overrides, state=state, start=False).start(wait=not early)

    writer: Writer | None = None
    try:
        for i in itertools.count():
            # Past the iterations asked for, only while no Put was ever acknowledged (on a busy
            # machine short runs may all be killed first): a served run, killed once one is.
            extra = i >= iterations
            if extra and (acked or i >= iterations + 3):
                break
            mode = "stream" if extra else rng.choices(["stream", "boot", "reconcile"], weights=[70, 10, 20])[0]
            stale = tmp_files(ssd_dir)        # left by the previous kill: the reconcile must remove them
            doubtful = [b for batch in in_doubt for b in batch if b.serial not in acked]
            if mode != "stream":
                # The writer is already knocking when the daemon starts: its first Puts race the boot
                # reconcile. "boot" kills at a random moment of the start-up (often before ready),
                # "reconcile" soon after ready, mostly while the reconcile still walks the directory.
                writer = Writer(f"unix:{state / 'kvcached.sock'}", workload, in_doubt, connected=False)
                writer.start()
                d = start(early=True)
                if mode == "boot":
                    time.sleep(rng.uniform(0.0, 0.4))
                else:
                    wait_for(lambda: "msg=ready" in d.log(), 20, "the daemon's ready line", d.log)
                    time.sleep(rng.uniform(0.0, 0.5))
            else:
                d = start(early=False)
                t_verify = time.monotonic()
                with d.client(timeout=30.0) as client:
                    verify_acknowledged(client, sorted(acked.values(), key=lambda b: b.serial), tally)
                    verify_in_doubt(client, doubtful, tally)
                tally.verify_s += time.monotonic() - t_verify
                tally.verified_restarts += 1
                wait_for(lambda: RECONCILED in d.log(), 20, "the SSD boot reconcile", d.log)
                leftover = tmp_files(ssd_dir)
                assert not leftover, f"iteration {i}: temporary files survive the reconcile: {sorted(leftover)[:10]}"
                writer = Writer(d.target, workload, in_doubt, connected=True)
                writer.start()
                time.sleep(rng.uniform(0.05, 1.5))
                if extra:
                    wait_for(lambda: bool(writer.acked), 20, "a first acknowledged Put", d.log)
            writer.killed.set()
            d.stop(signal.SIGKILL)
            log_before_kill = d.log()         # all the daemon wrote before it died
            writer.join(30)
            assert not writer.is_alive(), "the writer is stuck after the kill"
            assert not writer.unexpected, f"iteration {i} ({mode}): " + "; ".join(writer.unexpected)

            if "msg=ready" not in log_before_kill:
                tally.kills["before ready"] += 1
            elif RECONCILED not in log_before_kill:
                tally.kills["during reconcile"] += 1
            else:
                tally.kills["serving"] += 1
            if RECONCILED in log_before_kill:
                still = stale & tmp_files(ssd_dir)
                assert not still, f"iteration {i}: earlier temporary files survive the reconcile: {sorted(still)[:10]}"
            for batch in writer.acked:
                for b in batch:
                    acked[b.serial] = b
            in_doubt = writer.in_doubt
            tally.puts_acked += len(writer.acked)
            tally.puts_cut += writer.cut
            tally.iterations += 1
    finally:
        if writer is not None:     # a failed iteration must not leave the writer knocking
            writer.killed.set()

    # A last start that is not killed: everything acknowledged is served; after the reconcile the
    # SSD directory holds exactly the files the index claims, no temporary file, and a clean stop.
    d = start(early=False)
    with d.client(timeout=30.0) as client:
        verify_acknowledged(client, sorted(acked.values(), key=lambda b: b.serial), tally)
        verify_in_doubt(client, [b for batch in in_doubt for b in batch if b.serial not in acked], tally)
        tally.verified_restarts += 1
        wait_for(lambda: RECONCILED in d.log(), 20, "the SSD boot reconcile", d.log)
        on_ssd = {_pair(info.address) for info in client.list_blocks(tier=pb.TIER_SSD)}
    missing = [b for b in acked.values() if _pair(b.address) not in on_ssd]
    assert not missing, f"{len(missing)} acknowledged blocks are not on the SSD tier in the index"
    files = block_files(ssd_dir)
    assert len(files) == len(on_ssd), f"{len(files)} block files but {len(on_ssd)} index records on SSD (orphans?)"
    assert not tmp_files(ssd_dir)
    assert d.stop() == 0, d.log()[-4000:]
    reconciles = check_logs(state)
    assert tally.corrupt_served == 0
    assert acked, "no Put was ever acknowledged: the loop tested nothing"

    elapsed = time.monotonic() - t0
    kills = ", ".join(f"{n} {when}" for when, n in tally.kills.items())
    print(f"crash loop ({durability}): {tally.iterations} iterations (kills: {kills}), {len(acked)} acknowledged "
          f"blocks ({sum(b.size for b in acked.values()) / 2**20:.1f} MiB) in {tally.puts_acked} Puts; "
          f"{tally.blocks_checked} acknowledged blocks checked bit-exact ({tally.bytes_checked / 2**20:.0f} MiB) over "
          f"{tally.verified_restarts} restarts, {tally.corrupt_served} corrupt served; "
          f"{tally.puts_cut} Puts cut by a kill (in-doubt block checks: {tally.doubtful_served} served bit-exact, "
          f"{tally.doubtful_absent} absent); {reconciles} reconciles, 0 bad files; {elapsed:.1f} s "
          f"({tally.verify_s:.1f} s reading back)")
