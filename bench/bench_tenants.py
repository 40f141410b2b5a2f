"""What tenants hide and what they cost (kvcached.tenants, issue 41): one tenant's Lookup of
another's cached prefix against its Lookup of a prefix nobody stored, and an agent's saves and
loads with tenants configured against none, in the same run.

    python bench/bench_tenants.py [--quick] [--json PATH]

Needs root and useradd: it creates two system users for the run and deletes them after (it says
so and exits 0 without them). Agents run in forked children that drop to those users' ids
before they connect (the kernel's SO_PEERCRED is what names a tenant), with torch on one thread.

Setup: ``kvcached serve`` subprocesses (bench_core.start_kvcached: RAM 1 GiB, SSD off, the
agent socket in a 0711 directory with mode 0666): "none" with no [tenants] settings (every agent
the default tenant), "two" with ``tenants.uids = { alice = [A], bob = [B] }`` and a gRPC socket
for each (``tenants.sockets``). Before the figures, bob fills each daemon's RAM tier once over
with fresh blocks, so every timed round meets the same state: every arena page touched and a
tier that evicts to make room (without it a daemon used before is measured evicting against a
fresh one that is not, and the first touch of arena pages costs more than what follows).

1. Timing. On "two", alice saves a 32-block prefix P (64 KiB blocks). Then bob, in one
   connection, alternates Lookup of P's digests (alice's blocks, cached) and of a prefix Q
   nobody stored, ``lookups`` times each; every answer must be 0. p50 and p90 of each, and the
   ratio P / Q. Target (issue 41): p50 within 10% of the miss's.
2. Cost. bob saves 64 fresh 64 KiB blocks a save, back to back for ``seconds``, on "two" (his
   digests mapped to his addresses) and on "none" (where he is the default tenant: no mapping),
   interleaved rounds, the order reversed each round; then loads a 64-block working set as
   often. GB/s of each side's median round; the ratio the median over rounds of two / none.
   Target (issue 41): >= 0.95x.
4. Cost of RAM shares. Two more daemons with RAM 0.25 GiB (so saves evict), both with the two
   tenants: "shares" with ``tenants.ram_shares = { alice = 0.5, bob = 0.25 }``, "unshared"
   without. bob saves and loads as in 2, rounds interleaved, so every save past the first
   quarter GiB evicts, by the shares' rule on one side and the policy's alone on the other.
   The ratio the median over rounds of shares / unshared. No target of the issue's; printed so
   the cost of the rule is known.
5. Spread (A/A): bob's saves and loads on "none" against a second daemon just like it
   ("none-b"), as in 2. How far apart two identical daemons measure in the same run: a cost
   ratio of 2 or 4 within this spread of 1.00x is noise.
3. Timing over gRPC. On bob's tenant socket (this process is root, which its ACL admits; the
   socket, not the caller, names the tenant), Lookup of P's digests and of Q, alternating,
   ``lookups`` times each; every answer must be 0, and alice's socket must find all of P.
   p50 of each and the ratio. Target (issue 41): within 10%.

6. Arenas (issue 61): alice and bob save and load at once, 1 MiB x64 each (fresh blocks a
   save, then a 64-block working set loaded as often), on "two" (each tenant's blocks in an
   arena of its own, the node's RAM one budget: once it is full, every slab one tenant's saves
   take from the other is punched out of the other's arena and faulted in fresh) and on "none"
   (both the default tenant: one arena), rounds interleaved. GB/s of both together; the ratio
   the median over rounds of two / none. Target (issue 61): >= 0.95x for saves and loads. The
   header says the kernel's shmem huge page setting: with ``never`` (Debian's default) every slab
   that changes owner is punched and faulted in 4 KiB pages, about 10x the cost of 2 MiB ones
   (``advise``, which the daemon and the agents ask for).

7. Arenas against the code before them: figure 6's load on "two" against the same two tenants
   on the daemon of ``--before`` (default BEFORE_ARENAS, the last commit before issue 61, checked
   out with ``git worktree`` for the run), where every tenant's blocks share one arena: the
   arenas' own cost, with the tenants' per-call work (their addresses, tallies) on both sides.
   Target (issue 61): >= 0.95x. Not run (and said) where this is no git checkout.

--quick: 200 lookups, 3 rounds of 0.3 s (about 30 s). Full: 1000 lookups, 5 rounds of 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The agents run in forked children; this process also calls gRPC (figure 3), whose fork
# handlers would log a line at every fork. The children never use gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
import torch  # noqa: E402
from bench_core import KiB, Row, percentile, print_fitted, progress, start_kvcached  # noqa: E402

from kvcached.client import KvCacheClient  # noqa: E402
from kvcached.host.process import shmem_huge_pages  # noqa: E402
from kvcached_agent.agent import Agent  # noqa: E402
from tests.integration.users import as_user as run_as  # noqa: E402
from tests.integration.users import made_users  # noqa: E402
from tests.integration.users import together as run_together  # noqa: E402

BLOCK = 64 * KiB
BIG = 1024 * KiB            # figure 6's blocks
BEFORE_ARENAS = "80d5d78"   # figure 7's baseline: main before issue 61 (one arena for every tenant)
BATCH = 64
PREFIX = 32
TIMING_TARGET = 0.10        # p50 of another tenant's cached prefix within 10% of a miss's
COST_TARGET = 0.95


def as_user(uid: int, gid: int, work: Callable[[], Any]) -> Any:
    """``work()``'s JSON-able result, run in a forked child as ``uid``/``gid``."""
    answer = run_as(uid, gid, work)
    if "error" in answer:
        raise RuntimeError(f"agent as uid {uid}: {answer['error']}")
    return answer["ok"]


