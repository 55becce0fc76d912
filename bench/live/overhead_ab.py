"""Added latency of this checkout's balancer beside another checkout's (an earlier commit), interleaved.

`python -m bench.live.overhead_ab --baseline PATH [--rounds 3] [--n 500]` runs bench/live/overhead.py's part (a) ``rounds``
times: each round starts one emulated replica, this checkout's SkyLB (``skylb``) and the other checkout's
(``skylb@<commit>``), both in their default configuration, and sends ``n`` small non-streamed completions to the
replica directly and through each balancer, request i to every system in turn (random order), so machine load hits
both alike. It prints, per round and over the rounds (median, [min, max]), each balancer's added p50 and p99 (ms,
its percentile minus the direct one's) and the difference between the two, and writes a Markdown report with the
commits, date, command and machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.live.harness import now_label
from bench.live.overhead import added_latency
from bench.replay.report import emit_markdown, markdown_table
from bench.replay.sampling import conditions_lines

__all__ = ["main", "run_ab"]

ROOT = Path(__file__).resolve().parents[2]


def _commit(path: Path) -> str:
    return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip() or "unknown"


def run_ab(baseline: Path, *, rounds: int, n: int, run_dir: Path) -> dict:
    """``rounds`` interleaved part-(a) runs; returns {"commit", "baseline", "rounds": [part (a) results]}."""
    name = f"skylb@{_commit(baseline)}"
    results = [added_latency(n=n, systems=("direct", "skylb"), floor=False, run_dir=run_dir / f"round-{i}",
                             checkouts={name: baseline}) for i in range(rounds)]
    return {"commit": _commit(ROOT), "baseline": name, "rounds": results}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def format_report(result: dict, command: str) -> str:
    """The Markdown report of :func:`run_ab`."""
    base, rounds = result["baseline"], result["rounds"]
    rows = []
    for i, r in enumerate(rounds):
        s = r["systems"]
        rows.append([i, f"{s['direct']['p50_ms']:.3f}", f"{s['skylb']['added_p50_ms']:.3f}",
                     f"{s[base]['added_p50_ms']:.3f}", f"{s['skylb']['added_p99_ms']:.3f}",
                     f"{s[base]['added_p99_ms']:.3f}", s["skylb"]["errors"] + s[base]["errors"]])
    diff50 = [r["systems"]["skylb"]["added_p50_ms"] - r["systems"][base]["added_p50_ms"] for r in rounds]
    diff99 = [r["systems"]["skylb"]["added_p99_ms"] - r["systems"][base]["added_p99_ms"] for r in rounds]
    lines = [f"# Added latency: skylb@{result['commit']} beside {base}", "",
             f"Command: `{command}`; generated {now_label()}.", "",
             *conditions_lines(rounds[0]["load"], [(f"round {i}", r["load"]) for i, r in enumerate(rounds)],
                               "shared with other engineers' work"),
             markdown_table(["round", "direct p50 ms", f"skylb@{result['commit']} added p50", f"{base} added p50",
                             f"skylb@{result['commit']} added p99", f"{base} added p99", "errors"], rows), "",
             f"Over {len(rounds)} rounds, median [min, max], ms: added p50 this commit "
             f"{_spread([r['systems']['skylb']['added_p50_ms'] for r in rounds])}, {base} "
             f"{_spread([r['systems'][base]['added_p50_ms'] for r in rounds])}; difference (this minus {base}) "
             f"p50 {_spread(diff50)}, p99 {_spread(diff99)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the report; 0 when every round ran."""
    p = argparse.ArgumentParser(prog="python -m bench.live.overhead_ab", description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="another SkyLB checkout (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs (default 3)")
    p.add_argument("--n", type=int, default=500, help="requests per system per round (default 500)")
    p.add_argument("--out-md", default="bench/results/overhead_ab.md", help="Markdown report ('' for none)")
    args = p.parse_args(argv)
    result = run_ab(args.baseline.resolve(), rounds=args.rounds, n=args.n,
                    run_dir=Path(tempfile.mkdtemp(prefix="overhead-ab-")))
    command = "python -m bench.live.overhead_ab " + " ".join(argv if argv is not None else sys.argv[1:])
    text = format_report(result, command)
    emit_markdown(text, result, out_md=args.out_md, out_json=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
