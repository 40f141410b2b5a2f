"""Prefetch policies: how long a load waits for the blocks it has to read from SSD or pull
from a peer (SGLang HiCache's prefetch policies, ../shared/seeds/002).

The reads themselves always run to the end in the background (a block read is kept in RAM for
the next request: that is the prefetch); the policy only decides when the request answers with
what is resident by then:

- ``wait_complete``: when every read has finished (or failed): the most hits, the longest wait;
- ``best_effort``: at once, with what RAM already held;
- ``timeout``: after at most ``kv.prefetch_timeout_ms``, with what has arrived by then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["PrefetchPolicy", "PREFETCH_POLICIES", "make_prefetch_policy"]


class PrefetchPolicy(ABC):
    @abstractmethod
    def wait_s(self) -> float | None:
        """How long a load may wait for its reads, seconds; None: until they are all done."""


class WaitComplete(PrefetchPolicy):
    def wait_s(self) -> float | None:
        return None


class BestEffort(PrefetchPolicy):
    def wait_s(self) -> float | None:
        return 0.0


class Timeout(PrefetchPolicy):
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def wait_s(self) -> float | None:
        return self.timeout_s


#: config string -> policy class ([kv] prefetch_policy)
PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {"wait_complete": WaitComplete, "best_effort": BestEffort,
                                                      "timeout": Timeout}


def make_prefetch_policy(name: str, timeout_s: float = 0.05) -> PrefetchPolicy:
    if name not in PREFETCH_POLICIES:
        raise ValueError(f"unknown prefetch policy {name!r}; known: {', '.join(PREFETCH_POLICIES)}")
    return Timeout(timeout_s) if name == "timeout" else PREFETCH_POLICIES[name]()
