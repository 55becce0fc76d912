"""Where a simulated cell's time to first token goes, request by request: a diagnostic for the routing rules.

``.venv/bin/python -m bench.sim.ttft_parts CELL [--seed 0] [--split dev] [--stop-at S] [--counts us=2,eu=4,asia=6]
[--rtt-scale X] SYSTEM...`` (CELL: a robustness-matrix cell such as ``tot@0.5x``, bench/sim/matrix.py, on its own
replicas per region or those of ``--counts``, its round trips between regions x ``--rtt-scale``; SYSTEM: a key of bench/sim/systems.py ``SYSTEMS``
or ``LAYOUT:POLICY`` for one of the oracle's candidates in a layout (``global:skylb-paper``, bench/sim/oracle_gap.py),
each optionally followed by ``+option=value`` for the ``skylb`` policy's options or ``+cfg.setting=value`` for a
balancer setting, Python literals). Prints, per system, the requests sent in the measurement window in three groups:
``first`` (no parent: a tree's root, a conversation's first turn, an open-loop request), ``same`` (on the replica
that served its parent: a tree's branch or a session's next turn kept where its context is) and ``other``
(elsewhere). Per group: its share, the mean TTFT and its parts (client to engine: network and balancer queue;
engine queue: arrival at the engine to its first scheduled step; prefill: that step to the first token, which
includes the prompts batched beside it), the uncached prompt tokens and the hit rate, the time per output token and
the end-to-end time, and at arrival the replica's requests (running and waiting) over the least and the mean of its
region's replicas and the requests waiting in its engine; then the same parts for the group's requests in the tail
(TTFT at or above the run's P90). With ``--by-region``, also per client region: TTFT mean and P90, and the same
parts for the region's requests served at home and served abroad (a replica of another region). With ``--spread``,
also per replica region the engines' mean running and waiting requests per replica and KV-cache usage over the
window (sampled every 0.1 s), and how each prompt group (the requests whose prompts agree on their first 16 tokens
past what every prompt of the run shares: a tenant of ``multi_tenant``, a tree, a session) spreads over replicas:
replicas per group, the request-weighted effective number (inverse Simpson index of its requests' shares) and its
requests off the group's main replica, in that replica's region or another. Prefix-sharing requests on one replica
share KV blocks, so a spread group costs KV memory and with it the running batch. Times in seconds unless marked;
simulated time throughout.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
from dataclasses import replace

__all__ = ["parse_system", "run", "spread", "main"]

GROUPS = ("first", "same", "other")
#: Tokens past the run's common prefix that name a prompt group (``--spread``).
GROUP_TOKENS = 16


def parse_system(spec: str):
    """(System, policy options, balancer settings) of ``SYSTEM[+key=value...]`` (module docstring)."""
    from bench.sim.systems import SYSTEMS, System
    name, *opts = spec.split("+")
    if name in SYSTEMS:
        system = SYSTEMS[name]
    elif ":" in name:
        layout, policy = name.split(":", 1)
        system = System(name, f"{policy} in the {layout} layout", layout, policy)
    else:
        raise ValueError(f"unknown system {name!r}: a key of bench/sim/systems.py SYSTEMS or LAYOUT:POLICY")
    options, settings = {}, {}
    for item in opts:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"option {item!r}: expected key=value")
        (settings if key.startswith("cfg.") else options)[key.removeprefix("cfg.")] = ast.literal_eval(value)
    return replace(system, candidates=()), options, settings


def run(cell: str, spec: str, *, seed: int = 0, split: str = "dev", stop_at: float | None = None,
        counts: tuple[tuple[str, int], ...] | None = None, rtt_scale: float = 1.0) -> dict:
    """Run ``spec`` on ``cell`` (on ``counts`` replicas per region instead of the cell's, bench/sim/matrix.py
    ``deployed``; every round trip between regions x ``rtt_scale``); returns {"p90", "mean", "throughput", "groups": {group: {figure: mean}}, "tail": {group:
    {figure: mean}}} (module docstring for the figures)."""
    from bench.sim.matrix import TIMES, WORKLOADS, deployed, parse_cell, trace_window
    from bench.sim.regime import engine_params
    from bench.sim.systems import build
    from skylb.config import BalancerConfig
    system, options, cfg = parse_system(spec)
    params = engine_params()
    name, load = parse_cell(cell)
    wl = deployed(WORKLOADS[name], counts)
    full_stop, warmup_s = TIMES[wl.kind]
    stop_at = stop_at or full_stop
    settings = None
    if options or cfg:
        settings = BalancerConfig.model_validate(BalancerConfig().model_dump() | cfg | (
            {"policies": {system.policy: options}} if options else {}))
    from bench.sim.cluster import farther
    network = farther(rtt_scale)
    cluster = build(system, wl.make(seed, load, trace_window(split, seed), stop_at), dict(wl.counts), seed=seed,
                    stop_at=stop_at, network=network, params=params, settings=settings,
                    replica_params=wl.replica_params(params))
    at_arrival: dict[str, tuple[int, float, float, int]] = {}

    def arrived(replica, flight) -> None:
        load = {r.id: r.engine.num_running + r.engine.num_waiting for r in cluster.replicas.values()
                if r.region == replica.region}
        own = load[replica.id]
        at_arrival[flight.req.id] = (own - min(load.values()), own - statistics.fmean(load.values()),
                                     replica.engine.num_waiting)

    cluster.submit_hooks.append(arrived)
    cluster.run()
    done = {f.req.id: f for f in cluster.records}
    rows = []
    for f in cluster.records:
        if not (warmup_s <= f.sent_at < stop_at) or f.result is None or f.req.id not in at_arrival:
            continue
        r, parent = f.result, done.get(f.req.parent) if f.req.parent else None
        group = "first" if f.req.parent is None else "same" if parent is not None and parent.replica is f.replica \
            else "other"
        over_min, over_mean, waiting = at_arrival[f.req.id]
        rows.append({"group": group, "region": f.region,
                     "abroad": f.replica is not None and f.replica.region != f.region,
                     "ttft": f.first_token_at - f.sent_at, "to_engine": r.submitted_at - f.sent_at,
                     "engine_queue": r.admitted_at - r.submitted_at, "prefill": r.first_token_at - r.admitted_at,
                     "uncached": r.prompt_tokens - r.cached_tokens,
                     "hit": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
                     "tpot_ms": 1e3 * (r.finished_at - r.first_token_at) / max(1, r.completion_tokens - 1),
                     "e2e": f.done_at - f.sent_at, "over_min": over_min, "over_mean": over_mean,
                     "waiting": waiting})
    if not rows:
        raise RuntimeError(f"{cell} {spec}: no request completed in the window")
    ttfts = sorted(x["ttft"] for x in rows)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]

    def means(subset: list[dict]) -> dict:
        return {"n": len(subset), **{k: statistics.fmean(x[k] for x in subset) for k in rows[0]
                                     if k not in ("group", "region")}}

    groups = {g: means(sub) for g in GROUPS if (sub := [x for x in rows if x["group"] == g])}
    tail = {g: means(sub) for g in GROUPS if (sub := [x for x in rows if x["group"] == g and x["ttft"] >= p90])}
    regions = {}
    for region in sorted({x["region"] for x in rows}):
        own = [x for x in rows if x["region"] == region]
        times = sorted(x["ttft"] for x in own)
        regions[region] = {"p90": times[min(len(times) - 1, int(0.9 * len(times)))], **{
            where: means(sub) for where, sub in (("home", [x for x in own if not x["abroad"]]),
                                                 ("abroad", [x for x in own if x["abroad"]])) if sub}}
    return {"p90": p90, "mean": statistics.fmean(ttfts), "throughput": len(rows) / (stop_at - warmup_s),
            "requests": len(rows), "groups": groups, "tail": tail, "regions": regions,
            "spread": spread(cluster, warmup_s, stop_at)}


def spread(cluster, warmup_s: float, stop_at: float) -> dict:
    """How a finished simulated ``cluster``'s requests sent in [``warmup_s``, ``stop_at``) s spread (module docstring,
    ``--spread``): {"engines": {region: {"running", "waiting" (requests per replica), "kv" (usage, 0-1)}},
    "groups": {"groups", "requests", "replicas" (distinct per group), "effective" (request-weighted inverse Simpson
    index), "off_same_region", "off_other_region" (requests off their group's main replica)}}."""
    ids = list(cluster.replicas)
    region_of = {rid: cluster.replicas[rid].region for rid in ids}
    samples = [s for s in cluster.samples if warmup_s <= s[0] < stop_at]
    engines = {}
    for region in sorted(set(region_of.values())):
        idx = [i for i, rid in enumerate(ids) if region_of[rid] == region]
        if samples:
            in_engine = statistics.fmean(s[1][i] for s in samples for i in idx)
            waiting = statistics.fmean(s[2][i] for s in samples for i in idx)
            engines[region] = {"running": in_engine - waiting, "waiting": waiting,
                               "kv": statistics.fmean(s[4][i] for s in samples for i in idx)}
    measured = [f for f in cluster.records if warmup_s <= f.sent_at < stop_at and f.replica is not None]
    shared = len(os.path.commonprefix([f.req.tokens for f in measured])) if measured else 0
    per_group: dict[tuple, dict[str, int]] = {}
    for f in measured:
        counts = per_group.setdefault(tuple(f.req.tokens[shared:shared + GROUP_TOKENS]), {})
        counts[f.replica.id] = counts.get(f.replica.id, 0) + 1
    n = sum(sum(c.values()) for c in per_group.values())
    same = other = 0
    effective = 0.0
    for counts in per_group.values():
        total = sum(counts.values())
        effective += total / sum((v / total) ** 2 for v in counts.values())  # request-weighted inverse Simpson
        main = max(counts, key=lambda rid: (counts[rid], rid))
        for rid, v in counts.items():
            if rid != main:
                same, other = (same + v, other) if region_of[rid] == region_of[main] else (same, other + v)
    groups = {"groups": len(per_group), "requests": n,
              "replicas": statistics.fmean(len(c) for c in per_group.values()) if per_group else 0.0,
              "effective": effective / n if n else 0.0, "off_same_region": same, "off_other_region": other}
    return {"engines": engines, "groups": groups}


def render(cell: str, spec: str, result: dict, *, by_region: bool = False, spread: bool = False) -> str:
    """The printed block of one ``run`` (with ``by_region`` and ``spread``, those lines too)."""
    lines = [f"== {cell} {spec}: {result['requests']} requests, TTFT P90 {result['p90']:.3f} s, mean "
             f"{result['mean']:.3f} s, {result['throughput']:.2f} req/s"]
    for g, m in result["groups"].items():
        t = result["tail"].get(g)
        lines.append(f"  {g:5s} {m['n'] / result['requests']:4.0%} ttft {m['ttft']:.3f} = to engine "
                     f"{m['to_engine']:.3f} + engine queue {m['engine_queue']:.3f} + prefill {m['prefill']:.3f}; "
                     f"uncached {m['uncached']:.0f} hit {m['hit']:.2f}; tpot {m['tpot_ms']:.1f} ms e2e {m['e2e']:.2f}; "
                     f"at arrival +{m['over_min']:.1f} over least, {m['over_mean']:+.1f} over mean, "
                     f"{m['waiting']:.2f} waiting")
        if t:
            lines.append(f"        tail {t['n']}: engine queue {t['engine_queue']:.3f} prefill {t['prefill']:.3f} "
                         f"uncached {t['uncached']:.0f} to engine {t['to_engine']:.3f}")
    for region, r in result["regions"].items() if by_region else ():
        n = sum(r[w]["n"] for w in ("home", "abroad") if w in r)
        lines.append(f"  from {region or '-'}: {n} requests, TTFT P90 {r['p90']:.3f}")
        for where in ("home", "abroad"):
            if where in r:
                m = r[where]
                lines.append(f"    served {where:6s} {m['n'] / n:4.0%} ttft {m['ttft']:.3f} = to engine "
                             f"{m['to_engine']:.3f} + engine queue {m['engine_queue']:.3f} + prefill "
                             f"{m['prefill']:.3f}; hit {m['hit']:.2f}")
    if spread:
        for region, e in result["spread"]["engines"].items():
            lines.append(f"  engines in {region}: {e['running']:.1f} running, {e['waiting']:.1f} waiting per replica, "
                         f"KV usage {e['kv']:.2f}")
        g = result["spread"]["groups"]
        lines.append(f"  {g['groups']} prompt groups: {g['replicas']:.2f} replicas each, {g['effective']:.2f} "
                     f"effective (request-weighted); off the main replica {g['off_same_region']} in its region, "
                     f"{g['off_other_region']} in another, of {g['requests']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run each system on the cell and print its block; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.ttft_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("cell", help="a robustness-matrix cell, e.g. tot@0.5x")
    p.add_argument("systems", nargs="+", help="SYSTEM[+option=value...] (module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="dev", choices=("dev", "val"))
    p.add_argument("--stop-at", type=float, default=None, help="simulated seconds of sending (default: the cell's)")
    p.add_argument("--counts", default=None, metavar="us=N,eu=N,asia=N",
                   help="replicas per region instead of the cell's (e.g. us=2,eu=4,asia=6)")
    p.add_argument("--rtt-scale", type=float, default=1.0, metavar="X",
                   help="every round trip between regions x this (default 1)")
    p.add_argument("--by-region", action="store_true",
                   help="also per client region: TTFT and its parts, served at home and abroad")
    p.add_argument("--spread", action="store_true",
                   help="also the engines' running batch per region and how prompt groups spread over replicas")
    args = p.parse_args(argv)
    try:
        from bench.sim.matrix import parse_counts
        counts = parse_counts(args.counts) if args.counts else None
        for spec in args.systems:
            print(render(args.cell, spec, run(args.cell, spec, seed=args.seed, split=args.split,
                                              stop_at=args.stop_at, counts=counts, rtt_scale=args.rtt_scale),
                         by_region=args.by_region,
                         spread=args.spread), flush=True)
    except (ValueError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
