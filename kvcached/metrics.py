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
        ssd = "ssd_blocks" in s
        yield InfoMetricFamily("kvcached_build", "kvcached build information", value={"version": __version__})
        for name, doc, ram_key, ssd_key in (
                ("kvcached_blocks", "Blocks resident per tier", "ram_blocks", "ssd_blocks"),
                ("kvcached_bytes", "Payload bytes resident per tier", "ram_bytes", "ssd_bytes"),
                ("kvcached_capacity_bytes", "Capacity per tier", "ram_capacity_bytes", "ssd_capacity_bytes")):
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            g.add_metric(["ram"], s[ram_key])
            if ssd:
                g.add_metric(["ssd"], s[ssd_key])
            yield g
        yield GaugeMetricFamily("kvcached_index_entries", "Index records (estimate, tombstones included)", value=s["index_entries"])
        yield GaugeMetricFamily("kvcached_agents_connected", "Agents connected on the agent socket", value=s["agents"])
        yield GaugeMetricFamily("kvcached_agent_held_bytes", "Arena bytes held by agents and streams (reserved or pinned)",
                                value=s["held_bytes"])
        yield GaugeMetricFamily("kvcached_gpu_view_blocks", "Blocks agents report on their GPUs, all agents together",
                                value=s["gpu_blocks"])
        yield GaugeMetricFamily("kvcached_ram_dirty_bytes", "RAM bytes not yet written back to SSD", value=s["ram_dirty_bytes"])
        for name, key, doc in (("hits", "hits", "Blocks served"), ("misses", "misses", "Blocks asked for and not served"),
                               ("puts", "puts", "Blocks stored"), ("lookups", "lookups", "Lookup calls"),
                               ("promotions", "promotions", "Blocks read from SSD into RAM"),
                               ("demotions", "demotions", "Blocks published on SSD from RAM")):
            yield CounterMetricFamily(f"kvcached_{name}", doc, value=s[key])
        ev = CounterMetricFamily("kvcached_evictions", "Blocks evicted per tier and reason", labels=["tier", "reason"])
        ev.add_metric(["ram", "capacity"], s["ram_evictions"])
        if ssd:
            ev.add_metric(["ram", "dirty_dropped"], s["ram_dirty_evictions"])
            ev.add_metric(["ssd", "ttl"], s["ssd_evictions_ttl"])
            ev.add_metric(["ssd", "capacity"], s["ssd_evictions_capacity"])
        yield ev
        if not ssd:
            return
        for name, key, doc in (
                ("ssd_corrupt_blocks", "ssd_corrupt", "SSD block files that failed verification (quarantined, never served)"),
                ("ssd_missing_blocks", "ssd_missing", "SSD block files the index named that were gone at a read"),
                ("ssd_reads", "ssd_reads", "Verified SSD block reads"),
                ("ssd_read_bytes", "ssd_read_bytes", "Payload bytes read from SSD"),
                ("ssd_writes", "ssd_writes", "SSD block files published"),
                ("ssd_write_bytes", "ssd_write_bytes", "Payload bytes published on SSD"),
                ("ssd_write_errors", "ssd_write_errors", "SSD block writes that failed (discarded, never acknowledged)"),
                ("ssd_no_space", "ssd_no_space", "SSD block writes that met a full disk"),
                ("ssd_group_commits", "ssd_group_commits", "Group commits (ssd_durability = batch)")):
            yield CounterMetricFamily(f"kvcached_{name}", doc, value=s[key])
        yield GaugeMetricFamily("kvcached_ssd_file_bytes", "Bytes of SSD block files (headers and padding included)",
                                value=s["ssd_file_bytes"])
        yield GaugeMetricFamily("kvcached_ssd_reconciled", "1 once the boot reconcile of the SSD tier has finished",
                                value=s["ssd_reconciled"])


def start_metrics(listen: str, store: Store) -> Any:
    """Serve /metrics in a background thread; returns the HTTP server (``.shutdown()`` stops it)."""
    address = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    host = (address.host or "").strip("[]")
    httpd, _thread = start_http_server(address.port or 0, addr=host, registry=registry)
    return httpd
