"""Engine plug-ins: kvcached inside vLLM (a KV connector) and SGLang (a HiCache storage backend).

Both are thin: they turn the engine's calls into the agent's lookups, saves and loads, and keep
no cache policy of their own. Importing a plug-in module checks the engine's version first
(:mod:`kvcached_agent.engines.versions`); nothing here imports an engine until then.
"""
