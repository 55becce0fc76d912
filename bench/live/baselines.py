"""SkyLB beside the balancers people use instead, each tuned as operators deploy it, on the same replicas and requests.

The baselines run in paired runs: every system replays the same requests in a run.

Entry points:

* ``.venv/bin/python -m bench.live.baselines [--systems NAME ...] [--seeds N,N,...] [--out-md
  bench/results/baselines.md] [--out-json PATH]`` (``--help`` lists the knobs); :func:`main` ``(argv) -> int`` is
  the same thing for the ``skylb bench baselines`` subcommand. The JSON result goes beside the Markdown report
  (``.json`` for ``.md``) unless ``--out-json`` says otherwise; bench/reporting/glance.py quotes it in the README.
* :func:`run_baselines` runs the comparison and returns its result dict; :func:`format_markdown` renders it;
  :func:`summary_rows` and :func:`acceptance` are the figures over the runs and the targets they are judged on.
* The systems are started by bench/launch/launchers.py and the machine is watched by bench/replay/sampling.py (both reused by
  bench/live/overhead.py and bench/live/regions.py).

The systems (:data:`SYSTEMS`; a default run is :data:`DEFAULT_SYSTEMS`): SkyLB (policies ``skylb``, the default
configuration, and ``skylb-ch``, one region, with its controller), the SGLang router from PyPI (``sglang-router``;
``cache_aware`` with its balance thresholds sized for the cluster, and ``round_robin``) and HAProxy from Debian
(``leastconn`` with a per-server ``maxconn`` of one engine batch, and consistent hashing with bounded loads on the
client's session header), each configured by :func:`configured` for the run's cluster. Each runs in front of the
same emulated vLLM replicas (one ``skylb emulator`` process, the same ports, restarted per system so every system
starts with cold prefix caches) and gets the same closed-loop multi-turn workload (bench/replay/workload.py
``synthetic_workload``, one seed per paired run) from the same client (bench/replay/run.py). A replica poller reads
every replica's ``vllm:num_requests_waiting`` every 0.1 s to report the replicas' peak pending requests, and the
system's own processes' CPU time (/proc, bench/launch/procs.py) over the replay gives its CPU time per request. A system
whose binary is missing is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.live.harness import benchmark_parser, now_label, report_tail, setup_from_args, summarize
from bench.launch.launchers import MODEL, System, Unavailable, start_emulator, start_system, unavailable_reason, versions
from bench.replay.run import SESSION_HEADER, replay
from bench.replay.report import emit_markdown, markdown_table
from bench.replay.sampling import BUSY_FRACTION, MachineLoad, PendingSampler
from bench.replay.workload import WorkloadConfig, describe, synthetic_workload
from bench.launch.procs import ProcGroup, free_ports

__all__ = ["SYSTEMS", "DEFAULT_SYSTEMS", "DEFAULT_SEEDS", "BaselinesSetup", "configured", "run_system",
           "run_baselines", "summary_rows", "acceptance", "format_markdown", "build_parser", "main"]

# ------------------------------------------------------------------------------------------------- the systems

#: HAProxy ``hash-balance-factor`` (percent of the average number of requests in flight a server may carry before
#: the hash moves on to the next server on the ring). The HAProxy Configuration Manual ("hash-balance-factor")
#: calls 125 to 200 reasonable; 125 is the tightest of them, chosen because with a batch of 4 a replica only a
#: little over the average already queues.
HASH_BALANCE_FACTOR = 125
#: SGLang router ``--cache-threshold`` (0-1), its default: a conversation's later turns match about half or more
#: of their prompt on the replica that served the earlier ones, so they stay there; a new conversation matches the
#: shared system prompt on every replica that saw it (most of a first turn), so no cache threshold spreads new
#: conversations here: the balance thresholds do.
SGLANG_CACHE_THRESHOLD = 0.3
#: SGLang router ``--balance-rel-threshold``: balance when the busiest replica carries more than this times the
#: least busy one's in-flight requests; 1.25 allows the same 25% over as HAProxy's bounded loads above.
SGLANG_BALANCE_REL_THRESHOLD = 1.25

#: The rows of the comparison, by name. :func:`configured` adds the options sized for a run's cluster.
SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("skylb", "skylb", "skylb"),
    System("skylb-ch", "skylb", "skylb-ch"),
    System("sglang-cache_aware", "sglang", "cache_aware"),
    System("sglang-round_robin", "sglang", "round_robin"),
    System("haproxy-leastconn", "haproxy", "leastconn"),
    System("haproxy-hash", "haproxy", f"hdr({SESSION_HEADER})",
           options={"hash_header": SESSION_HEADER, "hash_balance_factor": HASH_BALANCE_FACTOR}),
    # Selectable, not in a default run:
    # at most 1 request per replica between two probes instead of 4 (not SkyLB's default configuration).
    System("skylb-cap1", "skylb", "skylb", {"max_dispatch_per_probe": 1}),
    # The default configuration with each replica's batch stated (`skylb-ctl replica add --max-concurrency`, sized
    # by SIZED_OPTIONS as HAProxy's maxconn is) instead of learned from its probes.
    System("skylb-stated-batch", "skylb", "skylb"),
    System("skylb-round-robin", "skylb", "round-robin"),
    # Two balancers of the region (siblings) in front of the same replicas, each request to one of them by a hash
    # of its id, so a conversation's turns land on both: the default configuration otherwise.
    System("skylb-siblings", "skylb", "skylb", options={"balancers": 2}),
    # the router's defaults (thresholds 0.3, 64, 1.5), as in the earlier reports.
    System("sglang-cache_aware-defaults", "sglang", "cache_aware"),
    System("haproxy-roundrobin", "haproxy", "roundrobin"),
)}
#: The systems of a default run: SkyLB's default configuration and its hash ring, and each baseline as operators
#: deploy it.
DEFAULT_SYSTEMS = ("skylb", "skylb-ch", "sglang-cache_aware", "sglang-round_robin", "haproxy-leastconn",
                   "haproxy-hash")
#: The workload seeds of a default run: five paired runs (every system runs each seed, seed by seed).
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class BaselinesSetup:
    """The shared setup of a baselines run (every system gets exactly this).

    Attributes:
        replicas: emulated vLLM replicas. max_num_seqs: running-batch slots per replica (requests); small, so
            requests queue and where they queue matters (a burst of a few requests fills a batch).
        time_scale: emulated durations x this (1 = Llama-3.1-8B on an L4; 0.5 = a replica twice as fast, so that a
            run of 512 requests takes about 45 s per system and 6 systems x 5 paired runs fit in about 30 minutes
            on a 2-core machine: measured 11.3 req/s for SkyLB on 4 replicas x batch 4).
        conversations: closed-loop multi-turn conversations (clients), all in one region; 32 against 16 batch
            slots keeps about two requests per slot. turns: per conversation; 16, so a run has 512 requests.
        token_scale: prompt and answer lengths x this. seed: workload seed. request_timeout_s: per request, s.
        deadline_s: bound of one system's replay, s.
    """

    replicas: int = 4
    max_num_seqs: int = 4
    time_scale: float = 0.5
    conversations: int = 32
    turns: int = 16
    token_scale: float = 0.25
    seed: int = 0
    request_timeout_s: float = 120.0
    deadline_s: float = 300.0

    def workload_config(self) -> WorkloadConfig:
        """The WorkloadConfig of the synthetic workload (one region, "us")."""
        return WorkloadConfig(trace=None, synthetic_conversations=self.conversations,
                              synthetic_turns=self.turns, token_scale=self.token_scale,
                              region_weights={"us": 1.0}, seed=self.seed, request_timeout_s=self.request_timeout_s)


def _sglang_thresholds(setup: BaselinesSetup) -> dict[str, Any]:
    """cache_aware's thresholds for ``setup``'s cluster. The router's load of a worker is its own count of requests
    in flight there; it routes to the least loaded worker when max - min > abs and max > rel x min, else by prefix
    match. Its defaults (64, 1.5) need 65 more requests on one replica than on another, which 4 replicas x batch 4
    with 32 conversations never reach: every request then followed the shared system prompt to one replica. Half
    a batch (2 here) of difference is already a replica queueing while another has room or a shorter queue."""
    return {"cache_threshold": SGLANG_CACHE_THRESHOLD, "balance_abs_threshold": max(1, setup.max_num_seqs // 2),
            "balance_rel_threshold": SGLANG_BALANCE_REL_THRESHOLD}


def _haproxy_queueing(setup: BaselinesSetup) -> dict[str, Any]:
    """leastconn's queueing for ``setup``'s cluster: ``maxconn`` = the engine's batch (``--max-num-seqs``), so a
    replica gets no more requests than it runs at once and the rest wait in HAProxy's queue for the first free
    server (HAProxy Configuration Manual, server option "maxconn"); ``timeout queue`` = the client's request
    timeout, so HAProxy drops no request the client still waits for (unset, it is ``timeout connect``, 5 s)."""
    return {"maxconn": setup.max_num_seqs, "timeout_queue_s": setup.request_timeout_s}


def _stated_batch(setup: BaselinesSetup) -> dict[str, Any]:
    """The replicas' batch (``--max-num-seqs``) stated to SkyLB, the figure HAProxy's ``maxconn`` gets."""
    return {"max_concurrency": setup.max_num_seqs}


#: System name -> the launcher options sized for a setup's cluster (added by :func:`configured`).
SIZED_OPTIONS: dict[str, Callable[[BaselinesSetup], dict[str, Any]]] = {
    "sglang-cache_aware": _sglang_thresholds,
    "haproxy-leastconn": _haproxy_queueing,
    "skylb-stated-batch": _stated_batch,
}


def configured(system: System, setup: BaselinesSetup) -> System:
    """``system`` with the launcher options sized for ``setup``'s cluster (:data:`SIZED_OPTIONS`), if any."""
    sized = SIZED_OPTIONS.get(system.name)
    return dataclasses.replace(system, options={**system.options, **sized(setup)}) if sized else system


