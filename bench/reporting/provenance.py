"""Where a benchmark figure came from: the commit, the date, the command and the machine, for every report.

A figure without its provenance cannot be compared with a later one (was it the same code? the same machine? a
quieter one?), so every report in bench/results/ records the dict :func:`provenance` returns, in its JSON
(``"provenance"``) and as one line of its Markdown (:func:`provenance_line`). bench/replay/report.py ``emit_markdown``
adds both to the reports that go through it; the simulated suite (bench/bench_cli.py) adds them itself.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "git_commit", "provenance", "provenance_line"]

#: The checkout the benchmarks run from (bench/ lives at its top level).
ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit as a short hash, with ``+dirty`` when tracked files differ from it; ``"unknown"``
    outside a git checkout (an unpacked source archive) or without git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor() (may be empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def provenance(command: str | None = None, *, now: _dt.datetime | None = None) -> dict[str, Any]:
    """``{"commit", "date", "command", "machine": {"cores", "cpu", "memory_gib", "python", "system"}}``.

    ``command``: what reproduces the report (default: this process's command line, ``python -m`` form when run
    as a module). ``date``: ISO 8601 in UTC, to the second. ``cores``: ``os.cpu_count()``; ``memory_gib``: total
    memory, GiB (None where /proc/meminfo is missing).
    """
    if command is None:
        argv = list(sys.argv)
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        head = ["python", "-m", spec.name] if spec is not None and spec.name else [Path(argv[0]).name]
        command = shlex.join(head + argv[1:])
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 2 ** 20, 1)  # kB -> GiB
                break
    except (OSError, ValueError, IndexError):
        pass
    when = (now or _dt.datetime.now(_dt.timezone.utc)).astimezone(_dt.timezone.utc)
    return {
        "commit": git_commit(),
        "date": when.replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "command": command,
        "machine": {"cores": os.cpu_count(), "cpu": _cpu_model(), "memory_gib": memory,
                    "python": platform.python_version(), "system": f"{platform.system()} {platform.machine()}"},
    }


def provenance_line(p: dict[str, Any]) -> str:
    """One Markdown line for a report: "Commit ..., date ..., command ..., machine ..." from :func:`provenance`."""
    m = p.get("machine", {})
    memory = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    cpu = f" ({m['cpu']})" if m.get("cpu") else ""
    return (f"Provenance: commit `{p.get('commit')}`, {p.get('date')}, `{p.get('command')}`, on {m.get('cores')} "
            f"cores{cpu}{memory}, Python {m.get('python')}.")
