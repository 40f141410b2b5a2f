"""The daemon's KV events (docs/events.md) from real daemons: what a save, a write to SSD and a
restart publish, sequence numbers across restarts and a SIGKILL, the replay endpoint against
bad requests and floods of connections, and the engine keys an agent passes (or not)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvcached.events.schema import decode_batch
from kvcached_agent import protocol as p
from kvcached_agent.agent import Agent
from kvcached_agent.client import AgentError
from kvcached_agent.route import RouteKey, encode_routes

from .conftest import DaemonProcess, wait_for
from .test_agent import agent_socket

END = (-1).to_bytes(8, "big", signed=True)


def events_daemon(make_daemon: Any, state: Path, *extra: str) -> DaemonProcess:
    return make_daemon(f'events.endpoint="ipc://{state}/events"', f'events.replay_endpoint="ipc://{state}/replay"',
                       "events.batch_ms=10", 'events.node="node-a"', "kv.ssd_gib=0.05", 'kv.write_policy="write_through"',
                       *extra, state=state)


def replay(state: Path, request: list[bytes], ctx: zmq.Context[Any], name: str = "replay") -> list[list[bytes]]:
    """The answer of the replay endpoint ``state``/``name`` to ``request``, the end marker last."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{state}/{name}")
    sock.send_multipart([b"", *request])
    out = []
    while True:
        frames = sock.recv_multipart()
        out.append(frames[1:])
        if frames[2] == END:
            sock.close(linger=0)
            return out


def batches(state: Path, ctx: zmq.Context[Any]) -> list[tuple[int, Any]]:
    return [(int.from_bytes(seq, "big"), decode_batch(payload))
            for topic, seq, payload in replay(state, [(0).to_bytes(8, "big")], ctx)[:-1]]


def names(found: list[tuple[int, Any]]) -> list[tuple[str, str | None]]:
    """(event type, medium) per block an event names (one for a clear): a chain of blocks saved
    together is one event, as vLLM sends it."""
    return [(type(e).__name__, getattr(e, "medium", None)) for _, b in found for e in b.events
            for _ in getattr(e, "block_hashes", [None])]


def save(agent: Agent, tokens: list[int], routes: bool = True) -> list[bytes]:
    digests = agent.hash_tokens(tokens)
    keys = [encode_routes([RouteKey([1000 + i], 999 + i if i else None, tokens[16 * i:16 * i + 16], 16)]) if routes else None
            for i in range(len(digests))]
    saved = agent.save(agent.addresses(digests), [torch.full((4096,), i, dtype=torch.uint8) for i in range(len(digests))],
                       routes=keys)
    assert saved.stored == len(digests)
    return digests


def connect(d: DaemonProcess) -> Agent:
    return Agent.connect(agent_socket(d), agent_id="events", model="m", dtype="bf16", block_tokens=16, num_layers=1,
                         layer_block_bytes=4096, timeout=5)


