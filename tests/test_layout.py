"""The folder layout's rules between packages: bench -> controller -> skylb, a pure routing core, no import cycles.

The contracts live in pyproject.toml (``[tool.importlinter]``) and run here through `lint-imports` from its own venv
(``.venv-lint``, `make lint-tools`; not the test venv: import-linter requires rich, which structlog then imports in
every process the tests start); without that venv the test skips here and fails under CI. What
import-linter cannot say is checked below with its graph library (grimp): the routing core's allow-list of
libraries, and import cycles between modules across packages, where a type-only import counts unless it names only
Protocols.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

from tests.system import skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
#: `lint-imports` of the venv `make lint-tools` builds.
LINT_IMPORTS = ROOT / ".venv-lint" / "bin" / "lint-imports"
PRODUCT = ("skylb", "controller")
#: What the routing core may import besides the standard library and itself (the core is pure: no I/O, no clock).
CORE_LIBRARIES = {"pydantic", "uhashring"}

def _in(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_import_contracts_hold():
    """pyproject.toml's import-linter contracts are kept: skylb imports neither controller nor bench, controller
    does not import bench (function-local imports included); skylb.core imports no quota, balancer, engine adapter
    or aiohttp; no cycle between the modules and subpackages of skylb.core, skylb.quota and controller."""
    if not LINT_IMPORTS.exists():
        skip_or_fail(f"{LINT_IMPORTS.relative_to(ROOT)} is missing: `make lint-tools` installs import-linter there")
    # The checkout on the path: import-linter reads the packages' source, it does not need their dependencies.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def test_routing_core_imports_only_the_standard_library_and_its_libraries():
    """Every import in skylb/core (run-time and type-only, function-local included) is of the standard library,
    pydantic, uhashring or skylb.core itself."""
    graph = grimp.build_graph("skylb", include_external_packages=True, cache_dir=None)
    core = {m for m in graph.modules if _in(m, ["skylb.core"])}
    assert len(core) > 15
    outside = sorted(f"{m} -> {i}" for m in core for i in graph.find_modules_directly_imported_by(m)
                     if not _in(i, ["skylb.core"]) and i.split(".")[0] not in CORE_LIBRARIES
                     and i.split(".")[0] not in sys.stdlib_module_names)
    assert outside == []


def _type_checking_blocks(tree: ast.Module) -> list[ast.If]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.If)
            and ((isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                 or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))]


def _is_protocol(module: str, name: str) -> bool:
    """True when ``module.name`` is a class deriving from typing.Protocol (not a submodule, not another class)."""
    value = getattr(importlib.import_module(module), name, None)
    return isinstance(value, type) and bool(getattr(value, "_is_protocol", False))


def _coupling_type_only_imports(graph: grimp.ImportGraph, module: str) -> set[str]:
    """The modules of ``graph`` that ``module`` imports only under ``if TYPE_CHECKING:`` for a name that is not a
    Protocol: such an import hides a coupling, so the cycle check counts it as an import."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
    package = module if spec.origin.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for block in _type_checking_blocks(tree):
        for node in ast.walk(block):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in graph.modules}
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                for alias in node.names:
                    if f"{base}.{alias.name}" in graph.modules:
                        found.add(f"{base}.{alias.name}")
                    elif base in graph.modules and not _is_protocol(base, alias.name):
                        found.add(base)
    return found


def find_cycles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of a graph (module -> the modules it imports): each strongly connected component of more
    than one module, or a module importing itself, as one cycle through it from its smallest module, and then, when
    the component holds more, the rest of its modules after a "+" (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in imports.get(node, ()):
                    components.append(component)
    cycles = []
    for component in components:
        cycle = _cycle_through(component, imports)
        rest = sorted(component - set(cycle))
        cycles.append(cycle + (["+", *rest] if rest else []))
    return sorted(cycles)


def _cycle_through(component: set[str], imports: Mapping[str, Iterable[str]]) -> list[str]:
    """One cycle inside a strongly connected ``component``: from its smallest module, a shortest path back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(imports.get(node, ())):
                if child == start:
                    return paths[node] + [start]
                if child in component and child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"not a cycle: {sorted(component)}")


def test_find_cycles_reports_each_circle_once():
    """The cycle finder names every circle (a self-import too) once with all its modules, and nothing in an
    acyclic graph."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"g"}, "g": {"f", "a"},
             "h": {"i"}, "i": {"h", "j"}, "j": {"i"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"], ["f", "g", "f"], ["h", "i", "h", "+", "j"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_in_the_product():
    """No import cycle among the modules of skylb/ and controller/: run-time imports, function-local ones
    included, plus type-only imports (under ``if TYPE_CHECKING:``) of anything but a Protocol."""
    graph = grimp.build_graph(*PRODUCT, exclude_type_checking_imports=True, cache_dir=None)
    modules = set(graph.modules)
    assert {"skylb.core.state", "skylb.quota.gate", "controller.server"} <= modules
    imports = {m: ({*graph.find_modules_directly_imported_by(m), *_coupling_type_only_imports(graph, m)})
               & modules for m in modules}
    circles = [" -> ".join(c[:c.index("+")]) + f" (and {', '.join(c[c.index('+') + 1:])})" if "+" in c
               else " -> ".join(c) for c in find_cycles(imports)]
    assert circles == []


def test_product_holds_no_harness():
    """skylb/ holds no emulator, latency proxy or process launcher: those live in bench/ (the harness)."""
    assert not [p for p in ("emulator", "latency", "dns", "procs.py", "llamacpp.py", "local.py")
                if (ROOT / "skylb" / p).exists()]
    assert (ROOT / "bench" / "emulator" / "server.py").exists() and (ROOT / "bench" / "latency" / "server.py").exists()


def test_the_wheel_ships_no_bench_package():
    """pyproject's package list takes skylb and controller only; bench/ reaches `skylb` as entry-point plugins."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [pattern for pattern in include if pattern.startswith("bench")]
    plugins = project["project"]["entry-points"]["skylb.commands"]
    assert set(plugins) == {"emulator", "toxiproxy", "local", "replay", "bench"}

