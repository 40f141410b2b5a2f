"""kvcached: a per-node tiered KV-cache daemon for LLM inference engines."""

__version__ = "0.1.0"
