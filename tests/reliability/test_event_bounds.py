"""What a stranger on the host can make the daemon hold through KV events (issue 59), on real
daemons: replay clients that ask and never read, route keys of blocks never stored, and
subscriptions counted one by one.

Replay: the log is filled with batches of about 64 KiB (blocks with large route keys), then a
thousand connections each ask a replay from the oldest batch and never read. ZMQ would keep a
copy of what each was sent, even after it left (measured on main: 5.6 GiB at 1,000 clients,
7.1 GiB after they all closed). Now answers share the log's batches, each client's queue holds
at most 64 of them, and past ``events.replay_clients_mib`` the endpoint is reset: the daemon's
RSS grows by less than that bound plus what the log keeps, an honest replay is answered in full
meanwhile, and once the clients leave nothing of theirs stays.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import zmq

from kvcached.events.schema import decode_batch
from kvcached_agent.agent import Agent
from kvcached_agent.route import RouteKey, encode_routes
from tests.integration.conftest import DaemonProcess, wait_for
from tests.integration.test_operations import free_tcp_port
from tests.integration.users import needs_users, start_as_user
from tests.reliability.conftest import report, rss_kib

BLOCK = 4096
END = (-1).to_bytes(8, "big", signed=True)


def stallers(endpoint: str, clients: int) -> Callable[[Callable[[], None]], None]:
    """A stranger's process: ``clients`` connections, each asking a replay from 0, none reading."""
    def work(ready: Callable[[], None]) -> None:
        ctx = zmq.Context()
        socks = []
        for _ in range(clients):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(sock)
        ready()
        time.sleep(3600)
    return work


def events_daemon(make_daemon: Any, state: Path, *extra: str) -> tuple[DaemonProcess, int]:
    """A daemon publishing events on ipc paths under ``state``, and its metrics port."""
    port = free_tcp_port()
    return make_daemon(f'events.endpoint="ipc://{state}/events"', f'events.replay_endpoint="ipc://{state}/replay"',
                       "events.batch_ms=10", "kv.ram_gib=0.25", f'metrics.listen="127.0.0.1:{port}"', *extra,
                       state=state), port


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def fill_log(d: DaemonProcess, blocks: int, key_tokens: int = 8000) -> None:
    """Blocks whose route keys are ~30 KiB each: two events a batch of about 64 KiB."""
    with Agent.connect(str(d.state / "agent.sock"), agent_id="filler", model="m", dtype="bf16", block_tokens=16,
                       num_layers=1, layer_block_bytes=BLOCK, timeout=10) as agent:
        assert agent.wants_routes
        for start in range(0, blocks, 64):
            digests = agent.hash_tokens(list(range(16 * start, 16 * (start + 64))))
            keys = [encode_routes([RouteKey([start + i], None, [(start + i) % 30000] * key_tokens, 16)])
                    for i in range(len(digests))]
            saved = agent.save(agent.addresses(digests), [torch.zeros(BLOCK, dtype=torch.uint8)] * len(digests),
                               routes=keys)
            assert saved.stored == len(digests)


def honest_replay(state: Path, ctx: zmq.Context[Any], timeout_s: float = 60.0) -> tuple[list[int], bytes]:
    """Sequence numbers of a whole replay from 0 and its end marker's reason, as a router that
    reads at once gets them (asking again if the endpoint was reset under it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(f"ipc://{state}/replay")
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        try:
            while True:
                frames = sock.recv_multipart()
                if frames[2] == END:
                    return seqs, frames[3]
                seqs.append(int.from_bytes(frames[2], "big"))
                decode_batch(frames[3])
        except zmq.Again:                # reset under it: ask again, as a router does
            continue
        finally:
            sock.close(linger=0)
    raise AssertionError(f"no whole replay within {timeout_s} s")


@needs_users
@pytest.mark.parametrize("clients, budget_mib", [(1000, 64), (1000, 8), pytest.param(5000, 64, marks=pytest.mark.soak)])
def test_replay_clients_that_never_read_hold_a_bounded_amount(make_daemon: Any, users: Callable[[], tuple[int, int]],
                                                               socket_dir: Path, clients: int, budget_mib: int) -> None:
    """A stranger's thousand clients on a replay endpoint anyone on the host may open (as a TCP
    port is; the operator's ipc path is the daemon user's alone): the daemon holds less than
    the budget for them, and the operator's router is answered in full meanwhile."""
    state = socket_dir
    state.chmod(0o711)
    d, port = events_daemon(make_daemon, state, f"events.replay_clients_mib={budget_mib}")
    (state / "replay").chmod(0o666)
    fill_log(d, 640)
    ctx: zmq.Context[Any] = zmq.Context()
    wait_for(lambda: len(honest_replay(state, ctx)[0]) >= 300, text="the log holds ~300 batches of ~64 KiB")
    before = rss_kib(d.proc.pid)                            # type: ignore[union-attr]
    uid, gid = users()
    stranger = start_as_user(uid, gid, stallers(f"ipc://{state}/replay", clients))
    try:
        time.sleep(3.0 + clients / 1000)                   # every request taken, every queue full
        started = time.monotonic()
        seqs, reason = honest_replay(state, ctx)
        took = time.monotonic() - started
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 300 and reason == b"", reason
        grown = (rss_kib(d.proc.pid) - before) / 1024       # type: ignore[union-attr]
        held, resets = scrape(port, "kvcached_events_replay_held_bytes"), scrape(port, "kvcached_events_replay_resets_total")
        refused = scrape(port, "kvcached_events_replay_refused_connections_total")
    finally:
        os.kill(stranger, signal.SIGKILL)
        os.waitpid(stranger, 0)
    with d.client() as c:
        assert c.stats().puts >= 640, "the daemon serves on"
    report("replay_flood", clients=clients, budget_mib=budget_mib, rss_growth_mib=round(grown, 1),
           honest_replay_s=round(took, 2), batches=len(seqs), resets=resets,
           held_mib=round(held / 2**20, 1), refused_connections=refused)
    # RSS also keeps heap freed since (kvcached.host.process keeps up to 256 MiB of it, by design):
    # the connections refused at their handshake had buffers for a moment.
    assert grown < 96, f"RSS grew {grown:.0f} MiB for {clients} replay clients that never read"
    assert refused > 0 and held <= budget_mib << 20
    wait_for(lambda: scrape(port, "kvcached_events_replay_connections") == 0, text="the stranger's connections counted gone")
    ctx.term()


