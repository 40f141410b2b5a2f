"""Admission: which offered blocks the daemon stores at all, and how many bytes a day the SSD
tier may write.

- ``always``: every new block is stored (the default).
- ``reuse``: a block is stored only on its N-th offer within a window (vLLM's store_threshold,
  ../shared/seeds/000): one-off blocks, most of a request's tail, never displace blocks that
  are reused. Offers are counted in a count-min sketch of bounded memory that ages (all counts
  halve after ``window`` offers, as TinyLFU resets its sketch), so "N times" means "N times
  lately".
- :class:`SsdWriteBudget`: bytes written to the SSD tier in any 24 hours never exceed the
  budget (drive endurance is rated in drive writes per day); the store asks it before every
  publish, and a block it refuses is kept in RAM only.

No I/O here; the store calls these on the event loop and persists their state
(kvcached.index.policy_state).
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections import deque

__all__ = ["AdmissionPolicy", "AlwaysAdmit", "ReuseAdmission", "CountMinSketch", "SsdWriteBudget",
           "ADMISSION_POLICIES", "make_admission_policy"]

DAY_S = 86400.0
BUCKET_S = 60.0          # the write budget's ledger counts bytes per minute


class AdmissionPolicy(ABC):
    """Decides whether a block that is offered (a Put or an agent's save of a block no tier
    holds) is stored."""

    name = ""

    @abstractmethod
    def admit(self, key: bytes) -> bool:
        """``key`` is offered once more: store it now?"""

    def state(self) -> bytes:
        """What the policy has learned, to survive a restart (b"": nothing)."""
        return b""

    def restore(self, raw: bytes) -> None:
        """Take up :meth:`state` of an instance with the same settings; raises ValueError if
        ``raw`` does not fit."""


class AlwaysAdmit(AdmissionPolicy):
    name = "always"

    def admit(self, key: bytes) -> bool:
        return True


class CountMinSketch:
    """Approximate counts of keys in 4 rows of ``width`` one-byte counters (Cormode and
    Muthukrishnan, 2005). A key's count is the smallest of its counters, so it is never
    under-counted; it is over-counted only when every one of its counters is shared with other
    keys, with probability about (distinct keys / width) ** 4. Increments are conservative
    (only the counters at the minimum grow), which keeps the over-count small.

    After ``window`` increments every counter halves (aging): counts reflect recent offers, and
    a counter saturates at 255, never wraps. Keys must be uniformly random bytes, 32 of them
    (BLAKE3 index keys are): each row indexes with 8 bytes of the key, so no hashing is needed
    and counts do not depend on a per-process hash seed, which lets the sketch survive a
    restart. About 1 us per :meth:`add`."""

    DEPTH = 4

    def __init__(self, width: int, window: int = 0) -> None:
        if width < 1:
            raise ValueError("width must be positive")
        self.width = width
        self.window = window or 10 * width
        self.rows = [bytearray(width) for _ in range(self.DEPTH)]
        self.added = 0               # increments since the last aging

    def _slots(self, key: bytes) -> tuple[int, int, int, int]:
        x = int.from_bytes(key[:32].ljust(32, b"\0"), "little")
        w, m = self.width, 0xFFFFFFFFFFFFFFFF
        return (x & m) % w, (x >> 64 & m) % w, (x >> 128 & m) % w, (x >> 192) % w

    def estimate(self, key: bytes) -> int:
        a, b, c, d = self._slots(key)
        r0, r1, r2, r3 = self.rows
        return min(r0[a], r1[b], r2[c], r3[d])

    def add(self, key: bytes) -> int:
        """Count one more of ``key``; returns its new estimate."""
        a, b, c, d = self._slots(key)
        r0, r1, r2, r3 = self.rows
        low = min(r0[a], r1[b], r2[c], r3[d])
        if low < 255:
            new = low + 1
            if r0[a] == low:
                r0[a] = new
            if r1[b] == low:
                r1[b] = new
            if r2[c] == low:
                r2[c] = new
            if r3[d] == low:
                r3[d] = new
            low = new
        self.added += 1
        if self.added >= self.window:
            self.age()
        return low

    def age(self) -> None:
        """Halve every counter (a whole row at once, as one big integer: no Python loop)."""
        mask = int.from_bytes(b"\x7f" * self.width, "little")
        for row in self.rows:
            row[:] = ((int.from_bytes(row, "little") >> 1) & mask).to_bytes(self.width, "little")
        self.added = 0

    def state(self) -> bytes:
        return struct.pack("<QQQ", self.width, self.DEPTH, self.added) + b"".join(self.rows)

    def restore(self, raw: bytes) -> None:
        width, depth, added = struct.unpack_from("<QQQ", raw)
        if (width, depth) != (self.width, self.DEPTH) or len(raw) != 24 + width * depth:
            raise ValueError(f"a sketch of {depth}x{width} counters does not fit this one ({self.DEPTH}x{self.width})")
        self.rows = [bytearray(raw[24 + i * width:24 + (i + 1) * width]) for i in range(depth)]
        self.added = min(added, self.window - 1)


class ReuseAdmission(AdmissionPolicy):
    """Store a block on its ``threshold``-th offer within about ``window`` offers.

    The sketch has 4 rows of ``4 * window`` counters (16 bytes of memory per offer of the
    window, whatever the number of blocks): even when every offer of a window is a distinct
    block, a block offered once passes a threshold of 2 with probability under 0.3%
    ((1 - e^-1/4)^4), and one offered N-1 times passes N about as rarely."""

    name = "reuse"

    def __init__(self, threshold: int = 2, window: int = 100_000) -> None:
        if threshold < 1 or window < 1:
            raise ValueError("threshold and window must be positive")
        self.threshold = threshold
        self.sketch = CountMinSketch(width=4 * window, window=window)

    def admit(self, key: bytes) -> bool:
        return self.sketch.add(key) >= self.threshold

    def state(self) -> bytes:
        return self.sketch.state()

    def restore(self, raw: bytes) -> None:
        self.sketch.restore(raw)


#: config string -> policy class ([kv] admission)
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {"always": AlwaysAdmit, "reuse": ReuseAdmission}


def make_admission_policy(name: str, threshold: int = 2, window: int = 100_000) -> AdmissionPolicy:
    if name == "reuse":
        return ReuseAdmission(threshold, window)
    if name not in ADMISSION_POLICIES:
        raise ValueError(f"unknown admission policy {name!r}; known: {', '.join(ADMISSION_POLICIES)}")
    return ADMISSION_POLICIES[name]()


class SsdWriteBudget:
    """At most ``bytes_per_day`` bytes written to the SSD tier in any 24 hours.

    A ledger of bytes per minute: a write is allowed if the bytes of the minutes that may still
    lie within the last 24 hours, plus its own, fit the budget. A minute's bytes are counted
    until the whole minute is more than a day old, so the check errs on the safe side by up to
    a minute. ``bytes_per_day`` 0 means no budget. :meth:`take` is all or nothing for a batch.
    """

    def __init__(self, bytes_per_day: int) -> None:
        self.bytes_per_day = bytes_per_day
        self._minutes: deque[list[int]] = deque()     # [minute number, bytes], oldest first
        self._total = 0

    @property
    def unlimited(self) -> bool:
        return self.bytes_per_day <= 0

    def _expire(self, now: float) -> None:
        oldest = int((now - DAY_S) // BUCKET_S)       # minutes before this one ended > a day ago
        while self._minutes and self._minutes[0][0] < oldest:
            self._total -= self._minutes.popleft()[1]

    def used(self, now: float) -> int:
        """Bytes written within the last day (as the ledger counts them)."""
        self._expire(now)
        return self._total

    def remaining(self, now: float) -> int:
        """Bytes that may still be written now. Read-only (the metrics thread calls it while
        the event loop takes): it reads a copy of the ledger and changes nothing."""
        if self.unlimited:
            return 1 << 62
        oldest = int((now - DAY_S) // BUCKET_S)
        used = sum(n for m, n in list(self._minutes) if m >= oldest)     # list(): one C-level copy
        return max(0, self.bytes_per_day - used)

    def take(self, nbytes: int, now: float) -> bool:
        """Count ``nbytes`` about to be written now, if the budget has room for all of them."""
        if self.unlimited:
            return True
        if self.used(now) + nbytes > self.bytes_per_day:
            return False
        minute = int(now // BUCKET_S)
        if self._minutes and self._minutes[-1][0] >= minute:
            self._minutes[-1][1] += nbytes
        else:
            self._minutes.append([minute, nbytes])
        self._total += nbytes
        return True

    def current_minute(self) -> tuple[int, int]:
        """(minute, bytes) of the newest ledger entry, to persist right after a take."""
        return (self._minutes[-1][0], self._minutes[-1][1]) if self._minutes else (0, 0)

    def minutes(self) -> list[tuple[int, int]]:
        """The ledger: (minute, bytes), oldest first."""
        return [(m, n) for m, n in self._minutes]

    def load(self, minutes: list[tuple[int, int]], now: float) -> None:
        """Take up persisted (minute, bytes) entries (any order; repeats keep the larger)."""
        merged: dict[int, int] = {}
        for minute, nbytes in minutes:
            merged[minute] = max(merged.get(minute, 0), nbytes)
        self._minutes = deque([m, n] for m, n in sorted(merged.items()))
        self._total = sum(n for _, n in self._minutes)
        self._expire(now)
