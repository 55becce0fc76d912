"""Scale-out: one region served by 1, 2 and 4 balancers (siblings) in front of fast emulated replicas.

Part (b) of bench/live/overhead.py's method, for several balancers at once: an open-loop stepped ramp of completions,
spread round robin over the region's balancers (as DNS answering every sibling spreads clients), each step
sustained when at most 1 % failed, its p99 stayed under 500 ms and at least 95 % of the offered rate completed.
Non-streamed (1 token) and streamed (16 tokens, SSE) ramps; each configuration ``rounds`` times in interleaved order
(1, 2, 4, 1, 2, 4, ...) so that machine noise touches all alike; figures are medians with their min-max spread, and
the balancers' CPU per request (all siblings together) beside them.

    .venv/bin/python -m bench.live.scale_out [--balancers 1 2 4] [--rounds 3] [--step-s 3] [--out-json FILE]

(also ``skylb bench scale_out``). Every process a configuration starts is stopped when it ends, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import yaml

from bench.launch.launchers import START_TIMEOUT_S, _post_json, start_emulator
from bench.live.overhead import RATES, STREAM_RATES, STREAM_TOKENS, FAST_TIME_SCALE, _open_loop_step
from bench.launch.procs import ProcGroup, free_ports

__all__ = ["start_siblings", "ramp", "scale_out", "format_text", "main"]

#: Emulated replicas of the region: enough that every balancer of the largest run owns one.
REPLICAS = 4
#: The siblings' peer token (they forward to each other), made for this run.
PEER_TOKEN = secrets.token_hex(16)


def start_siblings(procs: ProcGroup, replica_urls: Sequence[str], n: int, *, run_dir: Path) -> list[str]:
    """Start a controller and ``n`` balancers of region us (ids b1..bn) in front of ``replica_urls``; returns the
    balancers' URLs once every replica is probed healthy by its owner. RuntimeError after START_TIMEOUT_S."""
    run_dir.mkdir(parents=True, exist_ok=True)
    controller_port, *ports = free_ports(1 + n)
    config = run_dir / f"scale-{n}.yaml"
    config.write_text(yaml.safe_dump({
        "controller": {"db": str(run_dir / f"scale-{n}.sqlite")},
        "balancer": {"state_dir": str(run_dir / f"scale-{n}-state")},
        "regions": {"us": {"replicas": 0}}}))
    controller = f"http://127.0.0.1:{controller_port}"
    env = {"SKYLB_PEER_TOKEN": PEER_TOKEN}
    procs.skylb("controller", "--config", str(config), "--port", str(controller_port), name=f"scale-{n}-controller",
                wait_url=f"{controller}/healthz", env=env)
    for url in replica_urls:
        _post_json(f"{controller}/v1/replicas", {"region": "us", "url": url, "engine": "vllm"})
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for i, (port, url) in enumerate(zip(ports, urls), 1):
        procs.skylb("balancer", "--config", str(config), "--region", "us", "--port", str(port), "--controller",
                    controller, "--balancer-id", f"b{i}", name=f"scale-{n}-balancer-{i}", wait_url=f"{url}/healthz",
                    env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        headers = {"X-SkyLB-Token": PEER_TOKEN}
        healthy = sum(r["healthy"] and not r["draining"] for url in urls
                      for r in _get_json_with(f"{url}/skylb/v1/status?format=json", headers)["replicas"])
        if healthy >= len(replica_urls):
            return urls
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} balancers probed {healthy} of {len(replica_urls)} replicas healthy")
        time.sleep(0.1)


def _get_json_with(url: str, headers: dict[str, str]) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
        return json.loads(resp.read())


def ramp(targets: list[str], rates: Sequence[int], *, step_s: float, stream: bool, cpu) -> dict[str, Any]:
    """One stepped ramp over ``targets`` (round robin) until a step is not sustained; ``cpu()`` is the balancers'
    CPU seconds so far. Returns {"sustained_rps", "steps": [overhead's step figures + "cpu_ms_per_req"]}."""
    steps, sustained = [], 0
    for rate in rates:
        cpu0 = cpu()
        step = asyncio.run(_open_loop_step(targets, rate, step_s, stream=stream,
                                           max_tokens=STREAM_TOKENS if stream else 1))
        step["cpu_ms_per_req"] = (cpu() - cpu0) * 1000.0 / step["ok"] if step["ok"] else None
        steps.append(step)
        if not (step["errors"] <= 0.01 * step["sent"] and step["p99_ms"] is not None and step["p99_ms"] <= 500.0
                and step["achieved_rps"] >= 0.95 * rate):
            break
        sustained = rate
    return {"sustained_rps": sustained, "steps": steps}


