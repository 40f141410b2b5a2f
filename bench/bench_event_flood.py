"""An engine's small Lookup and an honest router's replay while a stranger floods the KV events,
against the same without the stranger.

    python bench/bench_event_flood.py [--quick] [--json PATH]     (as root: it makes a user)

Issue 59: replay clients that never read grew the daemon by gigabytes, and route keys of blocks
never saved by 1.6 GiB. Both are bounded now (docs/security.md, "KV events: what a stranger can
make the daemon hold"); this measures what the daemon's well-behaved users see meanwhile.

One real ``kvcached serve`` subprocess (config/kvcached.toml, events on ipc paths, the replay
endpoint opened to every local user as a TCP port would be, its log filled with about 500
batches of about 64 KiB). The stranger is a user made for the run; the operator is this process.

- Victim: an agent's 8-digest Lookup on the agent socket, back to back, each call timed (the
  daemon's event loop, which serves replay and route keys too).
- Cases: (1) the stranger's 1,000 replay connections, each asking from the oldest batch and
  never reading; (2) an agent of the stranger's sending route keys of about 60 KiB for blocks
  it never saves, without pause; (3) both.
- Baseline: the same Lookups without the stranger, in interleaved rounds (quiet, loaded, loaded,
  quiet, ...); p50 and p99 over all of a side's calls; ratio loaded / quiet. Each round also
  times the operator's replay of every batch (figure 2: the slowest of each side).

Target (the issue's): the small Lookup's p99 within 3x quiet. --quick: 2 rounds of 1 s per side
and case (about 40 s); full: 4 rounds of 3 s (about 2 minutes). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import zmq  # noqa: E402
from bench_core import Row, percentile, print_fitted, progress, start_kvcached  # noqa: E402

from kvcached_agent.agent import Agent  # noqa: E402
from kvcached_agent.route import RouteKey, encode_routes  # noqa: E402

END = (-1).to_bytes(8, "big", signed=True)
BLOCK = 4096
TITLES = {1: "1. An agent's 8-digest Lookup while a stranger floods the KV events (lower is better)",
          2: "2. The operator's replay of every batch, meanwhile"}


def connect(tmp: Path, name: str) -> Agent:
    return Agent.connect(str(tmp / "agent.sock"), agent_id=name, model="m", dtype="bf16", block_tokens=16,
                         num_layers=1, layer_block_bytes=BLOCK, timeout=30)


def fill_log(tmp: Path, blocks: int = 960) -> None:
    """Blocks whose route keys are ~24 KiB each: about two events a 64 KiB batch."""
    with connect(tmp, "filler") as agent:
        for start in range(0, blocks, 64):
            digests = agent.hash_tokens(list(range(16 * start, 16 * (start + 64))))
            keys = [encode_routes([RouteKey([start + i], None, [(start + i) % 30000] * 8000, 16)])
                    for i in range(len(digests))]
            agent.save(agent.addresses(digests), [torch.zeros(BLOCK, dtype=torch.uint8)] * len(digests), routes=keys)


def replay_all(tmp: Path, ctx: zmq.Context[Any]) -> tuple[float, int]:
    """(seconds, batches) of a whole replay from 0, asking again if cut under it."""
    started = time.perf_counter()
    for _ in range(20):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(f"ipc://{tmp}/replay")
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        n = 0
        try:
            while True:
                frames = sock.recv_multipart()
                if frames[2] == END:
                    return time.perf_counter() - started, n
                n += 1
        except zmq.Again:
            continue
        finally:
            sock.close(linger=0)
    return float("nan"), 0


def lookups(agent: Agent, seconds: float) -> list[float]:
    digests = [n.to_bytes(32, "big") for n in range(8)]
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        agent.lookup(digests, 0)
        out.append(time.perf_counter() - started)
    return out


def stranger(uid: int, gid: int, tmp: Path, replay_clients: int, route_keys: bool) -> int:
    """A forked process running as ``uid``: its replay clients and its route-key agent, until killed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        os.read(read, 1)
        os.close(read)
        return pid
    try:
        os.close(read)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        ctx = zmq.Context()
        socks = []
        for _ in range(replay_clients):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{tmp}/replay")
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(sock)
        os.write(write, b"r")
        if not route_keys:
            time.sleep(3600)
        blob = encode_routes([RouteKey([1], None, [29_999] * 20_000, 16)])
        with connect(tmp, "stranger") as agent:
            n = 0
            while True:
                digests = [os.urandom(32) for _ in range(100)]
                agent.send_routes(agent.addresses(digests), [blob] * len(digests))
                n += 1
                if n % 10 == 0:
                    agent.lookup(digests[:1])       # read what came back
    finally:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rounds, seconds = (2, 1.0) if args.quick else (4, 3.0)
    if os.geteuid() != 0:
        print("bench_event_flood: run as root (it makes a user for the stranger)", file=sys.stderr)
        return 2
    name = f"kvcbench{os.getpid()}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    rows: list[Row] = []
    try:
        entry = pwd.getpwnam(name)
        with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvcached-bench-") as tmp_name:
            tmp = Path(tmp_name)
            tmp.chmod(0o711)
            progress("starting the daemon, filling the event log")
            start_kvcached(stack, tmp, 0.25, [f'events.endpoint="ipc://{tmp}/events"',
                                              f'events.replay_endpoint="ipc://{tmp}/replay"', "events.batch_ms=10"])
            (tmp / "replay").chmod(0o666)
            (tmp / "agent.sock").chmod(0o666)
            fill_log(tmp)
            ctx: zmq.Context[Any] = zmq.Context()
            stack.callback(ctx.term)
            victim = stack.enter_context(connect(tmp, "victim"))
            lookups(victim, 0.3)
            cases: list[tuple[str, Callable[[], int]]] = [
                ("1,000 replay clients that never read", lambda: stranger(entry.pw_uid, entry.pw_gid, tmp, 1000, False)),
                ("route keys of blocks never saved", lambda: stranger(entry.pw_uid, entry.pw_gid, tmp, 0, True)),
                ("both", lambda: stranger(entry.pw_uid, entry.pw_gid, tmp, 1000, True))]
            for label, start in cases:
                quiet: list[float] = []
                loaded: list[float] = []
                replays: list[float] = []
                quiet_replays: list[float] = []
                for r in range(rounds):
                    for side in (("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet")):
                        progress(f"{label}: round {r + 1}/{rounds}, {side}")
                        if side == "quiet":
                            quiet += lookups(victim, seconds)
                            quiet_replays.append(replay_all(tmp, ctx)[0])
                            continue
                        pid = start()
                        try:
                            time.sleep(0.5)
                            loaded += lookups(victim, seconds)
                            took, batches = replay_all(tmp, ctx)
                            replays.append(took)
                        finally:
                            os.kill(pid, signal.SIGKILL)
                            os.waitpid(pid, 0)
                        time.sleep(1.0)                  # its connections counted gone
                q99, l99 = percentile(quiet, 0.99), percentile(loaded, 0.99)
                rows.append(Row(1, f"{label}, p50", "ms", percentile(loaded, 0.5) * 1e3, "no stranger",
                                percentile(quiet, 0.5) * 1e3, False))
                rows.append(Row(1, f"{label}, p99", "ms", l99 * 1e3, "no stranger", q99 * 1e3, False,
                                target="<= 3x", passed=l99 <= 3 * q99))
                rows.append(Row(2, f"{label} ({batches} batches)", "s", max(replays), "no stranger",
                                max(quiet_replays), False, details={"replays_s": replays, "quiet_s": quiet_replays}))
    finally:
        subprocess.run(["userdel", name], capture_output=True)
    print_fitted(rows, f"kvcached event flood benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
                 f"{rounds} rounds of {seconds:g} s a side", TITLES,
                 lambda v, unit: f"{v:.2f} {unit}",
                 ["ratio: with the stranger / without; figure 2: the slowest of the operator's replays each side."])
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