def connect(sock: str, name: str) -> Agent:
    return Agent.connect(sock, agent_id=name, model="bench/tenants", dtype="bf16", block_tokens=16, num_layers=1,
                         layer_block_bytes=BLOCK, use_cuda=False, timeout=30)


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(blocks * 16)]


def save_prefix(sock: str) -> Callable[[], int]:
    def work() -> int:
        with connect(sock, "alice") as agent:
            addresses = agent.addresses(agent.hash_tokens(tokens(1, PREFIX)))
            return agent.save(addresses, [torch.full((BLOCK,), 1, dtype=torch.uint8) for _ in addresses]).stored
    return work


def time_lookups(sock: str, n: int) -> Callable[[], dict[str, Any]]:
    def work() -> dict[str, Any]:
        with connect(sock, "bob") as agent:
            cached = agent.hash_tokens(tokens(1, PREFIX))          # alice's prefix
            never = agent.hash_tokens(tokens(2, PREFIX))
            times: dict[str, list[float]] = {"cached": [], "never": []}
            found = 0
            for i in range(n + 20):
                for name, digests in (("cached", cached), ("never", never)) if i % 2 == 0 else (
                        ("never", never), ("cached", cached)):
                    t0 = time.perf_counter()
                    answer = agent.lookup(digests)
                    dt = time.perf_counter() - t0
                    found += answer.longest
                    if i >= 20:                                       # the first 20 are warm-up
                        times[name].append(dt)
            return {"times": times, "found": found}
    return work


def save_load(sock: str, seconds: float, seed: int) -> Callable[[], dict[str, float]]:
    def work() -> dict[str, float]:
        torch.set_num_threads(1)
        src = list(torch.randint(0, 256, (BATCH * BLOCK,), dtype=torch.uint8).view(-1, BLOCK))
        with connect(sock, "bob") as agent:
            spent = stored = 0.0
            n = 0
            while spent < seconds:
                digests = [os.urandom(32) for _ in range(BATCH)]
                addresses = agent.addresses(digests)
                t0 = time.perf_counter()
                stored += agent.save(addresses, src).stored
                spent += time.perf_counter() - t0
                n += 1
            working = agent.addresses([bytes([seed]) * 31 + bytes([i]) for i in range(BATCH)])
            agent.save(working, src)
            out = [torch.empty(BLOCK, dtype=torch.uint8) for _ in range(BATCH)]
            loaded = 0.0
            t_load = 0.0
            for _ in range(n):
                t0 = time.perf_counter()
                loaded += agent.load(working, out).loaded
                t_load += time.perf_counter() - t0
            return {"save": stored * BLOCK / spent / 1e9, "load": loaded * BLOCK / max(t_load, 1e-9) / 1e9}
    return work


