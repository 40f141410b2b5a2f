"""A local user against another tenant's blocks (issue 59), with real users made for the test:
alice and bob are tenants by uid, carol is no one's (the default tenant). The operator's event
stream names every block by its stored address; it lives on an ipc path only the daemon's user
opens (a TCP port or an abstract socket beside tenants is refused at start, tests/unit). Even a
leaked address opens nothing: every read checks whose block it serves, so carol, naming alice's
stored addresses as her own on the agent socket and on the read-only gRPC listener, finds,
loads, plans, overwrites and deletes nothing of alice's, and no byte of alice's reaches her."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any, Callable

import grpc
import torch
import zmq

from kvcached.events.schema import decode_batch
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress
from kvcached_agent.agent import Agent
from tests.integration.conftest import wait_for
from tests.integration.test_events import replay
from tests.integration.test_operations import free_tcp_port
from tests.integration.test_tenants_grpc import connects
from tests.integration.users import as_user, needs_users

pytestmark = needs_users

BLOCK = 4096
BLOCKS = 64


def connect(sock: Path, agent_id: str) -> Agent:
    return Agent.connect(str(sock), agent_id=agent_id, model="m", dtype="bf16", block_tokens=16, num_layers=1,
                         layer_block_bytes=BLOCK, timeout=10)


def alice_saves(sock: Path, markers: list[bytes]) -> Callable[[], int]:
    def work() -> int:
        with connect(sock, "alice") as agent:
            addresses = agent.addresses(agent.hash_tokens(list(range(16 * len(markers)))))
            blocks = [torch.frombuffer(bytearray(m), dtype=torch.uint8) for m in markers]
            return agent.save(addresses, blocks).stored
    return work


def alice_loads(sock: Path, markers: list[bytes]) -> Callable[[], int]:
    def work() -> int:
        with connect(sock, "alice-again") as agent:
            addresses = agent.addresses(agent.hash_tokens(list(range(16 * len(markers)))))
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses]
            loaded = agent.load(addresses, out).loaded
            return loaded if [bytes(t.numpy()) for t in out] == markers else -1
    return work


def stranger(sock: Path, stolen: list[tuple[str, int]], port: int) -> Callable[[], dict[str, Any]]:
    """Everything carol tries with alice's stored addresses as if they were her own digests."""
    def work() -> dict[str, Any]:
        addresses = [BlockAddress(bytes.fromhex(h), layer) for h, layer in stolen]
        digests = [a.digest for a in addresses]
        layer = addresses[0].layer
        with connect(sock, "carol") as agent:
            out = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in addresses]
            loaded = agent.load(addresses, out).loaded
            seen = agent.lookup(digests, layer)
            present = agent.present(digests, layer)
            plan = agent.plan_loads(digests, 1.0, layer)
            saved = agent.save(addresses, [torch.full((BLOCK,), 0xEE, dtype=torch.uint8) for _ in addresses])
            served = b"".join(bytes(t.numpy()) for t in out)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            get = channel.unary_unary("/kvcached.v1.KvCache/Get")
            answer = pb.GetResponse.FromString(get(pb.GetRequest(
                addresses=[pb.BlockAddress(digest=a.digest, layer=a.layer) for a in addresses],
                allow_partial=True).SerializeToString(), timeout=30))
            lookup = channel.unary_unary("/kvcached.v1.KvCache/Lookup")
            looked = pb.LookupResponse.FromString(lookup(pb.LookupRequest(digests=digests, layer=layer)
                                                         .SerializeToString(), timeout=30))
        served += b"".join(b.payload for b in answer.blocks)
        return {"loaded": loaded, "longest": seen.longest, "ram": seen.ram, "present": sum(present),
                "plan_held": plan.held, "stored": saved.stored, "grpc_blocks": len(answer.blocks),
                "grpc_reasons": sorted({m.reason for m in answer.misses}), "grpc_longest": looked.longest,
                "served": served.hex()}
    return work


def test_a_stranger_with_another_tenants_stored_addresses_reads_nothing_of_them(
        make_daemon: Any, users: Callable[[], tuple[int, int]], socket_dir: Path, tmp_path: Path) -> None:
    (a_uid, a_gid), (b_uid, _), (c_uid, c_gid) = users(), users(), users()
    sock, events, port, scrape = socket_dir / "agent.sock", socket_dir / "events", free_tcp_port(), free_tcp_port()
    d = make_daemon(f'agent.socket="{sock}"', 'agent.mode="0666"', f'grpc.read_only_listen=["127.0.0.1:{port}"]',
                    f'metrics.listen="127.0.0.1:{scrape}"',
                    f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}", f'events.endpoint="ipc://{events}"',
                    f'events.replay_endpoint="ipc://{socket_dir / "replay"}"', "events.batch_ms=10")
    with connect(sock, "root"):                 # imports what the children use before they fork
        pass
    markers = [os.urandom(BLOCK) for _ in range(BLOCKS)]
    assert as_user(a_uid, a_gid, alice_saves(sock, markers)) == {"ok": BLOCKS}

    # Only the daemon's user may open the operator's stream (ipc, mode 0600 under its umask).
    assert as_user(c_uid, c_gid, connects(events)) == {"ok": "EACCES"}
    assert as_user(c_uid, c_gid, connects(socket_dir / "replay")) == {"ok": "EACCES"}
    ctx: zmq.Context[Any] = zmq.Context()

    def named() -> list[tuple[str, int]]:
        batches = [decode_batch(p) for _t, _s, p in replay(socket_dir, [(0).to_bytes(8, "big")], ctx)[:-1]]
        return [(e.extra_keys[0][1], e.extra_keys[0][2]) for b in batches for e in b.events
                if type(e).__name__ == "BlockStored" and e.extra_keys and e.medium == "CPU"]   # RAM (SSD's come later)
    wait_for(lambda: len(named()) >= BLOCKS, text="the operator's stream names alice's blocks")
    stolen = named()[:BLOCKS]
    ctx.term()

    # Say the operator's stream leaked anyway: carol names alice's stored addresses as her own.
    got = as_user(c_uid, c_gid, stranger(sock, stolen, port))
    assert "ok" in got, got
    result = got["ok"]
    served = bytes.fromhex(result.pop("served"))
    assert result == {"loaded": 0, "longest": 0, "ram": 0, "present": 0, "plan_held": 0, "stored": 0,
                      "grpc_blocks": 0, "grpc_reasons": ["unknown block"], "grpc_longest": 0}, result
    assert not any(m[i:i + 64] in served for m in markers for i in range(0, BLOCK, 64)), "a byte run of alice's"
    # Nothing of alice's was overwritten, deleted or lost: she loads every byte as she saved it.
    assert as_user(a_uid, a_gid, alice_loads(sock, markers)) == {"ok": BLOCKS}
    text = urllib.request.urlopen(f"http://127.0.0.1:{scrape}/metrics", timeout=10).read().decode()
    counted = next(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("kvcached_other_tenant_blocks_total "))
    assert counted >= 3 * BLOCKS, text          # each Load, save and Get of them; a Lookup counts where it stops
    with d.client() as c:
        assert c.delete([BlockAddress(bytes.fromhex(h), layer) for h, layer in stolen[:4]]).deleted == 4, \
            "the operator reaches every block"
