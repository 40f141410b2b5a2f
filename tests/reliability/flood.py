"""A flood of QUIC Initial-shaped datagrams from many loopback source addresses.

What an attacker without a certificate can send to the [quic] port at no cost to itself: each
datagram is 1,200 bytes (the smallest a server must take as an Initial), a long header of
version 1 with a fresh destination connection ID (so each looks like a new connection), no
token, and random bytes where the protected packet would be. All of 127.0.0.0/8 is loopback on
Linux, so binding to 127.0.x.y gives many source addresses on one machine with no setup.

    python -m tests.reliability.flood --target 127.0.0.1:7470 --count 1000000 --sources 256
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import time
from dataclasses import dataclass

from aioquic.buffer import Buffer
from aioquic.quic.packet import QuicPacketType, pull_quic_header

__all__ = ["FloodResult", "flood", "initial_datagram"]

DATAGRAM = 1200
_DCID_AT = 6          # first byte, 4 version bytes, the DCID length: the DCID starts here


def initial_datagram(size: int = DATAGRAM, *, dcid: bytes = b"", token: bytes = b"") -> bytearray:
    """One Initial-shaped datagram: long header, version 1, an 8-byte DCID (random unless given)
    and SCID, ``token`` (empty: a first Initial), a 2-byte length covering the rest, which is
    random (it does not decrypt)."""
    dcid = dcid or os.urandom(8)
    buf = Buffer(capacity=64 + len(token))
    buf.push_uint_var(len(token))
    head = (bytes([0xC3]) + struct.pack("!I", 1) + bytes([len(dcid)]) + dcid + bytes([8]) + os.urandom(8)
            + buf.data + token)
    rest = size - len(head) - 2
    return bytearray(head + struct.pack("!H", 0x4000 | rest) + os.urandom(rest))


def _answer_retries(sock: socket.socket, target: tuple[str, int]) -> int:
    """Read the Retry packets waiting on ``sock`` and send each one's token back in a new
    Initial, as a client that receives at its address would: each makes the server create a
    connection (which then never completes). Returns how many were sent."""
    sent = 0
    while True:
        try:
            data = sock.recv(2048)
        except (BlockingIOError, OSError):
            return sent
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=8)
        except ValueError:
            continue
        if header.packet_type == QuicPacketType.RETRY and header.token:
            try:
                sock.sendto(initial_datagram(dcid=header.source_cid, token=header.token), target)
                sent += 1
            except (BlockingIOError, OSError):
                pass


@dataclass
class FloodResult:
    sent: int
    refused: int          # sendto errors (the kernel's buffers full): not sent
    seconds: float
    sources: int
    validated: int = 0    # Initials sent again with the token of a Retry (answer_retries)


def flood(target: tuple[str, int], count: int, *, sources: int = 256, rate: float = 0.0,
          answer_retries: bool = False, deadline_s: float = 120.0) -> FloodResult:
    """Send ``count`` Initial-shaped datagrams to ``target`` from ``sources`` addresses in
    127.0.0.0/8 (127.1.x.y), each with a destination connection ID never used before. ``rate``
    caps datagrams a second (0: as fast as the loop goes). ``answer_retries``: also answer each
    Retry with its token (an attacker that owns its addresses). Stops at ``deadline_s`` whatever
    ``count`` says: a load test here is bounded in count and time."""
    socks = []
    for i in range(sources):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.bind((f"127.1.{i // 250}.{i % 250 + 1}", 0))
        socks.append(s)
    datagram = initial_datagram()
    view = memoryview(datagram)
    sent = refused = validated = 0
    start = time.monotonic()
    stop_at = start + deadline_s
    try:
        for n in range(count):
            struct.pack_into("!Q", datagram, _DCID_AT, n)
            try:
                socks[n % sources].sendto(view, target)
                sent += 1
            except (BlockingIOError, OSError):
                refused += 1
            if n & 1023 == 0:
                if answer_retries:
                    validated += sum(_answer_retries(sock, target) for sock in socks)
                now = time.monotonic()
                if now > stop_at:
                    break
                if rate > 0:
                    ahead = n / rate - (now - start)
                    if ahead > 0:
                        time.sleep(ahead)
        if answer_retries:
            time.sleep(0.05)
            validated += sum(_answer_retries(sock, target) for sock in socks)
    finally:
        for s in socks:
            s.close()
    return FloodResult(sent, refused, time.monotonic() - start, sources, validated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the [quic] listener (loopback only)")
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--sources", type=int, default=256)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--answer-retries", action="store_true", help="send each Retry's token back")
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    if not host.startswith("127."):
        parser.error("the flood goes only to loopback addresses (127.0.0.0/8)")
    result = flood((host, int(port)), args.count, sources=args.sources, rate=args.rate,
                   answer_retries=args.answer_retries)
    print(f"sent={result.sent} validated={result.validated} refused={result.refused} sources={result.sources} "
          f"seconds={result.seconds:.1f}")


if __name__ == "__main__":
    main()
