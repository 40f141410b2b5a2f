"""Prometheus metrics on ``[metrics] listen`` (prometheus_client).

Everything is read from the store when Prometheus scrapes (a custom collector): gauges and
counters from the store's own counters, read latencies from kvcached.store.reads histograms, so the
hot path pays an integer add, or a bisect for a latency, and never a label lookup or a lock.
Only tiers this daemon runs are exported. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from typing import Any, Iterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvcached import __version__
from kvcached.api.agent_server import AgentServer
from kvcached.api.callers import Refusals
from kvcached.config import parse_listen
from kvcached.events import EventCounters
from kvcached.host.loop_lag import LoopLag
from kvcached.policies.curves import MissRatioCurves
from kvcached.store import Store
from kvcached.store.keeper import StoreKeeper

__all__ = ["AgentsCollector", "StoreCollector", "LoopLagCollector", "KeeperCollector", "start_metrics"]

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
            if name == "kvcached_blocks":        # what agents report pinned on their GPUs, all agents together
                g.add_metric(["gpu"], s["gpu_blocks"])
            g.add_metric(["ram"], s[ram_key])
            if ssd:
                g.add_metric(["ssd"], s[ssd_key])
            yield g
        yield GaugeMetricFamily("kvcached_index_entries", "Index records (estimate, tombstones included)", value=s["index_entries"])
        index = self.store.index
        yield GaugeMetricFamily("kvcached_index_writable", "1 while the index can be written; 0 while it cannot (its "
                                "disk is full): puts are refused until it recovers by itself", value=int(index.writable))
        yield CounterMetricFamily("kvcached_index_recoveries", "Times the index became writable again by itself, "
                                  "without a restart", value=index.recoveries)
        yield CounterMetricFamily("kvcached_index_write_failures", "Index writes that failed, or were refused while "
                                  "the index could not be written", value=index.write_failures)
        cache = index.cache
        yield GaugeMetricFamily("kvcached_index_cached_records", "Live index records held in memory, as last written "
                                "(reads of them skip RocksDB)", value=len(cache))
        reads = CounterMetricFamily("kvcached_index_cached_reads", "Index record reads by whether the record cache "
                                    "answered them", labels=["result"])
        reads.add_metric(["hit"], cache.hits)
        reads.add_metric(["miss"], cache.misses)
        yield reads
        yield GaugeMetricFamily("kvcached_agents_connected", "Agents connected on the agent socket", value=s["agents"])
        yield GaugeMetricFamily("kvcached_agent_held_bytes", "Arena bytes held by agents and streams (reserved or pinned)",
                                value=s["held_bytes"])
        yield GaugeMetricFamily("kvcached_ram_dirty_bytes", "RAM bytes not yet written back to SSD", value=s["ram_dirty_bytes"])
        yield CounterMetricFamily("kvcached_ram_slabs_moved", "Slabs of the RAM tier passed from one tenant's arena to "
                                  "another's, their pages punched out of the first (docs/security.md)",
                                  value=s["ram_slabs_moved"])
        routes = self.store.routes
        yield GaugeMetricFamily("kvcached_route_keys_bytes", "Engine keys (Route frames) held for blocks agents are "
                                "saving, with each entry's cost (events.route_keys_mib bounds them)", value=routes.bytes)
        yield CounterMetricFamily("kvcached_route_keys_dropped", "Engine keys dropped before their block was saved: "
                                  "past the bounds, or not reserved in time (those blocks' events name the digest)",
                                  value=routes.dropped)
        by_tenant = GaugeMetricFamily("kvcached_ram_bytes_by_tenant", "RAM payload bytes by tenant (labels from the "
                                      "configuration's names; counted apart where tenants.ram_shares is set)",
                                      labels=["tenant"])
        for tag, n in self.store.ram.used_by_tenant().items():
            by_tenant.add_metric([tag or "default"], n)
        yield by_tenant
        skipped = CounterMetricFamily("kvcached_loads_skipped", "Held blocks a load plan left to be recomputed, as "
                                      "slower to load than to recompute (PlanLoads)", labels=["source"])
        skipped.add_metric(["ssd"], self.store.counters.loads_skipped_ssd)
        skipped.add_metric(["peer"], self.store.counters.loads_skipped_peer)
        yield skipped
        estimates = self.store.delivery.estimates()
        if estimates:
            rate = GaugeMetricFamily("kvcached_delivery_bytes_per_second", "What a source of blocks delivers lately "
                                     "(ssd: promotions, peer: pulls), fitted over its last batches", labels=["source"])
            latency = GaugeMetricFamily("kvcached_delivery_latency_seconds", "The latency of a batch from that "
                                        "source, fitted with the rate", labels=["source"])
            for source, d in estimates.items():
                rate.add_metric([source], d.bytes_per_s)
                latency.add_metric([source], d.latency_s)
            yield rate
            yield latency
        ssd_tier = self.store.ssd
        if ssd_tier is not None and self.store.tally.on:
            on_ssd = GaugeMetricFamily("kvcached_ssd_bytes_by_tenant", "SSD block file bytes by tenant (labels from "
                                       "the configuration's names; where several tenants are configured)",
                                       labels=["tenant"])
            for tag, use in list(ssd_tier.usage.tenants.items()):
                on_ssd.add_metric([tag or "default"], use.file_bytes)
            yield on_ssd
        tally = self.store.tally.by
        if tally:
            for name, doc in (("puts", "Blocks stored"), ("put_bytes", "Payload bytes stored"),
                              ("hits", "Blocks read"), ("misses", "Blocks asked for and not found"),
                              ("lookups", "Lookup calls")):
                c = CounterMetricFamily(f"kvcached_tenant_{name}", f"{doc}, by tenant (where several are configured)",
                                        labels=["tenant"])
                for tag, counts in list(tally.items()):
                    c.add_metric([tag or "default"], getattr(counts, name))
                yield c
        for name, key, doc in (("puts", "puts", "Blocks stored"), ("lookups", "lookups", "Lookup calls"),
                               ("promotions", "promotions", "Blocks read from SSD into RAM"),
                               ("demotions", "demotions", "Blocks published on SSD from RAM"),
                               ("admission_declined", "admission_declined",
                                "New blocks offered that the admission policy did not store (kv.admission)"),
                               ("other_tenant_blocks", "other_tenant_blocks",
                                "Blocks a caller named that another tenant stores: answered as never stored (reads, "
                                "deletes) or declined (saves)")):
            yield CounterMetricFamily(f"kvcached_{name}", doc, value=s[key])
        yield from self._reads(ssd)
        peers = self.store.peers.stats() if self.store.peers is not None else None
        if peers is not None:
            yield from _peer_metrics(peers)
            yield from _quic_server_metrics(self.store.peers.server_stats())  # type: ignore[union-attr]
            yield from _nixl_metrics(self.store.peers.nixl_stats())  # type: ignore[union-attr]
        integrity = CounterMetricFamily("kvcached_integrity_failures", "Blocks that failed their checksum, never "
                                        "served (SSD: quarantined; peer: the pulled copy dropped)", labels=["tier"])
        if ssd:
            integrity.add_metric(["ssd"], s["ssd_corrupt"])
        if peers is not None:
            integrity.add_metric(["peer"], peers["peer_corrupt"])
        adoption = self.store.ram_adoption
        integrity.add_metric(["ram"], adoption.mismatched if adoption is not None else 0)
        yield integrity
        if adoption is not None:
            taken = GaugeMetricFamily("kvcached_ram_takeover_blocks", "Blocks of the RAM tier the previous process "
                                      "left (an upgrade, or systemd's fd store after a crash), by outcome",
                                      labels=["outcome"])
            settled = adoption.adopted + adoption.mismatched + adoption.unrecorded + adoption.other_tenants
            for outcome, n in (("adopted", adoption.adopted), ("mismatched", adoption.mismatched),
                               ("unrecorded", adoption.unrecorded), ("conflicting", adoption.conflicting),
                               ("other_tenant", adoption.other_tenants),
                               ("pending", 0 if adoption.done else max(0, adoption.placed - settled))):
                taken.add_metric([outcome], n)
            yield taken
        ev = CounterMetricFamily("kvcached_evictions", "Blocks evicted per tier and reason", labels=["tier", "reason"])
        ev.add_metric(["ram", "capacity"], s["ram_evictions"])
        ev.add_metric(["ram", "admin"], s["ram_dropped"])
        if ssd:
            ev.add_metric(["ram", "dirty_dropped"], s["ram_dirty_evictions"])
            ev.add_metric(["ssd", "ttl"], s["ssd_evictions_ttl"])
            ev.add_metric(["ssd", "capacity"], s["ssd_evictions_capacity"])
            ev.add_metric(["ssd", "admin"], s["ssd_evictions_admin"])
        yield ev
        if not ssd:
            return
        for name, key, doc in (
                ("ssd_missing_blocks", "ssd_missing", "SSD block files the index named that were gone at a read"),
                ("ssd_reads", "ssd_reads", "Verified SSD block reads"),
                ("ssd_read_bytes", "ssd_read_bytes", "Payload bytes read from SSD"),
                ("ssd_writes", "ssd_writes", "SSD block files published"),
                ("ssd_write_bytes", "ssd_write_bytes", "Payload bytes published on SSD"),
                ("ssd_bytes_written", "ssd_file_bytes_written",
                 "Bytes of block files published on SSD, headers and padding included (drive wear)"),
                ("ssd_write_errors", "ssd_write_errors", "SSD block writes that failed in the end (not published); "
                 "a write that met a full disk and succeeded after a forced eviction is not one"),
                ("ssd_no_space", "ssd_no_space", "SSD block writes that met a full disk (published after a forced "
                 "eviction or not) or were refused because even an empty tier would not make room"),
                ("ssd_full_disk_evictions", "ssd_full_disk_evictions", "SSD blocks a forced eviction dropped to make "
                 "room for writes that met a full disk (also counted in kvcached_evictions_total)"),
                ("ssd_group_commits", "ssd_group_commits", "Group commits (ssd_durability = batch)"),
                ("ssd_budget_declined", "ssd_budget_declined",
                 "Blocks the SSD write budget kept off SSD (kv.ssd_write_budget_gib)"),
                ("selective_written", "held_written",
                 "Blocks write_through_selective sent to SSD once their hits passed the threshold"),
                ("ssd_coded_writes", "ssd_coded", "SSD block files written in a codec's form (kv.ssd_codec)"),
                ("ssd_sealed_writes", "ssd_sealed", "SSD block files written sealed (tenants.seal_ssd)")):
            yield CounterMetricFamily(f"kvcached_{name}", doc, value=s[key])
        if "ssd_budget_remaining_bytes" in s:
            yield GaugeMetricFamily("kvcached_ssd_write_budget_remaining_bytes", "Bytes the SSD tier may still write "
                                    "within the last 24 hours (kv.ssd_write_budget_gib)",
                                    value=s["ssd_budget_remaining_bytes"])
        yield GaugeMetricFamily("kvcached_ssd_file_bytes", "Bytes of SSD block files (headers and padding included)",
                                value=s["ssd_file_bytes"])
        if "ssd_codec_saving_milli" in s:
            yield GaugeMetricFamily("kvcached_ssd_codec_saving_ratio", "kv.ssd_codec auto: disk seconds coding saves / "
                                    "coding seconds, a block written and read once (codes above 1.2, stops below 0.83)",
                                    value=s["ssd_codec_saving_milli"] / 1000)
        yield GaugeMetricFamily("kvcached_ssd_reconciled", "1 once the boot reconcile of the SSD tier has finished",
                                value=s["ssd_reconciled"])


    def _reads(self, ssd: bool) -> Iterator[Metric]:
        reads = self.store.reads
        tiers = ["ram"] + (["ssd"] if ssd else []) + (["peer"] if self.store.peers is not None else [])
        for name, counts, doc in (("hits", reads.hits, "Blocks served, per tier that held them"),
                                  ("misses", reads.misses, "Blocks asked for that a tier did not hold (a block "
                                   "served from SSD is a RAM miss and an SSD hit)")):
            family = CounterMetricFamily(f"kvcached_{name}", doc, labels=["tier"])
            for tier in tiers:
                family.add_metric([tier], counts[tier])
            yield family
        if reads.latency is None:
            return
        histogram_family = HistogramMetricFamily(
            "kvcached_lookup_seconds", "Time to answer a read (Lookup, Get, agent lookup or load, peer pull served), "
            "by the deepest tier it reached and its outcome", labels=["tier", "outcome"])
        for (tier, result), histogram in reads.latency.items():
            buckets, total = histogram.cumulative()
            histogram_family.add_metric([tier, result], buckets, total)
        yield histogram_family


def _peer_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    up = GaugeMetricFamily("kvcached_peer_up", "1 while a configured peer is usable (connected or not yet failing), "
                           "0 while it is down and backed off", labels=["peer"])
    blocks = GaugeMetricFamily("kvcached_peer_blocks", "Blocks a peer has announced", labels=["peer"])
    for name, peer in stats["peers"].items():
        up.add_metric([name], 1 if peer["up"] else 0)
        blocks.add_metric([name], peer["blocks"])
    yield up
    yield blocks
    pulls = CounterMetricFamily("kvcached_quic_pulls", "Blocks this daemon asked peers for, by outcome (ok: arrived "
                                "and verified; miss: no peer sent it; corrupt: failed its checksum; failed: the peer "
                                "failed or timed out)", labels=["outcome"])
    for result, key in (("ok", "peer_pulled"), ("miss", "peer_missed"), ("corrupt", "peer_corrupt"),
                        ("failed", "peer_failed")):
        pulls.add_metric([result], stats[key])
    yield pulls
    for name, key, doc in (("quic_pulled_bytes", "peer_pulled_bytes", "Payload bytes pulled from peers"),
                           ("quic_hedged", "peer_hedged", "Pulls also asked of a second peer after the hedge delay"),
                           ("quic_served_blocks", "peer_served", "Blocks sent to peers"),
                           ("quic_served_bytes", "peer_served_bytes", "Payload bytes sent to peers"),
                           ("quic_pulls_other_tenant", "peer_other_tenant",
                            "Blocks a peer's Pull named another tenant for than their record: answered not found"),
                           ("lane_pulls", "peer_lane_pulls", "Pulls made over a bulk lane ([quic] lane = \"tls\" or \"mac\")"),
                           ("lane_fallbacks", "peer_lane_fallbacks",
                            "Pulls that went over QUIC because the lane could not be had or broke")):
        yield CounterMetricFamily(f"kvcached_{name}", doc, value=stats[key])
    cluster = stats.get("cluster")
    if cluster is not None:
        yield from _cluster_metrics(cluster)


def _cluster_metrics(c: dict[str, Any]) -> Iterator[Metric]:
    """A daemon in a cluster ([cluster] etcd): membership and block location (docs/cluster.md)."""
    yield GaugeMetricFamily("kvcached_cluster_etcd_reachable", "1 while etcd answers; 0: serving with the last "
                            "membership", value=1 if c.get("etcd_reachable") else 0)
    yield GaugeMetricFamily("kvcached_cluster_members", "Live members of the cluster as this daemon sees them",
                            value=len(c.get("members", [])))
    yield GaugeMetricFamily("kvcached_cluster_home_records", "Block location records this daemon keeps as a home",
                            value=c["home_records"])
    locates = CounterMetricFamily("kvcached_cluster_locates", "Locate requests sent to home nodes, by outcome",
                                  labels=["outcome"])
    locates.add_metric(["ok"], c["locates"] - c["locate_failures"])
    locates.add_metric(["failed"], c["locate_failures"])
    yield locates
    for name, key, doc in (("cluster_served_locates", "served_locates", "Locate requests answered as a home"),
                           ("cluster_republished", "republished", "Block announcements made because a bucket "
                            "gained a home node (membership changes)"),
                           ("cluster_forgotten_records", "forgotten", "Location records dropped because their "
                            "holder left the cluster"),
                           ("cluster_lease_losses", "etcd_lease_losses", "Times this daemon's etcd lease ended "
                            "under it (registered again at once)"),
                           ("cluster_registrations_refused", "registrations_refused", "Member registrations in "
                            "etcd that could not be used (unproven: no valid certificate, lease or signature; a bad "
                            "value, a name that is not its key's)"),
                           ("cluster_restorations", "etcd_restorations", "Times this daemon put its own registration "
                            "back in etcd after finding it replaced or deleted")):
        yield CounterMetricFamily(f"kvcached_{name}", doc, value=c.get(key, 0))


def _quic_server_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """What the QUIC server holds for senders and what its bounds turned away (docs/security.md)."""
    if not stats:
        return
    yield GaugeMetricFamily("kvcached_quic_handshakes", "QUIC connections in handshake (no verified certificate "
                            "yet)", value=stats["quic_handshakes"])
    yield GaugeMetricFamily("kvcached_quic_connections", "QUIC connections the server holds, in handshake or "
                            "verified", value=stats["quic_connections"])
    yield CounterMetricFamily("kvcached_quic_retries", "Stateless Retry packets sent (address validation)",
                              value=stats["quic_retries"])
    yield CounterMetricFamily("kvcached_quic_dropped_datagrams", "Datagrams for no connection dropped unanswered "
                              "(not an Initial, a bound reached, the reply budget spent)",
                              value=stats["quic_dropped_datagrams"])
    refused = CounterMetricFamily("kvcached_quic_refused", "New connections refused or handshakes dropped by the "
                                  "server's bounds, by reason (source_limit, full, displaced, timeout, budget)",
                                  labels=["reason"])
    for reason in ("source_limit", "full", "displaced", "timeout", "budget"):
        refused.add_metric([reason], stats["quic_refused"].get(reason, 0))
    yield refused
    if "lane_refused" in stats:
        yield CounterMetricFamily("kvcached_lane_refused", "Bulk-lane connections refused: tls, a certificate that "
                                  "names no configured peer or fails the peer checks; mac, a key not proved (either "
                                  "side)", value=stats["lane_refused"])
        yield CounterMetricFamily("kvcached_lane_bad_seals", "mac lanes ended by this server for a frame whose seal "
                                  "was missing or did not match (changed, replayed, out of order)",
                                  value=stats["lane_bad_seals"])
        yield CounterMetricFamily("kvcached_lane_stalled", "Lane answers given up because the puller read nothing "
                                  "for 30 s (its pinned blocks released, the lane closed)", value=stats["lane_stalled"])
        yield GaugeMetricFamily("kvcached_lane_handshakes", "Lane connections in handshake (no verified certificate "
                                "or lane key yet)", value=stats["lane_handshakes"])
        yield GaugeMetricFamily("kvcached_lane_connections", "Verified lanes the lane server holds",
                                value=stats["lane_connections"])
        limited = CounterMetricFamily("kvcached_lane_limited", "Lane connections reset at accept or handshakes dropped "
                                      "by the lane server's bounds, by reason (source_limit, full, displaced, timeout)",
                                      labels=["reason"])
        for reason in ("source_limit", "full", "displaced", "timeout"):
            limited.add_metric([reason], stats["lane_limited"].get(reason, 0))
        yield limited
        for key, doc in (("lane_coded_pulls", "Pulls this daemon asked for coded for the wire ([quic] link_codec)"),
                         ("lane_coded_blocks", "Blocks this daemon sent peers coded for the wire (the rest of a "
                          "coded pull's blocks went raw: the codec did not shrink them)"),
                         ("lane_coded_saved_bytes", "Bytes that coding for the wire kept off the links this daemon "
                          "sends on")):
            yield CounterMetricFamily(f"kvcached_{key}", doc, value=stats[key])


def _nixl_metrics(stats: dict[str, int]) -> Iterator[Metric]:
    """The NIXL lane, holder and puller sides ([quic] nixl; docs/peers.md): nothing where it is off."""
    if not stats:
        return
    yield GaugeMetricFamily("kvcached_nixl_leases", "NIXL leases held: answers to peers' NixlPulls whose blocks "
                            "stay pinned until the peer is done, quic.nixl_hold_s passes or its session ends",
                            value=stats["leases"])
    yield CounterMetricFamily("kvcached_nixl_pulls_answered", "NixlPulls answered (where each block lies in the "
                              "arena, and its checksum)", value=stats["answered"])
    yield CounterMetricFamily("kvcached_nixl_pulls_overloaded", "NixlPulls answered overloaded: the peer held its "
                              "most leases already", value=stats["overloaded"])
    ended = CounterMetricFamily("kvcached_nixl_leases_ended", "NIXL leases ended, by how: done (the peer said "
                                "NixlDone), expired (quic.nixl_hold_s passed), session (its QUIC session ended)",
                                labels=["how"])
    for how, key in (("done", "leases_done"), ("expired", "leases_expired"), ("session", "leases_ended")):
        ended.add_metric([how], stats[key])
    yield ended
    yield CounterMetricFamily("kvcached_nixl_pulled_blocks", "Blocks this daemon read from peers over NIXL and "
                              "published (each checked against the checksum from the QUIC session)",
                              value=stats["pull_pulled"])
    yield CounterMetricFamily("kvcached_nixl_pulled_bytes", "Payload bytes of those blocks", value=stats["pull_pulled_bytes"])
    yield CounterMetricFamily("kvcached_nixl_refused_blocks", "Blocks read over NIXL that did not match the checksum "
                              "from the session: dropped, never served (also in kvcached_integrity_failures)",
                              value=stats["pull_corrupt"])
    yield CounterMetricFamily("kvcached_nixl_fallbacks", "Pulls that went over the TCP lane or QUIC because NIXL "
                              "could not be used with the peer (it runs no NIXL lane, or a read failed)",
                              value=stats["pull_fallbacks"])


class LoopLagCollector(Collector):
    """How late the event loop ran its watcher's ticks (kvcached.host.loop_lag): how long
    requests waited behind other work on the loop."""

    def __init__(self, lag: LoopLag) -> None:
        self.lag = lag

    def collect(self) -> Iterator[Metric]:
        buckets, total = self.lag.lags.cumulative()
        histogram = HistogramMetricFamily("kvcached_event_loop_lag_seconds", "How late the event loop ran a tick "
                                          f"due every {self.lag.period_s * 1000:g} ms: the longest any request "
                                          "waited behind other work on the loop, at that moment")
        histogram.add_metric([], buckets, total)
        yield histogram
        yield GaugeMetricFamily("kvcached_event_loop_lag_max_seconds", "The longest event loop lag since the "
                                "daemon started", value=self.lag.max)
        yield CounterMetricFamily("kvcached_event_loop_stalls", f"Event loop lags of {self.lag.stall_s:g} s or "
                                  "more (each also logged, at most one line every few seconds)", value=self.lag.stalls)


class CurvesCollector(Collector):
    """The live miss-ratio curves (kvcached.policies.curves): each tier's policy and Belady's MIN
    at a fixed set of size multiples, so the labels are few and fixed."""

    def __init__(self, curves: MissRatioCurves) -> None:
        self.curves = curves

    def collect(self) -> Iterator[Metric]:
        curves = self.curves
        rates = GaugeMetricFamily("kvcached_curve_hit_ratio", "Estimated hit ratio of a tier at a multiple of its "
                                  "size: its policy's, and Belady's MIN over the recent window (estimator: docs/"
                                  "operations.md)", labels=["tier", "multiple", "of"])
        errors = GaugeMetricFamily("kvcached_curve_error", "How far the estimated hit ratio may be off (about 95% of "
                                   "the time: twice its standard error over the sample)", labels=["tier", "multiple", "of"])
        keys = GaugeMetricFamily("kvcached_curve_window_keys", "Distinct keys the tier's curve stands on (its window of "
                                 "sampled uses)", labels=["tier"])
        points = curves.points()
        for p in points:
            if p.hit_rate is not None and p.min_hit_rate is not None and p.error is not None and p.min_error is not None:
                rates.add_metric([p.tier, f"{p.multiple:g}", "policy"], p.hit_rate)
                rates.add_metric([p.tier, f"{p.multiple:g}", "min"], p.min_hit_rate)
                errors.add_metric([p.tier, f"{p.multiple:g}", "policy"], p.error)
                errors.add_metric([p.tier, f"{p.multiple:g}", "min"], p.min_error)
        for tier in dict.fromkeys(p.tier for p in points):
            keys.add_metric([tier], next(p.keys for p in points if p.tier == tier))
        yield rates
        yield errors
        yield keys
        yield GaugeMetricFamily("kvcached_curve_sampling_rate", "Share of the keys the curves sample",
                                value=curves.sample.rate)
        yield GaugeMetricFamily("kvcached_curve_sampled_keys", "Distinct keys in the curves' sample now",
                                value=len(curves.sample))
        yield CounterMetricFamily("kvcached_curve_accesses", "Block uses the curves counted", value=curves.accesses)
        busy = CounterMetricFamily("kvcached_curve_busy_seconds", "What keeping the curves took: counting block "
                                   "uses (on the event loop), computing the figures, MIN among them (off it)", labels=["part"])
        busy.add_metric(["uses"], curves.busy_s)
        busy.add_metric(["min"], curves.min_busy_s)
        yield busy


class KeeperCollector(Collector):
    """The store keeper's periodic saves of the policies' state (kvcached.store.keeper)."""

    def __init__(self, keeper: StoreKeeper) -> None:
        self.keeper = keeper

    def collect(self) -> Iterator[Metric]:
        keeper = self.keeper
        yield CounterMetricFamily("kvcached_policy_saves", "Periodic saves of what the policies learned "
                                  "(kv.policy_save_s)", value=keeper.saves)
        last = keeper.last_save
        if last is None:
            return
        yield GaugeMetricFamily("kvcached_policy_save_last_timestamp_seconds", "When the last periodic policy save "
                                "ended (Unix time)", value=last.ended_at)
        yield GaugeMetricFamily("kvcached_policy_save_last_seconds", "How long the last periodic policy save took, "
                                "its write included", value=last.seconds)
        yield GaugeMetricFamily("kvcached_policy_save_last_loop_seconds", "Of which on the event loop: its slices "
                                "together (requests run between them)", value=last.loop_seconds)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class AgentsCollector(Collector):
    """The agent socket's tenants (kvcached.tenants): agents connected per tenant (labels from
    the configuration's names only) and Hellos refused for naming no tenant."""

    def __init__(self, server: AgentServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server = self.server
        yield CounterMetricFamily("kvcached_agents_refused_no_tenant", "Agent connections refused: the process's uid "
                                  "and gid name no tenant and tenants.default is empty", value=server.refused_no_tenant)
        if server.tenants is None:
            return
        connected = dict.fromkeys(server.tenants.names, 0)
        for conn in list(server.connections):
            tenant = conn.session.tenant if conn.session is not None else None
            if tenant is not None and tenant.name in connected:
                connected[tenant.name] += 1
        g = GaugeMetricFamily("kvcached_agents_connected_by_tenant", "Agents connected, by tenant", labels=["tenant"])
        for name, n in connected.items():
            g.add_metric([name], n)
        yield g


class GrpcRefusalsCollector(Collector):
    """gRPC calls refused for who made them (kvcached.api.callers), by reason."""

    def __init__(self, refusals: Refusals) -> None:
        self.refusals = refusals

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("kvcached_grpc_tenant_refusals", "gRPC calls refused for who made them: no_tenant (no "
                                "mapping and no tenants.default), no_certificate_name (the certificate lacks "
                                "tenants.cert_field), other_tenant (a tenant naming another), unknown_tenant (the "
                                "operator naming no configured tenant), operator_only (a tenant calling Admin)",
                                labels=["reason"])
        for reason, n in self.refusals.counts.items():
            c.add_metric([reason], n)
        yield c


class EventsCollector(Collector):
    """The KV event streams' counters (kvcached.events), every stream's together."""

    def __init__(self, counters: Sequence[EventCounters]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        c = EventCounters(**{f.name: sum(getattr(part, f.name) for part in self.counters)
                             for f in dataclasses.fields(EventCounters)})
        for name, value, doc in (
                ("events_published", c.events, "KV events published (vLLM's schema, docs/events.md)"),
                ("events_batches", c.batches, "KV event batches published (each a sequence number)"),
                ("events_dropped_hwm", c.dropped_hwm, "times a subscriber's queue filled to the high-water mark "
                                                     "(each stall once: libzmq drops the batches it then misses "
                                                     "without telling; the subscriber sees the gap and may replay)"),
                ("events_dropped_feed", c.dropped_feed, "tier changes lost before publishing (the feed was full)"),
                ("events_replays", c.replays, "KV event replay requests answered"),
                ("events_replays_refused", c.replays_refused, "replay requests malformed, asking for numbers not "
                                                             "published or not kept, or refused while busy"),
                ("events_replays_cut", c.replays_cut, "replay answers cut short: the client stopped reading, or "
                                                     "the endpoint was reset"),
                ("events_replay_resets", c.replay_resets, "times a replay endpoint was reset to free what its "
                                                         "clients held (events.replay_clients_mib)"),
                ("events_replay_refused_connections", c.replay_refused_connections,
                 "replay connections refused at their handshake: past the endpoint's cap, or one peer's"),
                ("events_seq_write_failures", c.seq_write_failures, "writes of the KV events' sequence file that failed "
                                                                    "(a crash before the next one may repeat numbers)")):
            yield CounterMetricFamily(f"kvcached_{name}", doc, value=value)
        yield GaugeMetricFamily("kvcached_events_subscriptions", "KV event subscriptions open now", value=c.subscriptions)
        yield GaugeMetricFamily("kvcached_events_replay_connections", "Replay connections open now",
                                value=c.replay_connections)
        yield GaugeMetricFamily("kvcached_events_replay_held_bytes", "What replay clients may make the daemon hold "
                                "now beyond the kept batches (an upper bound)", value=c.replay_held_bytes)


def start_metrics(listen: str, store: Store, fd: int | None = None, loop_lag: LoopLag | None = None,
                  keeper: StoreKeeper | None = None, events: Sequence[EventCounters] | None = None,
                  agents: AgentServer | None = None, refusals: Refusals | None = None) -> Any:
    """Serve /metrics in a background thread; returns the HTTP server (``.shutdown()`` stops it).
    With ``fd``: serve on that listening socket (a predecessor's, passed at an upgrade); with
    ``loop_lag`` and ``keeper``: the event loop's lag and the keeper's saves too."""
    address = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    ProcessCollector(registry=registry)      # process_cpu_seconds_total and the rest: what the curves' share is of
    if loop_lag is not None:
        registry.register(LoopLagCollector(loop_lag))
    if keeper is not None:
        registry.register(KeeperCollector(keeper))
    if events is not None:
        registry.register(EventsCollector(events))
    if agents is not None:
        registry.register(AgentsCollector(agents))
    if refusals is not None:
        registry.register(GrpcRefusalsCollector(refusals))
    if store.curves is not None:
        registry.register(CurvesCollector(store.curves))
    host = (address.host or "").strip("[]")
    if fd is None:
        httpd, _thread = start_http_server(address.port or 0, addr=host, registry=registry)
        return httpd
    sock = socket.socket(fileno=fd)
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": sock.family})
    httpd = server_class(sock.getsockname()[:2], _QuietHandler, bind_and_activate=False)
    httpd.socket.close()
    httpd.socket = sock
    httpd.server_address = sock.getsockname()
    httpd.server_name, httpd.server_port = host or "localhost", httpd.server_address[1]
    httpd.setup_environ()
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics").start()
    return httpd
