"""Small asyncio helpers the daemon's rooms share."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, whatever it raised (a stop's way of
    ending background loops: nothing of theirs runs once this returns)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
