"""One side of a NIXL transfer in a process of its own (UCX reads its transports when the
process's agent starts), for tests/integration/test_nixl_transfer.py.

    python -m tests.nixl_peer holder SIZE SEED TRANSPORTS     # prints {"metadata", "base"}, serves until stdin closes
    python -m tests.nixl_peer puller SIZE TRANSPORTS          # reads one JSON job from stdin, prints the result

A holder's region holds SIZE bytes drawn from SEED. A puller's job: the holder's metadata and
base, spans (holder offset, own offset, length) and a timeout; it answers the BLAKE3 of each span
read, or the error.
"""

from __future__ import annotations

import json
import mmap
import random
import sys

import blake3

from kvcached.peers.nixl_transfer import NixlEndpoint, NixlTransferError


def region(size: int, seed: int | None) -> mmap.mmap:
    area = mmap.mmap(-1, size)
    if seed is not None:
        area[:] = random.Random(seed).randbytes(size)
    return area


def main() -> None:
    role, size = sys.argv[1], int(sys.argv[2])
    transports = tuple(t for t in sys.argv[-1].split(",") if t)
    if role == "holder":
        area = region(size, int(sys.argv[3]))
        end = NixlEndpoint("holder", area, transports)
        print(json.dumps({"metadata": end.metadata.hex(), "base": end.base}), flush=True)
        sys.stdin.read()
        end.close()
        return
    area = region(size, None)
    end = NixlEndpoint("puller", area, transports)
    job = json.loads(sys.stdin.readline())
    try:
        peer = end.add_peer(bytes.fromhex(job["metadata"]), job["base"])
        end.read(peer, [tuple(s) for s in job["spans"]], job["timeout_s"])
    except NixlTransferError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return
    print(json.dumps({"hashes": [blake3.blake3(area[o:o + n]).hexdigest() for _, o, n in job["spans"]]}), flush=True)
    end.close()


if __name__ == "__main__":
    main()
