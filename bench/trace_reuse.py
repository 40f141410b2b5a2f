"""What a production KV-cache trace rewards: how its blocks are reused, and how much of the
optimum (Belady's MIN) a cache can get without seeing the future. Backs the section "What the
trace rewards" of docs/policies.md, under "The production trace".

    python bench/trace_reuse.py [--trace FILE.jsonl]

The trace is a Mooncake JSON Lines file (kvcached.sim.traces; default the conversation trace,
/work/shared/traces/conversation_trace.jsonl, or where that is absent its first 1,500 requests
in tests/data, said in the output). A request's *hit prefix* is its longest prefix of blocks
some earlier request used; its *new blocks* are those after it, leaving out the request's last
block (a prompt's last 512-token block is mostly partial, so it is counted on its own). "Used
again" means by a later request. Figures, each with the statement it backs:

1. Totals: requests, block accesses, distinct blocks; the share of accesses that are a block's
   first use. Backs "no cache hits more than one minus that share, however large": the
   ceiling, which MIN reaches from 5% of the distinct blocks up (figure 6), so what is left
   above that size is what a policy gives away, not what the trace withholds.
2. All-or-none reuse: requests whose new blocks are all used again later, none, or some, and
   the reuse rate of last blocks alone. Backs "a conversation comes back whole or not at all":
   few requests are mixed, so a cache's question per request is whether its conversation
   returns, not which of its blocks will.
3. P(a block is used again | it has been used n times), n = 1..5 and 6+. Backs the statement on
   what a block's use count predicts, the bet of ARC, S3-FIFO and slru's protected list: how
   much likelier a reused block is to come back than one used once, and how many of the
   accesses (most are first uses) that bet can help with.
4. P(a request's new blocks are used again) by what is known when they are saved: first turn or
   continuation, number of new blocks, length of the hit prefix, and (continuations) the time
   since the hit prefix's last block was used before. Backs "nothing known at save time tells a
   returning conversation well from one that will not return": how far apart the buckets'
   rates are is what an admission policy could learn from these features. (A request near the
   trace's end has less future to be reused in; figures 2 and 4 count that as not reused.)
5. Reuse distance after a first use: quantiles of the block accesses and of the seconds between
   a block's first and second use. Backs "conversations come back after more traffic than a
   small cache holds": to be hit, a block must outlive that many accesses (compare the sizes
   of figure 6).
6. Block hit rates at 1, 5, 10 and 20% of the distinct blocks: LRU (the daemon's class through
   kvcached.sim.replay), LRU with an oracle admission (never stores a block with no later use,
   drops a block at its last use: offline), leaf-aware LRU (SGLang's radix-tree eviction,
   tair-kvcache's LeafAware LRU: only blocks with no resident child may go, least recently used
   first), and MIN; prefix hits (up to a request's first miss) beside each; each as a ratio to
   MIN's. Backs "the gap to MIN is admission, not eviction order": knowing which blocks return
   closes most of it with plain LRU order; and "leaf-aware eviction buys nothing here": chains
   are used in order, so LRU's prefix hits are its block hits already.

Every replay uses the request semantics of kvcached.sim.replay.replay_requests (prefix=False):
the blocks a request finds are hits (touched), then the ones it did not find are saved in order,
evicting while the cache is full. Plain Python; about 10 s on the full trace (288,500 block
accesses). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcached.policies import make_keyed_policy  # noqa: E402
from kvcached.sim.replay import accesses_of, belady_hits, prefix_count, replay_requests  # noqa: E402
from kvcached.sim.traces import LoadedTrace, TraceError, load_trace  # noqa: E402

DEFAULT_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")
TRACE_SLICE = ROOT / "tests" / "data" / "mooncake_conversation_slice.jsonl"
FRACTIONS = (0.01, 0.05, 0.1, 0.2)          # cache sizes, of the trace's distinct blocks
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
MIN_BUCKET = 100                            # requests a bucket needs to count in figure 4's spread
_T0 = time.monotonic()

Trace = Sequence[Sequence[bytes]]


def progress(message: str) -> None:
    print(f"[trace_reuse {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# the facts every figure reads


@dataclass(frozen=True)
class Saved:
    """One request as the cache sees it when its blocks are saved."""

    prefix: int                 # hit prefix: leading blocks some earlier request used
    new: int                    # blocks after the hit prefix, the request's last block left out
    reused: int                 # of those, used again by a later request
    last_new: bool              # its last block is after the hit prefix
    last_reused: bool           # ... and used again by a later request
    gap_s: float | None         # since the last hit-prefix block's previous use (None: no hit prefix)


def next_requests(requests: Trace) -> list[list[int]]:
    """Per request and block, the index of the next later request that uses the block, or
    len(requests) (never)."""
    never = len(requests)
    following: dict[bytes, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        out[r] = [following.get(key, never) for key in requests[r]]
        for key in requests[r]:
            following[key] = r
    return out


def saved_requests(requests: Trace, times_s: Sequence[float], nexts: Sequence[Sequence[int]]) -> list[Saved]:
    """Each request's :class:`Saved`, in trace order."""
    never = len(requests)
    last_seen: dict[bytes, float] = {}      # key -> time of its latest use so far
    out: list[Saved] = []
    for request, nxt, t in zip(requests, nexts, times_s):
        p = 0
        while p < len(request) and request[p] in last_seen:
            p += 1
        end = max(p, len(request) - 1)
        last_new = p < len(request)
        out.append(Saved(prefix=p, new=end - p, reused=sum(n != never for n in nxt[p:end]),
                         last_new=last_new, last_reused=last_new and nxt[-1] != never,
                         gap_s=t - last_seen[request[p - 1]] if p else None))
        for key in request:
            last_seen[key] = t
    return out


