"""Every grpcurl recipe in docs/admin.md, run in order with the real grpcurl binary against a
live daemon configured as the page says, and its answer compared with the one shown there:
a line ``...`` stands for any lines, ``<...>`` inside a line for any text."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from kvcached.peers.certs import make_cluster
from tests.integration.conftest import ROOT, grpcurl_binary
from tests.integration.test_operations import free_tcp_port

DOC = ROOT / "docs" / "admin.md"


def recipes(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected answer lines) of every ``console`` block."""
    out = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        lines = block.rstrip("\n").split("\n")
        assert lines[0].startswith("$ "), f"a console block starts with its command: {lines[0]!r}"
        out.append((lines[0][2:], lines[1:]))
    return out


def line_matches(pattern: str, line: str) -> bool:
    regex = ".*".join(re.escape(part) for part in pattern.split("<...>"))
    return re.fullmatch(regex, line) is not None


def answer_matches(expected: list[str], actual: list[str]) -> bool:
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(answer_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and line_matches(expected[0], actual[0]) and answer_matches(expected[1:], actual[1:])


def test_the_matcher() -> None:
    assert answer_matches(["{", "...", "}"], ["{", "  a", "  b", "}"])
    assert answer_matches(['  "x": <...>,'], ['  "x": 1.5,'])
    assert not answer_matches(["{", "}"], ["{", "  a", "}"])
    assert not answer_matches(['  "x": 1'], ['  "x": 12'])


def test_every_recipe_in_admin_md_answers_as_documented(make_daemon, tmp_path: Path) -> None:
    text = DOC.read_text()
    found = recipes(text)
    commands = " ".join(c for c, _ in found)
    for task in ("list", "describe", "Health/Check", "KvCache/Stats", "KvCache/Lookup", "Admin/Evict",
                 "Admin/Drain", "Admin/GetConfig", "Admin/ListAgents", "Admin/ListPeers", "Admin/ReconcileStatus",
                 "Admin/SetLogLevel"):
        assert task in commands, f"docs/admin.md has no recipe for {task}"
    var = tmp_path / "var"
    var.mkdir()
    certs, _ = make_cluster(var / "certs", ["node-a", "ops-alice"])
    cert, key = certs.nodes["node-a"]
    mtls, read_only = free_tcp_port(), free_tcp_port()
    d = make_daemon('grpc.listen=["unix:var/kvcached.sock", "127.0.0.1:7401"]', "grpc.tls=true",
                    f'grpc.tls_cert="{cert}"', f'grpc.tls_key="{key}"', f'grpc.tls_ca="{certs.ca}"',
                    'grpc.read_only_listen=["127.0.0.1:7402"]', 'kv.write_policy="write_through"', start=False)
    # the page's ports, swapped for free ones; its relative paths hold because the daemon and
    # grpcurl both run in tmp_path
    d.overrides = [o.replace("7401", str(mtls)).replace("7402", str(read_only)) for o in d.overrides]
    d.socket.parent.mkdir(exist_ok=True)
    (tmp_path / "kvcached.sock").symlink_to(var / "kvcached.sock")    # where the fixture waits for it
    d.start()
    grpcurl = grpcurl_binary()
    def ports(text: str) -> str:
        return text.replace("7401", str(mtls)).replace("7402", str(read_only))

    for command, expected in found:
        expected = [ports(line) for line in expected]
        argv = shlex.split(ports(command))
        assert argv[0] == "grpcurl", command
        r = subprocess.run([grpcurl, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=30)
        actual = (r.stdout + r.stderr).rstrip("\n").split("\n")
        assert answer_matches(expected, actual), (f"docs/admin.md: `{command}` answered\n" + "\n".join(actual)
                                                  + "\n\nthe page shows\n" + "\n".join(expected))
    d.stop()
