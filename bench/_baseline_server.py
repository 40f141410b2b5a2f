"""Baseline for bench/bench_core.py: a bare grpc.aio KvCache servicer that keeps bytes in a dict.

It serves the same kvcached.v1.KvCache proto as the daemon, on the same kind of listener (a Unix
socket), with the same server options and event loop (uvloop), but does nothing besides the
gRPC/protobuf work: Put copies each payload into a dict (FIFO-bounded by ``--cap-mib`` so long
Put runs cannot exhaust memory), Get answers from the dict (NOT_FOUND on a miss), Lookup and
Stats answer an empty message (the floor of a unary round trip). No checksums, no index, no
arena: whatever kvcached costs beyond this is the daemon's own work.

    python bench/_baseline_server.py unix:/tmp/x/bare.sock [--cap-mib 1024] [--max-message-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

from kvcached.v1 import kvcache_pb2 as pb
from kvcached.v1 import kvcache_pb2_grpc as pb_grpc


class BareKvCache(pb_grpc.KvCacheServicer):
    """Put/Get into a dict; Lookup/Stats return empty messages."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.blocks: dict[tuple[bytes, int], bytes] = {}
        self.nbytes = 0

    async def Put(self, request: pb.PutRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        stored = present = 0
        blocks = self.blocks
        for block in request.blocks:
            key = (block.address.digest, block.address.layer)
            if key in blocks:
                present += 1
                continue
            payload = block.payload
            blocks[key] = payload
            self.nbytes += len(payload)
            stored += 1
        while self.nbytes > self.cap_bytes and blocks:     # FIFO: drop the oldest
            self.nbytes -= len(blocks.pop(next(iter(blocks))))
        return pb.PutResponse(stored=stored, already_present=present)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> pb.GetResponse:
        out = []
        for address in request.addresses:
            payload = self.blocks.get((address.digest, address.layer))
            if payload is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown block")
            out.append(pb.Block(address=address, payload=payload))
        return pb.GetResponse(blocks=out)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        return pb.LookupResponse()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse()


async def serve(target: str, cap_bytes: int, max_message_bytes: int) -> None:
    # Same options as kvcached.lifecycle.daemon.Daemon._start_grpc.
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    pb_grpc.add_KvCacheServicer_to_server(BareKvCache(cap_bytes), server)
    server.add_insecure_port(target)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="listen address in gRPC syntax, e.g. unix:/tmp/bare.sock")
    parser.add_argument("--cap-mib", type=int, default=1024, help="bytes kept before the oldest blocks go")
    parser.add_argument("--max-message-mib", type=int, default=64)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:   # pragma: no cover - kvcached depends on uvloop
        asyncio.run(serve(args.target, args.cap_mib << 20, args.max_message_mib << 20))
    else:
        uvloop.run(serve(args.target, args.cap_mib << 20, args.max_message_mib << 20))


if __name__ == "__main__":
    main()
