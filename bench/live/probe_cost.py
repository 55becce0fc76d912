"""What probing costs a balancer: CPU per replica and per second, with no request to serve.

Entry point: ``.venv/bin/python -m bench.live.probe_cost [--replicas 4 16] [--intervals-ms 100 500]
[--max-backoff 1 8] [--window-s 15] [--repeats 2] [--out-md bench/results/probe_cost.md]`` (also ``skylb bench probe_cost ...``); :func:`main`
``(argv) -> int``.

Method: for each number of replicas and probe interval, one emulator process serving that many emulated vLLM
replicas and one static balancer (``--replica URL`` each, no controller, no peer) probing them; after every replica
is healthy and a settling second, the balancer's CPU time (user + system, /proc) over ``window_s`` seconds of idle
probing, and the emulator's (what the engines spend answering ``GET /metrics``). Idle on purpose: with no request
in flight every CPU second of the balancer is probing (and the timers behind it). ``--max-backoff`` is the
balancer's ``probe_backoff_max_intervals``: 1 probes every replica every interval (what a deployment pays per
replica whatever its load, and under load whenever its replicas' answers are not foreseen); 8, the default, lets
idle replicas be probed every 8 intervals (skylb/balancer/probe_backoff.py), what an idle deployment pays. Reported: balancer CPU ms per second, per replica per second and per probe
(the probes per second each replica's interval in the balancer's status gives at the end of the window); mean [min, max] over repetitions. The emulator's /metrics body is small (about
2 KB); a real vLLM's carries histograms and is larger, so its parse costs more (the probe drops other metrics'
lines before parsing, skylb/engines/base.py). Peer status probes are not in these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench.launch.procs import ProcGroup, free_port, free_ports, wait_http
from bench.reporting.provenance import provenance, provenance_line
from bench.replay.report import markdown_table

__all__ = ["measure_once", "run", "render", "main"]

RESULTS = Path(__file__).resolve().parents[1] / "results"


def measure_once(replicas: int, interval_ms: int, window_s: float, work: Path, max_backoff: int = 1) -> dict:
    """One measurement: {"balancer_ms_per_s", "per_replica_ms_per_s", "probes_per_s" (from each replica's probe
    interval in the balancer's status at the end), "per_probe_ms", "emulator_ms_per_s"}."""
    with ProcGroup(work / "logs") as procs:
        ports = free_ports(replicas)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        procs.skylb("emulator", "--engine", "vllm", "--time-scale", "0.01", "--no-request-log",
                    *(a for p in ports for a in ("--port", str(p))), name="emulator", wait_url=f"{urls[0]}/health")
        for url in urls[1:]:
            wait_http(f"{url}/health", timeout_s=10)
        config = work / "balancer.yaml"
        config.write_text(yaml.safe_dump({"balancer": {"probe_interval_ms": interval_ms,
                                                       "probe_backoff_max_intervals": max_backoff,
                                                       "state_dir": str(work / "state")}}))
        port = free_port()
        procs.skylb("balancer", "--config", str(config), "--region", "local", "--port", str(port),
                    "--engine", "vllm", *(a for u in urls for a in ("--replica", u)), name="balancer",
                    wait_url=f"http://127.0.0.1:{port}/healthz")
        status_url = f"http://127.0.0.1:{port}/skylb/v1/status?format=json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with urllib.request.urlopen(status_url, timeout=5) as resp:
                if sum(r["healthy"] for r in json.loads(resp.read())["replicas"]) == replicas:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"not every one of {replicas} replicas became healthy within 30 s")
        time.sleep(1.0)  # start-up work (imports, the first models list) is over
        b0, e0, t0 = procs.cpu_seconds("balancer"), procs.cpu_seconds("emulator"), time.monotonic()
        time.sleep(window_s)
        b1, e1, t1 = procs.cpu_seconds("balancer"), procs.cpu_seconds("emulator"), time.monotonic()
        with urllib.request.urlopen(status_url, timeout=5) as resp:
            intervals = [r["probe_interval_ms"] for r in json.loads(resp.read())["replicas"]]
    wall = t1 - t0
    balancer = 1000.0 * (b1 - b0) / wall
    probes_per_s = sum(1000.0 / ms for ms in intervals)  # each replica's interval at the end (steady when idle)
    return {"balancer_ms_per_s": balancer, "per_replica_ms_per_s": balancer / replicas, "probes_per_s": probes_per_s,
            "per_probe_ms": balancer / probes_per_s, "emulator_ms_per_s": 1000.0 * (e1 - e0) / wall}


def run(replicas: list[int], intervals_ms: list[int], window_s: float, repeats: int,
        max_backoff: list[int] = (1,)) -> list[dict]:
    """Every (replicas, interval, max backoff) cell, ``repeats`` times, interleaved (cell order within each
    repetition)."""
    cells = {(n, i, b): [] for n in replicas for i in intervals_ms for b in max_backoff}
    with tempfile.TemporaryDirectory(prefix="skylb-probe-cost-") as tmp:
        for rep in range(repeats):
            for (n, i, b), runs in cells.items():
                runs.append(measure_once(n, i, window_s, Path(tmp) / f"{n}-{i}-{b}-{rep}", max_backoff=b))
    return [{"replicas": n, "interval_ms": i, "max_backoff": b, "runs": runs} for (n, i, b), runs in cells.items()]


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def render(result: dict) -> str:
    """The Markdown report."""
    rows = [[str(c["replicas"]), str(c["interval_ms"]), str(c.get("max_backoff", 1)),
             _spread([r.get("probes_per_s", c["replicas"] * 1000 / c["interval_ms"]) for r in c["runs"]], "{:.0f}"),
             _spread([r["balancer_ms_per_s"] for r in c["runs"]], "{:.1f}"),
             _spread([r["per_replica_ms_per_s"] for r in c["runs"]]),
             _spread([r["per_probe_ms"] for r in c["runs"]], "{:.3f}"),
             _spread([r["emulator_ms_per_s"] for r in c["runs"]], "{:.1f}")] for c in result["cells"]]
    lines = ["# What probing costs a balancer (real processes, idle)", "",
             provenance_line(result["provenance"]), "",
             f"{result['window_s']:g} s measured per run, {result['repeats']} repetition(s): mean [min, max]. "
             "Method: bench/live/probe_cost.py (one static balancer, one emulator process serving the replicas, no "
             "request in flight; peer status probes not included).", "",
             markdown_table(["Replicas", "Probe interval ms", "Max backoff (intervals)", "Probes/s",
                             "Balancer CPU ms/s",
                             "Per replica ms/s", "Per probe ms", "Emulator CPU ms/s"], rows), ""]
    if result.get("notes"):
        lines += [result["notes"].rstrip(), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.live.probe_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 16], help="replicas behind the balancer")
    p.add_argument("--intervals-ms", type=int, nargs="+", default=[100, 500], help="probe intervals, ms")
    p.add_argument("--max-backoff", type=int, nargs="+", default=[1, 8],
                   help="the balancer's probe_backoff_max_intervals (1: every replica every interval)")
    p.add_argument("--window-s", type=float, default=15.0, help="seconds measured per run")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of every cell")
    p.add_argument("--out-md", default=str(RESULTS / "probe_cost.md"), help="report ('' for none; JSON beside it)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure, write the report and its JSON, print the report; returns the exit status."""
    args = build_parser().parse_args(argv)
    if (min(args.replicas) < 1 or min(args.intervals_ms) < 10 or min(args.max_backoff) < 1 or args.window_s <= 0
            or args.repeats < 1):
        print("python -m bench.live.probe_cost: replicas >= 1, intervals >= 10 ms, max backoff >= 1, a positive window "
              "and repeats >= 1",
              file=sys.stderr)
        return 2
    prov = provenance("python -m bench.live.probe_cost " + " ".join(argv if argv is not None else sys.argv[1:]))
    result = {"provenance": prov, "window_s": args.window_s, "repeats": args.repeats,
              "cells": run(args.replicas, args.intervals_ms, args.window_s, args.repeats, args.max_backoff),
              "notes": Path(args.notes).read_text() if args.notes else ""}
    text = render(result)
    if args.out_md:
        Path(args.out_md).write_text(text)
        Path(args.out_md).with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
