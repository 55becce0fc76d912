"""Compare two results.json files of `skylb bench all` field by field, run-time fields aside.

`python -m bench.sim.compare_results A/results.json B/results.json` walks both files' ``results`` and ``runs`` and
prints how many leaf fields it compared and every one that differs (path, both values); exit status 0 when none
differs, 1 otherwise. Fields whose name says when or how long a run took (``wall``, ``elapsed``, ``generated``,
``date``, ``commit``) are skipped: the simulated figures are deterministic for a seed (with ``PYTHONHASHSEED``
fixed), the wall time is not. Use it to show a change left routing untouched: two runs of the old commit agree,
then the old and the new.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["compare", "main", "SKIPPED_KEYS"]

#: Substrings of the keys left out of the comparison (run time, provenance).
SKIPPED_KEYS = ("wall", "elapsed", "generated", "date", "commit")


def compare(a: Any, b: Any, path: str = "") -> tuple[int, list[str]]:
    """(leaf fields compared, differences as "path: a vs b") between two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        count, diffs = 0, []
        for key in sorted(set(a) | set(b)):
            if any(word in key for word in SKIPPED_KEYS):
                continue
            if key not in a or key not in b:
                diffs.append(f"{path}/{key}: only in {'the second' if key not in a else 'the first'}")
                continue
            n, d = compare(a[key], b[key], f"{path}/{key}")
            count, diffs = count + n, diffs + d
        return count, diffs
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return 1, [f"{path}: {len(a)} items vs {len(b)}"]
        count, diffs = 0, []
        for i, (x, y) in enumerate(zip(a, b)):
            n, d = compare(x, y, f"{path}[{i}]")
            count, diffs = count + n, diffs + d
        return count, diffs
    return 1, ([] if a == b else [f"{path}: {str(a)[:80]} vs {str(b)[:80]}"])


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of two results.json files; 0 when they agree."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.compare_results", description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    args = p.parse_args(argv)
    a, b = (json.loads(path.read_text()) for path in (args.first, args.second))
    count, diffs = compare({k: a.get(k) for k in ("results", "runs")}, {k: b.get(k) for k in ("results", "runs")})
    print(f"{count} leaf fields compared; {len(diffs)} differ")
    for line in diffs[:50]:
        print("  " + line)
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
