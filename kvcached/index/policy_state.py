"""What the cache policies learned, kept in the index so it survives a restart.

Saved every ``kv.policy_save_s`` and on a clean stop, into the index's ``policy`` family:
the RAM tier's eviction policy (``ram``), the SSD tier's in-memory one (``ssd``, when
``kv.ssd_policy`` is not the index's own LRU queue) and the admission policy's sketch
(``admission``). Each is one :class:`~kvcached.policies.PolicySnapshot` (or sketch) written
in chunks in one atomic batch, so a crash mid-save leaves the previous save whole. The SSD
write budget's ledger is not saved here: the store writes it before each publish (a crash must
not let the daemon write more than its budget).

The snapshot is taken on the event loop (the policy's id queues walked into lists of keys; the
cost per million keys is in bench/bench_policies.py) and encoded (``b"".join`` of fixed-size keys) and written by
a worker thread, off the hot path. At boot:

- the RAM tier is empty (block bytes live in RAM only while the daemon runs), so the RAM
  policy takes up only what it can use with no resident blocks: ghost lists, ARC's target,
  S3-FIFO's memory of which blocks had proved themselves (kvcached.policies, ``restore``);
- the SSD policy is rebuilt once the boot reconcile is done: the snapshot's order for the
  blocks still on SSD, then any others in the index queue's order (:func:`build_ssd_order`);
- a snapshot written by another policy (the operator changed ``kv.ram_policy``) or damaged is
  skipped with a warning: the policy starts cold, nothing else is lost.
"""

from __future__ import annotations

import logging
import struct
from typing import Callable

from kvcached.index import BlockIndex
from kvcached.policies import KeyedPolicy, PolicySettings, PolicySnapshot, PolicyState, SnapshotError, make_keyed_policy
from kvcached.policies.admission import AdmissionPolicy

__all__ = ["save_blob", "load_blob", "capture", "write_captured", "restore_ram", "restore_admission",
           "build_ssd_order", "RAM", "SSD", "ADMISSION"]

log = logging.getLogger("kvcached.policy_state")

RAM, SSD, ADMISSION = b"ram", b"ssd", b"admission"
CHUNK = 4 << 20          # bytes per RocksDB value
_COUNT = struct.Struct(">I")      # big-endian: chunk keys sort in chunk order


def save_blob(index: BlockIndex, name: bytes, data: bytes) -> None:
    """Store ``data`` under ``name`` in chunks, replacing the previous blob atomically."""
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    old = index.policy_items(name + b"/")
    puts: list[tuple[bytes, bytes | None]] = [(name + b"/" + _COUNT.pack(i), c) for i, c in enumerate(chunks)]
    puts += [(key, None) for key, _ in old[len(chunks):]]
    puts.append((name, _COUNT.pack(len(chunks))))
    index.write(policy=puts)


def load_blob(index: BlockIndex, name: bytes) -> bytes | None:
    """The blob saved under ``name`` (None if there is none, or it is incomplete)."""
    head = index.policy_get(name)
    if head is None or len(head) != _COUNT.size:
        return None
    count = _COUNT.unpack(head)[0]
    chunks = [v for k, v in index.policy_items(name + b"/")][:count]
    return b"".join(chunks) if len(chunks) == count else None


def capture(ram: PolicyState, ssd: PolicyState | None, admission: AdmissionPolicy) -> list[
        tuple[bytes, PolicySnapshot | bytes]]:
    """On the event loop: copies of what each policy knows (encoding comes later, off it)."""
    out: list[tuple[bytes, PolicySnapshot | bytes]] = [(RAM, ram.snapshot())]
    if ssd is not None:
        out.append((SSD, ssd.snapshot()))
    state = admission.state()
    if state:
        out.append((ADMISSION, admission.name.encode() + b"\0" + state))
    return out


def write_captured(index: BlockIndex, captured: list[tuple[bytes, PolicySnapshot | bytes]]) -> int:
    """In a worker thread: encode and save what :func:`capture` took; returns bytes written."""
    total = 0
    for name, item in captured:
        data = item.encode() if isinstance(item, PolicySnapshot) else item
        save_blob(index, name, data)
        total += len(data)
    return total


def _snapshot(index: BlockIndex, name: bytes, kind: str) -> PolicySnapshot | None:
    raw = load_blob(index, name)
    if raw is None:
        return None
    try:
        snapshot = PolicySnapshot.decode(raw)
    except SnapshotError as exc:
        log.warning("saved policy state is unreadable; starting cold", extra={"fields": {"policy": name.decode(),
                                                                                         "error": str(exc)}})
        return None
    if snapshot.kind != kind:
        log.info("saved policy state is of another policy; starting cold",
                 extra={"fields": {"tier": name.decode(), "saved": snapshot.kind, "now": kind}})
        return None
    return snapshot


def restore_ram(index: BlockIndex, policy: PolicyState, kind: str) -> int:
    """At boot, before any block is stored: the RAM policy takes up its saved state (no key is
    resident). Returns how many keys the saved state held."""
    snapshot = _snapshot(index, RAM, kind)
    if snapshot is None:
        return 0
    policy.restore(snapshot, lambda key: False)
    return sum(len(items) for items in snapshot.lists.values())


def restore_admission(index: BlockIndex, admission: AdmissionPolicy) -> bool:
    """At boot: the admission policy takes up its saved state if it was saved by the same
    policy with the same settings."""
    raw = load_blob(index, ADMISSION)
    if raw is None:
        return False
    name, _, state = raw.partition(b"\0")
    if name.decode(errors="replace") != admission.name:
        return False
    try:
        admission.restore(state)
    except (ValueError, struct.error) as exc:
        log.info("saved admission state does not fit the configured one; starting cold",
                 extra={"fields": {"reason": str(exc)}})
        return False
    return True


def build_ssd_order(index: BlockIndex, kind: str, stop: Callable[[], bool] = lambda: False,
                    progress: Callable[[int], None] = lambda n: None,
                    settings: PolicySettings | None = None) -> KeyedPolicy:
    """In a worker thread, after the boot reconcile: the SSD tier's policy over every block the
    index has on SSD, in the saved order where there is one, then in the SSD queue's order
    (least recently used first) for the rest."""
    on_ssd: set[bytes] = set()
    for key, _ in index.ssd_records(stop):
        on_ssd.add(key)
        if len(on_ssd) % 1_000_000 == 0:
            progress(len(on_ssd))
    policy = make_keyed_policy(kind, settings)
    snapshot = _snapshot(index, SSD, kind)
    if snapshot is not None:
        policy.restore(snapshot, on_ssd.__contains__)
    for key in index.ssd_queue_keys():
        if key in on_ssd and key not in policy:
            policy.insert(key)
    for key in on_ssd:
        if key not in policy:
            policy.insert(key)
    return policy
