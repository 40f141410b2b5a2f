"""Prometheus metrics on ``[metrics] listen`` (prometheus_client).

Gauges and counters are read from the store when Prometheus scrapes (a custom collector), so the
hot path pays nothing for them. Only tiers this daemon runs are exported.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcached import __version__
from kvcached.config import parse_listen
from kvcached.store import Store

__all__ = ["StoreCollector", "start_metrics"]

log = logging.getLogger("kvcached.metrics")


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        yield InfoMetricFamily("kvcached_build", "kvcached build information", value={"version": __version__})
        blocks = GaugeMetricFamily("kvcached_blocks", "Blocks resident per tier", labels=["tier"])
        blocks.add_metric(["ram"], s["ram_blocks"])
        yield blocks
        nbytes = GaugeMetricFamily("kvcached_bytes", "Payload bytes resident per tier", labels=["tier"])
        nbytes.add_metric(["ram"], s["ram_bytes"])
        yield nbytes
        cap = GaugeMetricFamily("kvcached_capacity_bytes", "Capacity per tier", labels=["tier"])
        cap.add_metric(["ram"], s["ram_capacity_bytes"])
        yield cap
        yield GaugeMetricFamily("kvcached_index_entries", "Index records (estimate, tombstones included)", value=s["index_entries"])
        for name, key, doc in (("hits", "hits", "Blocks served"), ("misses", "misses", "Blocks asked for and not served"),
                               ("puts", "puts", "Blocks stored"), ("lookups", "lookups", "Lookup calls")):
            c = CounterMetricFamily(f"kvcached_{name}", doc, labels=["tier"] if name in ("hits", "misses") else None)
            if name in ("hits", "misses"):
                c.add_metric(["ram"], s[key])
            else:
                c.add_metric([], s[key])
            yield c
        ev = CounterMetricFamily("kvcached_evictions", "Blocks evicted per tier and reason", labels=["tier", "reason"])
        ev.add_metric(["ram", "capacity"], s["ram_evictions"])
        yield ev


def start_metrics(listen: str, store: Store) -> Any:
    """Serve /metrics in a background thread; returns the HTTP server (``.shutdown()`` stops it)."""
    address = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    host = (address.host or "").strip("[]")
    httpd, _thread = start_http_server(address.port or 0, addr=host, registry=registry)
    return httpd
