"""A full index disk, on a real daemon (issue 20, part 6).

The index lives on a real 8 MiB tmpfs that a foreign file fills. Puts must be refused
UNAVAILABLE while reads go on; once the file is deleted the index must take writes again by
itself within seconds, no restart; and no block acknowledged before, during or after must be
lost, which a clean stop and a restart (the blocks come back from the SSD tier) show.
"""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import blake3
import grpc
import pytest

from kvcached_agent.address import BlockAddress
from tests.disks import fill, small_tmpfs
from tests.integration.conftest import DaemonProcess, wait_for

from .conftest import report

RECOVERY_WITHIN_S = 10.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "8m") as mnt:
        yield mnt


def block(seed: int, i: int, size: int = 4096) -> tuple[BlockAddress, bytes]:
    return (BlockAddress(blake3.blake3(b"disk-full %d %d" % (seed, i)).digest()),
            blake3.blake3(b"payload %d %d" % (seed, i)).digest(length=size))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


def put_refused(c, item: tuple[BlockAddress, bytes]) -> grpc.RpcError | None:  # type: ignore[no-untyped-def]
    try:
        c.put([item])
    except grpc.RpcError as err:
        return err
    return None


def assert_all_served(c, acked: dict[BlockAddress, bytes]) -> None:  # type: ignore[no-untyped-def]
    found, misses = c.get(list(acked))
    assert not misses, f"{len(misses)} acknowledged blocks missing: {misses[0]}"
    assert {f.address: f.payload for f in found} == acked


def test_puts_come_back_without_a_restart_once_the_index_disk_has_room(
        make_daemon, tmp_path: Path, small_disk: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    overrides = (f'kv.index_dir="{small_disk / "index"}"', f'metrics.listen="127.0.0.1:{port}"')
    d: DaemonProcess = make_daemon(*overrides)
    acked: dict[BlockAddress, bytes] = {}
    with d.client(timeout=10) as c:
        first = dict(block(1, i) for i in range(20))
        c.put(list(first.items()))
        acked |= first

        hog = fill(small_disk)
        refused = None
        for i in range(1000):                 # the page cache takes a few more writes, then RocksDB fails
            item = block(2, i)
            refused = put_refused(c, item)
            if refused is not None:
                break
            acked[item[0]] = item[1]
        assert refused is not None, "1000 puts on a full index disk were all accepted"
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "the index cannot be written" in refused.details() and "No space left on device" in refused.details()
        assert c.lookup([item[0].digest]).longest == 0, "the refused block was not kept"
        assert_all_served(c, acked)           # reads go on
        assert metric(port, "kvcached_index_writable") == 0
        assert metric(port, "kvcached_index_write_failures_total") >= 1

        time.sleep(2)                         # nothing comes back while the disk is still full
        still = put_refused(c, block(3, 0))
        assert still is not None and still.code() == grpc.StatusCode.UNAVAILABLE
        assert_all_served(c, acked)

        hog.unlink()
        t0 = time.monotonic()
        after = block(4, 0)
        wait_for(lambda: put_refused(c, after) is None, RECOVERY_WITHIN_S, "a put accepted after the disk was freed")
        recovered_s = time.monotonic() - t0
        acked[after[0]] = after[1]
        more = dict(block(5, i) for i in range(20))
        c.put(list(more.items()))
        acked |= more
        assert metric(port, "kvcached_index_writable") == 1
        assert metric(port, "kvcached_index_recoveries_total") == 1
        assert_all_served(c, acked)
    assert "the index is writable again" in d.log()
    assert "still not writable" not in d.log(), "the first reopen took RocksDB's lock: nothing held the old instance"

    # Nothing acknowledged was lost: the stop writes the dirty blocks back to SSD, the index
    # records them, and the next daemon serves every one of them from SSD.
    assert d.stop() == 0
    again = make_daemon(*overrides, state=tmp_path)
    with again.client(timeout=10) as c:
        assert_all_served(c, acked)
    report("index_disk_full", acked=len(acked), recovered_s=round(recovered_s, 2))
