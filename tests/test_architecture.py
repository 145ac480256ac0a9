"""The package map holds (docs/architecture.md#packages-and-imports): imports flow one way,
no module imports itself through others, no source file grows past 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eventbus", "openai_api", "inference_node", "state_store", "routing_api", "bridge", "kvflow", "migrations",
            "kvflow_vllm")
#: What each package may import among kvflow's (``kvflow``, the top floor, may import everything).
ALLOWED = {
    "eventbus": set(),
    "openai_api": {"eventbus"},
    "inference_node": {"eventbus", "openai_api"},
    "bridge": {"eventbus", "openai_api"},
    "state_store": {"eventbus"},
    "routing_api": {"eventbus", "openai_api", "state_store"},
    "migrations": {"eventbus", "state_store"},
    # vLLM's plugin, loaded inside vLLM: the wire's constants and kvflow's pure KV core only (no torch of ours)
    "kvflow_vllm": {"eventbus", "inference_node"},
    "kvflow": set(PACKAGES) - {"kvflow"},
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(f: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``f`` imports, anywhere in it (``TYPE_CHECKING`` blocks and functions too)."""
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    out.add(full)
                elif node.module in modules:
                    out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
    return out


MODULES = _modules()
GRAPH = {m: _imports(f, MODULES) - {m} for m, f in MODULES.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if m.split(".")[0] == package
                 for d in deps if d.split(".")[0] not in ALLOWED[package] | {package})
    assert bad == []


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_source_file_over_500_lines() -> None:
    long = {str(f.relative_to(ROOT)): n for f in MODULES.values()
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_router_and_the_bridge_never_reach_the_node() -> None:
    """The router never loads torch through kvflow's own modules; the bridge never imports the
    node's KV core (it meets the node in ``eventbus``)."""
    for m, deps in GRAPH.items():
        if m.startswith(("routing_api", "bridge", "state_store")):
            assert not {d for d in deps if d.startswith("inference_node")}, m
