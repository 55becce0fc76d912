"""`skylb bench chaos`: the whole three-region deployment under closed-loop load while a seeded schedule of faults
runs, counting per fault what was lost or duplicated, how long detection and recovery took, and what TTFT did.

The deployment (bench/chaos/cluster.py): three controllers on a three-member etcd, Redis for quotas, BIND for DNS,
``--replicas`` emulated replicas per region, one balancer per region (``--siblings N``: N, each replica owned by one
of them), every cuttable path through a latency link.
The load (bench/chaos/client.py): ``--clients`` closed-loop clients per region running the trace's sessions
(``--trace``, bench/replay/workload.py ``trace_sessions``), resolving through BIND and retrying once on a connection
error. The faults (bench/chaos/faults.py): the full schedule (SIGKILLs of a replica mid-stream, a balancer, the
controller leader, an etcd member and Redis; a partition, an asymmetric partition, a latency spike, a slow replica,
a replica answering 500s and a split brain) or ``--short`` (a replica kill, a balancer kill, a partition and the
split brain, under 60 s). The figures (bench/chaos/measure.py) and the report (bench/chaos/report.py).

Entry points: ``skylb bench chaos [--seeds 1,2,3] [--out-md bench/results/chaos.md]`` or ``python -m bench.chaos.run``;
:func:`run_once` ``(work, seed, ...) -> dict`` for one run (the test's short schedule uses it); :func:`main`
``(argv) -> int``: 0 when no request was lost or duplicated in any run, 1 otherwise. Every process is stopped at the
end of each run, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.chaos.client import ClientPlan, run_clients
from bench.chaos.cluster import MODEL, ChaosCluster, ClusterSettings
from bench.chaos.faults import FULL_SCHEDULE, SHORT_SCHEDULE, run_schedule, schedule
from bench.chaos.measure import measure_run
from bench.chaos.observe import Observer, evidence, executions, stale_epoch_refusals
from bench.sim.workloads import DEFAULT_TRACE
from bench.replay.workload import trace_sessions

__all__ = ["run_once", "run_chaos", "main", "DEFAULT_TRACE"]

#: Seconds of load after the last planned fault ends, so its recovery is seen.
TAIL_S = 12.0
#: Requests in the sessions the clients run: more than a full run sends (about 4,000 with one balancer per region),
#: so the load lasts to the end of the schedule.
SESSION_REQUESTS = 8000


def _load() -> dict[str, float]:
    one, five, _ = os.getloadavg()
    return {"load_1m": round(one, 2), "load_5m": round(five, 2), "cores": os.cpu_count()}


def run_once(work: Path, seed: int, *, short: bool, trace: Path, clients: int = 6, replicas: int = 4,
             token_scale: float = 0.05, settings: ClusterSettings | None = None,
             siblings: int = 1) -> dict[str, Any]:
    """One chaos run: start the deployment, load it, run the schedule, stop everything; returns the figures
    (bench/chaos/measure.py ``measure_run``) with the faults, the settings and the machine's load. ``siblings``:
    balancers per region when ``settings`` is not given."""
    settings = settings or ClusterSettings(replicas_per_region=replicas, siblings=siblings)
    cluster = ChaosCluster(work, settings)
    plan = SHORT_SCHEDULE if short else FULL_SCHEDULE
    faults = schedule(plan, cluster.regions, settings.replicas_per_region, seed, siblings=settings.siblings)
    stop_s = max(f.start_s + f.duration_s for f in faults) + (6.0 if short else TAIL_S)
    load_before = _load()
    abort, thread = threading.Event(), None
    try:
        started = time.monotonic()
        cluster.start()
        startup_s = time.monotonic() - started
        sessions = trace_sessions(trace, cluster.regions, weights={r: 1.0 for r in cluster.regions}, seed=seed,
                                  token_scale=token_scale, requests=SESSION_REQUESTS, max_turns=8)
        plan_c = ClientPlan(dns_server=cluster.bind.host, dns_port=cluster.bind.port, name=cluster.bind.name,
                            port=cluster.balancer_port, dial=cluster.client_address_for,
                            sources={r: cluster.client_source(r) for r in cluster.regions}, model=MODEL)
        t0, wall0 = time.monotonic(), time.time()
        clock = lambda: time.monotonic() - t0  # noqa: E731 - the run's one clock
        observer = Observer(cluster, clock)
        observer.start()
        leader_before = cluster.leader()
        errors: list[BaseException] = []

        def faults_thread() -> None:
            try:
                run_schedule(cluster, faults, clock, stop_s, abort)
            except BaseException as exc:  # noqa: BLE001 - reported with the run
                errors.append(exc)

        thread = threading.Thread(target=faults_thread, name="chaos-faults", daemon=True)
        thread.start()
        records = asyncio.run(run_clients(plan_c, sessions, dict.fromkeys(cluster.regions, clients),
                                          run_id=f"s{seed}", t0=t0, stop_s=stop_s))
        thread.join(timeout=120)
        time.sleep(1.0)  # the last request lines reach the logs
        # The recovery of the last fault is watched to the planned end even when the clients ran out of sessions
        # first (the tail after the last heal is what the recovery figures read).
        while clock() < stop_s and not abort.is_set():
            time.sleep(0.1)
        observer.stop()
        if errors:
            raise RuntimeError(f"fault schedule failed: {errors[0]!r}") from errors[0]
        for f in faults:  # from the cut to 20 s after the heal (the recovery, bounded)
            if f.kind in ("partition", "split_brain") and f.ended_s is not None:
                f.notes["stale_epoch_refusals"] = stale_epoch_refusals(
                    cluster, f.target, wall0 + f.started_s, wall0 + f.ended_s + 20.0)
        figures = measure_run(faults, observer.samples, records, executions(cluster),
                              leader_before=leader_before, quota_cap=settings.quota_max_concurrent,
                              balancers=cluster.balancers, replicas=settings.replicas_per_region)
        figures["duplicate_evidence"] = evidence(cluster, figures["duplicated_attempts"])
        return {**figures, "seed": seed, "short": short, "startup_s": round(startup_s, 1),
                "load_s": round(stop_s, 1), "machine_load_before": load_before, "machine_load_after": _load(),
                "settings": {"clients_per_region": clients, "replicas_per_region": settings.replicas_per_region,
                             "balancers_per_region": settings.siblings,
                             "time_scale": settings.time_scale, "max_num_seqs": settings.max_num_seqs,
                             "quota_max_concurrent": settings.quota_max_concurrent, "token_scale": token_scale,
                             "rtt_ms": settings.rtt_ms, "balancer": settings.balancer,
                             "trace": trace.name},
                "samples": len(observer.samples), "records": [r.to_dict() for r in records]}
    finally:
        abort.set()  # the schedule restarts nothing once the teardown began
        if thread is not None:
            thread.join(timeout=60)
        cluster.stop()


def run_chaos(seeds: list[int], **kwargs) -> dict[str, Any]:
    """One run per seed (each in a fresh temporary directory); returns {"runs": [...]}."""
    runs = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix=f"skylb-chaos-{seed}-") as tmp:
            runs.append(run_once(Path(tmp), seed, **kwargs))
        r = runs[-1]
        print(f"seed {seed}: {r['requests']} requests, outcomes {r['outcomes']}, "
              f"lost {sum(f['lost'] for f in r['faults'])}, duplicated {len(r['duplicated_attempts'])}",
              file=sys.stderr, flush=True)
    return {"runs": runs}


def build_parser() -> argparse.ArgumentParser:
    """`skylb bench chaos` options."""
    p = argparse.ArgumentParser(prog="skylb bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, one run each (default: 1,2,3)")
    p.add_argument("--short", action="store_true", help="the short schedule (under 60 s of faults)")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake trace whose sessions the clients run (default: $SKYLB_TRACE, else the "
                        "workspace's shared/traces/mooncake_conversation_trace.jsonl)")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients per region (default: 6)")
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas per region (default: 4)")
    p.add_argument("--siblings", type=int, default=1, help="balancers per region (1-10; default: 1); each replica "
                   "is owned by one of them, and a balancer's faults hit one of them")
    p.add_argument("--batch", type=int, default=4,
                   help="each replica's running batch, vLLM --max-num-seqs (requests; default: 4)")
    p.add_argument("--quota-cap", type=int, default=8,
                   help="the model's concurrency cap over all balancers, counted in Redis (requests; default: 8, "
                        "so the cap binds and Redis' fallback can over-admit)")
    p.add_argument("--token-scale", type=float, default=0.05,
                   help="prompt and output lengths x this (default: 0.05, so a 2-core machine keeps up)")
    p.add_argument("--out-md", default=None, metavar="PATH", help="also write the report here "
                   "(e.g. bench/results/chaos.md)")
    p.add_argument("--out-json", default=None, metavar="PATH", help="also write the figures as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report; 0 when nothing was lost or duplicated, 1 otherwise, 2 on bad
    input."""
    from bench.chaos.report import format_markdown
    from bench.replay.report import emit_markdown
    args = build_parser().parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"--seeds must be integers separated by commas, got {args.seeds!r}", file=sys.stderr)
        return 2
    trace = args.trace or Path(os.environ.get("SKYLB_TRACE", DEFAULT_TRACE))
    if not trace.is_file():
        print(f"trace {trace} not found (--trace PATH)", file=sys.stderr)
        return 2
    if (not seeds or min(args.clients, args.replicas, args.batch, args.quota_cap) < 1 or args.token_scale <= 0
            or not 1 <= args.siblings <= 10):
        print("need at least one seed, --clients, --replicas, --batch and --quota-cap >= 1, --siblings 1-10 and "
              "--token-scale > 0", file=sys.stderr)
        return 2
    from bench.reporting.provenance import provenance
    prov = provenance()  # at the start: the code that ran, even if the checkout changes during the runs
    try:
        result = run_chaos(seeds, short=args.short, trace=trace, clients=args.clients, replicas=args.replicas,
                           token_scale=args.token_scale,
                           settings=ClusterSettings(replicas_per_region=args.replicas, max_num_seqs=args.batch,
                                                    quota_max_concurrent=args.quota_cap, siblings=args.siblings))
    except RuntimeError as exc:
        print(f"chaos benchmark failed: {exc}", file=sys.stderr)
        return 1
    result["provenance"] = prov
    for run in result["runs"]:  # every request's record would be megabytes; the errors are what one reads again
        run["records_not_ok"] = [r for r in run.pop("records") if r["outcome"] != "ok"]
    emit_markdown(format_markdown(result), result, out_md=args.out_md, out_json=args.out_json)
    bad = sum(f["lost"] + f["duplicated"] for r in result["runs"] for f in r["faults"])
    bad += sum(r["outcomes"].get("lost", 0) + r["outcomes"].get("duplicated", 0) + len(r["duplicated_attempts"])
               for r in result["runs"])
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
