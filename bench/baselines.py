"""SkyLB beside the balancers people use instead (the baselines), on the same replicas and workload, in one run.

Entry points:

* ``.venv/bin/python -m bench.baselines [--systems NAME ...] [--out-md bench/results/baselines.md]
  [--out-json PATH]`` (``--help`` lists the knobs); :func:`main` ``(argv) -> int`` is the same thing for the
  ``skylb bench baselines`` subcommand.
* :func:`run_baselines` runs the comparison and returns its result dict; :func:`format_markdown` renders it.
* The systems are started by bench/launchers.py and the machine is watched by bench/sampling.py (both reused by
  bench/overhead.py and bench/live.py).

The systems (:data:`SYSTEMS`): SkyLB (policies ``skylb`` and ``round-robin``, one region, with its controller),
the SGLang router from PyPI (``sglang-router``; ``cache_aware`` and ``round_robin``) and HAProxy from Debian
(``balance roundrobin`` and ``balance leastconn``, HTTP mode). Each runs in front of the same emulated vLLM replicas
(one ``skylb emulator`` process, the same ports, restarted per system so every system starts with cold prefix
caches) and gets the same closed-loop multi-turn workload (bench/workload.py ``synthetic_workload``, fixed seed)
from the same client (bench/replay.py). A replica poller reads every replica's ``vllm:num_requests_waiting`` every
0.1 s to report the replicas' peak pending requests. A system whose binary is missing is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.harness import benchmark_parser, now_label, report_tail, setup_from_args, summarize
from bench.launchers import MODEL, System, Unavailable, start_emulator, start_system, unavailable_reason, versions
from bench.replay import replay
from bench.report import emit_markdown, markdown_table
from bench.sampling import BUSY_FRACTION, MachineLoad, PendingSampler
from bench.workload import WorkloadConfig, describe, synthetic_workload
from bench.procs import ProcGroup, free_ports

__all__ = ["SYSTEMS", "BaselinesSetup", "run_system", "run_baselines", "format_markdown", "build_parser", "main"]

#: The rows of the comparison, by name.
SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("skylb", "skylb", "skylb"),
    # Not the default config: at most 1 request per replica between two probes instead of 4, which matters when
    # a replica's batch is as small as the default cap (--max-num-seqs 4 here).
    System("skylb-cap1", "skylb", "skylb", {"max_dispatch_per_probe": 1}),
    System("skylb-round-robin", "skylb", "round-robin"),
    System("sglang-cache_aware", "sglang", "cache_aware"),
    System("sglang-round_robin", "sglang", "round_robin"),
    System("haproxy-roundrobin", "haproxy", "roundrobin"),
    System("haproxy-leastconn", "haproxy", "leastconn"),
)}


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class BaselinesSetup:
    """The shared setup of a baselines run (every system gets exactly this).

    Attributes:
        replicas: emulated vLLM replicas. max_num_seqs: running-batch slots per replica (requests); small, so
            requests queue and where they queue matters. time_scale: emulated durations x this (1 = an L4).
        conversations: closed-loop multi-turn conversations (clients), all in one region. turns: per conversation.
        token_scale: prompt and answer lengths x this. seed: workload seed. request_timeout_s: per request, s.
        deadline_s: bound of one system's replay, s.
    """

    replicas: int = 4
    max_num_seqs: int = 4
    time_scale: float = 1.0
    conversations: int = 32
    turns: int = 5
    token_scale: float = 0.25
    seed: int = 0
    request_timeout_s: float = 120.0
    deadline_s: float = 150.0

    def workload_config(self) -> WorkloadConfig:
        """The WorkloadConfig of the synthetic workload (one region, "us")."""
        return WorkloadConfig(trace=None, synthetic_conversations=self.conversations,
                              synthetic_turns=self.turns, token_scale=self.token_scale,
                              region_weights={"us": 1.0}, seed=self.seed, request_timeout_s=self.request_timeout_s)


async def _replay_with_sampler(requests, url: str, replica_urls: Sequence[str], setup: BaselinesSetup,
                               progress: bool | None):
    sampler = PendingSampler(replica_urls)
    sampler.start()
    try:
        result = await replay(requests, {"us": url}, model=MODEL, request_timeout_s=setup.request_timeout_s,
                              deadline_s=setup.deadline_s, progress=progress)
    finally:
        await sampler.stop()
    return result, sampler


def run_system(system: System, setup: BaselinesSetup, *, ports: Sequence[int], run_dir: Path,
               progress: bool | None = None) -> dict[str, Any]:
    """Run the workload of ``setup`` through ``system`` on fresh replicas at ``ports``; returns its row.

    Row: ``{"system", "status": "ok"|"skipped"|"failed", "reason", "figures": summarize(...) + "pending_peak"
    (per replica), "pending_peak_max", "pending_mean_total", "load": MachineLoad summary}``.
    """
    reason = unavailable_reason(system.kind)
    if reason:
        return {"system": system.name, "status": "skipped", "reason": reason}
    requests = synthetic_workload(setup.workload_config(), ["us"])
    load = MachineLoad().start()
    try:
        with ProcGroup(run_dir / system.name / "logs") as procs:
            replica_urls = start_emulator(procs, ports, time_scale=setup.time_scale,
                                          max_num_seqs=setup.max_num_seqs, name=f"{system.name}-emulator")
            url = start_system(procs, system, replica_urls, run_dir=run_dir / system.name)
            result, sampler = asyncio.run(_replay_with_sampler(requests, url, replica_urls, setup, progress))
    except (RuntimeError, Unavailable, OSError) as exc:
        return {"system": system.name, "status": "failed", "reason": str(exc)[:2000], "load": load.stop()}
    figures = summarize(result.records, result.wall_s)
    figures["pending_peak"] = sampler.peak
    figures["pending_peak_max"] = max(sampler.peak, default=0)
    figures["pending_mean_total"] = sampler.mean_total
    return {"system": system.name, "status": "ok", "figures": figures, "load": load.stop()}


def run_baselines(systems: Sequence[str] | None = None, *, setup: BaselinesSetup | None = None,
                  run_dir: Path | None = None, progress: bool | None = None,
                  seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Run every system in ``systems`` (names of :data:`SYSTEMS`; default all) one after the other, once per seed
    of ``seeds`` (default: ``setup.seed`` only; systems interleaved within each seed, so a slow spell of the
    machine does not fall on one system's runs).

    Returns ``{"setup": asdict(setup), "workload": one-line description, "versions": {...}, "rows": [row...],
    "seeds", "wall_s", "load": MachineLoad summary of the whole run}`` (rows: :func:`run_system`, each with its
    ``seed``).
    """
    setup = setup or BaselinesSetup()
    seeds = list(seeds) if seeds else [setup.seed]
    names = list(systems or SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="baselines-"))
    ports = free_ports(setup.replicas)
    load = MachineLoad().start()
    t0 = time.monotonic()
    rows = []
    for seed in seeds:
        seeded = dataclasses.replace(setup, seed=seed)
        for name in names:
            print(f"[bench.baselines] {name} seed {seed} ...", file=sys.stderr, flush=True)
            row = run_system(SYSTEMS[name], seeded, ports=ports, run_dir=run_dir / f"seed{seed}", progress=progress)
            row["seed"] = seed
            rows.append(row)
            print(f"[bench.baselines] {name} seed {seed}: {row['status']} {row.get('reason', '')}".rstrip(),
                  file=sys.stderr, flush=True)
    requests = synthetic_workload(setup.workload_config(), ["us"])
    return {
        "setup": setup.__dict__.copy(), "workload": describe(requests), "versions": versions(),
        "rows": rows, "seeds": seeds, "wall_s": time.monotonic() - t0, "load": load.stop(), "run_dir": str(run_dir),
        "generated": now_label(),
    }


