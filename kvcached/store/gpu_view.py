"""GPU residency: which blocks each connected agent holds on its GPU right now (no I/O).

Agents stream Pinned and Evicted events (block digests: a GPU block of an engine holds every
layer); this view keeps one set per agent session, so a router's overlap query ("how much of
this prefix is on which GPU?") is answered here without asking any engine. The view is only as
true as the events: an agent that goes away (disconnects, or stops heart-beating) has its set
dropped at once, never left to go stale.

Memory is bounded: one agent may hold at most ``max_blocks`` digests (about 100 bytes each
here); events beyond that are refused (the caller answers an error), never silently trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = ["GpuView", "AgentInfo", "GpuViewFull"]


class GpuViewFull(Exception):
    """The agent would hold more blocks than the view keeps per agent."""


@dataclass(slots=True)
class AgentInfo:
    session: int
    agent_id: str
    pid: int
    blocks: set[bytes] = field(default_factory=set)
    tenant: str = ""            # kvcached.tenants: whose blocks these are, a Tenant.tag ("": the default tenant's)


class GpuView:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._agents: dict[int, AgentInfo] = {}

    def __len__(self) -> int:
        return len(self._agents)

    def add_agent(self, session: int, agent_id: str, pid: int, tenant: str = "") -> None:
        self._agents[session] = AgentInfo(session, agent_id, pid, tenant=tenant)

    def drop_agent(self, session: int) -> int:
        """Forget an agent and its whole view; returns how many blocks it held."""
        info = self._agents.pop(session, None)
        return len(info.blocks) if info is not None else 0

    def agents(self) -> list[AgentInfo]:
        return list(self._agents.values())

    def pinned(self, session: int, digests: Iterable[bytes]) -> None:
        """Blocks now on the agent's GPU. All or nothing: GpuViewFull changes nothing."""
        blocks = self._agents[session].blocks
        new = set(digests) - blocks
        if len(blocks) + len(new) > self.max_blocks:
            raise GpuViewFull(f"the GPU view keeps at most {self.max_blocks} blocks per agent "
                              f"(agent.max_gpu_blocks); this agent holds {len(blocks)}, the event adds {len(new)}")
        blocks |= new

    def evicted(self, session: int, digests: Iterable[bytes]) -> None:
        """Blocks gone from the agent's GPU (unknown ones are ignored)."""
        self._agents[session].blocks.difference_update(digests)

    def prefix(self, session: int, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, the agent holds."""
        info = self._agents.get(session)
        return _prefix(info.blocks, digests) if info is not None else 0

    def held(self, session: int, digests: Sequence[bytes]) -> set[bytes]:
        """Which of ``digests`` the agent holds (any position)."""
        info = self._agents.get(session)
        return info.blocks.intersection(digests) if info is not None else set()

    def overlap(self, digests: Sequence[bytes], tenant: str | None = None) -> list[tuple[AgentInfo, int]]:
        """Every agent with the prefix it holds, longest first (ties by session); with
        ``tenant`` (a Tenant.tag), that tenant's agents only (another tenant's agents are not
        named at all)."""
        out = [(info, _prefix(info.blocks, digests)) for info in self._agents.values()
               if tenant is None or info.tenant == tenant]
        out.sort(key=lambda pair: (-pair[1], pair[0].session))
        return out

    def longest(self, digests: Sequence[bytes], tenant: str | None = None) -> int:
        """The longest prefix any one agent holds (of ``tenant``'s agents, a Tenant.tag, where given)."""
        return max((_prefix(info.blocks, digests) for info in self._agents.values()
                    if tenant is None or info.tenant == tenant), default=0)


def _prefix(blocks: set[bytes], digests: Sequence[bytes]) -> int:
    n = 0
    for digest in digests:
        if digest not in blocks:
            break
        n += 1
    return n
