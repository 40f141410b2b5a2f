"""A flood of Initial-shaped datagrams at a live daemon's [quic] port, while a real peer pulls.

The sender has no certificate. Part of the flood never answers (spoofed or silent addresses:
each datagram a new connection ID, no token), part answers every Retry with its token (a sender
that owns its addresses): the daemon may hold no state for the first and only its bounded
handshake table for the second. Counted: datagrams sent, Retry tokens returned, RSS and open
fds of the flooded daemon before, at its peak and after, and the peer's pulls meanwhile (each
checked bit for bit). `make test` sends 60,000 datagrams from 128 source addresses; `make soak`
sends 1,000,000 from 1,024; both at 20,000 a second (faster, the kernel drops most of them
before the daemon sees them, which tests less).
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_peers import Cluster, blocks, connected

from .conftest import open_fds, report, rss_kib
from .flood import FloodResult, flood

MIB = 1 << 10     # rss_kib is in KiB


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(kvcached_quic_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@dataclass
class Pulls:
    """A peer's Gets of blocks only the flooded daemon holds, in a loop, each checked."""

    node: DaemonProcess
    data: dict
    ok: int = 0
    missed: int = 0
    wrong: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with self.node.client(timeout=10) as client:
            while not self.stop.is_set():
                got, missing = client.get(list(self.data), allow_partial=True, verify=False)
                self.missed += len(missing)
                for block in got:
                    if block.payload == self.data[block.address]:
                        self.ok += 1
                    else:
                        self.wrong += 1
                time.sleep(0.01)


@dataclass
class Peak:
    """The flooded daemon's largest RSS, sampled every 50 ms."""

    pid: int
    kib: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            self.kib = max(self.kib, rss_kib(self.pid))
            time.sleep(0.05)


def flood_while_pulling(root: Path, count: int, sources: int, *, rate: float, handshake_timeout_s: float = 1.0) -> None:
    cluster = Cluster(root, ("node-a", "node-b"))
    metrics = free_tcp_port()
    try:
        a = cluster.daemon("node-a", f'metrics.listen="127.0.0.1:{metrics}"',
                           f"quic.handshake_timeout_s={handshake_timeout_s}")
        b = cluster.daemon("node-b", "kv.mirror_pulls=false")
        wait_for(lambda: connected(b, "node-a"), text="b connected to a")
        data = blocks(8, seed=11)
        with a.client() as client:
            client.put(list(data.items()))
        wait_for(lambda: b.client().lookup([x.digest for x in data]).peer == 8, text="b learns a's blocks")

        pid = a.proc.pid               # type: ignore[union-attr]
        time.sleep(0.5)
        rss_before, fds_before = rss_kib(pid), open_fds(pid)
        pulls, peak = Pulls(b, data), Peak(pid, rss_before)
        workers = [threading.Thread(target=pulls.run), threading.Thread(target=peak.run)]
        for w in workers:
            w.start()
        try:
            time.sleep(0.3)
            before_flood = pulls.ok
            target = ("127.0.0.1", int(cluster.addresses["node-a"].rsplit(":", 1)[1]))
            silent = flood(target, count // 2, sources=sources, rate=rate)
            answering = flood(target, count - count // 2, sources=sources, rate=rate, answer_retries=True)
            during = pulls.ok - before_flood
            held = scrape(metrics)
        finally:
            time.sleep(handshake_timeout_s + 1.5)          # every handshake past its timeout
            pulls.stop.set()
            peak.stop.set()
            for w in workers:
                w.join(30)
        after = scrape(metrics)
        rss_after, fds_after = rss_kib(pid), open_fds(pid)
        sent = FloodResult(silent.sent + answering.sent, silent.refused + answering.refused,
                           silent.seconds + answering.seconds, sources, answering.validated)
        report("quic-flood", datagrams=sent.sent, not_sent=sent.refused, sources=sources,
               tokens_returned=sent.validated, seconds=round(sent.seconds, 1),
               retries=int(after["kvcached_quic_retries_total"]),
               handshakes_at_end_of_flood=int(held["kvcached_quic_handshakes"]),
               refused=";".join(f"{k.split('=')[1][1:-2]}:{int(v)}" for k, v in after.items()
                                if k.startswith("kvcached_quic_refused_total")),
               rss_mib_before=round(rss_before / MIB, 1), rss_mib_peak=round(peak.kib / MIB, 1),
               rss_mib_after=round(rss_after / MIB, 1), fds_before=fds_before, fds_after=fds_after,
               pulls_ok_during=during, pulls_ok=pulls.ok, missed=pulls.missed, wrong=pulls.wrong)

        assert sent.validated > 0, "no Retry came back: the flood did not reach the address-validation path"
        assert after["kvcached_quic_retries_total"] > 0
        assert held["kvcached_quic_handshakes"] <= 64                    # the table's bound (default)
        assert after["kvcached_quic_handshakes"] == 0                    # all dropped at their timeout
        assert after["kvcached_quic_connections"] == 1                   # b, still connected
        assert peak.kib - rss_before < 48 * MIB, "connection state grew with the flood"
        assert rss_after - rss_before < 48 * MIB
        assert abs(fds_after - fds_before) <= 2
        assert pulls.wrong == 0
        assert during > 0, "the peer's pulls stopped during the flood"
        assert connected(b, "node-a")
        with b.client() as client:                                        # and go on after it
            got, missing = client.get(list(data))
            assert not missing and all(block.payload == data[block.address] for block in got)
        c = cluster.daemon("node-b", "kv.mirror_pulls=false", start=False)   # a peer that dials now gets in
        b.stop()
        c.start()
        wait_for(lambda: connected(c, "node-a"), text="a new connection after the flood")
    finally:
        cluster.stop()


def test_a_flood_of_initials_buys_bounded_state_and_peers_keep_pulling(tmp_path: Path) -> None:
    flood_while_pulling(tmp_path, 60_000, 128, rate=20_000)


@pytest.mark.soak
def test_soak_a_million_initials_from_a_thousand_sources(tmp_path: Path) -> None:
    flood_while_pulling(tmp_path, 1_000_000, 1024, rate=20_000, handshake_timeout_s=5.0)