def save_load_big(sock: str, name: str, seconds: float, seed: int) -> Callable[[], dict[str, float]]:
    """Figure 6: saves of 64 fresh 1 MiB blocks for ``seconds``, then loads of a 64-block
    working set as often; bytes and seconds of each."""
    def work() -> dict[str, float]:
        torch.set_num_threads(1)
        src = list(torch.randint(0, 256, (BATCH * BIG,), dtype=torch.uint8).view(-1, BIG))
        with Agent.connect(sock, agent_id=name, model="bench/tenants", dtype="bf16", block_tokens=16, num_layers=1,
                           layer_block_bytes=BIG, use_cuda=False, timeout=60) as agent:
            spent = stored = 0.0
            n = 0
            while spent < seconds:
                addresses = agent.addresses([os.urandom(32) for _ in range(BATCH)])
                t0 = time.perf_counter()
                stored += agent.save(addresses, src).stored
                spent += time.perf_counter() - t0
                n += 1
            working = agent.addresses([bytes([seed, 6]) * 15 + bytes([7, i]) for i in range(BATCH)])
            agent.save(working, src)
            out = [torch.empty(BIG, dtype=torch.uint8) for _ in range(BATCH)]
            loaded = t_load = 0.0
            for _ in range(n):
                t0 = time.perf_counter()
                loaded += agent.load(working, out).loaded
                t_load += time.perf_counter() - t0
            return {"save_bytes": stored * BIG, "save_s": spent, "load_bytes": loaded * BIG, "load_s": t_load}
    return work


def together(works: list[tuple[int, int, Callable[[], Any]]]) -> list[Any]:
    """Each ``work()`` in a forked child as its user, all at once; their results in order."""
    answers = run_together(works)
    for answer in answers:
        if "error" in answer:
            raise RuntimeError(f"agent: {answer['error']}")
    return [answer["ok"] for answer in answers]


def arena_rows(figure: int, socks: dict[str, str], base: str, base_name: str, alice: tuple[int, int],
               bob: tuple[int, int], rounds: int, seconds: float) -> list[Row]:
    """Figures 6 and 7: alice and bob at once on "two" (an arena each) against ``base``."""
    sides: dict[str, list[dict[str, float]]] = {"two": [], base: []}
    for r in range(rounds):
        for name in (("two", base) if r % 2 == 0 else (base, "two")):
            a, b = together([(*alice, save_load_big(socks[name], "alice", seconds, 2 * r)),
                             (*bob, save_load_big(socks[name], "bob", seconds, 2 * r + 1))])
            sides[name].append({what: (a[f"{what}_bytes"] + b[f"{what}_bytes"])
                                / max(a[f"{what}_s"], b[f"{what}_s"], 1e-9) / 1e9 for what in ("save", "load")})
    rows = []
    for what in ("save", "load"):
        ratio = statistics.median(t[what] / o[what] for t, o in zip(sides["two"], sides[base]))
        rows.append(Row(figure, f"alice and bob at once, {what} 1 MiB x{BATCH} each, an arena each", "GB/s",
                        statistics.median(x[what] for x in sides["two"]), base_name,
                        statistics.median(x[what] for x in sides[base]), True, f">= {COST_TARGET:.2f}x",
                        ratio >= COST_TARGET, {"rounds": list(sides.values())}, ratio))
    return rows


def checkout(stack: contextlib.ExitStack, rev: str, where: Path) -> Path | None:
    """``rev`` of this repository checked out at ``where`` (a git worktree, removed at the end);
    None where this is no git checkout or the revision is unknown."""
    root = Path(__file__).resolve().parents[1]
    made = subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(where), rev],
                          capture_output=True, text=True)
    if made.returncode != 0:
        return None
    stack.callback(subprocess.run, ["git", "-C", str(root), "worktree", "remove", "--force", str(where)],
                   capture_output=True)
    return where


def warm(sock: str, gib: float) -> Callable[[], int]:
    """Fill the daemon's RAM tier once over (fresh blocks): every timed round after this meets
    the same state, an arena whose pages are all touched and a tier that evicts to make room."""
    def work() -> int:
        torch.set_num_threads(1)
        src = list(torch.randint(0, 256, (BATCH * BLOCK,), dtype=torch.uint8).view(-1, BLOCK))
        written = 0
        with connect(sock, "bob") as agent:
            while written < 1.25 * gib * (1 << 30):
                agent.save(agent.addresses([os.urandom(32) for _ in range(BATCH)]), src)
                written += BATCH * BLOCK
        return written
    return work


