"""The paper's multi-region scenario scaled down and run live: SkyLB's policies on the local three-region deployment.

Entry points:

* ``.venv/bin/python -m bench.live.regions [--systems NAME ...] [--runs N] [--sim-seeds K] [--out-md
  bench/results/live.md] [--out-json PATH]``; :func:`main` ``(argv) -> int`` is the same for a ``skylb bench live``
  subcommand. The JSON result goes beside the Markdown report (``.json`` for ``.md``) unless ``--out-json`` says
  otherwise; both carry the run's provenance (bench/reporting/provenance.py: commit at the start, date, command, machine).
* :func:`run_live` runs every system and returns the result dict; :func:`format_markdown` renders the report with
  the ranking (throughput and P90 TTFT per system) beside the simulator's, from :func:`simulate_setup`: the same
  requests, replicas and round trips in bench/sim (bench/sim/twin.py), and Kendall's tau between the two orders.
* Parity (:func:`parity`): with ``--runs N`` every system runs N times (interleaved rounds: run 1 of every system,
  then run 2, ..., so a drift of the machine's load does not fall on one system) and the simulator once per seed
  (``--sim-seeds K``: seeds 0..K-1 of the twin's probe phases). A cell (system x figure: throughput, P90 TTFT,
  forwarded share) passes when every simulated figure lies in the live runs' [min, max] widened by
  :data:`PARITY_MARGIN` ([0.9 min, 1.1 max]); an ordering check passes when, for two systems whose live spreads of
  a figure do not overlap, every seed of the simulator orders them the same way.

Each system gets its own fresh deployment (bench/launch/local.py ``Deployment``: controller, one emulator process per
region, the latency proxy with the configured round trips between regions, one balancer per region, all real
processes) and the same multi-region workload: closed-loop multi-turn conversations (bench/replay/workload.py), regionally
skewed like the paper's 120/40/40 clients (§5.2 "Diurnal pattern"): weights us 0.6, eu 0.2, asia 0.2. With
``--trace PATH`` (``--start-s``, ``--window-s``, ``--time-compression``) a Mooncake-format trace window is replayed
open loop instead, sessions assigned to regions with the same weights, and the report gives the achieved prefix
hit rate beside the window's ideal (bench/sim/ideal.py).

Systems (:data:`LIVE_SYSTEMS`): the balancer's policies ``skylb`` (prefix trie + selective pushing), ``skylb-ch``
(hash ring + selective pushing), ``round-robin`` and ``least-load`` (blind pushing), and ``region-local`` (``skylb``
policy, but no balancer accepts another's status probes, so nothing is ever forwarded: the paper's region-local
deployment, Fig. 10). Note that blind-pushing balancers always find a healthy local replica, so they never forward
either; in the paper RR and LL are one global balancer in the US instead.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.live.harness import benchmark_parser, now_label, report_tail, setup_from_args, summarize
from bench.sim.ideal import replay_ideal_hit_rate
from bench.launch.launchers import MODEL
from bench.reporting.provenance import provenance
from bench.replay.run import replay
from bench.replay.report import build_report, emit_markdown, markdown_table
from bench.replay.sampling import MachineLoad
from bench.launch.settings import latency_settings
from bench.sim.twin import simulate
from bench.replay.workload import Request, WorkloadConfig, describe, load_workload
from skylb.config import DeploymentConfig, load_config
from bench.launch.local import Deployment

__all__ = ["LIVE_SYSTEMS", "LiveSetup", "RegionLocalDeployment", "deployment_config", "run_system", "run_live",
           "simulate_setup", "workload_requests", "ranking", "order", "kendall_tau", "parity", "PARITY_FIGURES",
           "PARITY_MARGIN", "format_markdown", "main"]

#: name -> (balancer policy, region-local?)
LIVE_SYSTEMS: dict[str, tuple[str, bool]] = {
    "skylb": ("skylb", False),
    "skylb-ch": ("skylb-ch", False),
    "round-robin": ("round-robin", False),
    "least-load": ("least-load", False),
    "region-local": ("skylb", True),
}
REGIONS = ("us", "eu", "asia")
#: The figures the parity check compares: (key in the figures, label, format of one value).
PARITY_FIGURES: tuple[tuple[str, str, str], ...] = (("throughput_rps", "req/s", "{:.2f}"),
                                                    ("ttft_p90_ms", "TTFT p90 ms", "{:.0f}"),
                                                    ("forwarded_frac", "forwarded", "{:.3f}"))
#: How far outside the live runs' [min, max] a simulated figure may lie: [min x (1 - m), max x (1 + m)].
PARITY_MARGIN = 0.10


@dataclass
class LiveSetup:
    """The shared setup of a live run.

    Attributes:
        replicas: emulated vLLM replicas per region. max_num_seqs: running-batch slots per replica (requests).
        time_scale: emulated durations x this (1 = Llama-3.1-8B on an L4). conversations: conversations per
            region on average (``synthetic_conversations``; split 0.6/0.2/0.2). turns: per conversation.
        token_scale: prompt and answer lengths x this. seed: workload seed. deadline_s: bound of one replay, s.
        rtt_ms: round trips between regions (ms), as in the default config.
        trace: a Mooncake-format trace to replay open loop instead of the synthetic conversations (None: those).
        start_s, window_s: the trace window (trace time, s). time_compression: trace time is divided by it.
    """

    replicas: int = 2
    max_num_seqs: int = 4
    time_scale: float = 1.0
    conversations: int = 10
    turns: int = 5
    token_scale: float = 0.25
    seed: int = 0
    deadline_s: float = 180.0
    request_timeout_s: float = 120.0
    rtt_ms: dict | None = None
    trace: str | None = None
    start_s: float = 0.0
    window_s: float = 60.0
    time_compression: float = 1.0

    def workload_config(self) -> WorkloadConfig:
        """The regionally skewed workload (us 0.6, eu 0.2, asia 0.2): the trace window when ``trace`` is set, else
        the synthetic conversations."""
        return WorkloadConfig(trace=self.trace, start_s=self.start_s, window_s=self.window_s,
                              time_compression=self.time_compression, synthetic_conversations=self.conversations,
                              synthetic_turns=self.turns, token_scale=self.token_scale,
                              region_weights={"us": 0.6, "eu": 0.2, "asia": 0.2}, seed=self.seed,
                              request_timeout_s=self.request_timeout_s)


def workload_requests(setup: LiveSetup) -> list[Request]:
    """The requests every system is sent (bench/replay/workload.py): the trace window, or the synthetic conversations.

    Raises FileNotFoundError when ``setup.trace`` names no file (no silent fallback to the synthetic workload).
    """
    if setup.trace is not None and not Path(setup.trace).is_file():
        raise FileNotFoundError(f"trace not found: {setup.trace}")
    return load_workload(setup.workload_config(), list(REGIONS))


def deployment_config(setup: LiveSetup, *, policy: str, region_local: bool) -> DeploymentConfig:
    """The deployment of one system: the embedded default config with the setup's sizes and ``policy``.

    Region-local: each region's balancer gets its own peer token, so every peer answers its status probes with
    403 and no peer is ever available (the balancer is unchanged; it simply never forwards).
    """
    data = load_config(None).model_dump()
    data["regions"] = {r: {"replicas": setup.replicas,
                           "balancer": {"peer_token": f"region-local-{r}-{secrets.token_urlsafe(24)}"}
                           if region_local else {}}
                       for r in REGIONS}
    data["emulator"].update(engine="vllm", model=MODEL, time_scale=setup.time_scale,
                            extra_args=["--max-num-seqs", str(setup.max_num_seqs), "--no-request-log"])
    data["balancer"]["policy"] = policy
    if setup.rtt_ms:
        data["latency"]["rtt_ms"] = dict(setup.rtt_ms)
    data["workload"] = setup.workload_config().model_dump()
    return DeploymentConfig.model_validate(data)


class RegionLocalDeployment(Deployment):
    """A Deployment whose readiness check does not wait for peers (in a region-local run none is reachable)."""

    expects_peers = False


def run_system(name: str, setup: LiveSetup, *, run_dir: Path, progress: bool | None = None) -> dict[str, Any]:
    """Run the workload on a fresh deployment of system ``name``; returns its row.

    Row: ``{"system", "status": "ok"|"failed", "reason", "report": build_report(...), "figures": summarize(...)
    + "forwarded_frac", "load"}``. Every process is stopped before it returns.
    """
    policy, region_local = LIVE_SYSTEMS[name]
    cfg = deployment_config(setup, policy=policy, region_local=region_local)
    requests = workload_requests(setup)
    sys_dir = Path(run_dir) / name
    sys_dir.mkdir(parents=True, exist_ok=True)
    deployment = (RegionLocalDeployment if region_local else Deployment)(cfg, sys_dir)
    load = MachineLoad().start()
    try:
        deployment.start()
        result = asyncio.run(replay(requests, deployment.balancer_urls, model=MODEL,
                                    request_timeout_s=setup.request_timeout_s, deadline_s=setup.deadline_s,
                                    progress=progress))
    except (RuntimeError, OSError) as exc:
        return {"system": name, "status": "failed", "reason": str(exc)[:2000], "load": load.stop()}
    finally:
        deployment.stop()
    report = build_report(result.records, result.wall_s)
    figures = summarize(result.records, result.wall_s)
    done = figures["completed"]
    figures["forwarded_frac"] = figures["forwarded_total"] / done if done else None
    return {"system": name, "status": "ok", "report": report, "figures": figures, "load": load.stop()}


def run_live(systems: Sequence[str] | None = None, *, setup: LiveSetup | None = None, run_dir: Path | None = None,
             progress: bool | None = None, runs: int = 1, sim_seeds: Sequence[int] = (0,)) -> dict[str, Any]:
    """Run every system of ``systems`` (default all of :data:`LIVE_SYSTEMS`) ``runs`` times, in interleaved rounds,
    and the simulator once per seed of ``sim_seeds``.

    Returns ``{"setup", "workload", "ideal_prefix_hit_rate", "rows" (round 1), "runs" (rows of every round),
    "ranking": ranking(rows), "sim" (the first seed's figures), "sim_seeds" ({seed: figures}), "sim_ranking",
    "parity": parity(...), "wall_s", "load", "run_dir", "rtt_ms"}`` (the ideal is None for the closed-loop synthetic
    workload).
    """
    setup = setup or LiveSetup()
    requests = workload_requests(setup)  # first: a missing trace fails before any deployment starts
    names = list(systems or LIVE_SYSTEMS)
    unknown = [n for n in names if n not in LIVE_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(LIVE_SYSTEMS)}")
    if runs < 1 or not sim_seeds:
        raise ValueError("runs must be >= 1 and sim_seeds not empty")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="live-"))
    # first: seconds each, and a failure here costs no live run
    sims = {seed: simulate_setup(setup, names, seed=seed) for seed in sim_seeds}
    sim = sims[sim_seeds[0]]
    load = MachineLoad().start()
    t0 = time.monotonic()
    rounds: list[list[dict[str, Any]]] = []
    for k in range(runs):
        rows = []
        for name in names:
            print(f"[bench.live.regions] run {k + 1}/{runs} {name} ...", file=sys.stderr, flush=True)
            rows.append(run_system(name, setup, run_dir=run_dir / f"run{k + 1}", progress=progress))
            rows[-1]["run"] = k + 1
            print(f"[bench.live.regions] run {k + 1}/{runs} {name}: {rows[-1]['status']} {rows[-1].get('reason', '')}"
                  .rstrip(), file=sys.stderr, flush=True)
        rounds.append(rows)
    cfg = deployment_config(setup, policy="skylb", region_local=False)
    return {"setup": setup.__dict__.copy(), "workload": describe(requests),
            "ideal_prefix_hit_rate": replay_ideal_hit_rate(requests),
            "rtt_ms": latency_settings(cfg).rtt_ms, "rows": rounds[0], "runs": rounds, "ranking": ranking(rounds[0]),
            "sim": sim, "sim_seeds": sims, "sim_ranking": order(sim), "parity": parity(rounds, sims),
            "wall_s": time.monotonic() - t0, "load": load.stop(), "run_dir": str(run_dir), "generated": now_label()}


def simulate_setup(setup: LiveSetup, systems: Sequence[str], *, seed: int | None = None) -> dict[str, dict[str, Any]]:
    """The live run of ``systems`` replayed in the simulator (bench/sim/twin.py): system -> figures (seconds).
    ``seed``: the twin's seed (probe phases; the workload is ``setup.seed``'s either way), default ``setup.seed``."""
    cfg = deployment_config(setup, policy="skylb", region_local=False)
    return simulate(workload_requests(setup), systems=systems,
                    replicas_per_region={r: setup.replicas for r in REGIONS}, max_num_seqs=setup.max_num_seqs,
                    time_scale=setup.time_scale, rtt_ms=latency_settings(cfg).rtt_ms,
                    seed=setup.seed if seed is None else seed)


def parity(rounds: list[list[dict[str, Any]]], sims: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Whether the simulator's figures lie within the live runs' spread, per system and figure, and whether it
    orders the systems as the live runs do wherever their live spreads do not overlap.

    ``rounds``: the live rows of each run; ``sims``: seed -> system -> the twin's figures. Returns ``{"cells":
    [{"system", "figure", "live": [values], "live_min", "live_max", "band": [lo, hi], "sim": [value per seed],
    "pass"}], "orderings": [{"figure", "below", "above", "live_below_max", "live_above_min", "sim_below",
    "sim_above", "pass"}], "cells_passed", "cells_total", "orderings_passed", "orderings_total"}``. ``below`` is the
    system with the lower live figure; a system with no completed live run has no cell. Forwarded share is a
    fraction (0-1), TTFT ms, throughput requests/s.
    """
    systems = [n for n in next(iter(sims.values()))]
    cells, spread = [], {}
    for key, _, _ in PARITY_FIGURES:
        for name in systems:
            live = [r["figures"][key] for rows in rounds for r in rows
                    if r["system"] == name and r["status"] == "ok" and r["figures"].get(key) is not None]
            sim = [s[name][key] for s in sims.values()]
            if not live or any(v is None for v in sim):
                continue
            lo, hi = min(live), max(live)
            band = [lo * (1 - PARITY_MARGIN), hi * (1 + PARITY_MARGIN)]
            spread[key, name] = (lo, hi, sim)
            cells.append({"system": name, "figure": key, "live": live, "live_min": lo, "live_max": hi,
                          "band": band, "sim": sim, "pass": all(band[0] <= v <= band[1] for v in sim)})
    orderings = []
    for key, _, _ in PARITY_FIGURES:
        names = [n for n in systems if (key, n) in spread]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                (alo, ahi, asim), (blo, bhi, bsim) = spread[key, a], spread[key, b]
                if ahi < blo:
                    below, above = a, b
                elif bhi < alo:
                    below, above = b, a
                else:
                    continue  # the live spreads overlap: no order to keep
                (_, bmax, bs), (amin, _, as_) = spread[key, below], spread[key, above]
                orderings.append({"figure": key, "below": below, "above": above, "live_below_max": bmax,
                                  "live_above_min": amin, "sim_below": bs, "sim_above": as_,
                                  "pass": all(x < y for x, y in zip(bs, as_))})
    return {"cells": cells, "orderings": orderings, "cells_passed": sum(c["pass"] for c in cells),
            "cells_total": len(cells), "orderings_passed": sum(o["pass"] for o in orderings),
            "orderings_total": len(orderings)}


