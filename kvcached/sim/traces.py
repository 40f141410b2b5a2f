"""Production request traces for the policy simulator: JSON Lines as in the Mooncake FAST'25
trace release (kvcache-ai/Mooncake, FAST25-release/traces/).

One request a line, an object with ``timestamp`` (arrival, ms from the start of the trace) and
``hash_ids`` (the request's prefix blocks in order, as non-negative integers: equal ids are
equal blocks, so two requests share the blocks of their common prefix); other fields
(input_length, output_length) are ignored.

Each id becomes a 32-byte key, BLAKE3 of a fixed domain string and the id as 8 little-endian
bytes. The daemon's index keys are BLAKE3 digests too: uniformly random bytes, which a policy
may sample or sketch by, as it would in the daemon; small integers would not be. The requests
are the same :data:`~kvcached.sim.workloads.Trace` the synthetic workloads give, so everything
downstream replays both alike; the arrival times are kept beside them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from kvcached.sim.workloads import Trace

__all__ = ["KEY_DOMAIN", "LoadedTrace", "TraceError", "block_key", "load_trace"]

#: hashed before each id, so that trace keys cannot collide with the keys of other uses of BLAKE3
KEY_DOMAIN = b"kvcached.sim trace block id\x00"
_ID_LIMIT = 1 << 64                 # ids are hashed as 8 bytes


class TraceError(ValueError):
    """A trace file that is not a valid trace; the message names the file and the line."""


@dataclass(frozen=True)
class LoadedTrace:
    """A trace file's requests (block keys, in order) and their arrival times (ms, not
    decreasing), one per request. No policy uses wall time today; the times give the span and
    the request rate of the report, and are there for a policy that will."""

    name: str                       # the file's stem: the trace's name in tables and plots
    requests: Trace
    times_ms: list[float]

    @property
    def span_ms(self) -> float:
        """From the first arrival to the last."""
        return self.times_ms[-1] - self.times_ms[0]

    @property
    def requests_per_s(self) -> float | None:
        """Mean arrival rate over the span; None when every request arrives at once."""
        return len(self.requests) / self.span_ms * 1000 if self.span_ms > 0 else None


def block_key(block_id: int) -> bytes:
    """The 32-byte key of trace block ``block_id`` (0 <= id < 2**64): the same id, the same key."""
    return blake3(KEY_DOMAIN + block_id.to_bytes(8, "little")).digest()


def load_trace(path: str | Path) -> LoadedTrace:
    """The trace in ``path``. Blank lines are skipped; a request with no blocks is kept (it
    accesses nothing). Raises :class:`TraceError` ("FILE:LINE: what") on a line that is not a
    JSON object, a missing or ill-typed ``timestamp`` or ``hash_ids``, an id that is not a
    non-negative integer below 2**64 (a bool is not one), a timestamp before the one of the
    line above, or a file with no requests; OSError if the file cannot be read."""
    path = Path(path)
    keys: dict[int, bytes] = {}             # id -> key: each id hashed once
    requests: Trace = []
    times: list[float] = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            time_ms, ids = _parse(line, where)
            if times and time_ms < times[-1]:
                raise TraceError(f"{where}: timestamp {time_ms:.15g} is before the previous line's {times[-1]:.15g}")
            times.append(time_ms)
            request = []
            for block_id in ids:
                key = keys.get(block_id)
                if key is None:
                    key = keys[block_id] = block_key(block_id)
                request.append(key)
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: no requests (an empty trace)")
    return LoadedTrace(path.stem, requests, times)


def _parse(line: bytes, where: str) -> tuple[float, list[int]]:
    """One line's timestamp and ids, checked."""
    try:
        obj = json.loads(line)
    except ValueError as exc:                # JSONDecodeError, UnicodeDecodeError
        raise TraceError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for field in ("timestamp", "hash_ids"):
        if field not in obj:
            raise TraceError(f"{where}: missing field {field!r}")
    time_ms, ids = obj["timestamp"], obj["hash_ids"]
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)) or not math.isfinite(time_ms):
        raise TraceError(f"{where}: 'timestamp' must be a finite number (ms), got {time_ms!r}")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of block ids, got {type(ids).__name__}")
    for i, block_id in enumerate(ids):
        if type(block_id) is not int or not 0 <= block_id < _ID_LIMIT:      # not bool, a subclass of int
            raise TraceError(f"{where}: hash_ids[{i}] must be an integer in [0, 2**64), got {block_id!r}")
    return float(time_ms), ids