def scale_out(*, balancers: Sequence[int] = (1, 2, 4), rounds: int = 3, step_s: float = 3.0,
              run_dir: Path) -> dict[str, Any]:
    """Each count of ``balancers`` ``rounds`` times, interleaved: {"runs": {n: [{"plain": ramp, "stream": ramp}]},
    "summary": {n: {kind: {"sustained_rps": [median, min, max], "p50_ms_at_sustained": ..., "cpu_ms_per_req":
    ...}}}} (latency and CPU taken at the step each run sustained last)."""
    runs: dict[int, list[dict]] = {n: [] for n in balancers}
    for r in range(rounds):
        for n in balancers:
            with ProcGroup(run_dir / f"round-{r}-{n}-logs") as procs:
                replicas = start_emulator(procs, free_ports(REPLICAS), time_scale=FAST_TIME_SCALE, max_num_seqs=1024,
                                          name=f"scale-{n}-emulator")
                targets = start_siblings(procs, replicas, n, run_dir=run_dir / f"round-{r}")
                cpu = lambda: procs.cpu_seconds(f"scale-{n}-balancer")  # noqa: E731
                result = {"plain": ramp(targets, RATES, step_s=step_s, stream=False, cpu=cpu),
                          "stream": ramp(targets, STREAM_RATES, step_s=step_s, stream=True, cpu=cpu)}
            runs[n].append(result)
            print(f"[bench.live.scale_out] round {r + 1}/{rounds}, {n} balancer(s): "
                  f"{result['plain']['sustained_rps']}/s plain, {result['stream']['sustained_rps']}/s streamed",
                  file=sys.stderr, flush=True)
    return {"runs": runs, "summary": {n: _summary(runs[n]) for n in balancers}, "rounds": rounds, "step_s": step_s,
            "replicas": REPLICAS}


def _spread(values: list[float]) -> list[float] | None:
    values = [v for v in values if v is not None]
    return [statistics.median(values), min(values), max(values)] if values else None


def _summary(results: list[dict]) -> dict[str, Any]:
    out = {}
    for kind in ("plain", "stream"):
        at = [next((s for s in r[kind]["steps"] if s["rate"] == r[kind]["sustained_rps"]), None) for r in results]
        out[kind] = {"sustained_rps": _spread([r[kind]["sustained_rps"] for r in results]),
                     "p50_ms_at_sustained": _spread([s["p50_ms"] for s in at if s]),
                     "p99_ms_at_sustained": _spread([s["p99_ms"] for s in at if s]),
                     "cpu_ms_per_req": _spread([s["cpu_ms_per_req"] for s in at if s])}
    return out


def format_text(result: dict[str, Any]) -> str:
    """The summary as a table: one line per balancer count and kind, median [min-max] of each figure."""
    def cell(v):
        return "-" if v is None else f"{v[0]:.0f} [{v[1]:.0f}-{v[2]:.0f}]" if v[0] >= 10 else \
            f"{v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}]"

    lines = [f"scale-out: {result['rounds']} rounds, {result['step_s']} s steps, {result['replicas']} fast replicas",
             "balancers | kind   | sustained req/s | p50 ms at it | p99 ms at it | balancer CPU ms/req"]
    for n, kinds in result["summary"].items():
        for kind, s in kinds.items():
            lines.append(f"{n:>9} | {kind:<6} | {cell(s['sustained_rps']):>15} | {cell(s['p50_ms_at_sustained']):>12} "
                         f"| {cell(s['p99_ms_at_sustained']):>12} | {cell(s['cpu_ms_per_req'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.live.scale_out`: run, print the table, write the JSON where ``--out-json`` says; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m bench.live.scale_out", description=__doc__.splitlines()[0])
    parser.add_argument("--balancers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=3.0)
    parser.add_argument("--run-dir", type=Path, help="logs and state (default: a new temporary directory)")
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="skylb-scale-out-"))
    result = scale_out(balancers=args.balancers, rounds=args.rounds, step_s=args.step_s, run_dir=run_dir)
    print(format_text(result))
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
