"""Modes of what the daemon owns do not depend on the umask it was started under (issue 20, part 5).

Real daemons started by hand under umask 000 (outside systemd and its UMask=0007) must still
create every state directory 0700 and every file without group or other bits, and refuse to
start on a state directory other users could write to. Plaintext listeners on any loopback
address (all of 127.0.0.0/8, ::1) are allowed without grpc.insecure.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import blake3
import pytest

from kvcached.client import KvCacheClient
from kvcached.config import ConfigError, load_config
from kvcached.host.fsmodes import UnsafeDirectory, check_state_dir, make_dirs, socket_dir_mode
from kvcached_agent.address import BlockAddress
from tests.integration.conftest import DaemonProcess


def started_under_umask(d: DaemonProcess, umask: int, wait: bool = True) -> DaemonProcess:
    """Start ``d`` as a shell would under ``umask`` (the child inherits it)."""
    old = os.umask(umask)
    try:
        d.start(wait=False)
    finally:
        os.umask(old)
    if wait:
        d.wait_ready()
    return d


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def state_tree(*tops: Path) -> tuple[list[Path], list[Path]]:
    """(directories, files) under ``tops``, the tops included."""
    dirs, files = [], []
    for top in tops:
        dirs.append(top)
        for root, names, leaves in os.walk(top):
            dirs += [Path(root, n) for n in names]
            files += [Path(root, n) for n in leaves]
    return dirs, files


# ---------------------------------------------------------------------------------------------
# kvcached.host.fsmodes on its own


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277])
def test_make_dirs_gives_the_exact_mode_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        created = make_dirs(tmp_path / "a" / "b" / "c")
        shared = make_dirs(tmp_path / "s" / "t", socket_dir_mode(0o666))
    finally:
        os.umask(old)
    assert created == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "c")]
    assert [mode(Path(p)) for p in created] == [0o700] * 3
    assert [mode(Path(p)) for p in shared] == [0o711] * 2, "search, never list or write, for others"
    assert make_dirs(tmp_path / "a" / "b" / "c") == [], "what exists is left alone"


def test_make_dirs_sets_the_group_and_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another group")
    (created,) = make_dirs(tmp_path / "run", 0o710, gid=65534)
    assert (Path(created).stat().st_gid, mode(Path(created))) == (65534, 0o710)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        make_dirs(tmp_path / "file" / "sub")


@pytest.mark.parametrize("socket_mode, expected", [(0o600, 0o700), (0o660, 0o710), (0o666, 0o711), (0o606, 0o701)])
def test_socket_directories_let_in_whom_the_socket_admits(socket_mode: int, expected: int) -> None:
    assert socket_dir_mode(socket_mode) == expected


def test_check_state_dir_follows_a_symlink_to_the_directory_it_names(tmp_path: Path) -> None:
    (tmp_path / "disk" / "ssd").mkdir(parents=True, mode=0o700)
    (tmp_path / "ssd").symlink_to(tmp_path / "disk" / "ssd")
    assert check_state_dir(tmp_path / "ssd", levels=3) == []
    (tmp_path / "disk" / "ssd").chmod(0o757)
    with pytest.raises(UnsafeDirectory, match=f"{tmp_path / 'disk' / 'ssd'} is writable by every user"):
        check_state_dir(tmp_path / "ssd", levels=3)


# ---------------------------------------------------------------------------------------------
# real daemons


def test_state_created_under_umask_000_is_private(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run" / "kvcached"                    # the agent socket's directories do not exist yet
    d = started_under_umask(make_daemon('kv.write_policy="write_through"', f'agent.socket="{run / "agent.sock"}"',
                                        start=False), 0o000)
    data = {BlockAddress(blake3.blake3(b"modes %d" % i).digest()): blake3.blake3(b"p %d" % i).digest(length=8192)
            for i in range(64)}
    with d.client() as c:
        c.put(list(data.items()))                           # write_through: on SSD, in many leaf directories
        found, _ = c.get(list(data))
        assert len(found) == len(data)
    assert mode(d.socket) == 0o660 and mode(run / "agent.sock") == 0o660, "the configured socket modes"
    assert mode(run) == mode(run.parent) == socket_dir_mode(0o660) == 0o710, "search only, for the group"
    assert d.stop() == 0                                    # the close writes RocksDB's last files too

    dirs, files = state_tree(tmp_path / "index", tmp_path / "ssd")
    leaves = [p for p in dirs if p.parent.parent.name == "blocks"]
    assert len(leaves) >= 16 and any(p.name.endswith(".kvb") for p in files), "blocks reached SSD leaf directories"
    assert {str(p): oct(mode(p)) for p in dirs if mode(p) != 0o700} == {}
    assert {str(p): oct(mode(p)) for p in files if mode(p) & 0o077} == {}


def test_a_group_writable_state_directory_is_tightened(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What earlier versions made under systemd's UMask=0007: the group may not write any more."""
    for path in (tmp_path / "index", tmp_path / "ssd" / "blocks" / "ab" / "c"):
        path.mkdir(parents=True)
    for path in (tmp_path / "index", tmp_path / "ssd", tmp_path / "ssd" / "blocks" / "ab" / "c"):
        path.chmod(0o770)
    d = make_daemon()
    with d.client() as c:
        assert c.stats().version
    assert mode(tmp_path / "index") == mode(tmp_path / "ssd") == mode(tmp_path / "ssd" / "blocks" / "ab" / "c") == 0o700
    assert "set to 0700" in d.log() and "0770 -> 0700" in d.log()


