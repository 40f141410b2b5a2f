"""The bare baseline of bench_agent.py's lookup figure: a uvloop Unix-socket server that answers
every frame with one frame of a fixed size, doing nothing else.

    python bench/_echo_server.py SOCKET_PATH REPLY_BODY_BYTES

Frames are kvcached_agent.protocol's (12-byte header: body length, version, type, flags,
request id; then the body). For each whole frame it receives, the server writes one reply frame
with the same request id, type LookupResult and REPLY_BODY_BYTES zero bytes of body: the same
sizes as the daemon's Lookup answer, none of its work (no decoding, no store, no encoding).
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

from kvcached_agent.protocol import HEADER, LookupResult


class Echo(asyncio.Protocol):
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= HEADER.size:
            length, version, _, _, request_id = HEADER.unpack_from(buf)
            end = HEADER.size + length
            if len(buf) < end:
                return
            del buf[:end]
            assert self.transport is not None
            self.transport.write(HEADER.pack(len(self.body), version, LookupResult.TYPE, 0, request_id) + self.body)


async def serve(path: str, reply_body: int) -> None:
    body = bytes(reply_body)
    server = await asyncio.get_running_loop().create_unix_server(lambda: Echo(body), path)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], int(sys.argv[2])))
