"""What the cache policies learned, kept in the index so it survives a restart.

Saved every ``kv.policy_save_s`` and on a clean stop, into the index's ``policy`` family:
the RAM tier's eviction policy (``ram``), the SSD tier's in-memory one (``ssd``, when
``kv.ssd_policy`` is not the index's own LRU queue) and the admission policy's sketch
(``admission``). Each is one :class:`~kvcached.policies.PolicySnapshot` (or sketch) written
in chunks of ``CHUNK`` bytes, one chunk a write, under keys of a new *generation*; a last
write points the blob's head at that generation and deletes the previous one's chunks, so a
crash mid-save leaves the previous save whole (its head still names it), and the chunks of a
save cut short are found and deleted by the next save of that blob. (Before generations every
save was one batch; a head of that layout is still read. A daemon of that layout reads a saved
generation as no saved state: it starts cold.) The SSD write budget's ledger is not saved
here: the store writes it before each publish (a crash must not let the daemon write more than
its budget).

While the daemon serves, a save must not hold the event loop: at a million keys the snapshot
alone took 0.2-0.5 s, the encoding 0.1 s and the batch write 0.1 s, each holding the
interpreter (bench/bench_loop.py). So :func:`capture_steps` runs on the loop in steps
(kvcached.policies.Steps): each policy is copied in one step (bulk copies of its columns and
key table: milliseconds), then walked and encoded a few thousand keys a step while requests
run in between; :func:`write_parts` writes the result in a worker thread, one chunk a write
(RocksDB releases the interpreter while it writes; a batch of tens of MB held it while it was
built). At boot:

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
from typing import Any, Callable, Iterable, Iterator

from kvcached.index import BlockIndex
from kvcached.policies import (
    KeyedPolicy,
    PolicySettings,
    PolicySnapshot,
    PolicyState,
    SnapshotError,
    Steps,
    make_keyed_policy,
    through,
)
from kvcached.policies.admission import AdmissionPolicy

__all__ = ["save_blob", "save_parts", "load_blob", "capture", "capture_steps", "write_captured", "write_parts",
           "restore_ram", "restore_admission", "build_ssd_order", "RAM", "SSD", "ADMISSION", "Captured"]

log = logging.getLogger("kvcached.policy_state")

RAM, SSD, ADMISSION = b"ram", b"ssd", b"admission"
CHUNK = 1 << 20          # bytes per RocksDB value, and per write of a save
_COUNT = struct.Struct(">I")      # big-endian: chunk keys sort in chunk order
_HEAD = struct.Struct(">II")      # a blob's head: its chunks, its generation
_FREE_STEP = 2048                 # list items freed in one step
_GENERATION = b"\xff"             # chunk keys: name/ 0xff generation index (generation 0, before: name/ index)
#: what :func:`capture_steps` gives :func:`write_parts`: per blob, its name and its bytes in parts
Captured = list[tuple[bytes, list[bytes]]]


def _prefix(name: bytes, generation: int) -> bytes:
    return name + b"/" + (_GENERATION + _COUNT.pack(generation) if generation else b"")


def _head(index: BlockIndex, name: bytes) -> tuple[int, int] | None:
    """(chunks, generation) of the blob saved under ``name``; None if there is none."""
    head = index.policy_get(name)
    if head is not None and len(head) == _COUNT.size:
        return _COUNT.unpack(head)[0], 0
    if head is not None and len(head) == _HEAD.size:
        count, generation = _HEAD.unpack(head)
        return count, generation
    return None


def _rechunked(parts: Iterable[bytes]) -> Iterator[bytes]:
    """The concatenation of ``parts`` in pieces of ``CHUNK`` bytes (the last one shorter)."""
    pending: list[memoryview] = []
    size = 0
    for part in parts:
        view = memoryview(part)
        while view:
            take = view[:CHUNK - size]
            pending.append(take)
            size += len(take)
            view = view[len(take):]
            if size == CHUNK:
                yield b"".join(pending)
                pending, size = [], 0
    if pending:
        yield b"".join(pending)


def save_parts(index: BlockIndex, name: bytes, parts: Iterable[bytes],
               pause: Callable[[int], object] = lambda nbytes: None) -> int:
    """Store the concatenation of ``parts`` under ``name``, replacing the previous blob atomically
    (see the module): one chunk a write, ``pause(bytes written)`` after each; returns the bytes
    stored."""
    old = _head(index, name)
    generation = (old[1] if old is not None else 0) + 1
    prefix = _prefix(name, generation)
    # chunks of this generation already there: a save cut short (a crash); normally none
    cut_short = [key for key, _ in index.policy_items(prefix)]
    count = total = 0
    for chunk in _rechunked(parts):
        index.write(policy=[(prefix + _COUNT.pack(count), chunk)])
        count += 1
        total += len(chunk)
        pause(len(chunk))
    if count == 0:
        index.write(policy=[(prefix + _COUNT.pack(0), b"")])
        count = 1
    done: list[tuple[bytes, bytes | None]] = [(name, _HEAD.pack(count, generation))]
    done += [(key, None) for key in cut_short if key[len(prefix):] >= _COUNT.pack(count)]
    if old is not None:
        done += [(_prefix(name, old[1]) + _COUNT.pack(i), None) for i in range(old[0])]
    index.write(policy=done)
    return total


def save_blob(index: BlockIndex, name: bytes, data: bytes) -> None:
    """Store ``data`` under ``name`` in chunks, replacing the previous blob atomically."""
    save_parts(index, name, [data])


def load_blob(index: BlockIndex, name: bytes) -> bytes | None:
    """The blob saved under ``name`` (None if there is none, or it is incomplete)."""
    head = _head(index, name)
    if head is None:
        return None
    count, generation = head
    prefix = _prefix(name, generation)
    chunks = [v for k, v in index.policy_items(prefix) if len(k) == len(prefix) + _COUNT.size][:count]
    return b"".join(chunks) if len(chunks) == count else None


def capture_steps(ram: PolicyState, ssd: PolicyState | None, admission: AdmissionPolicy) -> Steps[Captured]:
    """On the event loop, in steps (kvcached.policies.Steps): each policy copied in one step as
    it is then, walked and encoded a few thousand keys a step after; the admission policy's
    state copied in one step. The result goes to :func:`write_parts`, in a worker thread."""
    def steps() -> Steps[Captured]:
        out: Captured = []
        for name, state in ((RAM, ram), (SSD, ssd)):
            if state is not None:
                snapshot = yield from through(state.snapshot_steps())
                parts = yield from through(snapshot.encode_steps())
                out.append((name, parts))
                yield from _emptied(snapshot)
        sketch = admission.state()
        if sketch:
            out.append((ADMISSION, [admission.name.encode() + b"\0", sketch]))
        yield out
    return steps()


def _emptied(snapshot: PolicySnapshot) -> Iterator[None]:
    """Empty ``snapshot``'s lists a slice a step: a list of a million keys takes some 8 ms to
    free at once (a reference dropped from each key)."""
    every: list[list[Any]] = [*snapshot.lists.values(), *snapshot.values.values()]
    for items in every:
        while items:
            del items[-_FREE_STEP:]
            yield None


def write_parts(index: BlockIndex, captured: Captured, pause: Callable[[int], object] = lambda nbytes: None) -> int:
    """In a worker thread: save what :func:`capture_steps` took (``pause(bytes)`` after each chunk
    written: the event loop's own index writes wait for each, and RocksDB's flushes keep up);
    returns the bytes written."""
    return sum(save_parts(index, name, parts, pause) for name, parts in captured)


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
