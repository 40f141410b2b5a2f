"""The store's Stats table: every count it keeps, by name, as gRPC's Stats and the metrics read
it (kvcached.api). Plain ints, read by the Prometheus scrape thread too (no lock).
"""

from __future__ import annotations

from typing import Callable

from kvcached.index import BlockIndex
from kvcached.policies.admission import SsdWriteBudget
from kvcached.store.gpu_view import GpuView
from kvcached.store.inflight import InFlight
from kvcached.store.results import Counters
from kvcached.tiers.ram import RamTier
from kvcached.tiers.ssd import SsdTier

__all__ = ["stats_table"]


def stats_table(ram: RamTier, index: BlockIndex, c: Counters, gpu: GpuView, inflight: InFlight, hash_threads: int,
                ssd: SsdTier | None, ssd_reconciled: bool, ssd_budget: SsdWriteBudget,
                clock: Callable[[], float]) -> dict[str, int]:
    """The counts of the RAM tier, the index, the store's counters and the agents; with an SSD
    tier, its own too (and the budget left, where one is set)."""
    out = {
        "ram_blocks": len(ram),
        "ram_bytes": ram.used_bytes,
        "ram_reserved_bytes": ram.slabs.reserved_bytes,
        "ram_capacity_bytes": ram.capacity,
        "ram_evictions": ram.evictions,
        "ram_slabs_moved": ram.slabs.released,     # from one tenant's arena to another's (kvcached.tiers.arenas)
        "ram_dropped": ram.dropped,
        "index_entries": index.count_estimate(),
        "puts": c.puts, "put_bytes": c.put_bytes, "hits": c.hits, "misses": c.misses,
        "hit_bytes": c.hit_bytes, "lookups": c.lookups, "deletes": c.deletes,
        "ram_dirty_bytes": ram.dirty_bytes, "ram_dirty_evictions": ram.dirty_evictions,
        "promotions": c.promotions, "demotions": c.demotions,
        "agents": len(gpu), "held_bytes": inflight.held_bytes, "hash_threads": hash_threads,
        "gpu_blocks": sum(len(a.blocks) for a in gpu.agents()), "admission_declined": c.declined,
        "loads_skipped_ssd": c.loads_skipped_ssd, "loads_skipped_peer": c.loads_skipped_peer,
        "other_tenant_blocks": c.other_tenant,
    }
    if ssd is not None:
        sc = ssd.counters
        out |= {
            "ssd_blocks": ssd.blocks, "ssd_bytes": ssd.payload_bytes, "ssd_file_bytes": ssd.used_bytes,
            "ssd_capacity_bytes": ssd.capacity,
            "ssd_evictions_ttl": c.ssd_evictions_ttl, "ssd_evictions_capacity": c.ssd_evictions_capacity,
            "ssd_evictions_admin": c.ssd_evictions_admin, "ssd_full_disk_evictions": c.ssd_full_disk_evictions,
            "ssd_corrupt": c.ssd_corrupt, "ssd_reads": sc.reads, "ssd_read_bytes": sc.read_bytes,
            "ssd_writes": sc.writes, "ssd_write_bytes": sc.write_bytes,
            "ssd_file_bytes_written": sc.file_bytes_written, "ssd_write_errors": sc.write_errors,
            "ssd_no_space": sc.no_space, "ssd_missing": sc.missing, "ssd_group_commits": sc.group_commits,
            "ssd_reconciled": int(ssd_reconciled), "ssd_io_threads": ssd.threads,
            "ssd_budget_declined": c.ssd_budget_declined, "held_written": c.held_written,
            "ssd_coded": sc.coded, "ssd_sealed": sc.sealed,
        }
        choice = ssd.form.choice
        if choice is not None and (value := choice.saving_over_cost()) is not None:
            out["ssd_codec_saving_milli"] = round(value * 1000)        # the stats are integers
        if not ssd_budget.unlimited:
            out["ssd_budget_remaining_bytes"] = ssd_budget.remaining(clock())
    return out
