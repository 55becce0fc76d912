"""No function in the product packages (skylb/, controller/) is over MAX_LINES lines, argument-parser builders aside.

A long function hides its steps; split it into well-named helpers. Parser builders are exempt: they are flat lists of
``add_argument`` calls, one option each, and splitting them only scatters the command line's documentation.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("skylb", "controller")
MAX_LINES = 80

def is_parser_builder(name: str) -> bool:
    """Argument-parser builders: ``add_arguments``, ``build_parser`` and any ``*_parser``."""
    return name in ("add_arguments", "build_parser") or name.endswith("_parser")


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """Every function (sync or async, methods and nested ones included) over MAX_LINES lines in PACKAGES, as
    "path:qualified.name" -> its length in lines (``def`` line to last line; decorators not counted)."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            rel = path.relative_to(root).as_posix()
            for qualname, node in _functions(tree, ""):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES and not is_parser_builder(node.name):
                    found[f"{rel}:{qualname}"] = length
    return found


def _functions(node: ast.AST, prefix: str):
    """(qualified name, node) for every function under ``node``, classes and enclosing functions in the name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            yield name, child
            yield from _functions(child, f"{name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def test_no_function_over_max_lines():
    too_long = long_functions()
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into named helpers): "
                          + ", ".join(f"{key} ({n} lines)" for key, n in sorted(too_long.items())))


def test_detects_a_long_function_and_exempts_parser_builders(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "skylb").mkdir()
    (tmp_path / "controller").mkdir()
    (tmp_path / "skylb" / "m.py").write_text(
        f"class C:\n    def long(self):\n{body.replace('    ', '        ')}\n\n"
        f"def build_parser():\n{body}\n\ndef cli_parser():\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path) == {"skylb/m.py:C.long": MAX_LINES + 1}
