"""A daemon without peers, a cluster or metrics starts without importing them: aioquic,
cryptography's X.509, etcd's client, numpy and prometheus_client cost a plain daemon about
0.25 s of its start (of 0.5 s), and the tests alone start some 600 daemons."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("aioquic", "etcd3aio", "numpy", "prometheus_client", "kvcached.peers.tier", "kvcached.cluster.etcd")


def test_the_daemon_module_imports_the_optional_tiers_only_when_they_are_configured() -> None:
    code = ("import sys, kvcached.lifecycle.daemon\n"
            f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"imported at start-up: {out}"