def _spread(values: Sequence[float], fmt: str) -> str:
    """``mean [min, max]`` of ``values`` with ``fmt``; the value alone for one run."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per system over its ok runs (seeds): ``{"system", "runs", "rps", "ttft_p90", "ttft_p50", "hit",
    "pending_peak_max", "first_rps", "first_p90"}``: lists of per-run values, the largest peak pending of any
    run, and in how many seeds the system was first on throughput and on P90 TTFT among the systems that ran."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    out: dict[str, dict[str, Any]] = {}
    for r in ok:
        f = r["figures"]
        s = out.setdefault(r["system"], {"system": r["system"], "runs": 0, "rps": [], "ttft_p90": [], "ttft_p50": [],
                                         "hit": [], "pending_peak_max": 0, "first_rps": 0, "first_p90": 0})
        s["runs"] += 1
        s["rps"].append(f["throughput_rps"])
        s["ttft_p90"].append(f["ttft_p90_ms"])
        s["ttft_p50"].append(f["ttft_p50_ms"])
        s["hit"].append(100 * (f["prefix_hit_rate"] or 0.0))
        s["pending_peak_max"] = max(s["pending_peak_max"], f["pending_peak_max"])
    for seed in result.get("seeds") or [None]:
        runs = [r for r in ok if r.get("seed") == seed]
        if runs:
            out[max(runs, key=lambda r: r["figures"]["throughput_rps"])["system"]]["first_rps"] += 1
            out[min(runs, key=lambda r: r["figures"]["ttft_p90_ms"])["system"]]["first_p90"] += 1
    return list(out.values())


# ----------------------------------------------------------------------------------------------------- report


def _f(value, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _row(row: dict[str, Any]) -> list[str]:
    """One system's cells of the report table; a row that did not run says why in its third cell."""
    if row["status"] != "ok":
        reason = (row.get("reason") or "").splitlines()[0][:160].replace("|", "/")
        return [row["system"], str(row.get("seed", "")), f"{row['status']}: {reason}"]
    f = row["figures"]
    return [row["system"], str(row.get("seed", "")), f"{f['completed']}/{f['sent']}", _f(f["throughput_rps"], "{:.2f}"),
            _f(f["output_tokens_per_s"]), _f(f["ttft_mean_ms"]), _f(f["ttft_p50_ms"]), _f(f["ttft_p90_ms"]),
            _f(f["e2e_p50_ms"]), _f(f["e2e_p90_ms"]),
            _f(f["prefix_hit_rate"] and 100 * f["prefix_hit_rate"], "{:.1f}%"),
            f"{f['pending_peak_max']} ({'/'.join(map(str, f['pending_peak']))})", f"{f['pending_mean_total']:.1f}"]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The result as the Markdown report bench/results/baselines.md (table, setup, conditions); ``notes``
    (Markdown written after looking at the figures) is appended as is."""
    s = result["setup"]
    seeds = result.get("seeds") or [s["seed"]]
    summary = summary_rows(result)
    lines = [
        f"# SkyLB beside the SGLang router and HAProxy (live, {len(seeds)} run{'s' if len(seeds) > 1 else ''})",
        "",
        f"Generated by `python -m bench.baselines` on {result.get('generated') or now_label()}; "
        f"whole run {result['wall_s']:.0f} s; workload seeds {', '.join(map(str, seeds))}. Versions: sglang-router "
        f"{result['versions']['sglang-router']}, {result['versions']['haproxy']}, Python "
        f"{result['versions']['python']}.",
        "",
        "Over the runs (mean [min, max]; first: in how many runs the system had the highest req/s, the lowest "
        "TTFT p90):",
        "",
        markdown_table(["system", "runs", "req/s", "TTFT p50", "TTFT p90", "prefix hit %",
                        "peak pending (max of any run)", "first on req/s", "first on TTFT p90"],
                       [[x["system"], x["runs"], _spread(x["rps"], "{:.2f}"), _spread(x["ttft_p50"], "{:.0f}"),
                         _spread(x["ttft_p90"], "{:.0f}"), _spread(x["hit"], "{:.1f}"), x["pending_peak_max"],
                         x["first_rps"], x["first_p90"]] for x in summary]),
        "",
        "Each run:",
        "",
        markdown_table(["system", "seed", "ok/sent", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p90", "E2E p50",
                        "E2E p90", "prefix hit", "peak pending (max; per replica)", "mean pending (sum)"],
                       [_row(row) for row in result["rows"]]),
    ]
    lines += ["", "Latencies in ms, measured at the client (TTFT: to the first SSE chunk with text). "
              "Throughput: completed requests (output tokens) per second of the replay's wall time. "
              "Prefix hit: cached prompt tokens / prompt tokens, as the replicas report them in `usage`. "
              "Pending: `vllm:num_requests_waiting` polled on every replica every 0.1 s.", ""]
    lines += ["## Setup", "",
              f"- Replicas: {s['replicas']} emulated vLLM replicas (`skylb emulator`, one process), "
              f"`--max-num-seqs {s['max_num_seqs']}`, `--time-scale {s['time_scale']:g}` (Llama-3.1-8B on an L4 "
              f"x {s['time_scale']:g}), restarted on the same ports before each system so that every system starts "
              "with cold prefix caches.",
              f"- Workload: {result['workload']}; closed loop (a turn is sent 0.2-1.0 s after the previous turn of "
              f"its conversation completed), `token_scale {s['token_scale']:g}`, seed {s['seed']}; every turn "
              "extends the previous turn's prompt, and all conversations share a system prompt.",
              "- Client: bench/replay.py (aiohttp, streamed `/v1/completions`, `ignore_eos`), one process.",
              "- SkyLB: controller + one balancer (region `us`) with the default config (policy `skylb`, probe "
              "every 100 ms, selective pushing: a replica is available while its last probe showed 0 pending "
              "requests and this balancer's prompts not yet prefilled there stay under 2048 tokens, a finished "
              "request frees its place at once, and at most `max_dispatch_per_probe` = 4 requests go to a replica "
              "between two probes), replicas registered through the controller. `skylb-cap1` is the same with "
              "`max_dispatch_per_probe 1` (not the default).",
              "- SGLang router: `python -m sglang_router.launch_router --host 127.0.0.1 --worker-urls ... "
              "--policy P --prometheus-host 127.0.0.1 --prometheus-port FREE`, defaults otherwise (cache_aware: "
              "route to the worker with the longest prefix match when it covers >= 30% of the prompt, else to the "
              "smallest tree; switch to least load only when max - min load > 64 and max > 1.5 x min).",
              "- HAProxy: generated config, `mode http`, `balance roundrobin|leastconn`, no health checks, "
              "client/server timeouts 600 s, `option http-no-delay` (without it HAProxy sends with MSG_MORE and "
              "the kernel holds small SSE chunks up to 200 ms: TTFT p50 203 ms instead of 13 ms in a trial run).",
              ""]
    lines += _observations(result)
    lines += report_tail(result, "every process of the run (client, emulator, balancer) shares them", notes)
    return "\n".join(lines)


def _observations(result: dict[str, Any]) -> list[str]:
    """Automatic remarks on the rows: requests piled on one replica, rows measured while the machine was busy."""
    out = []
    for row in result["rows"]:
        if row["status"] != "ok":
            continue
        peaks = row["figures"]["pending_peak"]
        idle = [i for i, p in enumerate(peaks) if p == 0]
        if idle and max(peaks) > 0:
            out.append(f"- {row['system']}: requests queued on replica(s) "
                       f"{', '.join(str(i) for i, p in enumerate(peaks) if p > 0)} while replica(s) "
                       f"{', '.join(map(str, idle))} never had a pending request (peaks {peaks}).")
        frac = row["load"]["others_cpu_frac"]
        if frac > BUSY_FRACTION:
            out.append(f"- {row['system']}: measured while other processes used {100 * frac:.0f}% of the machine "
                       f"({', '.join(row['load']['top_others'])}); its timings are pessimistic.")
    return (["## Observations (automatic)", "", *out, ""]) if out else []


# -------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.baselines`."""
    p = benchmark_parser("python -m bench.baselines", __doc__.splitlines()[0], systems=SYSTEMS,
                         defaults=BaselinesSetup(), out_md="bench/results/baselines.md")
    p.add_argument("--seeds", type=_seed_list, default=None, metavar="N,N,...",
                   help="run every system once per workload seed (default: --seed only); the report gives each "
                        "figure's mean with [min, max] and how often each system came first")
    return p


def _seed_list(text: str) -> list[int]:
    """``--seeds``: comma-separated integers (argparse.ArgumentTypeError otherwise)."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds needs at least one seed")
    return seeds


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the report; 0 when every system that could run completed all requests."""
    args = build_parser().parse_args(argv)
    setup = setup_from_args(BaselinesSetup, args)
    result = run_baselines(args.systems, setup=setup, run_dir=Path(args.run_dir) if args.run_dir else None,
                           progress=False if args.no_progress else None, seeds=args.seeds)
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    emit_markdown(text, result, out_md=args.out_md, out_json=args.out_json)
    bad = [r for r in result["rows"] if r["status"] == "failed"
           or (r["status"] == "ok" and r["figures"]["failed"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