@pytest.mark.parametrize("where", ["index", "ssd", "ssd/blocks/ab/c"])
def test_a_world_writable_state_directory_is_refused(make_daemon, tmp_path: Path, where: str) -> None:  # type: ignore[no-untyped-def]
    planted = tmp_path / where
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    (planted / "planted").write_text("by someone else")
    d = started_under_umask(make_daemon(start=False), 0o000, wait=False)
    assert d.proc.wait(30) == 1
    key = "kv.index_dir" if where == "index" else "kv.ssd_dir"
    assert f"{key}: {planted} is writable by every user (mode 0777)" in d.log()
    assert "anyone could have planted, renamed or deleted files in it" in d.log() and "chmod 0700" in d.log()
    assert mode(planted) == 0o777 and (planted / "planted").read_text() == "by someone else", "left as found"
    assert not (tmp_path / "index" / "CURRENT").exists(), "the index was never opened"


def test_a_state_directory_of_another_user_is_refused(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory away")
    (tmp_path / "index").mkdir(mode=0o700)
    os.chown(tmp_path / "index", 65534, -1)
    d = make_daemon(start=False).start(wait=False)
    assert d.proc.wait(30) == 1
    assert f"kv.index_dir: {tmp_path / 'index'} is owned by uid 65534" in d.log()
    assert "not by the user kvcached runs as (uid 0" in d.log()


def test_a_world_writable_parent_without_the_sticky_bit_is_refused(make_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    d = make_daemon(f'kv.index_dir="{shared / "index"}"', start=False).start(wait=False)
    assert d.proc.wait(30) == 1
    assert f"{shared} (holding {shared / 'index'}) is writable by every user (mode 0777) and has no sticky bit" in d.log()

    shared.chmod(0o1777)                                   # like /tmp: others cannot replace our entries
    d = make_daemon(f'kv.index_dir="{shared / "index"}"')
    with d.client() as c:
        assert c.stats().version


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "[::1]", "localhost"])
def test_every_loopback_address_may_listen_in_plaintext(host: str) -> None:
    config = load_config(overrides=[f'grpc.read_only_listen=["{host}:7401"]', f'grpc.listen=["{host}:7400"]'])
    assert all(a.is_loopback for a in config.listeners)


@pytest.mark.parametrize("host", ["128.0.0.1", "0.0.0.0", "[::]", "10.1.2.3", "[::2]", "example.com"])
def test_other_addresses_still_need_tls_or_insecure(host: str) -> None:
    with pytest.raises(ConfigError, match="plaintext gRPC on the non-loopback address"):
        load_config(overrides=[f'grpc.listen=["{host}:7400"]'])


def test_a_daemon_serves_plaintext_on_127_0_0_2(make_daemon) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    d = make_daemon(f'grpc.read_only_listen=["127.0.0.2:{port}"]')
    with KvCacheClient(f"127.0.0.2:{port}", timeout=10) as c:
        assert c.stats().version
    assert "plaintext gRPC on a non-loopback address" not in d.log()
