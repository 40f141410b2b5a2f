"""NIXL moves byte ranges between two processes' registered regions (kvcached.peers.nixl_transfer),
bit-exact over each UCX transport this machine has (TCP, shared memory), and a holder that is
gone fails a read within its timeout instead of hanging the puller."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import blake3
import pytest

from tests.integration.conftest import ROOT

pytest.importorskip("nixl", reason="NIXL is not installed here: make nixl (make test installs it)")

SIZE = 80 << 20
SEED = 7


def holder(transports: str, regions: int = 1) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.nixl_peer", "holder", str(SIZE), str(SEED), transports,
                             str(regions)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the holder did not start"
    return proc, json.loads(line)


def pull(transports: str, job: dict[str, object], timeout: float = 60, regions: int = 1) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "tests.nixl_peer", "puller", str(SIZE), transports, str(regions)],
                         cwd=ROOT,
                         input=json.dumps(job) + "\n", capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("transports", ["tcp", "tcp,sm"])   # sm: shared memory (tcp: the wire-up and failure detection NIXL needs)
def test_ranges_read_over_nixl_are_bit_exact(transports: str) -> None:
    proc, offer = holder(transports)
    try:
        data = random.Random(SEED).randbytes(SIZE)
        spans = [(0, 0, 1 << 20), (5 << 20, 1 << 20, 64 << 10), ((64 << 20) + 3, 2 << 20, 1 << 20),
                 *[((8 + i) << 20, (4 + i) << 20, 1 << 20) for i in range(64)]]
        got = pull(transports, {**offer, "spans": spans, "timeout_s": 30})
        assert got.get("hashes") == [blake3.blake3(data[r:r + n]).hexdigest() for r, _, n in spans], got
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def test_a_read_from_a_holder_that_is_gone_fails_within_its_timeout() -> None:
    proc, offer = holder("tcp")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    started = time.monotonic()
    got = pull("tcp", {**offer, "spans": [(0, 0, 1 << 20)], "timeout_s": 5})
    assert "error" in got, got
    assert time.monotonic() - started < 30


def test_ranges_of_several_registered_regions_are_read_as_one_run() -> None:
    """A daemon with tenants registers every tenant's arena (kvcached.tiers.arenas): NIXL reads
    spans from the holder's second and fourth region into the puller's own regions, bit-exact,
    and refuses a span that would run across two regions."""
    proc, offer = holder("tcp", regions=4)
    try:
        assert len(offer["bases"]) == 4 and offer["size"] == SIZE   # type: ignore[arg-type]
        quarter = SIZE // 4
        data = random.Random(SEED).randbytes(SIZE)
        spans = [(quarter + 5, 0, 1 << 20), (3 * quarter, 2 * quarter + 7, 64 << 10), (0, quarter, 4096)]
        got = pull("tcp", {**offer, "spans": spans, "timeout_s": 30}, regions=4)
        assert got.get("hashes") == [blake3.blake3(data[r:r + n]).hexdigest() for r, _, n in spans], got
        across = pull("tcp", {**offer, "spans": [(quarter - 10, 0, 20)], "timeout_s": 10}, regions=4)
        assert "across two regions" in str(across.get("error", "")) or "outside" in str(across.get("error", "")), across
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)
