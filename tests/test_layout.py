"""The folder layout's one rule between product and benchmarks: the product never imports bench/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("skylb", "controller")


def _bench_imports(path: Path) -> list[str]:
    """The ``import bench...`` / ``from bench... import`` statements of one module, as "file:line module"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                  if n == "bench" or n.startswith("bench.")]
    return found


def test_product_never_imports_bench():
    """No module under skylb/ or controller/ imports bench/ (skylb/cli.py names demo and benchmark modules as
    strings, imported only when their subcommand runs)."""
    modules = [p for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 20
    assert [hit for path in modules for hit in _bench_imports(path)] == []


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