def cost_rows(figure: int, case: str, baseline: str, sock: str, base_sock: str, user: tuple[int, int], rounds: int,
              seconds: float, target: str = "", least: float | None = None) -> list[Row]:
    """bob's saves and loads on ``sock`` against ``base_sock``, rounds interleaved (the order
    reversed each round): a row for each, the ratio the median over rounds."""
    sides: dict[str, list[dict[str, float]]] = {sock: [], base_sock: []}
    for r in range(rounds):
        for name in ((sock, base_sock) if r % 2 == 0 else (base_sock, sock)):
            sides[name].append(as_user(*user, save_load(name, seconds, r)))
    rows = []
    for what in ("save", "load"):
        ratio = statistics.median(a[what] / b[what] for a, b in zip(sides[sock], sides[base_sock]))
        rows.append(Row(figure, f"agent {what}, 64 KiB x{BATCH}, {case}", "GB/s",
                        statistics.median(x[what] for x in sides[sock]), baseline,
                        statistics.median(x[what] for x in sides[base_sock]), True, target,
                        None if least is None else ratio >= least, {"rounds": list(sides.values())}, ratio))
    return rows


def grpc_lookups(target: str, cached: list[bytes], never: list[bytes], n: int) -> dict[str, Any]:
    """Alternating gRPC Lookups of ``cached`` and ``never`` on ``target``, ``n`` timed each."""
    times: dict[str, list[float]] = {"cached": [], "never": []}
    found = 0
    with KvCacheClient(target) as client:
        for i in range(n + 20):
            for name, digests in (("cached", cached), ("never", never)) if i % 2 == 0 else (
                    ("never", never), ("cached", cached)):
                t0 = time.perf_counter()
                found += client.lookup(digests).longest
                dt = time.perf_counter() - t0
                if i >= 20:
                    times[name].append(dt)
    return {"times": times, "found": found}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--before", default=BEFORE_ARENAS, help="figure 7's baseline: a revision of this repository "
                                                                "from before arenas (default %(default)s)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        print("bench_tenants: needs root and useradd (it runs agents as users it creates); not run")
        return 0
    lookups, rounds, seconds = (200, 3, 0.3) if args.quick else (1000, 5, 1.0)
    torch.set_num_threads(1)
    rows: list[Row] = []
    notes: list[str] = []
    with contextlib.ExitStack() as stack, made_users() as make:
        (a_uid, a_gid), (b_uid, b_gid) = make(), make()
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcb-")))
        tmp.chmod(0o711)
        socks = {}
        two = [f"tenants.uids={{ alice = [{a_uid}], bob = [{b_uid}] }}",
               f'tenants.sockets={{ alice = "{tmp / "alice.sock"}", bob = "{tmp / "bob.sock"}" }}']
        uids = two[:1]
        before = checkout(stack, args.before, tmp / "before-code")
        daemons = [("none", 1.0, [], None), ("none-b", 1.0, [], None), ("two", 1.0, two, None),
                   ("unshared", 0.25, uids, None),
                   ("shares", 0.25, [*uids, "tenants.ram_shares={ alice = 0.5, bob = 0.25 }"], None)]
        if before is not None:
            daemons.append(("before", 1.0, uids, before))
        for name, gib, extra, code in daemons:
            home = tmp / name
            home.mkdir()
            home.chmod(0o711)
            socks[name] = str(home / "agent.sock")
            start_kvcached(stack, home, gib, ["kv.ssd_gib=0", f'agent.socket="{socks[name]}"', 'agent.mode="0666"', *extra],
                           code=code)
            deadline = time.monotonic() + 30
            while not os.path.exists(socks[name]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no agent socket from {name}")
                time.sleep(0.05)
        progress("warming: bob fills each daemon's RAM tier once, so every timed round meets a full tier")
        for name, gib, _, _ in daemons:
            as_user(b_uid, b_gid, warm(socks[name], gib))
        progress("1. alice saves a 32-block prefix; bob looks it up, and a prefix nobody stored")
        if as_user(a_uid, a_gid, save_prefix(socks["two"])) != PREFIX:
            raise RuntimeError("alice's prefix was not stored")
        timed = as_user(b_uid, b_gid, time_lookups(socks["two"], lookups))
        if timed["found"]:
            raise RuntimeError(f"bob found {timed['found']} of alice's blocks")
        p50 = {k: percentile(v, 0.5) * 1e6 for k, v in timed["times"].items()}
        p90 = {k: percentile(v, 0.9) * 1e6 for k, v in timed["times"].items()}
        ratio = p50["cached"] / p50["never"]
        rows.append(Row(1, f"Lookup of another tenant's cached {PREFIX}-block prefix, p50", "us", p50["cached"],
                        "a prefix nobody stored", p50["never"], False, f"within {TIMING_TARGET:.0%}",
                        abs(ratio - 1) <= TIMING_TARGET, {"p90_us": p90, "lookups": lookups}))
        rows.append(Row(1, "the same, p90", "us", p90["cached"], "a prefix nobody stored", p90["never"], False))
        progress("3. the same over gRPC, on bob's tenant socket")
        with connect(socks["two"], "root") as root:
            cached, never = root.hash_tokens(tokens(1, PREFIX)), root.hash_tokens(tokens(2, PREFIX))
        with KvCacheClient(f"unix:{tmp / 'alice.sock'}") as alice:
            if alice.lookup(cached).longest != PREFIX:
                raise RuntimeError("alice's socket does not find her prefix")
        over_grpc = grpc_lookups(f"unix:{tmp / 'bob.sock'}", cached, never, lookups)
        if over_grpc["found"]:
            raise RuntimeError(f"bob's socket found {over_grpc['found']} of alice's blocks")
        p50 = {k: percentile(v, 0.5) * 1e6 for k, v in over_grpc["times"].items()}
        ratio = p50["cached"] / p50["never"]
        rows.append(Row(3, f"gRPC Lookup of another tenant's cached {PREFIX}-block prefix, p50", "us", p50["cached"],
                        "a prefix nobody stored", p50["never"], False, f"within {TIMING_TARGET:.0%}",
                        abs(ratio - 1) <= TIMING_TARGET, {"lookups": lookups}))
        progress(f"2. bob saves and loads on a daemon with tenants and on one without: {rounds} rounds of {seconds:g} s")
        rows += cost_rows(2, "bob a tenant", "no tenants configured", socks["two"], socks["none"], (b_uid, b_gid),
                          rounds, seconds, f">= {COST_TARGET:.2f}x", COST_TARGET)
        progress(f"4. bob saves and loads with RAM shares set and without, RAM 0.25 GiB: {rounds} rounds of {seconds:g} s")
        rows += cost_rows(4, "evicting, shares set", "no shares", socks["shares"], socks["unshared"], (b_uid, b_gid),
                          rounds, seconds)
        progress(f"6. alice and bob at once, 1 MiB blocks, an arena each vs one arena: {rounds} rounds of {seconds:g} s")
        rows += arena_rows(6, socks, "none", "one arena (no tenants configured)", (a_uid, a_gid), (b_uid, b_gid),
                           rounds, seconds)
        if "before" in socks:
            progress(f"7. the same against the two tenants on the code before arenas ({args.before}): "
                     f"{rounds} rounds of {seconds:g} s")
            rows += arena_rows(7, socks, "before", f"one arena for both ({args.before}, before arenas)",
                               (a_uid, a_gid), (b_uid, b_gid), rounds, seconds)
        else:
            notes.append(f"figure 7 not run: {args.before} could not be checked out here (no git checkout?)")
        progress(f"5. A/A: bob saves and loads on two daemons with no tenants: {rounds} rounds of {seconds:g} s")
        rows += cost_rows(5, "no tenants", "the same, another daemon", socks["none"], socks["none-b"], (b_uid, b_gid),
                          rounds, seconds)
    header = (f"kvcached tenants benchmark ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, "
              f"{lookups} lookups a side, {rounds} rounds of {seconds:g} s; shmem huge pages: {shmem_huge_pages() or 'unknown'}")
    titles = {1: "1. Timing: one tenant's Lookup of another's cached prefix vs of a prefix nobody stored (lower is better)",
              2: "2. Cost: an agent's saves and loads with tenants configured vs none (higher is better)",
              3: "3. Timing over gRPC, on bob's tenant socket (lower is better)",
              4: "4. Cost of RAM shares: an agent's saves and loads that evict, shares set vs none (higher is better)",
              5: "5. Spread: the same saves and loads on two identical daemons (A/A; how far from 1.00x is noise)",
              6: "6. Arenas: two tenants saving and loading at once, an arena each vs one arena (higher is better)",
              7: "7. Arenas: the same two tenants, an arena each vs sharing one (the code before arenas; higher is better)"}
    print_fitted(rows, header, titles, lambda v, u: f"{v:.3f} GB/s" if u == "GB/s" else f"{v:.1f} {u}",
                 ["ratio: kvcached / baseline; timing: within the target either way; cost: median over rounds."])
    for note in notes:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
