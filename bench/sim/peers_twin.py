"""The live comparisons (bench/live/peers.py across three regions, bench/live/baselines.py in one) replayed in the simulator:
the same sessions, clients, batch and round trips in simulated time, so a policy or setting can be ranked in seconds,
free of the noise of a shared machine, before it is measured live.

Three regions (bench/live/peers.py ``workload``: the trace's sessions assigned to regions us 0.6 / eu 0.2 / asia 0.2):
closed-loop clients as bench/replay/run.py ``replay_sessions`` runs them, except that a region's n clients take its
sessions in a fixed order (client i: sessions i, i + n, i + 2n, ...; live, a client takes the next one free, which
depends on timing), each turn ``think_s`` after the previous one ended, for the send window. One region
(``--one-region``): bench/live/baselines.py's synthetic conversations, one client each. Replicas: bench.emulator.model with
the live runs' batch and time scale. Systems:

* ``skylb``, ``skylb-ch``: one balancer per region (bench/sim/systems.py SkyLB, SkyLB-CH), forwarding.
* ``sglang-cache_aware``: one balancer in us, the ``sglang`` policy with the thresholds the live runs give the SGLang
  router (blind pushing into the engines' queues).
* ``least-load-us``: one balancer in us, least load, blind pushing.
* ``region-local``: one SkyLB balancer per region, no forwarding.
* ``oracle-skylb``, ``oracle-least-load``: one scheduler with a fresh view of every replica and a free network (a
  bound on what placement alone can do in this regime, not a system).

Figures: throughput in the send window, TTFT p50/p90 (ms) overall and per client region, the share forwarded, the
prefix hit rate, the mean TTFT split into the balancers' queue and the engines' queue, requests waiting at the
engines (peak, mean over 100 ms samples) and the learned admission capacities at the end. Usage:
``python -m bench.sim.peers_twin --seeds 0 1 2 3 4 [--set JSON] [--config JSON]`` (what-if options of SkyLB's
policy and balancer settings).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from bench.live.baselines import BaselinesSetup
from bench.emulator.model import EngineParams
from bench.live.peers import HOME, SYSTEMS as LIVE_SYSTEMS, PeersSetup, client_split, launch_options, workload
from bench.replay.report import percentile
from bench.sim.cluster import Cluster, Network
from bench.sim.systems import SYSTEMS, System, build, settings_for
from bench.sim.twin import LOCAL_RTT_MS
from bench.sim.workloads import ClientSpec, SimRequest, Workload, replayed
from bench.replay.workload import synthetic_workload

__all__ = ["TWIN_SYSTEMS", "sessions_workload", "simulate", "simulate_one_region", "main"]

TWIN_SYSTEMS: dict[str, System] = {
    "skylb": SYSTEMS["SkyLB"],
    "skylb-ch": SYSTEMS["SkyLB-CH"],
    "sglang-cache_aware": System("SGL-us", "SGLang cache_aware in us", "single", "sglang", home=HOME),
    "least-load-us": System("LL-us", "least load in us, blind pushing", "single", "least-load", home=HOME),
    "region-local": SYSTEMS["RegionLocal"],
    "oracle-skylb": replace(SYSTEMS["Oracle"], policy="skylb", candidates=()),
    "oracle-least-load": replace(SYSTEMS["Oracle"], policy="least-load", candidates=()),
}
#: Round trips between regions, ms (the live deployment's: configs/local-3region.yaml).
RTT_MS = {("us", "eu"): 80.0, ("us", "asia"): 150.0, ("eu", "asia"): 200.0}


def sessions_workload(sessions, clients: dict[str, int]) -> Workload:
    """Closed-loop clients over ``sessions`` (lists of bench.replay.workload.Request, one region each): ``clients[region]``
    clients per region, client i running that region's sessions i, i + n, ... one after another, client i of n
    starting at 2 i / n s (the live ramp)."""
    by_region: dict[str, list[list[SimRequest]]] = {}
    for turns in sessions:
        program = [SimRequest(r.id, r.session_id, r.prompt.split(), r.output_tokens, parent=r.after,
                              think_s=r.think_s if r.after else 0.0, _text=r.prompt) for r in turns]
        by_region.setdefault(turns[0].region, []).append(program)
    specs = []
    for region, n in clients.items():
        programs = by_region.get(region, [])
        for i in range(n):
            specs.append(ClientSpec(f"{region}-c{i}", region,
                                    lambda k, i=i, n=n, p=programs: p[i + k * n] if i + k * n < len(p) else None,
                                    start_s=2.0 * i / n))
    return Workload("peers-twin", "bench/live/peers.py sessions, closed loop", clients=specs)


def _settings(name: str, system: System, sglang: dict, overrides: dict | None, config: dict | None):
    """The balancer settings of ``name``: SGLang's thresholds for the router, the what-ifs for SkyLB's."""
    if name == "sglang-cache_aware":
        return settings_for("sglang", policies={"sglang": {"trie_chunk_chars": 256, **sglang}})
    if name.startswith("skylb") and (overrides or config):
        return settings_for(system.policy, policies={system.policy: overrides or {}}, **(config or {}))
    return None


def simulate(setup: PeersSetup, seed: int, systems, *, overrides: dict | None = None,
             config: dict | None = None) -> dict[str, dict]:
    """Run each of ``systems`` (keys of TWIN_SYSTEMS) on bench/live/peers.py run ``seed``'s sessions; name -> figures.
    ``overrides``: options of SkyLB's policy; ``config``: BalancerConfig fields of SkyLB's balancers."""
    sessions = workload(setup, seed)
    opts = launch_options(LIVE_SYSTEMS["sglang-cache_aware"], setup)
    sglang = {"match_threshold": opts["cache_threshold"], "balance_abs_threshold": opts["balance_abs_threshold"],
              "balance_rel_threshold": opts["balance_rel_threshold"]}
    params = EngineParams(max_num_seqs=setup.max_num_seqs, time_scale=setup.time_scale)
    counts = {g: setup.replicas for g in ("us", "eu", "asia")}
    out = {}
    for name in systems:
        system = TWIN_SYSTEMS[name]
        cluster = build(system, sessions_workload(sessions, client_split(setup.clients)), counts, seed=seed,
                        stop_at=setup.duration_s, network=Network(rtt_ms=RTT_MS, local_rtt_ms=LOCAL_RTT_MS),
                        params=params, settings=_settings(name, system, sglang, overrides, config)).run()
        out[name] = figures(cluster, setup.duration_s)
    return out


def simulate_one_region(setup: BaselinesSetup, seed: int, systems, *, overrides: dict | None = None,
                        config: dict | None = None) -> dict[str, dict]:
    """bench/live/baselines.py's regime (one region, ``setup``'s synthetic conversations with workload seed ``seed``,
    one client each, run to the end) for ``systems``; throughput over the whole run."""
    setup = replace(setup, seed=seed)
    requests = synthetic_workload(setup.workload_config(), ["us"])
    params = EngineParams(max_num_seqs=setup.max_num_seqs, time_scale=setup.time_scale)
    # bench/live/baselines.py sizes cache_aware for the cluster: half a batch, the bounded loads' headroom.
    sglang = {"balance_abs_threshold": max(1, setup.max_num_seqs // 2), "balance_rel_threshold": 1.25}
    out = {}
    for name in systems:
        system = TWIN_SYSTEMS[name]
        cluster = build(system, replayed(requests), {"us": setup.replicas}, seed=seed, stop_at=3600.0,
                        network=Network(local_rtt_ms=LOCAL_RTT_MS), params=params,
                        settings=_settings(name, system, sglang, overrides, config)).run()
        out[name] = figures(cluster, max(f.done_at for f in cluster.records))
    return out


def figures(cluster: Cluster, window_s: float) -> dict:
    """The figures of a finished run (module docstring); ``window_s``: the send window (s)."""
    records = cluster.records
    ttft = [1000 * (f.first_token_at - f.sent_at) for f in records]
    by_region: dict[str, list[float]] = {}
    for f, t in zip(records, ttft):
        by_region.setdefault(f.region, []).append(t)
    n = max(1, len(records))
    waiting = [w for sample in cluster.samples for w in sample[2]]
    return {"rps": sum(f.done_at <= window_s for f in records) / window_s,
            "p50": percentile(ttft, 50), "p90": percentile(ttft, 90),
            "p90_by_region": {r: round(percentile(v, 90)) for r, v in by_region.items()},
            "fwd": sum(f.forwarded for f in records) / n,
            "hit": sum(f.result.cached_tokens for f in records) / max(1, sum(f.result.prompt_tokens for f in records)),
            "lb_queue_ms": round(1000 * sum(f.origin_decision.queued_s if f.origin_decision else 0.0
                                            for f in records) / n),
            "engine_queue_ms": round(1000 * sum(f.result.queue_s for f in records) / n),
            "pending_peak": max(waiting, default=0), "pending_mean": round(sum(waiting) / max(1, len(waiting)), 2),
            "limits": sorted(r.capacity.limit for b in cluster.balancers.values() for r in b.router.replicas.values())}


def _mean(figs: list[dict], key: str) -> float:
    return sum(f[key] for f in figs) / len(figs)


def report(rows: dict[str, list[dict]], *, title: str, seeds: list[int], prov: dict) -> str:
    """Markdown: the means over ``seeds`` (with min and max) of each system in ``rows`` (name -> figures per seed),
    SkyLB's paired wins against each other system, and the provenance line of ``prov``."""
    from tabulate import tabulate
    from bench.reporting.provenance import provenance_line
    table = []
    for name, figs in rows.items():
        spread = lambda k, fmt: f"{fmt.format(_mean(figs, k))} [{fmt.format(min(f[k] for f in figs))}, " \
                                f"{fmt.format(max(f[k] for f in figs))}]"
        table.append([name, spread("rps", "{:.2f}"), spread("p50", "{:.0f}"), spread("p90", "{:.0f}"),
                      f"{_mean(figs, 'fwd'):.0%}", f"{_mean(figs, 'hit'):.1%}",
                      f"{_mean(figs, 'lb_queue_ms'):.0f} / {_mean(figs, 'engine_queue_ms'):.0f}",
                      f"{max(f['pending_peak'] for f in figs)} / {_mean(figs, 'pending_mean'):.2f}"])
    lines = [f"# {title}", "", provenance_line(prov), "",
             f"Simulated (bench/sim/peers_twin.py), seeds {', '.join(map(str, seeds))}; cells: mean [min, max] over "
             "the seeds. Deterministic: the figures do not depend on the machine's load.", "",
             tabulate(table, headers=["system", "req/s", "TTFT p50 ms", "TTFT p90 ms", "forwarded", "prefix hit",
                                      "queue ms: balancer / engine", "waiting at an engine: peak / mean"],
                      tablefmt="github"), ""]
    sky = rows.get("skylb")
    for name, figs in rows.items():
        if sky is None or name == "skylb":
            continue
        wins = sum(a["p90"] < b["p90"] for a, b in zip(sky, figs))
        lines.append(f"- skylb vs {name}: P90 TTFT {_mean(sky, 'p90') / _mean(figs, 'p90'):.2f}x, lower in {wins} "
                     f"of {len(figs)} seeds; throughput {_mean(sky, 'rps') / _mean(figs, 'rps'):.3f}x.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Print the figures of each system for each seed, and their means; with ``--out-md``, write the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["skylb", "sglang-cache_aware"], choices=list(TWIN_SYSTEMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: bench/live/peers.py's)")
    p.add_argument("--one-region", action="store_true", help="bench/live/baselines.py's regime instead")
    p.add_argument("--set", default="{}", help="JSON options of SkyLB's policy (what-if)")
    p.add_argument("--config", default="{}", help="JSON BalancerConfig fields of SkyLB's balancers (what-if)")
    p.add_argument("--out-md", default="", help="write a Markdown report here (and its JSON beside it)")
    a = p.parse_args(argv)
    from bench.reporting.provenance import provenance
    # Taken before anything is written: a rewritten tracked report would mark the checkout dirty.
    prov = provenance("python -m bench.sim.peers_twin " + " ".join(sys.argv[1:] if argv is None else argv))
    rows: dict[str, list[dict]] = {}
    for seed in a.seeds:
        if a.one_region:
            figs = simulate_one_region(BaselinesSetup(), seed, [s for s in a.systems if s != "region-local"],
                                       overrides=json.loads(a.set), config=json.loads(a.config))
        else:
            setup = PeersSetup(**({"trace": a.trace} if a.trace else {}))
            figs = simulate(setup, seed, a.systems, overrides=json.loads(a.set), config=json.loads(a.config))
        for name, fig in figs.items():
            rows.setdefault(name, []).append(fig)
            print(f"seed {seed} {name:18s} req/s {fig['rps']:6.2f} TTFT p50 {fig['p50']:5.0f} p90 {fig['p90']:5.0f} "
                  f"{fig['p90_by_region']} fwd {fig['fwd']:.0%} hit {fig['hit']:.1%} queue ms lb "
                  f"{fig['lb_queue_ms']} engine {fig['engine_queue_ms']} pending {fig['pending_peak']} / "
                  f"{fig['pending_mean']}", flush=True)
    for name, figs in rows.items():
        k = len(figs)
        print(f"mean {name:18s} req/s {sum(f['rps'] for f in figs) / k:6.2f} "
              f"TTFT p50 {sum(f['p50'] for f in figs) / k:5.0f} p90 {sum(f['p90'] for f in figs) / k:5.0f}")
    if a.out_md:
        from pathlib import Path
        title = ("One region (bench/live/baselines.py's regime) in the simulator" if a.one_region else
                 "Three regions (bench/live/peers.py's regime) in the simulator")
        Path(a.out_md).write_text(report(rows, title=title, seeds=a.seeds, prov=prov))
        Path(a.out_md).with_suffix(".json").write_text(json.dumps(
            {"provenance": prov, "title": title, "seeds": a.seeds, "systems": rows}, indent=1))


if __name__ == "__main__":
    main()
