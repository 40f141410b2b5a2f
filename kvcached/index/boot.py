"""The index made true at a start (:func:`reconcile_at_boot`): RAM held only bytes, and a
process that starts without them must not name them. Runs before anything serves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvcached.index.block_index import BlockIndex
from kvcached.index.format import BlockRecord, GoneReason, Tier

__all__ = ["reconcile_at_boot"]


def reconcile_at_boot(index: BlockIndex, now: float, gone_ttl: float,
                      progress: Callable[[int], None] | None = None, batch: int = 10_000,
                      ram_kept: set[bytes] | frozenset[bytes] = frozenset()) -> dict[str, int]:
    """Make the index true after a (re)start; returns counts.

    RAM held only bytes, and they are gone now, except for the blocks of ``ram_kept``: the
    ones a predecessor's arena still holds, being taken up (kvcached.store.adoption, which
    writes those it drops). Other records lose RAM; those whose only tier was RAM become
    tombstones (reason: lost at restart). Tombstones older than ``gone_ttl`` are deleted.
    Unreadable records are deleted. ``progress(seen)`` is called every ``batch`` records.
    """
    counts = {"seen": 0, "kept": 0, "lost_at_restart": 0, "pruned": 0, "unreadable": 0}
    puts: list[tuple[bytes, BlockRecord]] = []
    deletes: list[bytes] = []
    for key, raw in index.raw_records():
        counts["seen"] += 1
        try:
            record = BlockRecord.decode(raw)
        except (ValueError, UnicodeDecodeError):
            deletes.append(key)
            counts["unreadable"] += 1
        else:
            if record.tiers & Tier.RAM and key not in ram_kept:
                rest = record.tiers & ~Tier.RAM
                if rest:
                    puts.append((key, replace(record, tiers=rest)))
                    counts["kept"] += 1
                else:
                    puts.append((key, record.gone(GoneReason.LOST_AT_RESTART, now)))
                    counts["lost_at_restart"] += 1
            elif not record.present and now - record.gone_at > gone_ttl:
                deletes.append(key)
                counts["pruned"] += 1
            else:
                counts["kept"] += 1
        if len(puts) + len(deletes) >= batch:
            index.write(puts, deletes)
            puts, deletes = [], []
        if progress is not None and counts["seen"] % batch == 0:
            progress(counts["seen"])
    index.write(puts, deletes)
    return counts
