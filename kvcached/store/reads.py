"""Read accounting: per-tier hits and misses of every read, and how long each read took.

A read is one request for blocks or for a prefix: a Lookup (gRPC or an agent's), a Get or
GetStream, an agent's load, a peer's pull. Each block a read asks for is counted once per tier
it reached: a block served from SSD is a RAM miss and an SSD hit, one found nowhere is a miss of
every tier this daemon has (so each tier's hit rate is hits / (hits + misses) of the blocks that
got as far as it).

With metrics on, each read's duration also goes into a histogram labelled by ``tier``, the
deepest tier the read had to reach (gpu: an agent's lookup its own GPU blocks answered; ram;
ssd: a block had to be promoted, or the SSD index was asked for a prefix; peer: a pull, or the
peer directory was asked), and ``outcome``: hit (all of it), partial (some) or miss (none).
Buckets resolve the latency targets: a GPU-view lookup under 30 us, RAM under 200 us, SSD under
5 ms.

Plain classes, no I/O; the store records from the event loop thread only and the metrics
collector reads from its scrape thread (kvcached.host.histogram says why no lock is needed).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from time import monotonic, perf_counter
from typing import Callable, Iterable

from kvcached.host.histogram import Histogram
from kvcached.policies.load_cost import Delivery

__all__ = ["LATENCY_BUCKETS", "OUTCOMES", "TIERS", "DeliveryRates", "LatencyHistogram", "ReadStats", "outcome"]

TIERS = ("gpu", "ram", "ssd", "peer")
OUTCOMES = ("hit", "partial", "miss")
LATENCY_BUCKETS: tuple[float, ...] = (
    10e-6, 20e-6, 30e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0, 2.5)


class LatencyHistogram(Histogram):
    """Durations of reads, in seconds (kvcached.host.histogram: no lock per observation, a
    tenth of an agent's lookup otherwise)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(LATENCY_BUCKETS)


def outcome(asked: int, found: int) -> str:
    return "hit" if found >= asked else "partial" if found else "miss"


class ReadStats:
    """Per-tier block hits and misses, and (once ``time_reads`` is called) read latencies."""

    def __init__(self) -> None:
        self.hits = {"ram": 0, "ssd": 0, "peer": 0}
        self.misses = {"ram": 0, "ssd": 0, "peer": 0}
        self.latency: dict[tuple[str, str], LatencyHistogram] | None = None

    def time_reads(self, tiers: Iterable[str]) -> None:
        """Keep latency histograms for these tiers (the ones this daemon runs: a tier that does
        not exist gets no histogram, so none is exported as if it did)."""
        self.latency = {(tier, o): LatencyHistogram() for tier in tiers for o in OUTCOMES}

    def blocks(self, asked: int, found: int, promoted: int, pulled: int, *, ssd: bool, peers: bool) -> str:
        """Count a read of ``asked`` blocks of which ``found`` were served, ``promoted`` of them
        read from SSD and ``pulled`` from peers for it; ``ssd`` and ``peers``: whether those
        tiers exist. Returns the deepest tier the read reached."""
        ram_hits = max(0, found - promoted - pulled)
        ram_misses = asked - ram_hits
        self.hits["ram"] += ram_hits
        self.misses["ram"] += ram_misses
        tier = "ram"
        if ssd:
            self.hits["ssd"] += promoted
            self.misses["ssd"] += ram_misses - promoted
            tier = "ssd" if promoted or ram_misses else tier
        if peers:
            self.hits["peer"] += pulled
            self.misses["peer"] += asked - found
            tier = "peer" if pulled or found < asked else tier
        return tier

    def took(self, tier: str, result: str, started: float) -> None:
        """Record one read that began at ``started`` (time.perf_counter). Inlines
        LatencyHistogram.observe: this runs once per read, and a method call is a third of it."""
        latency = self.latency
        if latency is not None:
            histogram = latency.get((tier, result))
            if histogram is not None:
                seconds = perf_counter() - started
                histogram.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
                histogram.sum += seconds


class DeliveryRates:
    """What each source of blocks (``ssd``: promotions; ``peer``: pulls) delivered lately, from
    its last :data:`WINDOW` batches, (bytes, seconds) each, fitted to ``seconds = latency +
    bytes / rate`` (least squares where the batches' sizes differ enough to tell the two apart;
    else all of it taken as rate, no latency). Measured from the daemon's own reads, never a
    constant, over few batches: a throttled disk or a slow link, or its end, shows within them.

    A source judged too slow to load from is then not read, so nothing would tell when it is
    fast again: an estimate older than :data:`STALE_S` is stale, and the first plan that needs
    that source (:meth:`current`) goes without its estimate (it takes the source to pay, and
    its load measures it again: a probe); plans after it go by the old estimate until the probe
    has delivered or another ``STALE_S`` has passed, so one request per source in ``STALE_S``
    pays for a probe. The first batch after such a gap starts a new window, as does a batch
    of a size like the window's (within 2x of their mean: a latency-bound source's batches of
    other sizes are no change) that took :data:`CHANGE` times longer or shorter than the
    estimate said: the link or the disk changed, and the batches before say nothing of it now. A batch that
    delivered nothing (:meth:`nothing`: a pull that timed out) counts as one byte in its time.

    The event loop records and plans; the metrics thread reads :meth:`estimates` (whole-object
    reads under the GIL, as kvcached.host.histogram explains)."""

    WINDOW = 8
    STALE_S = 30.0
    CHANGE = 4.0
    MIN_FIT = 4

    def __init__(self, clock: Callable[[], float] = monotonic) -> None:
        self._clock = clock
        self._batches: dict[str, deque[tuple[int, float]]] = {}
        self._newest: dict[str, float] = {}
        self._probes: dict[str, float] = {}        # source -> when a plan was last let probe it

    def took(self, source: str, nbytes: int, seconds: float) -> None:
        """A batch of ``nbytes`` from ``source`` arrived ``seconds`` after it was asked for."""
        if nbytes > 0 and seconds > 0:
            now = self._clock()
            batches = self._batches.setdefault(source, deque(maxlen=self.WINDOW))
            if now - self._newest.get(source, now) > self.STALE_S or self._changed(batches, nbytes, seconds):
                batches.clear()
            batches.append((nbytes, seconds))
            self._newest[source] = now
            self._probes.pop(source, None)

    def nothing(self, source: str, seconds: float) -> None:
        """A batch from ``source`` delivered nothing in ``seconds`` (it timed out)."""
        self.took(source, 1, seconds)

    def _changed(self, batches: deque[tuple[int, float]], nbytes: int, seconds: float) -> bool:
        if not batches:
            return False
        said = _fit(list(batches))
        mean = sum(b for b, _ in batches) / len(batches)
        expected = said.latency_s + said.seconds(nbytes)
        return mean / 2 <= nbytes <= mean * 2 and not expected / self.CHANGE <= seconds <= expected * self.CHANGE

    def estimate(self, source: str) -> Delivery | None:
        batches = list(self._batches.get(source, ()))
        return _fit(batches) if batches else None

    def current(self, needed: Iterable[str] = ()) -> dict[str, Delivery]:
        """The estimates a load plan goes by, of the sources it ``needed``: those measured
        within :data:`STALE_S`, and stale ones while a probe granted earlier is out; a stale
        source with no probe out is left out (this plan probes it)."""
        now = self._clock()
        out = {}
        for source in needed:
            estimate = self.estimate(source)
            if estimate is None:
                continue
            if now - self._newest.get(source, now) > self.STALE_S:
                granted = self._probes.get(source)
                if granted is None or now - granted > self.STALE_S:
                    self._probes[source] = now
                    continue
            out[source] = estimate
        return out

    def estimates(self) -> dict[str, Delivery]:
        """Every source's latest estimate, however old (what the metrics show)."""
        return {source: d for source in list(self._batches) if (d := self.estimate(source)) is not None}


def _fit(batches: list[tuple[int, float]]) -> Delivery:
    """``seconds = latency + bytes / rate`` over (bytes, seconds) batches: least squares where
    there are :data:`DeliveryRates.MIN_FIT` of them and their sizes differ enough to tell the two
    apart, else all of it taken as rate."""
    n = len(batches)
    mean_b = sum(b for b, _ in batches) / n
    mean_s = sum(s for _, s in batches) / n
    var_b = sum((b - mean_b) ** 2 for b, _ in batches) / n
    if n >= DeliveryRates.MIN_FIT and var_b ** 0.5 > 0.25 * mean_b:
        slope = sum((b - mean_b) * (s - mean_s) for b, s in batches) / n / var_b
        latency = mean_s - slope * mean_b
        if slope > 0 and latency >= 0:
            return Delivery(latency, 1 / slope)
    return Delivery(0.0, mean_b / mean_s)
