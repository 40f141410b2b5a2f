"""Work in flight on blocks, in one table per kind, and the background tasks that do it.

- ``fetching``: blocks being read from SSD into RAM (a promotion) or pulled from a peer; the
  future resolves to the resident block, or None if it did not arrive. A second reader of the
  same block waits on it instead of reading it twice.
- ``publishing``: blocks being written to SSD (write-back or write-through); the future is done
  when the write and its index step are.
- ``hashing``: blocks an agent committed whose checksum (and so index record) is not written
  yet; ``hashing_bytes`` is their size. A read, delete or publish of such a block waits.
- ``held_bytes``: what readers pin and agents hold reserved; at most ``max_held_bytes`` (half the
  RAM tier), so a stalled reader or writer can never hold the whole tier.

Background work runs in tasks no caller can cancel (:meth:`InFlight.spawn`): a client that gives
up must not leave a slot reserved, or a future others wait on, unresolved. :meth:`drain` waits
for them on a clean stop. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Iterable

from kvcached.tiers.ram import RamBlock, RamTier

__all__ = ["InFlight", "pin_arrived", "release_view"]


class InFlight:
    """The in-flight tables and background tasks of one store (see the module)."""

    def __init__(self, max_held_bytes: int) -> None:
        self.fetching: dict[bytes, asyncio.Future[RamBlock | None]] = {}
        self.publishing: dict[bytes, asyncio.Future[None]] = {}
        self.hashing: dict[bytes, asyncio.Future[None]] = {}
        self.hashing_bytes = 0
        self.held_bytes = 0
        self.max_held_bytes = max_held_bytes
        self.background: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` in a task no caller can cancel (drain waits for it on a clean stop)."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for background promotions, pulls, publishes and checksums."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout)

    async def hashed(self, keys: Iterable[bytes]) -> None:
        """Wait until agent-written blocks among ``keys`` have their index records."""
        if self.hashing:
            waits = {id(f): f for k in keys if (f := self.hashing.get(k)) is not None}
            if waits:
                await asyncio.wait(waits.values())

    async def settled(self, keys: Iterable[bytes]) -> None:
        """Wait until none of ``keys`` is being fetched, published or checksummed."""
        keys = list(keys)
        while waits := {id(f): f for k in keys
                        if (f := self.publishing.get(k) or self.fetching.get(k) or self.hashing.get(k)) is not None}:
            await asyncio.wait(waits.values())

    async def published(self, keys: Iterable[bytes]) -> None:
        """Wait until none of ``keys`` is being published."""
        keys = list(keys)
        while waits := {id(f): f for k in keys if (f := self.publishing.get(k)) is not None}:
            await asyncio.wait(waits.values())


async def pin_arrived(ram: RamTier, waits: list[asyncio.Future[RamBlock | None]],
                      deadline: float | None = None) -> list[RamBlock]:
    """Wait for promotions or pulls (never cancelling them), until ``deadline`` (event-loop
    time; None: until all are done); pin the blocks that arrived and are still resident."""
    if not waits:
        return []
    if deadline is None:
        blocks = await asyncio.shield(asyncio.gather(*waits))
    else:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining > 0:
            await asyncio.wait(waits, timeout=remaining)      # on a timeout the reads go on
        blocks = [w.result() for w in waits if w.done() and not w.cancelled() and w.exception() is None]
    held: list[RamBlock] = []
    for block in blocks:
        if block is not None and ram.committed(block):
            ram.pin(block)
            held.append(block)
    return held


def release_view(view: memoryview) -> None:
    """Release an arena view now; if an I/O thread still holds a slice of it (a request was
    cancelled mid-I/O), the garbage collector releases it once the thread is done."""
    try:
        view.release()
    except BufferError:
        pass
