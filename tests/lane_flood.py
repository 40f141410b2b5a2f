"""Bursts of lane connections that never prove anything, from several loopback source addresses.

Run as a process of its own (``python -m tests.lane_flood``), so its sockets, its CPU and its
garbage are not the daemon's or the test's: it prints one JSON object of counts when done.

Each connection is opened non-blocking from one of ``--sources`` addresses (127.0.0.2 and up,
round-robin; Linux routes all of 127.0.0.0/8 to loopback) and then, by ``--kind``:

- ``idle``: sends nothing (a TCP handshake only; holds a place until the server's timeout);
- ``hello``: sends a real TLS 1.3 ClientHello (without any certificate to follow), so the
  server does its share of the handshake (key exchange, signature) and then waits;
- ``mac``: sends a ``mac`` lane hello naming a key id nobody granted.

``--kind`` may list several, comma-separated: connections take them in turn.

A burst opens ``--count`` connections as fast as the kernel takes them and keeps each open until
the server ends it or ``--hold`` seconds pass (then resets it); ``--bursts`` of them run
``--gap`` seconds apart, and the counts say how each connection ended.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import selectors
import socket
import ssl
import struct
import sys
import time
from typing import Any

KINDS = ("idle", "hello", "mac")


def client_hello() -> bytes:
    """The first flight of a TLS 1.3 client (what it sends before the server answers)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="stranger")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def mac_hello() -> bytes:
    """A well-formed ``mac`` lane hello (kvcached.peers.lane_mac.HELLO) naming a key never granted."""
    return struct.pack("<4s16s16s", b"KVLM", os.urandom(16), os.urandom(16))


def burst(host: str, port: int, sources: list[str], count: int, kinds: list[str], hold_s: float) -> dict[str, int]:
    """One burst (module docstring); returns how its connections ended."""
    made = {"idle": b"", "hello": client_hello(), "mac": mac_hello()}
    payloads = [made[kind] for kind in kinds]
    counts = {"opened": 0, "failed_to_open": 0, "reset_by_server": 0, "closed_by_server": 0, "held_to_the_end": 0}
    selector = selectors.DefaultSelector()
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = reset
        try:
            sock.bind((sources[i % len(sources)], 0))
            sock.connect_ex((host, port))
        except OSError:
            sock.close()
            counts["failed_to_open"] += 1
            continue
        counts["opened"] += 1
        selector.register(sock, selectors.EVENT_WRITE, payloads[i % len(payloads)])
        _poll(selector, 0, counts)
    deadline = time.monotonic() + hold_s
    while selector.get_map() and time.monotonic() < deadline:
        _poll(selector, min(0.1, max(0.0, deadline - time.monotonic())), counts)
    for key in list(selector.get_map().values()):
        counts["held_to_the_end"] += 1
        selector.unregister(key.fileobj)
        key.fileobj.close()              # type: ignore[union-attr]
    selector.close()
    return counts


def stranger(source: str, port: int, host: str = "127.0.0.1") -> socket.socket:
    """A non-blocking connection from ``source`` that will send nothing (the caller holds it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    sock.connect_ex((host, port))
    return sock


def ended(sock: socket.socket) -> bool:
    """Whether the server ended this idle non-blocking connection (closed or reset it)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _poll(selector: selectors.BaseSelector, timeout: float, counts: dict[str, int]) -> None:
    for key, events in selector.select(timeout):
        sock: Any = key.fileobj
        if events & selectors.EVENT_WRITE:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                _end(selector, sock, counts, "reset_by_server" if error == errno.ECONNRESET else "failed_to_open")
                continue
            try:
                if key.data:
                    sock.send(key.data)
            except OSError:
                _end(selector, sock, counts, "reset_by_server")
                continue
            selector.modify(sock, selectors.EVENT_READ)
        elif events & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except OSError:
                _end(selector, sock, counts, "reset_by_server")
                continue
            if not data:
                _end(selector, sock, counts, "closed_by_server")


def _end(selector: selectors.BaseSelector, sock: socket.socket, counts: dict[str, int], how: str) -> None:
    counts[how] += 1
    selector.unregister(sock)
    sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sources", type=int, default=8, help="source addresses 127.0.0.2 and up")
    parser.add_argument("--count", type=int, default=1000, help="connections per burst")
    parser.add_argument("--bursts", type=int, default=1)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between bursts")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds a connection is kept at most")
    parser.add_argument("--kind", default="hello", help=f"one or more of {', '.join(KINDS)}, comma-separated")
    args = parser.parse_args(argv)
    kinds = args.kind.split(",")
    if not kinds or any(kind not in KINDS for kind in kinds):
        parser.error(f"--kind: one or more of {', '.join(KINDS)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.count + 256)), hard))
    sources = [f"127.0.0.{2 + i}" for i in range(args.sources)]
    results = []
    for n in range(args.bursts):
        if n:
            time.sleep(args.gap)
        results.append(burst(args.host, args.port, sources, args.count, kinds, args.hold))
        print(json.dumps({"burst": n, **results[-1]}), file=sys.stderr, flush=True)
    total = {k: sum(r[k] for r in results) for k in results[0]}
    print(json.dumps({"bursts": results, "total": total}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