def ratio(value: float, reference: float) -> float:
    return value / reference if reference else 0.0


def rate(part: int, whole: int) -> str:
    return f"{part / whole:.3f}" if whole else "  -  "


# 1. totals


def fig_totals(trace: LoadedTrace, accesses: Sequence[bytes]) -> int:
    """Prints figure 1; returns the number of distinct blocks."""
    distinct = len(set(accesses))
    first = distinct / len(accesses)
    print("1. Totals")
    print(f"  requests {len(trace.requests)} over {trace.span_ms / 1000:.1f} s; block accesses {len(accesses)}; "
          f"distinct blocks {distinct}")
    print(f"  first uses: {first:.3f} of accesses; hit-rate ceiling of any cache: {1 - first:.3f}")
    return distinct


# 2. all-or-none reuse


def fig_all_or_none(saved: Sequence[Saved]) -> None:
    with_new = [s for s in saved if s.new]
    groups = {"all used again": [s for s in with_new if s.reused == s.new],
              "none used again": [s for s in with_new if s.reused == 0],
              "mixed": [s for s in with_new if 0 < s.reused < s.new]}
    blocks = sum(s.new for s in with_new)
    print("\n2. All-or-none reuse of a request's new blocks (after its hit prefix, its last block left out)")
    print(f"  requests with new blocks {len(with_new)} ({len(saved) - len(with_new)} without); new blocks {blocks}, "
          f"used again {rate(sum(s.reused for s in with_new), blocks)}")
    for label, group in groups.items():
        print(f"  {label:16} {len(group):6} requests ({rate(len(group), len(with_new))}), "
              f"{sum(s.new for s in group):7} new blocks ({rate(sum(s.new for s in group), blocks)})")
    lasts = [s for s in saved if s.last_new]
    print(f"  last blocks (after the hit prefix): {len(lasts)}, used again {rate(sum(s.last_reused for s in lasts), len(lasts))}")


# 3. reuse by number of uses


