"""Replaying a trace against the eviction policies the daemon uses, and against Belady's MIN.

The cache here holds ``capacity`` blocks (the traces' blocks are all one size, so a tier of
N blocks); each request walks its chain in order, and each block is a hit if the cache holds
it, else it is inserted, evicting what the policy offers first. The policies are the classes
of kvcached.policies, driven through the same calls the RAM tier makes (insert, touch,
candidates, evicted; by key, through KeyedPolicy), not copies of them.

Belady's MIN (offline: evict the block whose next use is furthest away) is the bound no online
policy can beat on block hits; its hit rate is the yardstick of the table.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from kvcached.policies import KeyedPolicy, make_keyed_policy

__all__ = ["Result", "accesses_of", "belady", "replay", "replay_hits", "simulate"]


def accesses_of(trace: Sequence[Sequence[bytes]]) -> list[bytes]:
    """The block accesses of a trace, in order."""
    return [digest for request in trace for digest in request]


def replay_hits(policy: KeyedPolicy, capacity: int, accesses: Iterable[bytes]) -> Iterator[bool]:
    """Per access, whether ``policy`` with room for ``capacity`` blocks had it: the calls the
    RAM tier makes (touch on a hit; on a miss with a full cache, evict the first candidate, then
    insert)."""
    resident: set[bytes] = set()
    for key in accesses:
        if key in resident:
            policy.touch(key)
            yield True
            continue
        if len(resident) >= capacity:
            victim = next(iter(policy.candidates()))
            policy.evicted(victim)
            resident.discard(victim)
        policy.insert(key)
        resident.add(key)
        yield False


def replay(policy_name: str, capacity: int, accesses: Iterable[bytes]) -> int:
    """Hits of ``policy_name`` with room for ``capacity`` blocks."""
    return sum(replay_hits(make_keyed_policy(policy_name), capacity, accesses))


def belady(capacity: int, accesses: Sequence[bytes]) -> int:
    """Hits of Belady's MIN: on a miss with a full cache, evict the resident block used again
    furthest in the future (or never)."""
    never = len(accesses)
    next_use = [never] * len(accesses)
    last: dict[bytes, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = last.get(accesses[i], never)
        last[accesses[i]] = i
    resident: dict[bytes, int] = {}           # key -> its next use
    heap: list[tuple[int, bytes]] = []        # (-next use, key); stale entries skipped
    hits = 0
    for i, key in enumerate(accesses):
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits


@dataclass
class Result:
    """Hit rates of one workload: per cache size (blocks), per policy (and "belady")."""

    workload: str
    accesses: int
    unique: int
    sizes: list[int]
    hit_rate: dict[str, list[float]] = field(default_factory=dict)


def simulate(workload: str, trace: Sequence[Sequence[bytes]], policies: Sequence[str],
             fractions: Sequence[float]) -> Result:
    """Hit rates of every policy and of Belady's MIN at cache sizes that are ``fractions`` of
    the trace's distinct blocks."""
    accesses = accesses_of(trace)
    unique = len(set(accesses))
    sizes = sorted({max(1, int(unique * f)) for f in fractions})
    result = Result(workload, len(accesses), unique, sizes)
    for name in policies:
        result.hit_rate[name] = [replay(name, size, accesses) / len(accesses) for size in sizes]
    result.hit_rate["belady"] = [belady(size, accesses) / len(accesses) for size in sizes]
    return result
