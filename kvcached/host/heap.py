"""The cyclic garbage collector in a process that holds millions of blocks' metadata.

CPython's cyclic collector visits every container it tracks, and every item of each: a
collection of the oldest generation walks the key tables of the RAM tier and of the SSD tier's
policy (a list with a reference per block; the keys themselves are not containers, but each is
looked at). Measured in a daemon with 300,000 such references (bench/bench_loop.py: 100k blocks
in RAM, 200k on SSD) and only 63,000 other containers: 26-31 ms a full collection, on the event
loop, every few seconds under load; some 100 ms at a million blocks. Those tables live as long
as the daemon, so there is nothing for the collector to find in them:

- :func:`freeze` moves every object alive now into the permanent generation (``gc.freeze``),
  which collections skip: after boot, and after a big structure was built (the SSD tier's
  policy, rebuilt after the boot reconcile). What is allocated later is collected as before;
  a frozen object that becomes part of a garbage cycle later is never collected, so freeze
  once things are built, not while requests come and go.
- :func:`paused` holds collections off for a while (``gc.disable``): a policy snapshot builds
  lists of up to a million keys over a second of slices, and every young collection meanwhile
  walks them (some 5 ms each); they are emptied before collections resume.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Iterator

__all__ = ["freeze", "paused"]

log = logging.getLogger("kvcached.heap")


def freeze(why: str, collect: bool = False) -> None:
    """Take every object alive now out of the collector's sight; with ``collect``, after a
    full collection (at boot: the garbage of starting up is not kept forever)."""
    t0 = time.monotonic()
    if collect:
        gc.collect()
    gc.freeze()
    log.debug("heap frozen", extra={"fields": {"why": why, "frozen": gc.get_freeze_count(),
                                               "elapsed_s": round(time.monotonic() - t0, 4)}})


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection in the ``with`` block (one that was due runs after it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
