"""A token bucket: at most ``rate`` units a second, in bursts of one second's worth. No I/O; the
clock is passed in. What it paces is its users' (kvcached.peers.handshakes.ReplyBudget: replies
to strangers; kvcached.api.agent_session: the engine keys an agent connection sends)."""

from __future__ import annotations

__all__ = ["TokenBucket"]


class TokenBucket:
    """At most ``rate`` units a second, a second's worth at once; full at ``now``."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def take(self, now: float, units: float = 1.0) -> bool:
        """Take ``units`` if the bucket holds them; False (and nothing taken) if not."""
        self._refill(now)
        if self._tokens >= units:
            self._tokens -= units
            return True
        return False

    def has(self, units: float, now: float) -> bool:
        """Whether the bucket holds ``units`` now (nothing taken)."""
        self._refill(now)
        return self._tokens >= units

    def charge(self, units: float, now: float) -> float:
        """Take ``units`` whatever the bucket holds; the seconds to wait before using them, so
        that what was taken keeps to the rate (0 while the bucket held them)."""
        self._refill(now)
        self._tokens -= units
        return max(0.0, -self._tokens / self.rate)