def fig_by_uses(requests: Trace, nexts: Sequence[Sequence[int]]) -> None:
    never = len(requests)
    top = 6
    seen: dict[int, int] = {n: 0 for n in range(1, top + 1)}
    again: dict[int, int] = dict.fromkeys(seen, 0)
    uses: dict[bytes, int] = {}
    for request, nxt in zip(requests, nexts):
        for key, n in zip(request, nxt):
            count = uses[key] = uses.get(key, 0) + 1
            bucket = min(count, top)
            seen[bucket] += 1
            again[bucket] += n != never
    print("\n3. P(a block is used again | it has been used n times)")
    for n in seen:
        label = f"{n}+" if n == top else str(n)
        print(f"  n = {label:3} {seen[n]:8} uses, used again {rate(again[n], seen[n])}")


# 4. what predicts a request's reuse


def power2_label(seconds: float) -> str:
    if seconds < 1:
        return "<1 s"
    k = int(math.log2(seconds))
    return f"{2 ** k}-{2 ** (k + 1)} s"


def count_bucket(value: int, edges: Sequence[int]) -> str:
    """The bucket of ``value`` among ranges starting at ``edges`` (the last one open)."""
    for lo, hi in zip(edges, edges[1:]):
        if value < hi:
            return f"{lo}-{hi - 1}"
    return f"{edges[-1]}+"


def print_buckets(title: str, rows: Iterable[tuple[str, Sequence[Saved]]]) -> None:
    """Per bucket, requests and the share whose new blocks are used again; then the spread of
    the rates over buckets of at least MIN_BUCKET requests."""
    print(f"  {title}")
    rates: list[float] = []
    for label, group in rows:
        returning = sum(s.reused > 0 for s in group)
        print(f"    {label:20} {len(group):6} requests, used again {rate(returning, len(group))}")
        if len(group) >= MIN_BUCKET:
            rates.append(returning / len(group))
    if len(rates) >= 2:
        print(f"    spread over buckets of >= {MIN_BUCKET} requests: {min(rates):.3f} to {max(rates):.3f}")


def grouped(saved: Sequence[Saved], key: Callable[[Saved], str], order: Sequence[str]) -> list[tuple[str, list[Saved]]]:
    groups: dict[str, list[Saved]] = {label: [] for label in order}
    for s in saved:
        groups[key(s)].append(s)
    return [(label, group) for label, group in groups.items() if group]


def fig_predictors(saved: Sequence[Saved]) -> None:
    with_new = [s for s in saved if s.new]
    returning = sum(s.reused > 0 for s in with_new)
    print("\n4. P(a request's new blocks are used again: any of them) by what is known when they are saved")
    print(f"  all requests with new blocks: {len(with_new)}, used again {rate(returning, len(with_new))}")
    turns = ("first (prefix <= 1)", "continuation")
    print_buckets("turn: first (a hit prefix of the first block at most) or continuation",
                  grouped(with_new, lambda s: turns[s.prefix > 1], turns))
    new_edges = (1, 5, 10, 20, 50)
    print_buckets("new blocks", grouped(with_new, lambda s: count_bucket(s.new, new_edges),
                                        [count_bucket(e, new_edges) for e in new_edges]))
    prefix_edges = (0, 2, 5, 10, 20, 50)
    print_buckets("hit prefix (blocks)", grouped(with_new, lambda s: count_bucket(s.prefix, prefix_edges),
                                                 [count_bucket(e, prefix_edges) for e in prefix_edges]))
    continuations = sorted((s for s in with_new if s.prefix > 1 and s.gap_s is not None), key=lambda s: s.gap_s or 0.0)
    labels = list(dict.fromkeys(power2_label(s.gap_s or 0.0) for s in continuations))
    print_buckets("continuations: since the last hit-prefix block's previous use",
                  grouped(continuations, lambda s: power2_label(s.gap_s or 0.0), labels))


# 5. reuse distance


def quantiles(values: list[float]) -> list[float]:
    """QUANTILES of ``values`` (nearest rank)."""
    values = sorted(values)
    return [values[min(len(values) - 1, int(q * len(values)))] for q in QUANTILES] if values else []


