"""Routing by the prefix trie vs by the engines' KV-cache events, simulated, where it matters: llm-d's multi-tenant
shared-prefix workload with KV memory smaller than all tenants' prefixes.

``.venv/bin/python -m bench.sim.kv_routing [--seed 0] [--loads 0.5,1,2,3] [--kv-cache-tokens 8192] [--out DIR]`` runs
the robustness matrix's ``multi_tenant`` workload (bench/sim/matrix.py: 150 tenants, 6,000-token prefixes and
1,200-token questions at x1/8, Poisson arrivals, 4 replicas in each of us, eu and asia) on vLLM's engine model (the
engine that publishes the events; L4 / Llama-3.1-8B timings, bench/emulator/model.py) with every replica's KV cache
cut to ``--kv-cache-tokens`` (8,192: 12 x 8,192 = 98k tokens for 112.5k tokens of prefixes, before any question or
output), at rising loads (1x = 0.8 of the deployment's saturated throughput with that cache,
``matrix.saturated_rps``), for the systems:

* ``SkyLB``: per-region balancers, the prefix trie (today's default);
* ``SkyLB-KV``: the same, routing by the replicas' KV-cache events (bench/sim/systems.py ``KV_SYSTEMS``);
* ``SGL``: one SGLang cache-aware router in us over every replica; ``LL``: one least-load balancer;
* ``Oracle``: one scheduler with a fresh global view and no network, the best of its candidate policies per figure.

It writes ``kv_routing.json`` (every run's RunSummary) and ``kv_routing.md`` (P90 TTFT, throughput, hit rate and the
KV-bounded ideal hit rate per load and system, the forwards of the SkyLB systems, and how each system spreads a
tenant's requests over replicas: bench/sim/ttft_parts.py ``spread``; with commit, date, command and machine) into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.emulator.model import EngineParams
from bench.sim.matrix import EVEN, ONE_X_UTILISATION, TIMES, saturated_rps
from bench.sim.metrics import RunSummary, best_of, summarize
from bench.sim.systems import KV_SYSTEMS, SYSTEMS, build, replica_layout
from bench.sim.ttft_parts import spread
from bench.sim.workloads_extra import multi_tenant

__all__ = ["SYSTEM_KEYS", "run", "report", "main"]

#: The compared systems, in table order.
SYSTEM_KEYS = ("SkyLB", "SkyLB-KV", "SGL", "LL", "Oracle")
_FIGURES = (("ttft_p90", "P90 TTFT s", 2), ("throughput_tps", "output tok/s", 0), ("hit_rate", "hit rate", 3),
            ("ideal_kv_hit_rate", "KV-bounded ideal", 3))


#: The systems whose forwards are audited (bench/sim/cluster.py ``Cluster.audit_forward``).
AUDITED = ("SkyLB", "SkyLB-KV")


def run(*, seed: int, loads: list[float], kv_cache_tokens: int, abroad: float = 0.0
        ) -> tuple[list[RunSummary], float, dict[tuple[str, str], dict[str, int]], dict[tuple[str, str], dict]]:
    """Every (load, system) run; returns the summaries, the 1x rate (req/s), per (scenario, audited system) its
    forwards after the warm-up: ``forwards``, ``held`` (some peer's region held at least half the prompt),
    ``to_holder`` (of those, sent to a region that held it), ``to_deepest`` (to the one that held most),
    ``held_with_room`` (held, and a holding region had room in the forwarding balancer's view),
    ``to_holder_with_room`` (of those, sent to a region that held it); and per (scenario, system without candidates)
    how its tenants' requests spread over replicas and its engines' batches per region (``spread``,
    bench/sim/ttft_parts.py).
    ``abroad``: the share of each tenant's requests that come from another region than its home (``multi_tenant``)."""
    params = EngineParams(admission="vllm", kv_cache_tokens=kv_cache_tokens)  # vLLM publishes the events
    counts = dict(EVEN)
    sample = multi_tenant(seed=0, rate_rps=1.0, duration_s=400.0).arrivals[:300]  # as matrix.one_x_rps samples it
    one_x = ONE_X_UTILISATION * saturated_rps(params, sample) * len(replica_layout(counts))
    stop_at, warmup = TIMES["open"]
    summaries, audits, spreads = [], {}, {}
    for load in loads:
        workload = multi_tenant(seed=seed, rate_rps=one_x * load, duration_s=stop_at, abroad=abroad)
        for key in SYSTEM_KEYS:
            system = KV_SYSTEMS.get(key) or SYSTEMS[key]
            runs = []
            for variant in [replace(system, policy=p) for p in system.candidates] or [system]:
                started = time.perf_counter()
                cluster = build(variant, workload, counts, seed=seed, stop_at=stop_at, params=params)
                cluster.audit_forwards = key in AUDITED
                cluster.run()
                if key in AUDITED:
                    kept = [a for a in cluster.forward_audit if a[0] >= warmup]
                    roomy = [a for a in kept if a[1] and a[4]]
                    audits[f"multi_tenant@{load:g}x", key] = {
                        "forwards": len(kept), "held": sum(a[1] for a in kept),
                        "to_holder": sum(a[1] and a[2] for a in kept), "to_deepest": sum(a[1] and a[3] for a in kept),
                        "held_with_room": len(roomy), "to_holder_with_room": sum(a[2] for a in roomy)}
                if not system.candidates:
                    spreads[f"multi_tenant@{load:g}x", key] = spread(cluster, warmup, stop_at)
                runs.append(summarize(cluster, scenario=f"multi_tenant@{load:g}x", system=key, layout=system.layout,
                                      warmup_s=warmup, seed=seed, wall_s=time.perf_counter() - started))
            summary = best_of(runs, system=key, labels=system.candidates) if system.candidates else runs[0]
            summaries.append(summary)
            print(f"{summary.scenario} {key}: P90 TTFT {summary.ttft_p90:.2f} s, hit {summary.hit_rate:.3f}",
                  file=sys.stderr, flush=True)
    return summaries, one_x, audits, spreads


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report(summaries: list[RunSummary], *, one_x: float, command: str, kv_cache_tokens: int,
           audits: dict[tuple[str, str], dict[str, int]] | None = None, abroad: float = 0.0,
           spreads: dict[tuple[str, str], dict] | None = None) -> str:
    """The Markdown report: provenance, then one table per figure (rows: loads; columns: systems)."""
    dirty = " (uncommitted changes)" if _git("status", "--porcelain", "--", "skylb", "bench",
                                             ":(exclude)bench/results") else ""
    lines = [
        "# Routing by the trie vs by KV-cache events: multi-tenant shared prefixes, KV memory below the prefixes",
        "",
        f"Commit {_git('rev-parse', '--short', 'HEAD')}{dirty}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"`{command}`; {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. Simulated "
        f"(bench/sim), one seed, vLLM's engine model (L4 / Llama-3.1-8B timings). Workload: bench/sim/matrix.py `multi_tenant` (150 tenants, 750-token prefixes and "
        f"150-token questions: llm-d's 6k/1.2k at x1/8), 4 replicas per region in us, eu, asia, each with a KV cache "
        f"of {kv_cache_tokens} tokens ({12 * kv_cache_tokens} in all for 112,500 tokens of prefixes); 1x = "
        f"{one_x:.2f} req/s (0.8 of the saturated throughput). Measured over [15 s, 90 s)."
        + (f" Each tenant's requests come from its home region but {abroad:.0%} of them from one of the two others."
           if abroad else " Each tenant's requests come from its home region."),
        ""]
    loads = sorted({s.scenario for s in summaries}, key=lambda n: float(n.split("@")[1].rstrip("x")))
    by = {(s.scenario, s.system): s for s in summaries}
    for attr, title, digits in _FIGURES:
        lines += [f"## {title}", "", "| load | " + " | ".join(SYSTEM_KEYS) + " |",
                  "|---|" + "---:|" * len(SYSTEM_KEYS)]
        for scenario in loads:
            cells = [f"{getattr(by[scenario, k], attr):.{digits}f}" if (scenario, k) in by else "-"
                     for k in SYSTEM_KEYS]
            lines.append(f"| {scenario.split('@')[1]} | " + " | ".join(cells) + " |")
        lines.append("")
    if audits:
        lines += ["## Forwards to the region holding the prefix", "",
                  "After the warm-up: forwarded requests; of those, how many some peer's region held (at least half "
                  "of the prompt in one replica's prefix cache, the engines' own caches at the decision); of those, "
                  "how many went to a region that held it, and to the one that held most; then the same for the "
                  "forwards when a holding region had room (an available peer in the forwarding balancer's view).",
                  "",
                  "| load | system | forwarded | held by a peer's region | to a holding region | to the deepest "
                  "| held, a holder with room | to a holding region |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for scenario in loads:
            for key in AUDITED:
                a = audits.get((scenario, key))
                if a is None:
                    continue
                share = (lambda n, of: f"{n} ({100 * n / of:.0f}%)" if of else str(n))
                lines.append(f"| {scenario.split('@')[1]} | {key} | {a['forwards']} | {a['held']} | "
                             f"{share(a['to_holder'], a['held'])} | {share(a['to_deepest'], a['held'])} | "
                             f"{a['held_with_room']} | {share(a['to_holder_with_room'], a['held_with_room'])} |")
        lines.append("")
    if spreads:
        keys = [k for k in SYSTEM_KEYS if any((scenario, k) in spreads for scenario in loads)]
        lines += ["## How each tenant's requests spread over replicas", "",
                  "After the warm-up, per tenant: the request-weighted effective number of replicas serving it (the "
                  "inverse Simpson index of its requests' shares: 1 when one replica serves it all), then the "
                  "requests off the tenant's main replica, in that replica's region / in another region.", "",
                  "| load | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for scenario in loads:
            cells = [(lambda g: f"{g['effective']:.2f} ({g['off_same_region']} / {g['off_other_region']})")(
                spreads[scenario, k]["groups"]) if (scenario, k) in spreads else "-" for k in keys]
            lines.append(f"| {scenario.split('@')[1]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim.kv_routing", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loads", default="0.5,1,2,3", help="comma-separated multiples of the 1x rate")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--abroad", type=float, default=0.0,
                        help="share of each tenant's requests sent from another region than its home (0-1)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    summaries, one_x, audits, spreads = run(seed=args.seed, loads=loads, kv_cache_tokens=args.kv_cache_tokens,
                                            abroad=args.abroad)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.sim.kv_routing " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "kv_routing.json").write_text(json.dumps([s.to_dict() for s in summaries], indent=1) + "\n")
    (args.out / "kv_routing_audit.json").write_text(json.dumps(
        [{"scenario": s, "system": k, **a} for (s, k), a in audits.items()], indent=1) + "\n")
    (args.out / "kv_routing_spread.json").write_text(json.dumps(
        [{"scenario": s, "system": k, **g} for (s, k), g in spreads.items()], indent=1) + "\n")  # groups, engines
    (args.out / "kv_routing.md").write_text(report(summaries, one_x=one_x, command=command.strip(),
                                                   kv_cache_tokens=args.kv_cache_tokens, audits=audits,
                                                   abroad=args.abroad, spreads=spreads) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
