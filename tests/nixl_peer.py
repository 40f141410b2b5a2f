"""One side of a NIXL transfer in a process of its own (UCX reads its transports when the
process's agent starts), for tests/integration/test_nixl_transfer.py.

    python -m tests.nixl_peer holder SIZE SEED TRANSPORTS [REGIONS]   # prints {"metadata", "base", "bases", "size"}
    python -m tests.nixl_peer puller SIZE TRANSPORTS [REGIONS]        # reads one JSON job from stdin, prints the result

A holder's regions (REGIONS of them, 1 by default: a daemon's tenants' arenas) hold SIZE bytes in
all, drawn from SEED and read as one run of offsets. A puller's job: the holder's metadata, base,
bases and size, spans (holder offset, own offset, length, in those runs) and a timeout; it
answers the BLAKE3 of each span read, or the error.
"""

from __future__ import annotations

import json
import mmap
import random
import sys

import blake3

from kvcached.peers.nixl_transfer import NixlEndpoint, NixlTransferError


def regions(size: int, count: int, seed: int | None) -> list[mmap.mmap]:
    data = random.Random(seed).randbytes(size) if seed is not None else None
    areas = []
    for i in range(count):
        area = mmap.mmap(-1, size // count)
        if data is not None:
            area[:] = data[i * (size // count):(i + 1) * (size // count)]
        areas.append(area)
    return areas


def main() -> None:
    role, size = sys.argv[1], int(sys.argv[2])
    rest = sys.argv[4:] if role == "holder" else sys.argv[3:]
    transports = tuple(t for t in rest[0].split(",") if t)
    count = int(rest[1]) if len(rest) > 1 else 1
    if role == "holder":
        areas = regions(size, count, int(sys.argv[3]))
        end = NixlEndpoint("holder", areas if count > 1 else areas[0], transports)
        print(json.dumps({"metadata": end.metadata.hex(), "base": end.base, "bases": list(end.bases),
                          "size": end.size}), flush=True)
        sys.stdin.read()
        end.close()
        return
    areas = regions(size, count, None)
    end = NixlEndpoint("puller", areas, transports)
    job = json.loads(sys.stdin.readline())
    try:
        peer = end.add_peer(bytes.fromhex(job["metadata"]), job["base"], job.get("bases", ()), job.get("size", 0))
        end.read(peer, [tuple(s) for s in job["spans"]], job["timeout_s"])
    except NixlTransferError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return
    whole = b"".join(bytes(a) for a in areas)
    print(json.dumps({"hashes": [blake3.blake3(whole[o:o + n]).hexdigest() for _, o, n in job["spans"]]}), flush=True)
    end.close()


if __name__ == "__main__":
    main()
