"""The paper's multi-region scenario scaled down and run live: SkyLB's policies on the local three-region deployment.

Entry points:

* ``.venv/bin/python -m bench.live [--systems NAME ...] [--out-md bench/results/live.md] [--out-json PATH]``;
  :func:`main` ``(argv) -> int`` is the same for a ``skylb bench live`` subcommand.
* :func:`run_live` runs every system and returns the result dict; :func:`format_markdown` renders the report with
  the ranking (throughput and P90 TTFT per system) beside the simulator's, from :func:`simulate_setup`: the same
  requests, replicas and round trips in bench/sim (bench/sim/twin.py), and Kendall's tau between the two orders.

Each system gets its own fresh deployment (bench/local.py ``Deployment``: controller, one emulator process per
region, the latency proxy with the configured round trips between regions, one balancer per region, all real
processes) and the same multi-region workload: closed-loop multi-turn conversations (bench/workload.py), regionally
skewed like the paper's 120/40/40 clients (§5.2 "Diurnal pattern"): weights us 0.6, eu 0.2, asia 0.2. With
``--trace PATH`` (``--start-s``, ``--window-s``, ``--time-compression``) a Mooncake-format trace window is replayed
open loop instead, sessions assigned to regions with the same weights, and the report gives the achieved prefix
hit rate beside the window's ideal (bench/ideal.py).

Systems (:data:`LIVE_SYSTEMS`): the balancer's policies ``skylb`` (prefix trie + selective pushing), ``skylb-ch``
(hash ring + selective pushing), ``round-robin`` and ``least-load`` (blind pushing), and ``region-local`` (``skylb``
policy, but no balancer accepts another's status probes, so nothing is ever forwarded: the paper's region-local
deployment, Fig. 10). Note that blind-pushing balancers always find a healthy local replica, so they never forward
either; in the paper RR and LL are one global balancer in the US instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.harness import benchmark_parser, now_label, report_tail, setup_from_args, summarize
from bench.ideal import replay_ideal_hit_rate
from bench.launchers import MODEL
from bench.replay import replay
from bench.report import build_report, emit_markdown, markdown_table
from bench.sampling import MachineLoad
from bench.settings import latency_settings
from bench.sim.twin import simulate
from bench.workload import Request, WorkloadConfig, describe, load_workload
from skylb.config import DeploymentConfig, load_config
from bench.local import Deployment

__all__ = ["LIVE_SYSTEMS", "LiveSetup", "RegionLocalDeployment", "deployment_config", "run_system", "run_live",
           "simulate_setup", "workload_requests", "ranking", "order", "kendall_tau", "format_markdown", "main"]

#: name -> (balancer policy, region-local?)
LIVE_SYSTEMS: dict[str, tuple[str, bool]] = {
    "skylb": ("skylb", False),
    "skylb-ch": ("skylb-ch", False),
    "round-robin": ("round-robin", False),
    "least-load": ("least-load", False),
    "region-local": ("skylb", True),
}
REGIONS = ("us", "eu", "asia")


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
    """The requests every system is sent (bench/workload.py): the trace window, or the synthetic conversations.

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
                           "balancer": {"peer_token": f"region-local-{r}"} if region_local else {}}
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
             progress: bool | None = None) -> dict[str, Any]:
    """Run every system of ``systems`` (default all of :data:`LIVE_SYSTEMS`) one after the other.

    Returns ``{"setup", "workload", "ideal_prefix_hit_rate", "rows", "ranking": ranking(rows), "wall_s", "load",
    "run_dir", "rtt_ms"}`` (the ideal is None for the closed-loop synthetic workload).
    """
    setup = setup or LiveSetup()
    requests = workload_requests(setup)  # first: a missing trace fails before any deployment starts
    names = list(systems or LIVE_SYSTEMS)
    unknown = [n for n in names if n not in LIVE_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(LIVE_SYSTEMS)}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="live-"))
    sim = simulate_setup(setup, names)  # first: about a second, and a failure here costs no live run
    load = MachineLoad().start()
    t0 = time.monotonic()
    rows = []
    for name in names:
        print(f"[bench.live] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_system(name, setup, run_dir=run_dir, progress=progress))
        print(f"[bench.live] {name}: {rows[-1]['status']} {rows[-1].get('reason', '')}".rstrip(), file=sys.stderr,
              flush=True)
    cfg = deployment_config(setup, policy="skylb", region_local=False)
    return {"setup": setup.__dict__.copy(), "workload": describe(requests),
            "ideal_prefix_hit_rate": replay_ideal_hit_rate(requests),
            "rtt_ms": latency_settings(cfg).rtt_ms, "rows": rows, "ranking": ranking(rows), "sim": sim,
            "sim_ranking": order(sim), "wall_s": time.monotonic() - t0, "load": load.stop(), "run_dir": str(run_dir),
            "generated": now_label()}


def simulate_setup(setup: LiveSetup, systems: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The live run of ``systems`` replayed in the simulator (bench/sim/twin.py): system -> figures (seconds)."""
    cfg = deployment_config(setup, policy="skylb", region_local=False)
    return simulate(workload_requests(setup), systems=systems,
                    replicas_per_region={r: setup.replicas for r in REGIONS}, max_num_seqs=setup.max_num_seqs,
                    time_scale=setup.time_scale, rtt_ms=latency_settings(cfg).rtt_ms, seed=setup.seed)


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


def _row(row: dict[str, Any]) -> list[str]:
    """One system's cells of the live table; a failed row says why in its second cell."""
    if row["status"] != "ok":
        reason = (row.get("reason") or "").splitlines()[0][:160].replace("|", "/")
        return [row["system"], f"failed: {reason}"]
    f, regions = row["figures"], row["report"]["regions"]
    hit = f["prefix_hit_rate"]
    return [row["system"], f"{f['completed']}/{f['sent']}", _f(f["throughput_rps"], "{:.2f}"),
            _f(f["output_tokens_per_s"]), _f(f["ttft_p50_ms"]), _f(f["ttft_p90_ms"]), _f(f["e2e_p50_ms"]),
            _f(f["e2e_p90_ms"]), _f(hit and 100 * hit, "{:.1f}%"),
            _f(f["forwarded_frac"] and 100 * f["forwarded_frac"], "{:.1f}%"),
            *(_f(regions.get(r, {}).get("ttft_p90_ms")) for r in REGIONS)]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The live result as the Markdown report bench/results/live.md; ``notes`` (Markdown) is appended as is."""
    s = result["setup"]
    lines = ["# Live multi-region run: SkyLB's policies on the local three-region deployment", "",
             f"Generated by `python -m bench.live` on {result.get('generated') or now_label()}; whole run "
             f"{result['wall_s']:.0f} s.", "",
             "## Ranking", "",
             f"- By throughput (best first): {' > '.join(result['ranking']['throughput']) or '-'}",
             f"- By P90 TTFT (best first): {' < '.join(result['ranking']['ttft_p90']) or '-'}", "",
             markdown_table(["system", "ok/sent", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "E2E p50", "E2E p90",
                             "prefix hit", "forwarded", *(f"{r} TTFT p90" for r in REGIONS)],
                            [_row(row) for row in result["rows"]])]
    ideal = result.get("ideal_prefix_hit_rate")
    if ideal is not None:
        lines += ["", f"Ideal prefix hit rate of these requests: {100 * ideal:.1f}% (each request's longest prefix "
                  "shared with any earlier request counts as cached: an infinite cache on one replica, "
                  "bench/ideal.py), a limit no policy can pass; the prefix hit column is what each system reached."]
    rtt = ", ".join(f"{k} {v:g} ms" for k, v in result["rtt_ms"].items())
    lines += _sim_section(result)
    lines += ["", "Latencies in ms at the client (TTFT: first SSE chunk with text; a forwarded request's TTFT "
              "includes the round trip to the peer). Throughput: completed requests (output tokens) per second of "
              "the replay's wall time. Forwarded: completed requests served by a peer region.", "",
              "## Setup", "",
              f"- Per system a fresh `skylb local` deployment (bench/local.py `Deployment`, real processes): "
              f"regions us, eu, asia with {s['replicas']} emulated vLLM replicas each (`--max-num-seqs "
              f"{s['max_num_seqs']}`, `--time-scale {s['time_scale']:g}`), controller, one balancer per region "
              f"(default config: probe every 100 ms, tau 2, `max_dispatch_per_probe 4`), the latency proxy "
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
    lines += report_tail(result, f"all {3 * s['replicas']} replicas (3 emulator processes), 3 balancers, the "
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
             "model in simulated time). Cells: live / simulated.", ""]
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


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live` (`skylb bench live`): the shared ones (bench/harness.py) and the trace
    window."""
    p = benchmark_parser("python -m bench.live", __doc__.splitlines()[0], systems=LIVE_SYSTEMS,
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
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the live comparison and write the report; 0 when every system completed every request."""
    args = build_parser().parse_args(argv)
    setup = setup_from_args(LiveSetup, args)
    setup.trace, setup.start_s, setup.window_s = args.trace, args.start_s, args.window_s
    setup.time_compression = args.time_compression
    result = run_live(args.systems, setup=setup, run_dir=Path(args.run_dir) if args.run_dir else None,
                      progress=False if args.no_progress else None)
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    emit_markdown(text, result, out_md=args.out_md, out_json=args.out_json)
    bad = [r for r in result["rows"] if r["status"] != "ok" or r["figures"]["failed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
