"""The package's arrows point one way (docs/architecture.md): who may import whom, read from the code."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshserve"
MAX_MODULE_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    """The meshserve modules `module` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return {name for name in found if name.split(".")[0] == "meshserve"}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _offenders(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {i}" for m, path in MODULES.items() if _in(m, source)
                  for i in _imports(path, m) if any(_in(i, f) for f in forbidden))


@pytest.mark.parametrize("source,forbidden", [
    ("meshserve.worker", ("meshserve.engine", "meshserve.server", "meshserve.gateway")),
    ("meshserve.gateway", ("meshserve.engine", "meshserve.worker", "meshserve.layers", "meshserve.models",
                           "meshserve.server")),
    ("meshserve.routing", ("meshserve.engine", "meshserve.worker", "meshserve.layers", "meshserve.server")),
    ("meshserve.api", ("meshserve.engine", "meshserve.worker", "meshserve.server", "meshserve.gateway")),
    ("meshserve.plan", ("meshserve.engine", "meshserve.worker", "meshserve.layers", "meshserve.calibration",
                        "meshserve.server")),
    ("meshserve.bench", ("meshserve.engine", "meshserve.worker", "meshserve.server", "meshserve.layers")),
    ("meshserve.entrypoints", ("meshserve.bench",)),
    ("meshserve.layers", ("meshserve.models", "meshserve.engine", "meshserve.worker")),
    ("meshserve.models", ("meshserve.engine", "meshserve.worker", "meshserve.server")),
])
def test_no_import_points_back_up(source, forbidden):
    assert _offenders(source, forbidden) == []


def test_no_import_cycles_between_modules():
    graph = {m: {i for i in _imports(p, m, top_level_only=True) if i in MODULES and i != m}
             for m, p in MODULES.items()}
    # A package's __init__ importing its own modules is not a cycle of behaviour.
    graph = {m: {i for i in deps if not _in(m, i)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


@pytest.mark.parametrize("entry", ["meshserve.gateway.app", "meshserve.plan.cli", "meshserve.bench.cli",
                                   "meshserve.routing.policies", "meshserve.api.protocol", "meshserve.cli"])
def test_front_doors_load_no_engine_and_no_torch(entry):
    """The gateway, planner and benchmark start fast and on machines without torch: importing them
    loads no engine, worker, layer or torch module."""
    probe = (f"import json, sys; import {entry}; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
             "m.startswith(('meshserve.engine', 'meshserve.worker', 'meshserve.layers', 'meshserve.server')))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
