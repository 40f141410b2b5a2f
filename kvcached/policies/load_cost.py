"""Loads that pay (issue 42, docs/engines.md "Loads that pay"): of a prefix the tiers hold, how
much to load and how much to recompute (no I/O).

A load from RAM is a copy at memory speed: always taken. A block on SSD or at a peer costs what
that source delivers now: ``latency + bytes / rate`` for the batch, its latency paid once per
source. Recomputing a block costs its tokens over the engine's prefill rate. The prefix to load
is the one that saves most: of every prefix length L, the one that minimises the time to have
the whole chain (load the first L blocks, recompute the rest), the longest on a tie. A block
after a block that is skipped is not loaded either (the engine recomputes from the first block
it does not load), so a fast source behind a slow one is cut with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence, cast

__all__ = ["Delivery", "LoadPlan", "plan_loads"]


@dataclass(frozen=True)
class Delivery:
    """What one source delivers now: a batch of n bytes takes ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else float("inf")


@dataclass(frozen=True)
class LoadPlan:
    """``load`` blocks of the chain to load (a prefix), ``loaded`` of them by source;
    ``skipped``: blocks held but not loaded past that, by source, as slower than recomputing
    them; ``seconds``: the time the plan expects, and ``load_all`` and ``recompute_all`` the two
    plans it chose between at most."""

    load: int
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    load_all: float = 0.0
    recompute_all: float = 0.0
    loaded: dict[str, int] = field(default_factory=dict)


def plan_loads(sources: Sequence[str | None], nbytes: Sequence[int], recompute_s: float,
               deliveries: Mapping[str, Delivery]) -> LoadPlan:
    """The plan for a chain whose block i is held by ``sources[i]`` ("ram", "ssd", "peer"; None:
    held nowhere, the chain's held prefix ends there) with ``nbytes[i]`` payload bytes, each
    block costing ``recompute_s`` to recompute. A source without a delivery estimate is taken to
    pay (nothing is known against it yet); "ram" always pays."""
    held = 0
    while held < len(sources) and sources[held] is not None:
        held += 1
    chain = cast(Sequence[str], sources[:held])
    total = len(sources) * recompute_s
    best, best_time = 0, total                   # recompute everything
    spent = 0.0
    paid: set[str] = set()
    for i, source in enumerate(chain):
        delivery = deliveries.get(source) if source != "ram" else None
        if delivery is not None:
            if source not in paid:
                spent += delivery.latency_s
                paid.add(source)
            spent += delivery.seconds(nbytes[i])
        time_if_here = spent + (len(sources) - i - 1) * recompute_s
        if time_if_here <= best_time:
            best, best_time = i + 1, time_if_here
    load_all = spent + (len(sources) - held) * recompute_s
    return LoadPlan(best, _count(chain[best:]), best_time, load_all, total, loaded=_count(chain[:best]))


def _count(sources: Sequence[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for source in sources:
        counts[source] = counts.get(source, 0) + 1
    return counts
