"""Which keys the live curves sample, and how many the daemon can afford (no I/O; the clocks are
passed in). kvcached.policies.curves says what the sample is for.

:class:`KeySample` is the spatial sample (SHARDS, Waldspurger et al., FAST 2015): a key is in it
while its hash (its first 8 bytes, big-endian: index keys are BLAKE3 digests, uniform already)
is below a threshold. The rate R is the threshold over 2^64.

:class:`RateBudget` moves the rate with what the sampled uses cost. Each one costs the same
work whatever the traffic (one access to every copy of every tier), so the curves' CPU is their
rate times the traffic; the budget is a share of the daemon's own CPU time, measured over
windows of the clock: over it, the rate falls in proportion at once; well under it, the rate
doubles (up to the cap), so a sample cut during a burst grows back when the traffic falls. A
rate that could only fall (halved for good past 200 sampled uses a second, as it was) kept 40
keys of a trace a daemon served at full speed for 25 s, and the curves were 0.2 off.
"""

from __future__ import annotations

__all__ = ["SPACE", "KeySample", "RateBudget"]

SPACE = 1 << 64


class KeySample:
    """The spatial sample: a key is in it while its hash is below the threshold and it was used
    since a point the owner names (:meth:`retire`: its window holds no use of it any more).
    What the sample costs to keep is bounded by the owner's window, not by every key ever seen:
    a daemon whose traffic brings new keys all day keeps the rate its budget allows (a sample of
    the keys with the smallest hashes ever seen, SHARDS' fixed-size variant as it was, let its
    rate fall as one over their number, and the copies with it)."""

    def __init__(self, rate: float = 1.0) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"a sampling rate of {rate}: it is in (0, 1]")
        self._threshold = 0
        self.bound = b""                        # the threshold as a key: a key is sampled exactly when it compares below
        self.threshold = int(SPACE * rate)      # a key is sampled while its hash is below this
        self._used: dict[bytes, int] = {}       # key -> the number of its last use, least recently used first

    @property
    def threshold(self) -> int:
        return self._threshold

    @threshold.setter
    def threshold(self, value: int) -> None:
        self._threshold = value
        self.bound = bound_key(value)

    @property
    def rate(self) -> float:
        """The share of the key space sampled."""
        return self.threshold / SPACE

    def __len__(self) -> int:
        return len(self._used)

    def __contains__(self, key: bytes) -> bool:
        return key in self._used

    def lower(self, threshold: int) -> list[bytes]:
        """Sample fewer keys: those with hashes below ``threshold`` only; returns the keys that
        left the sample."""
        if threshold >= self.threshold:
            return []
        self.threshold = max(1, threshold)
        bound = self.bound
        dropped = [key for key in self._used if key >= bound]
        for key in dropped:
            del self._used[key]
        return dropped

    def raise_to(self, threshold: int) -> None:
        """Sample more keys: those with hashes below ``threshold`` from now on (their earlier
        uses were not seen: the owner counts them once its copies have caught up)."""
        self.threshold = max(self.threshold, min(SPACE, threshold))

    def last(self, key: bytes) -> int | None:
        """The number of the last use of ``key`` (None: not in the sample)."""
        return self._used.get(key)

    def take(self, key: bytes, number: int) -> None:
        """A use of ``key`` (below the threshold), numbered ``number`` by the owner."""
        used = self._used
        if key in used:
            del used[key]
        used[key] = number

    def retire(self, before: int) -> int:
        """The keys last used before use number ``before`` leave the sample (the threshold
        stays); returns how many."""
        used = self._used
        n = 0
        while used:
            key = next(iter(used))
            if used[key] >= before:
                break
            del used[key]
            n += 1
        return n


def bound_key(threshold: int) -> bytes:
    """A threshold as a key: a key's hash is below ``threshold`` exactly when the key compares
    below this (one memcmp, no number made for the keys that are not sampled)."""
    return threshold.to_bytes(8, "big") + bytes(24) if threshold < SPACE else b"\xff" * 33


class RateBudget:
    """The sampling rate the curves can afford: their CPU time (``busy``, the owner's count of
    what counting sampled uses took) at most ``share`` of the process's (``cpu``), over windows
    of ``window_s`` seconds of the clock; ``floor`` of a core is allowed whatever the process
    used (an idle daemon's few uses are left alone, and its curves keep their sample).

    :meth:`observe` is called after each batch of sampled uses is counted and returns a new rate
    when the rate should move, else None: at the end of a window over the allowance, the rate
    that would have spent ``MARGIN`` of it (the cost of a sampled use is about the same at any
    rate), a FALL-th of it at least; after RISE_AFTER windows in a row under half of it, that rate again, at most twice
    this one (up to ``max_rate``) and only where that moves it by a quarter or more (each rise
    costs the curves the uses that come while their copies catch up: Bands.rose; a rate that
    rose whenever one window was light went up and down every few seconds on a loaded machine,
    and the figures stood on the few uses between). A burst that spends ``BURST`` times a full
    window's allowance before the window ends is answered at once."""

    MARGIN = 0.8
    BURST = 4.0
    MOVE = 0.25
    RISE_AFTER = 3          # windows in a row under half the allowance before the rate rises
    FALL = 4                # the most the rate falls at once (one collection of the garbage collector's, timed
                            # inside the curves' count, once put 50 ms in one window and the rate down twentyfold)

    def __init__(self, share: float, max_rate: float, *, window_s: float = 2.0, floor: float = 0.001) -> None:
        if not 0 < share < 1 or not 0 < max_rate <= 1 or window_s <= 0:
            raise ValueError(f"a share of {share}, a rate of {max_rate} at most, windows of {window_s} s")
        self.share = share
        self.max_rate = max_rate
        self.window_s = window_s
        self.floor = floor
        self._start: tuple[float, float, float] | None = None     # (clock, busy, cpu) at the window's start
        self._under = 0                                           # windows in a row under half the allowance

    def observe(self, now: float, busy: float, cpu: float, rate: float) -> float | None:
        start = self._start
        if start is None:
            self._start = (now, busy, cpu)
            return None
        elapsed, took, used = now - start[0], busy - start[1], cpu - start[2]
        allowed = max(self.share * used, self.floor * elapsed)
        full = max(self.share * used, self.floor * self.window_s)
        if elapsed < self.window_s and took <= self.BURST * full:
            return None
        self._start = (now, busy, cpu)
        if took > allowed:
            self._under = 0
            return max(rate * self.MARGIN * allowed / took, rate / self.FALL, 1 / SPACE)
        self._under = self._under + 1 if took < allowed / 2 else 0
        if self._under < self.RISE_AFTER:
            return None
        target = min(self.max_rate, 2 * rate, rate * self.MARGIN * allowed / took if took > 0 else 2 * rate)
        if target < rate * (1 + self.MOVE):
            return None
        self._under = 0
        return target
