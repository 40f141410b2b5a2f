"""The index's feeds: which blocks became present, or stopped being present, as the index's
writes made them so (the peer tier announces them to its peers), and which tiers each block
gained or lost (the KV event publisher tells routers). No I/O here: the index
hands the feed each write's records before and after, the feed works out what changed.
"""

from __future__ import annotations

from collections import deque

from kvcached.index.format import RECORD, SCHEMA_VERSION, TIERS_AT, is_present, wire_key_of

__all__ = ["PresenceFeed", "TierChange", "TierFeed"]


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


#: One block's tier set before and after one index write: ``(record, before, after)``, the
#: record being its raw record (the one written, or the one deleted), which carries the block's
#: route keys where it has them (kvcached.index.format); the tier sets as plain int bits (the
#: feed and the publisher sit on the write path: a tuple costs a tenth of a NamedTuple).
TierChange = tuple[bytes, int, int]


class TierFeed:
    """Every change of a block's tier set (RAM or SSD gained or lost), in the order the index's
    writes made them, for one reader to take in batches (the KV event publisher, kvcached.events).
    Like :class:`PresenceFeed`, written from whatever thread wrote the index without a lock. It
    holds at most ``limit`` changes: a reader that stops taking loses the oldest beyond that,
    counted in :attr:`dropped`, so the daemon's memory never grows with an absent reader."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self._changes: deque[TierChange] = deque(maxlen=limit)
        self.limit = limit
        self.dropped = 0

    def record_write(self, written: list[bytes], before: list[bytes | None]) -> None:
        """As :meth:`PresenceFeed.record_write`. Runs for every record of every write while
        events are on: the tier bits are read inline."""
        changes: list[TierChange] = []
        size, version = RECORD.size, SCHEMA_VERSION
        for raw, old in zip(written, before):
            was = old[TIERS_AT] if old is not None and len(old) >= size and old[0] == version else 0
            now = raw[TIERS_AT] if len(raw) >= size and raw[0] == version else 0
            if was != now:
                changes.append((raw, was, now))
        for old in before[len(written):]:
            if old is not None and len(old) >= size and old[0] == version and old[TIERS_AT]:
                changes.append((old, old[TIERS_AT], 0))
        if changes:
            self.add(changes)

    def add(self, changes: list[TierChange]) -> None:
        """Changes in the order they were made (a write's, or ones not made by a write)."""
        over = len(self._changes) + len(changes) - self.limit
        if over > 0:
            self.dropped += over
        self._changes.extend(changes)

    def take(self) -> list[TierChange]:
        changes = self._changes
        return [changes.popleft() for _ in range(len(changes))]

    def __len__(self) -> int:
        return len(self._changes)