def fig_reuse_distance(requests: Trace, times_s: Sequence[float]) -> None:
    first: dict[bytes, tuple[int, float]] = {}       # key -> (access index, time) of its first use
    second: set[bytes] = set()
    accesses: list[float] = []
    seconds: list[float] = []
    i = 0
    for request, t in zip(requests, times_s):
        for key in request:
            if key not in first:
                first[key] = (i, t)
            elif key not in second:
                second.add(key)
                accesses.append(i - first[key][0])
                seconds.append(t - first[key][1])
            i += 1
    head = "  ".join(f"{q:>8.0%}" for q in QUANTILES)
    print(f"\n5. From a block's first use to its second ({len(accesses)} of {len(first)} blocks have one)")
    print(f"  quantile         {head}")
    print("  block accesses   " + "  ".join(f"{v:8.0f}" for v in quantiles(accesses)))
    print("  seconds          " + "  ".join(f"{v:8.1f}" for v in quantiles(seconds)))


# 6. cache sizes: LRU, oracle-admission LRU, leaf-aware LRU, MIN


def lru_hits(requests: Trace, capacity: int) -> list[bool]:
    """LRU: the daemon's policy class, through the simulator's replay."""
    return list(replay_requests(make_keyed_policy("lru"), capacity, requests, prefix=False))


def oracle_lru_hits(requests: Trace, nexts: Sequence[Sequence[int]], capacity: int) -> list[bool]:
    """LRU that never stores a block no later request uses, and drops a block at its last use."""
    never = len(requests)
    resident: OrderedDict[bytes, None] = OrderedDict()     # least recently used first
    hits: list[bool] = []
    for request, nxt in zip(requests, nexts):
        new: dict[bytes, None] = {}
        for key, n in zip(request, nxt):
            hit = key in resident
            hits.append(hit)
            if hit and n == never:
                del resident[key]
            elif hit:
                resident.move_to_end(key)
            elif n != never:
                new[key] = None
        reserved = 0
        for _ in new:
            if len(resident) + reserved >= capacity:
                if not resident:
                    break
                resident.popitem(last=False)
            reserved += 1
        for key in islice(new, reserved):
            resident[key] = None
    return hits


class LeafAwareLru:
    """LRU over the leaves of the resident blocks' tree: a block may be evicted only when no
    resident block has it as its parent (the previous block of the request that inserted it).
    A heap of (last use, key) with lazy deletion: an entry is live while the key is resident,
    childless and last used at that tick."""

    def __init__(self) -> None:
        self.last_use: dict[bytes, int] = {}                # resident key -> tick of its last use
        self.parent: dict[bytes, bytes | None] = {}         # resident key -> its parent
        self.children: dict[bytes, int] = {}                # key -> resident children, when > 0
        self.heap: list[tuple[int, bytes]] = []
        self.tick = 0

    def __len__(self) -> int:
        return len(self.last_use)

    def __contains__(self, key: bytes) -> bool:
        return key in self.last_use

    def use(self, key: bytes) -> None:
        self.tick += 1
        self.last_use[key] = self.tick
        if key not in self.children:
            heapq.heappush(self.heap, (self.tick, key))

    def insert(self, key: bytes, parent: bytes | None) -> None:
        self.parent[key] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        self.use(key)

    def evict(self) -> bool:
        """Evicts the least recently used leaf; False when there is none."""
        while self.heap:
            tick, key = heapq.heappop(self.heap)
            if self.last_use.get(key) == tick and key not in self.children:
                del self.last_use[key]
                parent = self.parent.pop(key)
                if parent is not None:
                    self.children[parent] -= 1
                    if not self.children[parent]:
                        del self.children[parent]
                        if parent in self.last_use:         # a leaf again
                            heapq.heappush(self.heap, (self.last_use[parent], parent))
                return True
        return False