def route_flood(d: DaemonProcess, blocks: int, connections: int) -> list[Agent]:
    """Engine keys of about 60 KiB each for ``blocks`` blocks that are never saved, sent over
    ``connections`` agent connections at once (each checked at 16 MiB/s at most), each left open."""
    blob = encode_routes([RouteKey([1], None, [29_999] * 20_000, 16)])
    assert 55_000 < len(blob) < 65_536
    agents = [Agent.connect(str(d.state / "agent.sock"), agent_id=f"keys-{i}", model="m", dtype="bf16",
                            block_tokens=16, num_layers=1, layer_block_bytes=BLOCK, timeout=60) for i in range(connections)]
    per = blocks // connections

    def send(i: int) -> None:
        digests = [i.to_bytes(4, "big") + n.to_bytes(28, "big") for n in range(per)]
        agents[i].send_routes(agents[i].addresses(digests), [blob] * per)
        agents[i].lookup(digests[:1])            # answered once the frames before it were checked

    threads = [threading.Thread(target=send, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return agents


@pytest.mark.parametrize("blocks, connections", [(2_400, 4), pytest.param(40_000, 8, marks=pytest.mark.soak)])
def test_route_keys_of_blocks_never_saved_hold_a_bounded_amount_and_go_with_their_connection(
        make_daemon: Any, tmp_path: Path, blocks: int, connections: int) -> None:
    """An agent that sends the keys of blocks it never saves (on main: 28,704 blocks' worth in
    6 s took RSS from 110 to 1,740 MiB, kept after the connection closed)."""
    d, port = events_daemon(make_daemon, tmp_path)
    before = rss_kib(d.proc.pid)                            # type: ignore[union-attr]
    started = time.monotonic()
    agents = route_flood(d, blocks, connections)
    took = time.monotonic() - started
    held = scrape(port, "kvcached_route_keys_bytes")
    grown = (rss_kib(d.proc.pid) - before) / 1024           # type: ignore[union-attr]
    assert held <= 64 << 20, held
    for agent in agents:
        agent.close()
    wait_for(lambda: scrape(port, "kvcached_route_keys_bytes") == 0, text="the keys went with their connections")
    report("route_keys", blocks=blocks, connections=connections, seconds=round(took, 1), held_mib=round(held / 2**20, 1),
           rss_growth_mib=round(grown, 1), dropped=scrape(port, "kvcached_route_keys_dropped_total"))
    # The keys' bound, and what each connection's frames in flight take (a frame of up to 8 MiB
    # being read, and the one being checked: the agent socket's bound per connection).
    assert grown < 64 + 32 * connections, f"RSS grew {grown:.0f} MiB for route keys of {blocks} blocks never saved"
    with Agent.connect(str(d.state / "agent.sock"), agent_id="after", model="m", dtype="bf16", block_tokens=16,
                       num_layers=1, layer_block_bytes=BLOCK, timeout=10) as agent:
        digests = agent.hash_tokens(list(range(64)))
        assert agent.save(agent.addresses(digests), [torch.zeros(BLOCK, dtype=torch.uint8)] * 4).stored == 4


def test_every_subscription_is_counted_and_every_one_that_leaves(make_daemon: Any, tmp_path: Path) -> None:
    """On main a thousand subscribers to one topic read as 1 (XPUB passed on the first alone)."""
    d, port = events_daemon(make_daemon, tmp_path)
    ctx: zmq.Context[Any] = zmq.Context()
    subs = []
    for i in range(301):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@" if i else b"")
        sub.connect(f"ipc://{tmp_path}/events")
        subs.append(sub)
    wait_for(lambda: scrape(port, "kvcached_events_subscriptions") == 301, text="301 subscriptions")
    for sub in subs[:200]:
        sub.close(linger=0)
    wait_for(lambda: scrape(port, "kvcached_events_subscriptions") == 101, text="101 once 200 left")
    for sub in subs[200:]:
        sub.close(linger=0)
    ctx.term()
    del d
