"""Engine plug-in tests: real vLLM and SGLang packages against real daemon processes.

They run in the engines environment (``.venv-engines``, built by ``make engines-venv``; ``make
test`` runs them there). In an environment without the engines (the daemon's ``.venv``) this
directory is left out of collection, and the header says so.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")       # no GPU here: vLLM's platform is the CPU

HAVE_ENGINES = all(importlib.util.find_spec(name) is not None for name in ("vllm", "sglang"))

if HAVE_ENGINES:
    from tests.integration.conftest import daemon, make_daemon  # noqa: F401  (fixtures)
    from tests.integration.test_peers import cluster  # noqa: F401  (fixture)
else:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header() -> str:
    if HAVE_ENGINES:
        return "engine plug-in tests: vllm and sglang found"
    return "engine plug-in tests left out: run them in .venv-engines (make test does)"
