"""kvcached agent: the engine-side library of kvcached.

It never imports or ships a top-level ``kvcached`` package, so it installs beside the unrelated
PyPI project of that name. What the daemon and the agent share (addressing, the socket
protocol codec) lives here and the daemon imports it.
"""

from kvcached_agent.address import CROSS_LAYER, BlockAddress, chain_digests, chain_root, index_key

__all__ = ["CROSS_LAYER", "Agent", "AgentError", "BlockAddress", "chain_digests", "chain_root", "index_key"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The Agent needs torch; the daemon imports this package for addressing and the protocol
    # only, so torch is imported when an engine first asks for the Agent, not before.
    if name in ("Agent", "AgentError"):
        from kvcached_agent import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'kvcached_agent' has no attribute {name!r}")