def test_tiers_publish_vllm_events_and_sequence_numbers_never_go_back(make_daemon: Any, tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    d = events_daemon(make_daemon, tmp_path)
    with connect(d) as agent:
        assert agent.wants_routes
        save(agent, list(range(64)))
        save(agent, list(range(100, 132)), routes=False)
    wait_for(lambda: names(batches(tmp_path, ctx)).count(("BlockStored", "STORAGE")) == 6, text="six SSD stores")
    found = batches(tmp_path, ctx)
    assert [s for s, _ in found] == list(range(len(found))), "consecutive from 0"
    assert names(found)[0] == ("AllBlocksCleared", "CPU"), "a first start has no RAM tier to keep"
    stored = [e for _, b in found for e in b.events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    keyed = [e for e in stored if e.token_ids]
    assert [e.block_hashes for e in keyed] == [[1000, 1001, 1002, 1003]], "one chain, one event (as vLLM sends it)"
    assert keyed[0].parent_block_hash is None and keyed[0].token_ids == list(range(64)) and keyed[0].block_size == 16
    assert all(e.ownership == "kvcached@node-a" and e.locality == "LOCAL" for e in stored)
    unkeyed = [e for e in stored if not e.token_ids]
    assert len(unkeyed) == 2 and all(e.extra_keys[0][0] == "kvcached-digest" and e.block_size == 0 for e in unkeyed)
    last = found[-1][0]

    assert d.stop() == 0                                    # a clean stop: the next number is kept exactly
    assert int((tmp_path / "index" / "events.seq").read_text()) == last + 1
    d.start()
    wait_for(lambda: len(batches(tmp_path, ctx)) >= 1, text="the restart's clear")
    after = batches(tmp_path, ctx)
    assert after[0][0] == last + 1 and names(after)[:1] == [("AllBlocksCleared", "CPU")]
    with connect(d) as agent:
        save(agent, list(range(200, 232)))
    wait_for(lambda: names(batches(tmp_path, ctx)).count(("BlockStored", "STORAGE")) == 2, text="stores after the restart")
    before_kill = batches(tmp_path, ctx)[-1][0]
    d.proc.send_signal(signal.SIGKILL)                      # type: ignore[union-attr]
    d.proc.wait()                                           # type: ignore[union-attr]
    d.start()
    wait_for(lambda: len(batches(tmp_path, ctx)) >= 1, text="the clear after a SIGKILL")
    assert batches(tmp_path, ctx)[0][0] > before_kill, "never backwards, even after a SIGKILL"
    ctx.term()


def test_a_damaged_sequence_file_stops_the_start_with_a_clear_error_and_loses_nothing(make_daemon: Any,
                                                                                        tmp_path: Path) -> None:
    d = events_daemon(make_daemon, tmp_path)
    with connect(d) as agent:
        digests = save(agent, list(range(32)))
    assert d.stop() == 0
    (tmp_path / "index" / "events.seq").write_text("not a number\n")
    d.start(wait=False)
    assert d.proc.wait(20) != 0                             # type: ignore[union-attr]
    assert "does not hold a sequence number" in d.log() and "Traceback" not in d.log()
    (tmp_path / "index" / "events.seq").write_text("1000\n")
    d.start()
    with connect(d) as agent:
        assert agent.lookup(digests).ssd == len(digests), "the blocks are all there"


def test_bad_replay_requests_get_clear_answers_and_floods_cost_little(make_daemon: Any, tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    d = events_daemon(make_daemon, tmp_path)
    with connect(d) as agent:
        save(agent, list(range(32)))
    wait_for(lambda: names(batches(tmp_path, ctx)).count(("BlockStored", "STORAGE")) == 2, text="the SSD stores")
    newest = batches(tmp_path, ctx)[-1][0]
    for request, says in (([b"garbage"], b"malformed"), ([b"12345678", b"more"], b"malformed"),
                          ([(newest + 100).to_bytes(8, "big")], b"not published yet"),
                          ([(-5).to_bytes(8, "big", signed=True)], b"does not exist")):
        answer = replay(tmp_path, request, ctx)
        assert answer[-1][1] == END and says in answer[-1][2], (request, answer)
    # A frame longer than a replay request is refused by ZMQ itself: that client is dropped.
    big = ctx.socket(zmq.DEALER)
    big.connect(f"ipc://{tmp_path}/replay")
    big.send_multipart([b"", b"x" * 100_000])
    rss = _rss_kib(d.proc.pid)                              # type: ignore[union-attr]
    flood = []
    for _ in range(1000):                                   # one user's connections, asking and never reading
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{tmp_path}/replay")
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        flood.append(s)
    time.sleep(1.0)
    with connect(d) as agent:
        save(agent, list(range(500, 532)))
    grown = _rss_kib(d.proc.pid) - rss                      # type: ignore[union-attr]
    assert grown < 200 * 1024, f"{grown} KiB more for a thousand replay clients"
    for s in flood + [big]:                                 # past its share of connections the user is refused;
        s.close(linger=0)                                   # once they are gone, it is served again
    def served() -> bool:
        try:
            return replay(tmp_path, [(0).to_bytes(8, "big")], ctx)[-1][1] == END
        except zmq.Again:
            return False
    wait_for(served, timeout=30, text="the replay endpoint serves again")
    ctx.term()
    # tests/reliability/test_event_bounds.py: what a stranger's thousand such clients make the daemon hold.


def test_route_keys_that_do_not_decode_are_refused(make_daemon: Any, tmp_path: Path) -> None:
    d = events_daemon(make_daemon, tmp_path)
    with connect(d) as agent:
        assert agent.client is not None
        agent.client.send(p.Route([(b"d" * 32, 0xFFFFFFFF, b"\x93\x01\x02")]))
        agent.lookup(agent.hash_tokens(list(range(16))))    # a call reads the event's error on its way
        error = agent.client.event_errors[0]                                            # type: ignore[union-attr]
        assert isinstance(error, AgentError) and error.code == p.ErrorCode.INVALID_ARGUMENT
        assert "route keys do not decode" in str(error)
        save(agent, list(range(32)))                        # the connection goes on


def test_without_events_agents_are_not_asked_for_keys(daemon: DaemonProcess) -> None:
    with connect(daemon) as agent:
        assert not agent.wants_routes
        save(agent, list(range(32)))                        # keys given are not sent


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")


def test_a_long_route_frame_is_checked_before_the_frames_after_it(make_daemon: Any, tmp_path: Path) -> None:
    """A Route frame of more than 16 KiB of keys is checked a slice at a time: the save sent
    right after it on the same connection still finds every key (its events name the engine's
    hashes, not the digest)."""
    ctx: zmq.Context[Any] = zmq.Context()
    d = events_daemon(make_daemon, tmp_path)
    with connect(d) as agent:
        digests = agent.hash_tokens(list(range(16 * 12)))
        keys = [encode_routes([RouteKey([5000 + i], None, [i] * 12_000, 16)]) for i in range(len(digests))]
        assert sum(map(len, keys)) > 64 << 10
        saved = agent.save(agent.addresses(digests), [torch.full((4096,), 1, dtype=torch.uint8)] * len(digests),
                           routes=keys)
        assert saved.stored == len(digests)
    wait_for(lambda: names(batches(tmp_path, ctx)).count(("BlockStored", "CPU")) == len(digests), text="the stores")
    stored = [e for _, b in batches(tmp_path, ctx) for e in b.events if type(e).__name__ == "BlockStored"
              and e.medium == "CPU"]
    assert sorted(h for e in stored for h in e.block_hashes) == [5000 + i for i in range(len(digests))]
    ctx.term()
