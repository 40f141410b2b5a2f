"""The block index: where every block is, in RocksDB (docs/index.md).

``format`` is the record codec (no I/O), ``block_index`` the records' reads and writes,
``database`` the RocksDB instance and its recovery after a failed write, ``presence`` the feed
of blocks that became present or stopped being, ``policy_state`` the tiers' policy snapshots
kept beside the records. The names below are the index's public face; the rest of the daemon
imports them from here.
"""

from kvcached.index.block_index import FOREIGN, BlockIndex
from kvcached.index.database import (
    KEEP_LOG_FILES,
    MAX_WAL_BYTES,
    MEMTABLE_BYTES,
    RECOVERY_HEADROOM,
    RETRY_FIRST_S,
    IndexError_,
    IndexUnwritable,
)
from kvcached.index.format import (
    SCHEMA_VERSION,
    BlockRecord,
    GoneReason,
    Tier,
    queue_entry,
    queue_time,
    raw_ssd_view,
    record_tenant,
)
from kvcached.index.presence import PresenceFeed

__all__ = ["FOREIGN", "BlockIndex", "PresenceFeed", "BlockRecord", "Tier", "GoneReason", "IndexError_", "IndexUnwritable", "queue_entry",
           "queue_time", "raw_ssd_view", "record_tenant", "SCHEMA_VERSION", "KEEP_LOG_FILES", "MAX_WAL_BYTES", "MEMTABLE_BYTES",
           "RECOVERY_HEADROOM", "RETRY_FIRST_S"]