def order(figures: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Systems best first from ``{system: figures}``: ``{"throughput": by req/s descending, "ttft_p90": by P90
    TTFT ascending}`` (systems that completed nothing are left out)."""
    ok = {name: f for name, f in figures.items() if f.get("completed")}
    return {"throughput": sorted(ok, key=lambda n: -ok[n]["throughput_rps"]),
            "ttft_p90": sorted(ok, key=lambda n: ok[n]["ttft_p90_ms"])}


def ranking(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """:func:`order` of the live rows that ran."""
    return order({r["system"]: r["figures"] for r in rows if r["status"] == "ok"})


def kendall_tau(a: Sequence[str], b: Sequence[str]) -> float | None:
    """Kendall's rank correlation of two orders of the same items (1 = same order, -1 = reversed); None if fewer
    than two items are in both."""
    common = [x for x in a if x in b]
    pos = {x: i for i, x in enumerate(b)}
    pairs = [(x, y) for i, x in enumerate(common) for y in common[i + 1:]]
    if not pairs:
        return None
    return sum(1 if pos[x] < pos[y] else -1 for x, y in pairs) / len(pairs)


def _f(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _row(row: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[str]:
    """One system's cells of the live table; a failed row says why in its second cell. With ``runs`` (the system's
    rows of every run), each figure is the median over the ok runs with its [min, max]."""
    runs = runs or [row]
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        reason = (row.get("reason") or "").splitlines()[0][:160].replace("|", "/")
        return [row["system"], f"failed: {reason}" if len(runs) == 1 else f"failed in all {len(runs)} runs"]

    def cell(get, fmt="{:.0f}", scale=1.0) -> str:
        vals = sorted(v * scale for v in (get(r) for r in ok) if v is not None)
        if not vals:
            return "-"
        mid = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
        text = fmt.format(mid)
        return text if len(vals) == 1 else f"{text} [{fmt.format(vals[0])}, {fmt.format(vals[-1])}]"

    fig = lambda key: lambda r: r["figures"][key]  # noqa: E731
    sent = f"{sum(r['figures']['completed'] for r in ok)}/{sum(r['figures']['sent'] for r in ok)}"
    return [row["system"], sent if len(ok) == len(runs) else f"{sent} ({len(ok)} ok runs)",
            cell(fig("throughput_rps"), "{:.2f}"), cell(fig("output_tokens_per_s")), cell(fig("ttft_p50_ms")),
            cell(fig("ttft_p90_ms")), cell(fig("e2e_p50_ms")), cell(fig("e2e_p90_ms")),
            cell(fig("prefix_hit_rate"), "{:.1f}%", 100), cell(fig("forwarded_frac"), "{:.1f}%", 100),
            *(cell(lambda x, r=r: x["report"]["regions"].get(r, {}).get("ttft_p90_ms")) for r in REGIONS)]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The live result as the Markdown report bench/results/live.md; ``notes`` (Markdown) is appended as is."""
    s = result["setup"]
    rounds = result.get("runs") or [result["rows"]]
    runs_of = {row["system"]: [r for rows in rounds for r in rows if r["system"] == row["system"]]
               for row in result["rows"]}
    origin = result.get("origin") or {}  # reports written before bench/reporting/provenance.py: their own origin line
    made = (f"Generated by `{origin.get('command')}` at commit {origin.get('commit')} on "
            f"{result.get('generated') or now_label()}, on a machine with {origin.get('cores')} CPU cores; "
            if origin and not result.get("provenance") else f"Generated on {result.get('generated') or now_label()}; ")
    lines = ["# Live multi-region run: SkyLB's policies on the local three-region deployment", "",
             f"{made}{len(rounds)} live run(s) of every system (interleaved rounds), whole run "
             f"{result['wall_s']:.0f} s.", "",
             "## Ranking", "",
             *(["Ranking by run 1; table cells: median [min, max] over the live runs.", ""] if len(rounds) > 1
               else []),
             f"- By throughput (best first): {' > '.join(result['ranking']['throughput']) or '-'}",
             f"- By P90 TTFT (best first): {' < '.join(result['ranking']['ttft_p90']) or '-'}", "",
             markdown_table(["system", "ok/sent", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "E2E p50", "E2E p90",
                             "prefix hit", "forwarded", *(f"{r} TTFT p90" for r in REGIONS)],
                            [_row(row, runs_of[row["system"]]) for row in result["rows"]])]
    ideal = result.get("ideal_prefix_hit_rate")
    if ideal is not None:
        lines += ["", f"Ideal prefix hit rate of these requests: {100 * ideal:.1f}% (each request's longest prefix "
                  "shared with any earlier request counts as cached: an infinite cache on one replica, "
                  "bench/sim/ideal.py), a limit no policy can pass; the prefix hit column is what each system reached."]
    rtt = ", ".join(f"{k} {v:g} ms" for k, v in result["rtt_ms"].items())
    lines += _sim_section(result)
    lines += _parity_section(result)
    lines += ["", "Latencies in ms at the client (TTFT: first SSE chunk with text; a forwarded request's TTFT "
              "includes the round trip to the peer). Throughput: completed requests (output tokens) per second of "
              "the replay's wall time. Forwarded: completed requests served by a peer region.", "",
              "## Setup", "",
              f"- Per system a fresh `skylb local` deployment (bench/launch/local.py `Deployment`, real processes): "
              f"regions us, eu, asia with {s['replicas']} emulated vLLM replicas each (`--max-num-seqs "
              f"{s['max_num_seqs']}`, `--time-scale {s['time_scale']:g}`), controller, one balancer per region "
              f"(default config: probe every 100 ms, tau 2, each replica's batch learned from its probes), the latency proxy "
              f"between balancers with round trips {rtt}.",
              f"- Workload: {result['workload']}; " + (
                  f"open loop, trace `{s['trace']}` from {s.get('start_s', 0):g} s for {s.get('window_s', 0):g} s of "
                  f"trace time at {s.get('time_compression', 1):g}x" if s.get("trace") else
                  "closed loop (turn k+1 is sent 0.2-1.0 s after turn k completed)")
              + f", `token_scale {s['token_scale']:g}`, seed {s['seed']}; each region's clients call their "
              "own region's balancer. The skew 0.6/0.2/0.2 is the paper's 120/40/40 clients (§5.2).",
              "- Systems: `skylb` (prefix trie + selective pushing), `skylb-ch` (hash ring on the session id + "
              "selective pushing), `round-robin` and `least-load` (blind pushing to local replicas: a blind "
              "balancer always finds a healthy local replica, so it never forwards), `region-local` (`skylb` "
              "policy with forwarding impossible: each balancer has its own peer token, so peers refuse its status "
              "probes).", ""]
    windows = {**result, "rows": [{**r, "system": f"{r['system']} #{r.get('run', 1)}"}
                                  for rows in rounds for r in rows]}
    lines += report_tail(windows, f"all {3 * s['replicas']} replicas (3 emulator processes), 3 balancers, the "
                                 "controller, the latency proxy and the client share them", notes)
    return "\n".join(lines)


