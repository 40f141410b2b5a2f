"""Replaying a trace against the eviction policies the daemon uses, and against Belady's MIN.

The cache here holds ``capacity`` blocks (the traces' blocks are all one size, so a tier of
N blocks). The policies are the classes of kvcached.policies, driven through the same calls
the RAM tier makes (insert, touch, candidates, evicted; by key, through KeyedPolicy), not
copies of them. Two counts, each its own replay, as the access pattern differs:

- block hits: each block of a request the cache holds is a hit (loaded: touch); then the
  blocks it did not hold are saved, as one batch (slots reserved in turn, evicting what the
  policy offers first, then all inserted), as the agent saves them;
- prefix hits, what an engine gets: a request is served up to its first miss only. The blocks
  before it are loaded (touch, hits); from the first miss on the engine recomputes and saves
  the rest: the blocks not resident as one batch, while one still resident is not touched
  (the daemon takes a re-save of a RAM-resident block as present, without telling the RAM
  policy) and counts as a miss.

This is the order of the daemon's own calls for an agent's load and save, so a daemon driven
by such requests counts the hits the replay counts (tests/integration/test_trace_hit_rate.py).

Belady's MIN (offline: evict the block whose next use is furthest away) is the bound no online
policy can beat on block hits; its hit rate is the yardstick of the table. Its prefix count is
the same MIN run, counted up to each request's first miss: a yardstick, not the optimum of the
prefix metric (MIN may keep the tail of a chain whose head it dropped, which no prefix serves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Iterable, Iterator, Sequence

from kvcached.policies import KeyedPolicy, make_keyed_policy
from kvcached.policies.belady import belady_hits

__all__ = ["Result", "accesses_of", "belady", "belady_hits", "prefix_count", "replay", "replay_hits",
           "replay_prefix", "replay_requests", "simulate"]


def accesses_of(trace: Sequence[Sequence[bytes]]) -> list[bytes]:
    """The block accesses of a trace, in order."""
    return [digest for request in trace for digest in request]


def replay_requests(policy: KeyedPolicy, capacity: int, trace: Iterable[Iterable[bytes]], *,
                    prefix: bool) -> Iterator[bool]:
    """Per block access of ``trace``, whether it counts as a hit of ``policy`` with room for
    ``capacity`` blocks. Each request is what an engine does with a tier (the agent's load, then
    its save), in the calls the RAM tier makes:

    1. the blocks it finds are loaded: touched, hits (with ``prefix`` only those before the
       request's first miss; a resident block after it is neither touched nor a hit);
    2. the blocks it did not find are saved in one batch: a slot is reserved for each in turn,
       evicting the policy's first candidate while the tier is full (a reserved block is not in
       the policy yet, so it cannot be evicted; the tier answers a block it cannot make room
       for as not stored), then the batch is committed: each is inserted, in order.

    The one replay loop, for both counts (see the module's docstring)."""
    resident: set[bytes] = set()
    for request in trace:
        served = True                       # False from the first miss on, with prefix
        new: dict[bytes, None] = {}         # the batch to save, each block once
        for key in request:
            if key in resident:
                if served:
                    policy.touch(key)
                yield served
                continue
            served = not prefix
            new[key] = None
            yield False
        reserved = 0
        for key in new:
            if len(resident) + reserved >= capacity:
                victim = next(iter(policy.candidates()), None)
                if victim is None:          # every slot is reserved by this batch: not stored
                    break
                policy.evicted(victim)
                resident.discard(victim)
            reserved += 1
        for key in islice(new, reserved):
            policy.insert(key)
            resident.add(key)


def replay_hits(policy: KeyedPolicy, capacity: int, accesses: Iterable[bytes]) -> Iterator[bool]:
    """Per access, whether ``policy`` with room for ``capacity`` blocks had it, each access a
    request of its own (block hits)."""
    return replay_requests(policy, capacity, ([key] for key in accesses), prefix=False)


def replay(policy_name: str, capacity: int, accesses: Iterable[bytes]) -> int:
    """Block hits of ``policy_name`` with room for ``capacity`` blocks."""
    return sum(replay_hits(make_keyed_policy(policy_name), capacity, accesses))


def replay_prefix(policy_name: str, capacity: int, trace: Iterable[Iterable[bytes]]) -> int:
    """Prefix hits of ``policy_name`` with room for ``capacity`` blocks."""
    return sum(replay_requests(make_keyed_policy(policy_name), capacity, trace, prefix=True))


def belady(capacity: int, accesses: Sequence[bytes]) -> int:
    """Block hits of Belady's MIN."""
    return sum(belady_hits(capacity, accesses))


def prefix_count(trace: Iterable[Sequence[bytes]], hits: Iterable[bool]) -> int:
    """Of per-access ``hits`` over ``trace`` (the accesses in order), those before their
    request's first miss."""
    it = iter(hits)
    count = 0
    for request in trace:
        served = True
        for hit in islice(it, len(request)):
            served = served and hit
            count += served
    return count


@dataclass
class Result:
    """Hit rates of one workload: per cache size (blocks), per policy (and "belady"); block hits
    in ``hit_rate``, prefix hits in ``prefix_hit_rate`` (empty when not replayed)."""

    workload: str
    accesses: int
    unique: int
    sizes: list[int]
    hit_rate: dict[str, list[float]] = field(default_factory=dict)
    prefix_hit_rate: dict[str, list[float]] = field(default_factory=dict)
    requests: int = 0
    span_ms: float | None = None            # first to last arrival, for a trace with times


def simulate(workload: str, trace: Sequence[Sequence[bytes]], policies: Sequence[str], fractions: Sequence[float],
             *, prefix: bool = True, span_ms: float | None = None,
             progress: Callable[[str], None] | None = None) -> Result:
    """Hit rates of every policy and of Belady's MIN at cache sizes that are ``fractions`` of
    the trace's distinct blocks: block hits, and with ``prefix`` prefix hits too (one more
    replay per policy and size). ``progress`` is told each policy's time."""
    accesses = accesses_of(trace)
    unique = len(set(accesses))
    sizes = sorted({max(1, int(unique * f)) for f in fractions})
    result = Result(workload, len(accesses), unique, sizes, requests=len(trace), span_ms=span_ms)
    total = len(accesses) or 1
    for name in [*policies, "belady"]:
        t0 = time.monotonic()
        if name == "belady":
            runs = [belady_hits(size, accesses) for size in sizes]
            result.hit_rate[name] = [sum(hits) / total for hits in runs]
            if prefix:
                result.prefix_hit_rate[name] = [prefix_count(trace, hits) / total for hits in runs]
        else:
            result.hit_rate[name] = [sum(replay_requests(make_keyed_policy(name), size, trace, prefix=False)) / total
                                     for size in sizes]
            if prefix:
                result.prefix_hit_rate[name] = [replay_prefix(name, size, trace) / total for size in sizes]
        if progress is not None:
            progress(f"{workload}: {name}, {len(sizes)} sizes, {time.monotonic() - t0:.1f} s")
    return result
