"""Tenants on the agent socket (issue 41, docs/security.md): real agent processes under two real
uids, created for the test and dropped after it, against a real daemon. The tenant comes from
the kernel (SO_PEERCRED), never from the agent: the same tokens saved by two tenants are two
blocks, neither tenant finds, loads or overlaps the other's, a process no mapping names is
refused (and counted), and the blocks stored before tenants existed stay the default tenant's.

Agents run in forked children that drop to the test users' ids before they connect (the
interpreter lives under /root, which other users cannot reach, so a fresh process could not
start as them); everything the children use is imported first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from kvcached_agent.agent import Agent
from tests.integration.users import as_user, needs_users

pytestmark = needs_users

BLOCK = 4096
TOKENS = list(range(64))          # four blocks of 16 tokens, the same for every tenant


def connect(sock: Path, agent_id: str) -> Agent:
    return Agent.connect(str(sock), agent_id=agent_id, model="m", dtype="bf16", block_tokens=16, num_layers=1,
                         layer_block_bytes=BLOCK, timeout=10)


def saver(sock: Path, fill: int) -> Callable[[], dict[str, Any]]:
    """Save TOKENS' blocks filled with ``fill``, then say what a lookup and a load see."""
    def work() -> dict[str, Any]:
        with connect(sock, f"saver-{fill}") as agent:
            addresses = agent.addresses(agent.hash_tokens(TOKENS))
            before = agent.lookup([a.digest for a in addresses]).longest
            saved = agent.save(addresses, [torch.full((BLOCK,), fill, dtype=torch.uint8) for _ in addresses])
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses]
            loaded = agent.load(addresses, out)
            return {"before": before, "stored": saved.stored, "present": saved.present, "loaded": loaded.loaded,
                    "bytes": sorted({int(t[0]) for t in out}), "overlap": len(agent.overlap([a.digest for a in addresses]))}
    return work


def reader(sock: Path) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        with connect(sock, "reader") as agent:
            addresses = agent.addresses(agent.hash_tokens(TOKENS))
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses]
            loaded = agent.load(addresses, out)
            return {"longest": agent.lookup([a.digest for a in addresses]).longest, "loaded": loaded.loaded,
                    "bytes": sorted({int(t[0]) for t in out})}
    return work


def test_two_tenants_with_the_same_tokens_never_see_each_others_blocks(
        make_daemon: Any, users: Callable[[], tuple[int, int]], socket_dir: Path, tmp_path: Path) -> None:
    (a_uid, a_gid), (b_uid, b_gid), (c_uid, c_gid) = users(), users(), users()
    sock = socket_dir / "agent.sock"
    base = [f'agent.socket="{sock}"', 'agent.mode="0666"']
    # Before tenants: root (the default tenant) stores the blocks.
    d = make_daemon(*base, state=tmp_path)
    with connect(sock, "before") as agent:          # also imports everything the children use
        addresses = agent.addresses(agent.hash_tokens(TOKENS))
        assert agent.save(addresses, [torch.full((BLOCK,), 7, dtype=torch.uint8) for _ in addresses]).stored == 4
        agent.load(addresses, [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses])
        agent.overlap([a.digest for a in addresses])
    assert d.stop() == 0

    tenants = [f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}], default = [0] }}", 'tenants.default=""']
    d = make_daemon(*base, *tenants, state=tmp_path)
    # uid 0 is mapped to the default tenant: the blocks of before are its own. It stays connected
    # with them on its "GPU" (a load reports them pinned), so a tenant whose overlap named it
    # would count two agents.
    with connect(sock, "root") as root:
        addresses = root.addresses(root.hash_tokens(TOKENS))
        out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses]
        assert root.load(addresses, out).loaded == 4 and {int(t[0]) for t in out} == {7}
        alice = as_user(a_uid, a_gid, saver(sock, 1))
        assert alice.get("ok") == {"before": 0, "stored": 4, "present": 0, "loaded": 4, "bytes": [1], "overlap": 1}, alice
        bob = as_user(b_uid, b_gid, reader(sock))
        assert bob.get("ok") == {"longest": 0, "loaded": 0, "bytes": [0]}, f"bob found another tenant's blocks: {bob}"
        bob = as_user(b_uid, b_gid, saver(sock, 2))
        assert bob.get("ok") == {"before": 0, "stored": 4, "present": 0, "loaded": 4, "bytes": [2], "overlap": 1}, bob
        again = as_user(a_uid, a_gid, reader(sock))
        assert again.get("ok") == {"longest": 4, "loaded": 4, "bytes": [1]}, "alice's blocks are hers, untouched by bob's"
        assert len(root.overlap([a.digest for a in addresses])) == 1, "root's overlap names no other tenant's agent"
    refused = as_user(c_uid, c_gid, reader(sock))
    assert "error" in refused and "name no tenant" in refused["error"], refused
    assert "name no tenant" in d.log()
    with d.client() as c:
        assert c.stats().puts >= 8, "two tenants, two sets of blocks"
        owners = [b.tenant for b in c.list_blocks()]
        assert sorted(set(owners)) == ["", "alice", "bob"] and owners.count("alice") == owners.count("bob") == 4, \
            "each block's record says whose it is (\"\": the default tenant's, stored before tenants)"


