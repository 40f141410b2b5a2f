"""Operations: what Prometheus scrapes, what systemd sees, and the deploy files, checked with
the real tools (promtool, systemd-analyze) against real daemon processes."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcached_agent.address import BlockAddress
from tests.integration.conftest import ROOT

KIB = 1 << 10
SMALL_RAM = ("kv.ram_gib=0.0078125", "kv.max_block_mib=1")   # 8 MiB arena


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make system-deps` installs it (make test does)")
    return path


def free_tcp_port() -> int:
    """A TCP port free on every address now, below the kernel's ephemeral range: the kernel hands
    ephemeral ports to outgoing connections (every test's clients, on two workers), so a port
    picked there could be taken between the pick and the daemon's bind (seen: "Address already
    in use" for a 0.0.0.0 listener)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page, keyed ``name{label="value",...}`` (labels sorted)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    checked = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, f"promtool check metrics:\n{checked.stdout}{checked.stderr}"
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_a_scrape_counts_what_the_daemon_did_and_passes_promtool(make_daemon) -> None:
    port = free_tcp_port()
    d = make_daemon(*SMALL_RAM, "kv.ssd_gib=0", f'metrics.listen="127.0.0.1:{port}"')
    first = [BlockAddress(os.urandom(32)) for _ in range(4)]
    unknown = [BlockAddress(os.urandom(32)) for _ in range(2)]
    with d.client() as c:
        c.put([(a, os.urandom(100 * KIB)) for a in first])
        c.get(first[:2])                                        # 2 RAM hits
        c.get([first[2], *unknown], allow_partial=True)         # 1 hit, 2 misses
        c.lookup([a.digest for a in first])                     # a lookup, all in RAM
        for _ in range(12):                                     # 12 MiB through an 8 MiB arena: evictions
            c.put([(BlockAddress(os.urandom(32)), os.urandom(100 * KIB)) for _ in range(10)])
        stats = c.stats()
    m = scrape(port)
    assert m["kvcached_puts_total"] == 124 == stats.puts
    assert m['kvcached_hits_total{tier="ram"}'] == 3 and m['kvcached_misses_total{tier="ram"}'] == 2
    assert 'kvcached_hits_total{tier="ssd"}' not in m and 'kvcached_hits_total{tier="peer"}' not in m
    evicted = m['kvcached_evictions_total{reason="capacity",tier="ram"}']
    assert evicted > 0 and evicted + m['kvcached_blocks{tier="ram"}'] == 124
    assert m['kvcached_lookup_seconds_count{outcome="hit",tier="ram"}'] == 2        # the Get and the Lookup
    assert m['kvcached_lookup_seconds_count{outcome="partial",tier="ram"}'] == 1
    assert m['kvcached_lookup_seconds_bucket{le="+Inf",outcome="hit",tier="ram"}'] == 2
    assert 0 < m['kvcached_lookup_seconds_sum{outcome="hit",tier="ram"}'] < 1
    assert not any('tier="ssd"' in k or 'tier="peer"' in k for k in m), "a tier this daemon does not run"
    assert m['kvcached_build_info{version="0.1.0"}'] == 1 and m["kvcached_agents_connected"] == 0
    assert m["kvcached_index_entries"] >= 1
    d.stop()


# ---------------------------------------------------------------------------------------------
# systemd


def test_the_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as shipped, with ExecStart pointing at this checkout's daemon (verify checks
    that the command exists; /opt/kvcached is where deploy/README.md installs it)."""
    import sys

    unit = (ROOT / "deploy" / "kvcached.service").read_text()
    assert "/opt/kvcached/.venv/bin/kvcached serve" in unit
    exe = Path(sys.executable).with_name("kvcached")
    (tmp_path / "kvcached.service").write_text(unit.replace("/opt/kvcached/.venv/bin/kvcached", str(exe)))
    r = subprocess.run([tool("systemd-analyze"), "verify", str(tmp_path / "kvcached.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kvcached.service" not in r.stderr, r.stderr


def test_readiness_watchdog_and_stopping_reach_notify_socket(make_daemon, tmp_path: Path) -> None:
    import time

    from kvcached.client import KvCacheClient

    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(20)
    port = free_tcp_port()
    d = make_daemon(f'metrics.listen="127.0.0.1:{port}"', start=False)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "400000"}     # a ping every 0.2 s
    from tests.integration.conftest import KVCACHED
    log = open(tmp_path / "daemon.log", "wb")
    d.proc = subprocess.Popen(KVCACHED + ["serve", *d.args()], cwd=tmp_path, stdout=log, stderr=log, env=env)
    try:
        stored = []         # the arena's two memfds go to the fd store first (docs/operations.md)
        while (first := sock.recv(4096).decode().split("\n"))[0].startswith("FDSTORE"):
            stored.append(first)
        assert sorted(m[1] for m in stored if m[0] == "FDSTORE=1") == ["FDNAME=kvcached-arena", "FDNAME=kvcached-slots"]
        assert first[0] == "READY=1" and f"MAINPID={d.proc.pid}" in first, first
        # READY came after every listener accepts: each answers now
        with KvCacheClient(d.target, timeout=2) as c:
            assert c.stats().puts == 0
        with socket.socket(socket.AF_UNIX) as agent:
            agent.connect(str(d.state / "agent.sock"))
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        t0 = time.monotonic()
        pings = []
        while time.monotonic() - t0 < 1.0:
            message = sock.recv(4096).decode().split("\n")
            if "WATCHDOG=1" in message:          # alone, or with a STATUS line (the SSD reconcile's)
                pings.append(time.monotonic())
        assert len(pings) >= 4, f"{len(pings)} watchdog pings in 1 s, expected one every 0.2 s"
        d.proc.send_signal(15)
        messages = []
        while not any(m.startswith("STOPPING=1") for m in messages):
            messages.append(sock.recv(4096).decode())
        assert d.proc.wait(20) == 0
    finally:
        log.close()
        sock.close()


# ---------------------------------------------------------------------------------------------
# Prometheus deploy files


@pytest.mark.parametrize("args", [["check", "config", "deploy/prometheus.yml"], ["check", "rules", "deploy/alerts.yml"],
                                  ["test", "rules", "tests/data/alerts_test.yml"]], ids=lambda a: " ".join(a[:2]))
def test_the_prometheus_files_pass_promtool(args: list[str]) -> None:
    r = subprocess.run([tool("promtool"), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr
