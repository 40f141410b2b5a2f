"""The agent's blocking client against a hand-written server on a real Unix socket: a request
that times out ends the connection (its late answer could hand out slots nobody would release),
and a closed connection fails every later call at once."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from kvcached_agent import protocol as p
from kvcached_agent.client import AgentClient, ConnectionClosed

HELLO = p.Hello("client-test", "m", "float16", 16, 1, 4096)


def silent_daemon(path: Path, seen_eof: threading.Event) -> threading.Thread:
    """Accepts one agent, welcomes it (with a real memfd), then reads and never answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        decoder = p.FrameDecoder()
        while (frame := decoder.next_frame()) is None:
            decoder.feed(conn.recv(4096))
        assert isinstance(p.decode(frame), p.Hello)
        fd = os.memfd_create("arena")
        os.ftruncate(fd, 1 << 20)
        socket.send_fds(conn, [p.encode(p.Welcome(1, 1 << 20, 4096, 60_000, "test"), frame.request_id)], [fd])
        os.close(fd)
        while conn.recv(4096):
            pass
        seen_eof.set()
        conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_timed_out_request_ends_the_connection(tmp_path: Path) -> None:
    eof = threading.Event()
    thread = silent_daemon(tmp_path / "agent.sock", eof)
    client = AgentClient(str(tmp_path / "agent.sock"), HELLO, timeout=0.3, heartbeat=False)
    try:
        assert client.arena_fd >= 0 and client.welcome.arena_bytes == 1 << 20
        with pytest.raises(ConnectionClosed, match="no answer from the daemon within 0.3 s"):
            client.call(p.Lookup(0, [bytes(32)]))
        assert eof.wait(5), "the daemon saw the connection end (and would release what it held)"
        with pytest.raises(ConnectionClosed, match="closed"):
            client.call(p.Lookup(0, [bytes(32)]))
        with pytest.raises(ConnectionClosed):
            client.send(p.Heartbeat())
    finally:
        client.close()
        thread.join(5)