def leaf_lru_hits(requests: Trace, capacity: int) -> list[bool]:
    """Leaf-aware LRU (SGLang's radix-tree eviction, tair-kvcache's LeafAware LRU)."""
    cache = LeafAwareLru()
    hits: list[bool] = []
    for request in requests:
        new: dict[bytes, bytes | None] = {}                 # key -> its parent
        for j, key in enumerate(request):
            hit = key in cache
            hits.append(hit)
            if hit:
                cache.use(key)
            else:
                new.setdefault(key, request[j - 1] if j else None)
        reserved = 0
        for _ in new:
            if len(cache) + reserved >= capacity and not cache.evict():
                break
            reserved += 1
        for key, parent in islice(new.items(), reserved):
            cache.insert(key, parent)
    return hits


def fig_cache_sizes(requests: Trace, nexts: Sequence[Sequence[int]], accesses: Sequence[bytes], distinct: int) -> None:
    total = len(accesses)
    sizes = sorted({max(1, int(distinct * f)) for f in FRACTIONS})
    runs: dict[str, Callable[[int], list[bool]]] = {
        "LRU": lambda size: lru_hits(requests, size),
        "oracle-adm. LRU": lambda size: oracle_lru_hits(requests, nexts, size),
        "leaf-aware LRU": lambda size: leaf_lru_hits(requests, size),
        "MIN": lambda size: belady_hits(size, accesses),
    }
    rows: list[tuple[int, dict[str, tuple[float, float]]]] = []
    for size in sizes:
        row: dict[str, tuple[float, float]] = {}
        for name, run in runs.items():
            t0 = time.monotonic()
            hits = run(size)
            row[name] = (sum(hits) / total, prefix_count(requests, hits) / total)
            progress(f"figure 6: {name} at {size} blocks, {time.monotonic() - t0:.1f} s")
        rows.append((size, row))
    print("\n6. Hit rates by cache size: block hits / prefix hits (up to a request's first miss), of all accesses;")
    print("   below each, as a ratio to MIN's (block to block, prefix to prefix)")
    print("  size            " + "".join(f"{name:>20}" for name in runs))
    for size, row in rows:
        print(f"  {size:6} ({size / distinct:4.0%})  " + "".join(f"{b:>11.3f} / {p:.3f}" for b, p in row.values()))
        mb, mp = row["MIN"]
        print("    x MIN        " + "".join(f"{ratio(b, mb):>10.2f}x / {ratio(p, mp):.2f}x" for b, p in row.values()))


def pick_trace(path: Path | None) -> tuple[Path, str]:
    """The trace to read, and a note when it is not the one asked for."""
    if path is not None:
        return path, ""
    if DEFAULT_TRACE.exists():
        return DEFAULT_TRACE, ""
    return TRACE_SLICE, f"{DEFAULT_TRACE} is absent: reading {TRACE_SLICE.relative_to(ROOT)}, its first 1,500 requests"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--trace", metavar="FILE.jsonl", type=Path,
                        help=f"a Mooncake trace (default {DEFAULT_TRACE}, or where absent {TRACE_SLICE.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    path, note = pick_trace(args.trace)
    try:
        trace = load_trace(path)
    except (OSError, TraceError) as exc:
        parser.error(f"--trace {path}: {exc}")
    progress(f"loaded {len(trace.requests)} requests from {path}")
    requests = trace.requests
    times_s = [t / 1000 for t in trace.times_ms]
    accesses = accesses_of(requests)
    nexts = next_requests(requests)
    saved = saved_requests(requests, times_s, nexts)
    print(f"trace: {path}" + (f"\n({note})" if note else ""))
    distinct = fig_totals(trace, accesses)
    fig_all_or_none(saved)
    fig_by_uses(requests, nexts)
    fig_predictors(saved)
    fig_reuse_distance(requests, times_s)
    progress("figures 1-5 done")
    fig_cache_sizes(requests, nexts, accesses, distinct)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
