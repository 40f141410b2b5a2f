"""A soak: one daemon with an SSD tier under a mixed, partly hostile load for minutes, its memory
and file descriptors sampled as it goes (`make soak`; ``KVCACHED_SOAK_S`` sets the length,
default 300 s).

The load, from three clients at once: Puts of new blocks (RAM fills, demotion and SSD eviction
run all the time), Gets of recent and old blocks (promotions from SSD, misses), the largest
Lookups the API allows, Deletes, and requests the daemon must refuse (unknown blocks, bad
digests, oversize batches). What must hold: every block read back is bit-exact (the client
checks each BLAKE3 checksum), nothing errors but the refusals, and after a warm-up the daemon's
RSS and open fds stop growing (a leak shows as a steady climb over the whole run).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import blake3
import grpc
import pytest

from kvcached_agent.address import BlockAddress
from tests.integration.conftest import DaemonProcess

from .conftest import open_fds, report, rss_kib

SOAK_S = float(os.environ.get("KVCACHED_SOAK_S", "300"))


def block(n: int) -> tuple[BlockAddress, bytes]:
    size = (16 << 10, 64 << 10, 200_000, 256 << 10)[n % 4]       # a few sizes, as engines' blocks are
    return BlockAddress(blake3.blake3(b"soak-%d" % n).digest()), blake3.blake3(b"soak-payload-%d" % n).digest(length=size)


@dataclass
class Load:
    daemon: DaemonProcess
    stop: threading.Event = field(default_factory=threading.Event)
    written: int = 0
    read_ok: int = 0
    missed: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)

    def writer(self) -> None:
        with self.daemon.client(timeout=30) as c:
            n = 0
            while not self.stop.is_set():
                c.put([block(i) for i in range(n, n + 16)])
                n += 16
                self.written = n
                if n % 512 == 0:
                    c.delete([block(i)[0] for i in range(n - 512, n - 480)])

    def reader(self) -> None:
        rng = random.Random(1)
        with self.daemon.client(timeout=30) as c:
            while not self.stop.is_set():
                top = max(self.written, 1)
                wanted = [block(rng.randrange(max(0, top - 64), top)) for _ in range(4)]
                wanted += [block(rng.randrange(top)) for _ in range(4)]
                got, misses = c.get([a for a, _ in wanted], allow_partial=True)
                expect = dict(wanted)
                for f in got:
                    if f.payload != expect[f.address]:
                        self.errors.append(f"wrong bytes for {f.address}")
                self.read_ok += len(got)
                self.missed += len(misses)

    def hostile(self) -> None:
        rng = random.Random(2)
        with self.daemon.client(timeout=60) as c:
            while not self.stop.is_set():
                what = rng.randrange(3)
                try:
                    if what == 0:
                        c.lookup([os.urandom(32) for _ in range(4096)])
                    elif what == 1:
                        c.get([BlockAddress(os.urandom(32)) for _ in range(256)], allow_partial=True)
                    else:
                        c.lookup([b"short"])
                        self.errors.append("a 5-byte digest was accepted")
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        self.errors.append(f"{exc.code()}: {exc.details()}")
                    self.refused += 1


def run_soak(make_daemon: Callable[..., DaemonProcess], seconds: float) -> None:
    d = make_daemon('kv.write_policy="write_back"', "kv.ram_gib=0.125", "kv.ssd_gib=0.25")
    pid = d.proc.pid                     # type: ignore[union-attr]
    load = Load(d)
    threads = [threading.Thread(target=t, daemon=True) for t in (load.writer, load.reader, load.hostile)]
    for t in threads:
        t.start()
    samples: list[tuple[float, int, int]] = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds and not load.errors:
            time.sleep(min(5.0, seconds / 20))
            samples.append((time.monotonic() - start, rss_kib(pid), open_fds(pid, but_under=d.state / "index")))
    finally:
        load.stop.set()
        for t in threads:
            t.join(60)
    warm = [s for s in samples if s[0] >= seconds / 4] or samples
    first, last = warm[0], warm[-1]
    peak = max(s[1] for s in samples)
    report("soak", seconds=round(samples[-1][0]), blocks_written=load.written, blocks_read_bit_exact=load.read_ok,
           misses=load.missed, refused=load.refused, errors=len(load.errors),
           rss_mib_after_warmup=round(first[1] / 1024, 1), rss_mib_end=round(last[1] / 1024, 1),
           rss_mib_peak=round(peak / 1024, 1), fds_after_warmup=first[2], fds_end=last[2],
           index_files_open_end=open_fds(pid) - open_fds(pid, but_under=d.state / "index"))
    assert not load.errors, load.errors[:5]
    assert load.written > 0 and load.read_ok > 0 and load.refused > 0
    assert last[1] - first[1] < 64 * 1024, "RSS kept growing after the warm-up"
    assert last[2] - first[2] <= 4, "file descriptors kept growing"
    assert d.stop() == 0, d.log()[-4000:]


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 300)
def test_soak_mixed_load_holds_memory_and_fds(make_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    run_soak(make_daemon, SOAK_S)
