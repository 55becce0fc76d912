"""What the live benchmark CLIs (bench/live/baselines.py, bench/live/regions.py) share: their flags, the figures of one replay,
and the end of their reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.replay.report import RequestRecord, build_report, percentile
from bench.replay.sampling import conditions_lines
from bench.reporting.provenance import provenance

__all__ = ["SETUP_FLAGS", "benchmark_parser", "setup_from_args", "summarize", "now_label", "report_tail"]

#: The setup fields the live benchmark CLIs (bench.live.baselines, bench.live.regions) take as flags: BaselinesSetup and
#: LiveSetup both have them.
SETUP_FLAGS = ("replicas", "max_num_seqs", "time_scale", "conversations", "turns", "token_scale", "seed")


def benchmark_parser(prog: str, description: str, *, systems, defaults, out_md: str,
                     helps: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags shared by the live benchmark CLIs: ``--systems``, one flag per :data:`SETUP_FLAGS` field (its
    default from ``defaults``, a setup dataclass), and the report paths (``--out-md`` defaults to ``out_md``).
    ``helps``: help texts by flag (a setup field's name, or ``"systems"``)."""
    helps = helps or {}
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--systems", nargs="+", choices=list(systems),
                   help=helps.get("systems", "systems to run (default: all)"))
    for name in SETUP_FLAGS:
        default = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=helps.get(name))
    p.add_argument("--out-md", default=out_md, help="Markdown report ('' for none)")
    p.add_argument("--out-json", default=None,
                   help="the raw result as JSON here (default: beside the Markdown report, .json for .md)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report (analysis)")
    p.add_argument("--run-dir", default=None, help="logs and state (default: a new temporary directory)")
    p.add_argument("--no-progress", action="store_true")
    return p


def setup_from_args(cls, args: argparse.Namespace):
    """A ``cls`` setup (BaselinesSetup, LiveSetup) from the :data:`SETUP_FLAGS` of parsed ``args``."""
    return cls(**{name: getattr(args, name) for name in SETUP_FLAGS})


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The figures of one system's replay: build_report's totals plus the TTFT mean (ms)."""
    total = build_report(records, wall_s)["total"]
    ttft = [r.ttft_ms for r in records if r.ok and r.ttft_ms is not None]
    total["ttft_mean_ms"] = sum(ttft) / len(ttft) if ttft else None
    total["ttft_p99_ms"] = percentile(ttft, 99)
    total["wall_s"] = wall_s
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:160]] = errors.get(r.error[:160], 0) + 1
    total["errors"] = errors
    return total


def now_label() -> str:
    """The local time, for a report's "generated on" line."""
    return time.strftime("%Y-%m-%d %H:%M %Z")


def report_tail(result: dict[str, Any], sharing: str, notes: str) -> list[str]:
    """The end of a live benchmark report: the Conditions section (``sharing``: what shares the machine), the
    errors of rows that ran, then the hand-written ``notes`` (Markdown) as they are. A row's window is labelled with
    its system and, when it has one, its seed."""
    rows = result["rows"]
    windows = [(r["system"] + (f" seed {r['seed']}" if "seed" in r else ""), r["load"]) for r in rows if r.get("load")]
    lines = conditions_lines(result["load"], windows, sharing)
    errors = {r["system"]: r["figures"]["errors"] for r in rows if r["status"] == "ok" and r["figures"]["errors"]}
    if errors:
        lines += ["## Errors", ""] + [f"- {k}: {v}" for k, v in errors.items()] + [""]
    if notes:
        lines += [notes.rstrip(), ""]
    return lines


def write_result(result: dict[str, Any], out_md: Path, *, module: str, argv: list[str] | None, started: float,
                 render: Callable[[dict[str, Any]], str]) -> None:
    """Record in ``result`` its provenance (the command ``python -m module`` with ``argv``, else this process's
    arguments) and its wall time since ``started`` (time.time(), s), then write it as JSON beside the Markdown report
    ``out_md`` that ``render`` makes of it (folders created)."""
    command = f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])
    result["provenance"] = provenance(command.strip())
    result["wall_s"] = round(time.time() - started, 1)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out_md.write_text(render(result))
