"""An upgrade's handover passes every file, however many (kvcached.lifecycle.handover): a daemon
with tenants has an arena per tenant (up to 254) besides its slot directory and listeners, more
than one SCM_RIGHTS message may carry (the kernel passes 253 at most), so they go in messages of
FDS_PER_MESSAGE and the successor gathers them all, each under its name."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

from kvcached.lifecycle.handover import FDS_PER_MESSAGE, Takeover, send_files


def test_two_hundred_and_sixty_files_reach_the_successor_each_under_its_name(tmp_path: Path) -> None:
    path = tmp_path / "handover.sock"
    files = {f"kvcached-arena.{n}" if n else "kvcached-arena": os.memfd_create(f"arena-{n}") for n in range(255)}
    files |= {"kvcached-slots": os.memfd_create("slots"), **{f"listener-{n}": os.memfd_create(f"l{n}") for n in range(5)}}
    assert len(files) > 4 * FDS_PER_MESSAGE
    inodes = {name: os.fstat(fd).st_ino for name, fd in files.items()}

    async def run() -> dict[str, int]:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(str(path))
        server.listen(1)
        server.setblocking(False)
        loop = asyncio.get_running_loop()

        async def predecessor() -> None:
            conn, _ = await loop.sock_accept(server)
            conn.setblocking(False)
            ask = json.loads(await loop.sock_recv(conn, 1 << 16))
            assert ask["op"] == "takeover"
            await send_files(conn, files, {"grpc_tcp": {}})
            conn.close()

        serving = asyncio.ensure_future(predecessor())
        takeover = Takeover(path)
        await takeover.begin("test")
        await serving
        server.close()
        return dict(takeover.files)

    got = asyncio.run(run())
    assert set(got) == set(files)
    assert {name: os.fstat(fd).st_ino for name, fd in got.items()} == inodes
    for fd in [*got.values(), *files.values()]:
        os.close(fd)