async def _replay_with_sampler(requests, url: str | list[str], replica_urls: Sequence[str], setup: BaselinesSetup,
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
    """Run the workload of ``setup`` through ``system`` (as :func:`configured` for ``setup``) on fresh replicas at
    ``ports``; returns its row.

    Row: ``{"system", "status": "ok"|"skipped"|"failed", "reason", "figures": summarize(...) + "pending_peak"
    (per replica), "pending_peak_max", "pending_mean_total", "cpu_s" (CPU seconds of the system's own processes
    over the replay: SkyLB's controller and balancer, the SGLang router, HAProxy), "cpu_ms_per_request" (cpu_s per
    completed request, ms), "load": MachineLoad summary}``.
    """
    reason = unavailable_reason(system.kind)
    if reason:
        return {"system": system.name, "status": "skipped", "reason": reason}
    requests = synthetic_workload(setup.workload_config(), ["us"])
    load = MachineLoad().start()
    try:
        with ProcGroup(run_dir / system.name / "logs") as procs:
            # Named apart from the system, whose processes' names all start with system.name (cpu_seconds).
            replica_urls = start_emulator(procs, ports, time_scale=setup.time_scale,
                                          max_num_seqs=setup.max_num_seqs, name="emulator")
            url = start_system(procs, configured(system, setup), replica_urls, run_dir=run_dir / system.name)
            cpu_start = procs.cpu_seconds(system.name)  # after the start and warm-up: the replay's share only
            result, sampler = asyncio.run(_replay_with_sampler(requests, url, replica_urls, setup, progress))
            cpu_s = procs.cpu_seconds(system.name) - cpu_start
    except (RuntimeError, Unavailable, OSError) as exc:
        return {"system": system.name, "status": "failed", "reason": str(exc)[:2000], "load": load.stop()}
    figures = summarize(result.records, result.wall_s)
    figures["pending_peak"] = sampler.peak
    figures["pending_peak_max"] = max(sampler.peak, default=0)
    figures["pending_mean_total"] = sampler.mean_total
    figures["cpu_s"] = cpu_s
    figures["cpu_ms_per_request"] = 1000 * cpu_s / figures["completed"] if figures["completed"] else None
    return {"system": system.name, "status": "ok", "figures": figures, "load": load.stop()}


def run_baselines(systems: Sequence[str] | None = None, *, setup: BaselinesSetup | None = None,
                  run_dir: Path | None = None, progress: bool | None = None,
                  seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Run every system in ``systems`` (names of :data:`SYSTEMS`; default :data:`DEFAULT_SYSTEMS`) once per seed
    of ``seeds`` (default: ``setup.seed`` only), seed by seed: run 1 of every system, then run 2, so a slow spell
    of the machine does not fall on one system's runs, and every system of a run replays the same requests.

    Returns ``{"setup": asdict(setup), "workload": one-line description, "versions": {...}, "systems": {name:
    {"kind", "policy", "options", "skylb_overrides"}} as configured, "rows": [row...], "seeds", "wall_s", "load":
    MachineLoad summary of the whole run}`` (rows: :func:`run_system`, each with its ``seed``).
    """
    setup = setup or BaselinesSetup()
    seeds = list(seeds) if seeds else [setup.seed]
    names = list(systems or DEFAULT_SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="baselines-"))
    ports = free_ports(setup.replicas)
    load = MachineLoad().start()
    t0 = time.monotonic()
    rows = []
    for i, seed in enumerate(seeds):
        seeded = dataclasses.replace(setup, seed=seed)
        for name in names:
            print(f"[bench.live.baselines] run {i + 1}/{len(seeds)} (seed {seed}) {name} ... "
                  f"({time.monotonic() - t0:.0f} s so far)", file=sys.stderr, flush=True)
            row = run_system(SYSTEMS[name], seeded, ports=ports, run_dir=run_dir / f"seed{seed}", progress=progress)
            row["seed"] = seed
            rows.append(row)
            print(f"[bench.live.baselines] {name} seed {seed}: {row['status']} {row.get('reason', '')}".rstrip(),
                  file=sys.stderr, flush=True)
    requests = synthetic_workload(setup.workload_config(), ["us"])
    systems_used = {n: {"kind": s.kind, "policy": s.policy, "options": s.options,
                        "skylb_overrides": s.skylb_overrides}
                    for n, s in ((n, configured(SYSTEMS[n], setup)) for n in names)}
    return {
        "setup": setup.__dict__.copy(), "workload": describe(requests), "versions": versions(),
        "systems": systems_used, "rows": rows, "seeds": seeds, "wall_s": time.monotonic() - t0, "load": load.stop(),
        "run_dir": str(run_dir), "generated": now_label(),
    }


# -------------------------------------------------------------------------------------- over the paired runs


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _spread(values: Sequence[float | None], fmt: str, ends: str | None = None) -> str:
    """``mean [min, max]`` of ``values`` (None left out) with ``fmt`` (``ends`` for min, max and a lone value,
    default ``fmt``); the value alone for one run; "-" for none."""
    values = [v for v in values if v is not None]
    ends = ends or fmt
    if not values:
        return "-"
    if len(values) == 1:
        return ends.format(values[0])
    return f"{fmt.format(_mean(values))} [{ends.format(min(values))}, {ends.format(max(values))}]"


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per system over its ok runs (seeds): ``{"system", "runs", "rps", "ttft_p90", "ttft_p50", "hit",
    "pending_peak", "cpu_ms", "pending_peak_max", "first_rps", "first_p90", "lowest_p90"}``: lists of per-run
    values (``pending_peak``: the most pending requests any one replica had in that run; ``cpu_ms``: the system's
    CPU time per completed request, ms, None for a run from before it was measured), the largest peak pending of
    any run, in how many runs the system was first on throughput and on TTFT p90 among the systems that ran that
    seed, and in how many its TTFT p90 was lower than every other system's of the same seed (``lowest_p90``;
    ties count for no one, and a seed where it ran alone does not count)."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    out: dict[str, dict[str, Any]] = {}
    for r in ok:
        f = r["figures"]
        s = out.setdefault(r["system"], {"system": r["system"], "runs": 0, "rps": [], "ttft_p90": [], "ttft_p50": [],
                                         "hit": [], "pending_peak": [], "cpu_ms": [], "pending_peak_max": 0,
                                         "first_rps": 0, "first_p90": 0, "lowest_p90": 0})
        s["runs"] += 1
        s["rps"].append(f["throughput_rps"])
        s["ttft_p90"].append(f["ttft_p90_ms"])
        s["ttft_p50"].append(f["ttft_p50_ms"])
        s["hit"].append(100 * (f["prefix_hit_rate"] or 0.0))
        s["pending_peak"].append(f["pending_peak_max"])
        s["cpu_ms"].append(f.get("cpu_ms_per_request"))
        s["pending_peak_max"] = max(s["pending_peak_max"], f["pending_peak_max"])
    for seed in result.get("seeds") or [None]:
        runs = [r for r in ok if r.get("seed") == seed]
        if not runs:
            continue
        out[max(runs, key=lambda r: r["figures"]["throughput_rps"])["system"]]["first_rps"] += 1
        out[min(runs, key=lambda r: r["figures"]["ttft_p90_ms"])["system"]]["first_p90"] += 1
        for r in runs:
            others = [o["figures"]["ttft_p90_ms"] for o in runs if o is not r]
            if others and r["figures"]["ttft_p90_ms"] < min(others):
                out[r["system"]]["lowest_p90"] += 1
    return list(out.values())


#: What a run is judged on, for SkyLB's default configuration against every other system of the run.
TARGETS = (
    "mean TTFT p90 the lowest of all systems",
    "TTFT p90 lower than every other system's in >= 4 of 5 paired runs (>= 80% of them)",
    "throughput (mean req/s) within the best other system's [min, max] or above it",
    "peak pending requests per replica <= 2 (every replica, every run)",
)


def acceptance(result: dict[str, Any], system: str = "skylb") -> list[tuple[str, str, bool | None]]:
    """Each of :data:`TARGETS` for ``system`` as ``(target, measured, met)``; ``met`` is None where it cannot be
    judged (``system`` did not run, or ran alone)."""
    summary = {s["system"]: s for s in summary_rows(result)}
    me = summary.get(system)
    others = [s for name, s in summary.items() if name != system]
    if me is None or not others:
        why = f"{system} did not run" if me is None else "no other system ran"
        return [(t, why, None) for t in TARGETS]
    lowest_other = min(others, key=lambda s: _mean(s["ttft_p90"]))
    fastest = max(others, key=lambda s: _mean(s["rps"]))
    need = math.ceil(0.8 * me["runs"])
    return [
        (TARGETS[0], f"{_mean(me['ttft_p90']):.0f} ms; lowest other {lowest_other['system']} "
                     f"{_mean(lowest_other['ttft_p90']):.0f} ms", _mean(me["ttft_p90"]) < _mean(lowest_other["ttft_p90"])),
        (TARGETS[1], f"{me['lowest_p90']} of {me['runs']} (needs {need})", me["lowest_p90"] >= need),
        (TARGETS[2], f"{_mean(me['rps']):.3f} req/s; best other {fastest['system']} "
                     f"{_spread(fastest['rps'], '{:.3f}')}", _mean(me["rps"]) >= min(fastest["rps"])),
        (TARGETS[3], f"max {max(me['pending_peak'])} (per run: {', '.join(map(str, me['pending_peak']))})",
         max(me["pending_peak"]) <= 2),
    ]


# ----------------------------------------------------------------------------------------------------- report


def _f(value, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _row(row: dict[str, Any]) -> list[str]:
    """One system's cells of the per-run table; a row that did not run says why in its third cell."""
    if row["status"] != "ok":
        reason = (row.get("reason") or "").splitlines()[0][:160].replace("|", "/")
        return [row["system"], str(row.get("seed", "")), f"{row['status']}: {reason}"]
    f = row["figures"]
    return [row["system"], str(row.get("seed", "")), f"{f['completed']}/{f['sent']}", _f(f["throughput_rps"], "{:.2f}"),
            _f(f["output_tokens_per_s"]), _f(f["ttft_mean_ms"]), _f(f["ttft_p50_ms"]), _f(f["ttft_p90_ms"]),
            _f(f["e2e_p50_ms"]), _f(f["e2e_p90_ms"]),
            _f(f["prefix_hit_rate"] and 100 * f["prefix_hit_rate"], "{:.1f}%"),
            f"{f['pending_peak_max']} ({'/'.join(map(str, f['pending_peak']))})", f"{f['pending_mean_total']:.1f}",
            _f(f.get("cpu_ms_per_request"), "{:.2f}")]


def _tables(result: dict[str, Any]) -> list[str]:
    """The summary over the runs, then every run."""
    return [
        "Over the runs (mean [min, max]; peak pending: the most pending requests any one replica had in a run; "
        "first: in how many runs the system had the highest req/s, the lowest TTFT p90):",
        "",
        markdown_table(["system", "runs", "req/s", "TTFT p50", "TTFT p90", "prefix hit %", "peak pending per replica",
                        "CPU ms/request", "first on req/s", "first on TTFT p90"],
                       [[x["system"], x["runs"], _spread(x["rps"], "{:.2f}"), _spread(x["ttft_p50"], "{:.0f}"),
                         _spread(x["ttft_p90"], "{:.0f}"), _spread(x["hit"], "{:.1f}"),
                         _spread(x["pending_peak"], "{:.1f}", "{}"), _spread(x["cpu_ms"], "{:.2f}"), x["first_rps"],
                         x["first_p90"]] for x in summary_rows(result)]),
        "",
        "Each run:",
        "",
        markdown_table(["system", "seed", "ok/sent", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p90",
                        "E2E p50", "E2E p90", "prefix hit", "peak pending (max; per replica)", "mean pending (sum)",
                        "CPU ms/request"],
                       [_row(row) for row in result["rows"]]),
        "",
        "Latencies in ms, measured at the client (TTFT: to the first SSE chunk with text). Throughput: completed "
        "requests (output tokens) per second of the replay's wall time. Prefix hit: cached prompt tokens / prompt "
        "tokens, as the replicas report them in `usage`. Pending: `vllm:num_requests_waiting` polled on every "
        "replica every 0.1 s (requests a balancer holds in its own queue are not pending on a replica; a request is "
        "pending from its arrival until the next engine step schedules it, even with a free slot, so a peak of 1 "
        "can be that one step's wait). CPU "
        "ms/request: CPU time (user + system, all threads, from /proc) of the system's own processes over the "
        "replay (SkyLB: controller + balancer; the SGLang router; HAProxy), per completed request.",
        "",
    ]


def _skylb_line(name: str, system: dict[str, Any]) -> str:
    overrides = system.get("skylb_overrides") or {}
    if system["policy"] == "skylb":
        what = ("policy `skylb`: prefix trie + selective pushing (the balancer holds requests in its own queue and "
                "sends one to a replica only while that replica has room)")
    elif system["policy"] == "skylb-ch":
        what = ("policy `skylb-ch`: a hash ring on the session key (the client's `X-Session-ID` header) + selective "
                "pushing")
    else:
        what = f"policy `{system['policy']}`"
    config = ("with " + ", ".join(f"`{k}: {v}`" for k, v in overrides.items()) + " (not the default configuration)"
              if overrides else "the default configuration otherwise (no overrides)")
    n = (system.get("options") or {}).get("balancers", 1)
    balancers = ("one balancer" if n == 1 else
                 f"{n} balancers (siblings, each owning a share of the replicas; each request sent to one of them by a "
                 "hash of its id, so a conversation's turns land on several)")
    stated = (system.get("options") or {}).get("max_concurrency")
    registered = (f"replicas registered through the controller with `--max-concurrency {stated}` (their batch "
                  "stated, not learned)" if stated else "replicas registered through the controller")
    return f"- `{name}`: SkyLB controller + {balancers} (region `us`), {what}; {config}; {registered}."


def _sglang_line(name: str, system: dict[str, Any]) -> str:
    o = system.get("options") or {}
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in o.items())
    line = (f"- `{name}`: `python -m sglang_router.launch_router --policy {system['policy']}"
            f"{' ' + flags if flags else ''}`, the router's defaults otherwise")
    if system["policy"] != "cache_aware":
        return line + "."
    if not o:
        return line + " (cache_aware's defaults: cache threshold 0.3, balance thresholds 64 and 1.5)."
    return (line + ". The router routes to the least loaded worker (its own count of requests in flight) when "
            f"max - min > {o['balance_abs_threshold']} and max > {o['balance_rel_threshold']:g} x min, else to the "
            f"worker whose prefix tree matches >= {o['cache_threshold']:g} of the prompt, else to the smallest tree. "
            f"Abs threshold {o['balance_abs_threshold']}: half a batch, a replica queueing while another has room "
            "or a shorter queue. The defaults 64 / 1.5 can never trigger on 16 batch slots, which sent every "
            "request to the replica that first saw the shared system prompt in the earlier report. Rel threshold "
            f"{o['balance_rel_threshold']:g}: the 25% over that HAProxy's bounded loads allow. Cache threshold "
            f"{o['cache_threshold']:g}, the default: a conversation's later turns match about half or more of their "
            "prompt where its earlier turns went and stay there; a new conversation matches the shared system "
            "prompt anywhere, so the balance thresholds, not the cache threshold, spread new conversations.")


def _haproxy_line(name: str, system: dict[str, Any]) -> str:
    o = system.get("options") or {}
    if o.get("hash_header"):
        factor = o.get("hash_balance_factor")
        return (f"- `{name}`: `balance hdr({o['hash_header']})`, `hash-type consistent`"
                + (f", `hash-balance-factor {factor}`" if factor else "")
                + ": every turn of a conversation goes to the replica its session id hashes to (its prefix cache), "
                f"as long as that replica carries at most {factor}% of the average number of requests in flight "
                "(consistent hashing with bounded loads); else the next replica on the ring. "
                f"{factor}: the tightest of the values the HAProxy manual calls reasonable (125-200). No `maxconn`: "
                "HAProxy queues a hashed request on its own server, so a limit would move the replica's queue into "
                "HAProxy without sending it to a free replica.")
    line = f"- `{name}`: `balance {system['policy']}`"
    if o.get("maxconn"):
        line += (f", `server ... maxconn {o['maxconn']}` (the engine's batch, `--max-num-seqs`), "
                 f"`timeout queue {o['timeout_queue_s']:g}s` (the client's request timeout): a replica gets at most "
                 "as many requests as it runs at once; the rest wait in HAProxy's queue for the first free server "
                 "(HAProxy's own way of not overloading a server)")
    return line + "."


def _setup_lines(result: dict[str, Any]) -> list[str]:
    s = result["setup"]
    systems = result.get("systems") or {}
    lines = ["## Setup", "",
             f"- Replicas: {s['replicas']} emulated vLLM replicas (`skylb emulator`, one process), "
             f"`--max-num-seqs {s['max_num_seqs']}` ({s['replicas'] * s['max_num_seqs']} batch slots in all), "
             f"`--time-scale {s['time_scale']:g}` (Llama-3.1-8B on an L4 x {s['time_scale']:g}: "
             f"{1 / s['time_scale']:g}x an L4's speed, so a run is short enough for paired runs on 2 cores, while "
             "the batch stays small, where bursts matter), restarted on the same ports before each system so that "
             "every system starts with cold prefix caches.",
             f"- Workload: {result['workload']}; {s['conversations']} closed-loop conversations x {s['turns']} "
             "turns (a turn is sent 0.2-1.0 s after the previous turn of its conversation completed), "
             f"`token_scale {s['token_scale']:g}`; every turn extends the previous turn's prompt, and all "
             "conversations share a system prompt. Paired runs: every system replays the same requests (one "
             "workload seed) in a run, and the runs go seed by seed (run 1 of every system, then run 2), so a slow "
             "spell of the machine does not fall on one system.",
             "- Client: bench/replay/run.py (aiohttp, streamed `/v1/completions`, `ignore_eos`, the `X-Session-ID` "
             "header with the conversation's id), one process.",
             "- Systems, each as operators deploy it:"]
    for name, system in systems.items():
        line = {"skylb": _skylb_line, "sglang": _sglang_line, "haproxy": _haproxy_line}[system["kind"]](name, system)
        lines.append("  " + line)
    lines += ["- HAProxy, every row: generated config, `mode http`, no health checks, client/server timeouts 600 s, "
              "`option http-no-delay` (without it HAProxy sends with MSG_MORE and the kernel holds small SSE chunks "
              "up to 200 ms: TTFT p50 203 ms instead of 13 ms in a trial run).", ""]
    return lines


def _targets(result: dict[str, Any]) -> list[str]:
    """The targets section: each of :data:`TARGETS` MET or MISSED from the figures."""
    verdict = {True: "MET", False: "MISSED", None: "not judged"}
    return ["## Targets (automatic, for `skylb`, the default configuration)", "",
            markdown_table(["target", "measured", "verdict"],
                           [[t, m, verdict[ok]] for t, m, ok in acceptance(result)]), ""]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The result as the Markdown report bench/results/baselines.md (tables, setup, targets, conditions);
    ``notes`` (Markdown written after looking at the figures) is appended as is."""
    s = result["setup"]
    seeds = result.get("seeds") or [s["seed"]]
    lines = [
        f"# SkyLB beside the SGLang router and HAProxy (live, {len(seeds)} paired run{'s' if len(seeds) > 1 else ''})",
        "",
        f"Generated by `python -m bench.live.baselines` on {result.get('generated') or now_label()}; "
        f"whole run {result['wall_s']:.0f} s; workload seeds {', '.join(map(str, seeds))}. Versions: sglang-router "
        f"{result['versions']['sglang-router']}, {result['versions']['haproxy']}, Python "
        f"{result['versions']['python']}.",
        "",
    ]
    lines += _tables(result)
    lines += _setup_lines(result)
    lines += _targets(result)
    lines += _observations(result)
    lines += report_tail(result, "every process of the run (client, emulator, balancer) shares them", notes)
    return "\n".join(lines)


def _observations(result: dict[str, Any]) -> list[str]:
    """Automatic remarks on the rows, one line per system and remark: runs in which requests piled on some
    replicas while others never queued, runs measured while the machine was busy."""
    piled: dict[str, list[str]] = {}
    busy: dict[str, list[str]] = {}
    for row in result["rows"]:
        if row["status"] != "ok":
            continue
        peaks = row["figures"]["pending_peak"]
        if min(peaks, default=0) == 0 and max(peaks, default=0) > 0:
            piled.setdefault(row["system"], []).append(f"seed {row.get('seed')} {peaks}")
        frac = row["load"]["others_cpu_frac"]
        if frac > BUSY_FRACTION:
            busy.setdefault(row["system"], []).append(
                f"seed {row.get('seed')}: {100 * frac:.0f}% ({', '.join(row['load']['top_others'][:2])})")
    out = [f"- {name}: requests queued on some replicas while others never had a pending request, in "
           f"{len(runs)} run(s) (peaks per replica: {'; '.join(runs)})." for name, runs in piled.items()]
    out += [f"- {name}: measured while other processes used a share of the machine above "
            f"{100 * BUSY_FRACTION:.0f}% ({'; '.join(runs)}); its timings there are pessimistic."
            for name, runs in busy.items()]
    return (["## Observations (automatic)", "", *out, ""]) if out else []


# -------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live.baselines`."""
    p = benchmark_parser("python -m bench.live.baselines", __doc__.splitlines()[0], systems=SYSTEMS,
                         defaults=BaselinesSetup(), out_md="bench/results/baselines.md",
                         helps={"seed": "run this one workload seed only (same as --seeds N)",
                                "systems": f"systems to run (default: {' '.join(DEFAULT_SYSTEMS)}; the others are "
                                           "selectable)"})
    p.set_defaults(seed=None)  # None: --seeds decides (see setup_and_seeds)
    p.add_argument("--seeds", type=_seed_list, default=None, metavar="N,N,...",
                   help="run every system once per workload seed, seed by seed (paired runs; default: "
                        f"{','.join(map(str, DEFAULT_SEEDS))}); the report gives each figure's mean with [min, max] "
                        "and how often each system came first")
    return p


def setup_and_seeds(args: argparse.Namespace) -> tuple[BaselinesSetup, list[int]]:
    """The setup and the workload seeds of parsed ``args``: ``--seeds``, else ``--seed`` alone, else
    :data:`DEFAULT_SEEDS`; the setup's ``seed`` is the first of them."""
    seeds = args.seeds or ([args.seed] if args.seed is not None else list(DEFAULT_SEEDS))
    args.seed = seeds[0]
    return setup_from_args(BaselinesSetup, args), seeds


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
    """Run the comparison and write the report and its JSON (with the summary and the targets); 0 when every
    system that could run completed all requests."""
    args = build_parser().parse_args(argv)
    setup, seeds = setup_and_seeds(args)
    result = run_baselines(args.systems, setup=setup, run_dir=Path(args.run_dir) if args.run_dir else None,
                           progress=False if args.no_progress else None, seeds=seeds)
    result["summary"] = summary_rows(result)
    result["acceptance"] = acceptance(result)
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    out_json = args.out_json or (str(Path(args.out_md).with_suffix(".json")) if args.out_md else None)
    emit_markdown(text, result, out_md=args.out_md, out_json=out_json)
    bad = [r for r in result["rows"] if r["status"] == "failed"
           or (r["status"] == "ok" and r["figures"]["failed"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
