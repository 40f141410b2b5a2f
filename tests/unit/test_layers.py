"""The rooms of kvcached/ as stated contracts: every entry of the package sits in a layer of
the import-linter contract (``make lint`` enforces the layers themselves), no module imports
its way back to itself, imports made only for type checking included, and every module and
class stays short enough to read at once."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"v1"}     # protobuf's output (make proto): imports nothing of kvcached
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def _layer_names() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return {name.strip() for layer in layers for name in layer.split("|")}


def test_every_entry_of_the_package_is_in_a_layer() -> None:
    entries = {p.stem for p in (ROOT / "kvcached").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    named = {name.removeprefix("kvcached.") for name in _layer_names()}
    assert entries - GENERATED - named == set(), "add these to the layers contract in pyproject.toml"
    assert named - entries == set(), "the layers contract names entries that no longer exist"


def _cycles(graph: grimp.ImportGraph, modules: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in modules:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.find_modules_directly_imported_by(succ)))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    sys.path.insert(0, str(ROOT / "agent"))
    graph = grimp.build_graph("kvcached", "kvcached_agent")   # TYPE_CHECKING imports included
    modules = sorted(graph.modules)
    assert len(modules) > 100, "the graph was not built from the sources"
    assert _cycles(graph, modules) == []


def test_modules_and_classes_stay_short_enough_to_read_at_once() -> None:
    too_long = []
    for package in (ROOT / "kvcached", ROOT / "agent" / "kvcached_agent"):
        for path in sorted(package.rglob("*.py")):
            if GENERATED & set(path.relative_to(package).parts):
                continue
            text = path.read_text()
            if text.count("\n") > MAX_MODULE_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_CLASS_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}: class {node.name}: {lines} lines")
    assert too_long == [], "split these rooms (docs/architecture.md)"
