"""The index's presence feed: which blocks became present, or stopped being present, as the
index's writes made them so (the peer tier announces them to its peers). No I/O here: the index
hands the feed each write's records before and after, the feed works out what changed.
"""

from __future__ import annotations

from collections import deque

from kvcached.index.format import is_present, wire_key_of

__all__ = ["PresenceFeed"]


class PresenceFeed:
    """Blocks that became present or stopped being present, in the order the index's writes
    made them so, as (wire key, present) pairs for one reader to take in batches (the peer
    tier's announcer). The index records into it from whatever thread wrote; a deque's append
    and popleft are atomic, so neither side takes a lock and the index calls nothing above it.
    An index records changes only while it has a feed (:attr:`BlockIndex.presence`): a daemon
    without peers keeps none."""

    def __init__(self) -> None:
        self._changes: deque[tuple[bytes, bool]] = deque()

    def record(self, gained: list[bytes], dropped: list[bytes]) -> None:
        self._changes.extend((key, True) for key in gained)
        self._changes.extend((key, False) for key in dropped)

    def record_write(self, written: list[bytes], before: list[bytes | None]) -> None:
        """Record what one write changed: ``written`` are the raw records it put, ``before``
        the raw records their keys held before it (None where absent), followed by those of
        the keys it deleted. A record counts as present while it is readable and in a tier."""
        gained: list[bytes] = []
        dropped: list[bytes] = []
        for raw, old in zip(written, before):
            was, now = is_present(old), is_present(raw)
            if now and not was:
                gained.append(wire_key_of(raw))
            elif was and not now:
                dropped.append(wire_key_of(raw))
        for old in before[len(written):]:
            if is_present(old):
                dropped.append(wire_key_of(old))      # type: ignore[arg-type]
        if gained or dropped:
            self.record(gained, dropped)

    def take(self) -> list[tuple[bytes, bool]]:
        """The changes recorded so far, oldest first; they are gone from the feed."""
        changes = self._changes
        return [changes.popleft() for _ in range(len(changes))]

    def __len__(self) -> int:
        return len(self._changes)
