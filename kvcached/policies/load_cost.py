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
from typing import Mapping, Sequence

__all__ = ["Delivery", "LoadPlan", "PlanScan", "plan_loads"]


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
    scan = PlanScan(len(sources), recompute_s, deliveries)
    scan.add(sources, nbytes)
    return scan.plan()


class PlanScan:
    """:func:`plan_loads` over a chain of ``blocks`` blocks, a part at a time (:meth:`add` the
    parts in order): the same plan, for a chain too long to plan in one go on an event loop."""

    def __init__(self, blocks: int, recompute_s: float, deliveries: Mapping[str, Delivery]) -> None:
        self.blocks = blocks
        self.recompute_s = recompute_s
        self.deliveries = deliveries
        self.i = 0                      # blocks of the held prefix scanned
        self.held_ended = False
        self.spent = 0.0
        self._paid: set[str] = set()
        self.best, self.best_time = 0, blocks * recompute_s      # recompute everything
        self._names: list[str] = []                              # sources seen, in order
        self._counts: list[int] = []                             # held blocks by source so far
        self._loaded: tuple[int, ...] = ()                       # ... up to the best prefix

    def add(self, sources: Sequence[str | None], nbytes: Sequence[int]) -> None:
        """The next part of the chain: its sources and payload bytes."""
        deliveries, counts, names, n, r = self.deliveries, self._counts, self._names, self.blocks, self.recompute_s
        for source, size in zip(sources, nbytes):
            if self.held_ended or source is None:
                self.held_ended = True
                return
            delivery = deliveries.get(source) if source != "ram" else None
            if delivery is not None:
                if source not in self._paid:
                    self.spent += delivery.latency_s
                    self._paid.add(source)
                self.spent += delivery.seconds(size)
            if source not in names:
                names.append(source)
                counts.append(0)
            counts[names.index(source)] += 1
            time_if_here = self.spent + (n - self.i - 1) * r
            self.i += 1
            if time_if_here <= self.best_time:
                self.best, self.best_time = self.i, time_if_here
                self._loaded = tuple(counts)

    @property
    def held(self) -> int:
        """The held prefix scanned so far (the whole of it once a part met a block held nowhere)."""
        return self.i

    def plan(self) -> LoadPlan:
        loaded = dict(zip(self._names, self._loaded))
        skipped = {s: c - loaded.get(s, 0) for s, c in zip(self._names, self._counts) if c > loaded.get(s, 0)}
        load_all = self.spent + (self.blocks - self.i) * self.recompute_s
        return LoadPlan(self.best, skipped, self.best_time, load_all, self.blocks * self.recompute_s,
                        loaded={s: c for s, c in loaded.items() if c})