def _pair(live, sim, fmt="{:.0f}") -> str:
    return f"{_f(live, fmt)} / {_f(sim, fmt)}"


def _sim_section(result: dict[str, Any]) -> list[str]:
    """The simulator's figures for the same setup beside the live ones, and how the two rankings agree."""
    sim = result.get("sim")
    if not sim:
        return []
    live = {r["system"]: r for r in result["rows"] if r["status"] == "ok"}
    lines = ["", "## The simulator beside the live run", "",
             "The same requests (sessions, prompts, output lengths, start and think times), replicas, batch size and "
             "round trips, replayed in bench/sim (bench/sim/twin.py: the routing core and the emulator's engine "
             "model in simulated time). Cells: live (run 1) / simulated (the first seed).", ""]
    pct = lambda v: v and 100 * v  # noqa: E731
    body = []
    for name, s in sim.items():
        row = live.get(name)
        f = row["figures"] if row else {}
        regions = row["report"]["regions"] if row else {}
        body.append([name, s["sim_system"], _pair(f.get("throughput_rps"), s["throughput_rps"], "{:.2f}"),
                     _pair(f.get("ttft_p50_ms"), s["ttft_p50_ms"]), _pair(f.get("ttft_p90_ms"), s["ttft_p90_ms"]),
                     _pair(f.get("e2e_p90_ms"), s["e2e_p90_ms"]),
                     _pair(pct(f.get("prefix_hit_rate")), pct(s["prefix_hit_rate"]), "{:.1f}%"),
                     _pair(pct(f.get("forwarded_frac")), pct(s["forwarded_frac"]), "{:.1f}%"),
                     *(_pair(regions.get(r, {}).get("ttft_p90_ms"), s["region_ttft_p90_ms"].get(r))
                       for r in REGIONS)])
    lines.append(markdown_table(["system", "simulated as", "req/s", "TTFT p50", "TTFT p90", "E2E p90", "prefix hit",
                                 "forwarded", *(f"{r} TTFT p90" for r in REGIONS)], body))
    live_rank, sim_rank = result["ranking"], result["sim_ranking"]
    lines.append("")
    for key, label, sep in (("throughput", "throughput", " > "), ("ttft_p90", "P90 TTFT", " < ")):
        tau = kendall_tau(live_rank[key], sim_rank[key])
        lines.append(f"- By {label}: live {sep.join(live_rank[key]) or '-'}; simulated "
                     f"{sep.join(sim_rank[key]) or '-'}; Kendall's tau {_f(tau, '{:+.2f}')} (1 = the same order).")
    return lines