def test_a_damaged_or_open_tenant_key_stops_the_start_with_a_clear_error(make_daemon: Any, tmp_path: Path) -> None:
    key = tmp_path / "tenants.key"
    key.write_bytes(b"short")
    key.chmod(0o600)
    d = make_daemon(f'tenants.key_file="{key}"', state=tmp_path, start=False)
    d.start(wait=False)
    assert d.proc.wait(20) != 0                              # type: ignore[union-attr]
    assert "not a 32-byte tenant key" in d.log() and "Traceback" not in d.log()
    assert key.read_bytes() == b"short", "a damaged key is reported, never replaced"
    secret = os.urandom(32)
    key.write_bytes(secret)
    key.chmod(0o644)
    d.start(wait=False)
    assert d.proc.wait(20) != 0                              # type: ignore[union-attr]
    assert "others may read the tenant key" in d.log()
    key.chmod(0o600)
    d.start()                                                # waits until it serves
    assert d.proc.poll() is None and key.read_bytes() == secret, "the key is used as it is"


def test_a_tenants_own_agent_socket_names_it_whatever_the_uid(
        make_daemon: Any, users: Callable[[], tuple[int, int]], socket_dir: Path, tmp_path: Path) -> None:
    """tenants.agent_sockets (pods of two teams, one uid: docs/kubernetes.md): a connection through
    a tenant's own socket is that tenant; one whose uid the configuration maps to another tenant
    is refused there, and the shared socket still names tenants by uid."""
    (a_uid, a_gid), (x_uid, x_gid) = users(), users()
    shared = socket_dir / "agent.sock"
    alice_sock, bob_sock = socket_dir / "alice.sock", socket_dir / "bob.sock"
    d = make_daemon(f'agent.socket="{shared}"', 'agent.mode="0666"', f"tenants.uids={{ alice = [{a_uid}] }}",
                    f'tenants.agent_sockets={{ alice = "{alice_sock}", bob = "{bob_sock}" }}', 'tenants.default=""',
                    state=tmp_path)
    with connect(alice_sock, "warm") as agent:     # imports what the children use, before they fork
        agent.lookup([a.digest for a in agent.addresses(agent.hash_tokens(TOKENS))])
    # One uid (x) that names no tenant, on both tenants' sockets: each is the socket's tenant.
    alice = as_user(x_uid, x_gid, saver(alice_sock, 3))
    assert alice.get("ok", {}).get("stored") == 4, alice
    bob = as_user(x_uid, x_gid, reader(bob_sock))
    assert bob.get("ok") == {"longest": 0, "loaded": 0, "bytes": [0]}, f"bob's socket found alice's blocks: {bob}"
    again = as_user(x_uid, x_gid, reader(alice_sock))
    assert again.get("ok") == {"longest": 4, "loaded": 4, "bytes": [3]}, again
    # alice's uid on bob's socket: refused (a socket mounted where it should not be opens no other tenant's blocks).
    refused = as_user(a_uid, a_gid, reader(bob_sock))
    assert "error" in refused and "names another tenant than bob" in refused["error"], refused
    # alice's uid on the shared socket: alice, by uid.
    by_uid = as_user(a_uid, a_gid, reader(shared))
    assert by_uid.get("ok") == {"longest": 4, "loaded": 4, "bytes": [3]}, by_uid
    assert d.stop() == 0