def _parity_section(result: dict[str, Any]) -> list[str]:
    """The parity check (:func:`parity`) as a table of cells and a list of ordering checks."""
    par = result.get("parity")
    if not par:
        return []
    seeds = ", ".join(str(k) for k in result.get("sim_seeds", {})) or "-"
    nruns = len(result.get("runs") or [result["rows"]])
    fmts = {key: (label, fmt) for key, label, fmt in PARITY_FIGURES}
    lines = ["", "## Parity of the simulator with the live runs", "",
             f"Live: {nruns} run(s) of every system; simulated: the twin with seeds {seeds} (probe phases). A cell "
             f"passes when every simulated figure lies in the live [min, max] widened by {PARITY_MARGIN:.0%} "
             f"([{1 - PARITY_MARGIN:g} min, {1 + PARITY_MARGIN:g} max]). Forwarded: fraction of requests (0-1).",
             ""]
    body = []
    for c in par["cells"]:
        label, fmt = fmts[c["figure"]]
        body.append([c["system"], label, f"[{fmt.format(c['live_min'])}, {fmt.format(c['live_max'])}]",
                     f"[{fmt.format(c['band'][0])}, {fmt.format(c['band'][1])}]",
                     ", ".join(fmt.format(v) for v in c["sim"]), "pass" if c["pass"] else "MISS"])
    lines.append(markdown_table(["system", "figure", "live [min, max]", "band", "simulated (per seed)", "parity"],
                                body))
    lines += ["", f"Cells: {par['cells_passed']} of {par['cells_total']} pass. Orderings (two systems whose live "
              f"spreads do not overlap, every simulated seed in the same order): {par['orderings_passed']} of "
              f"{par['orderings_total']} pass.", ""]
    for o in par["orderings"]:
        label, fmt = fmts[o["figure"]]
        lines.append(f"- {label}: live {o['below']} (max {fmt.format(o['live_below_max'])}) < {o['above']} (min "
                     f"{fmt.format(o['live_above_min'])}); simulated "
                     + ", ".join(f"{fmt.format(x)} vs {fmt.format(y)}" for x, y in zip(o["sim_below"], o["sim_above"]))
                     + (": pass" if o["pass"] else ": MISS"))
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live.regions` (`skylb bench live`): the shared ones (bench/live/harness.py) and the trace
    window."""
    p = benchmark_parser("python -m bench.live.regions", __doc__.splitlines()[0], systems=LIVE_SYSTEMS,
                         defaults=LiveSetup(), out_md="bench/results/live.md",
                         helps={"replicas": "replicas per region",
                                "conversations": "conversations per region on average (split us 0.6, eu 0.2, "
                                                 "asia 0.2)"})
    defaults = LiveSetup()
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="replay this Mooncake-format trace open loop instead of the synthetic conversations")
    p.add_argument("--start-s", type=float, default=defaults.start_s,
                   help="start of the trace window (trace time, s; the first minute of a trace is cache-cold)")
    p.add_argument("--window-s", type=float, default=defaults.window_s, help="length of the trace window (trace "
                   "time, s)")
    p.add_argument("--time-compression", type=float, default=defaults.time_compression,
                   help="divide trace time by this (2 = twice as fast)")
    p.add_argument("--runs", type=int, default=1, help="live runs of every system (interleaved rounds)")
    p.add_argument("--sim-seeds", type=int, default=3, help="simulator runs, seeds 0..K-1 (probe phases)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the live comparison and write the report; 0 when every system completed every request."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    setup = setup_from_args(LiveSetup, args)
    setup.trace, setup.start_s, setup.window_s = args.trace, args.start_s, args.window_s
    setup.time_compression = args.time_compression
    prov = provenance(shlex.join(["python", "-m", "bench.live.regions", *argv]))  # the commit the run starts from
    result = run_live(args.systems, setup=setup, run_dir=Path(args.run_dir) if args.run_dir else None,
                      progress=False if args.no_progress else None, runs=args.runs,
                      sim_seeds=list(range(args.sim_seeds)))
    result["provenance"] = prov
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    out_json = args.out_json or (str(Path(args.out_md).with_suffix(".json")) if args.out_md else None)
    emit_markdown(text, result, out_md=args.out_md, out_json=out_json)
    bad = [r for rows in result["runs"] for r in rows if r["status"] != "ok" or r["figures"]["failed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
