"""The Markdown report of `skylb bench chaos`: per fault kind over the runs, then each run's schedule.

Figures over runs are ``median [min, max]`` (seconds or ms); counts are totals over the runs. A request overlapping
two faults' windows counts in both rows.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from bench.chaos.faults import KINDS
from bench.replay.report import markdown_table

__all__ = ["format_markdown", "spread"]

_DETECTED = {"replica_kill": "its balancer marks the replica unhealthy",
             "replica_500": "its balancer ejects the replica (outlier detection)",
             "balancer_kill": "the controllers mark the balancer unhealthy",
             "leader_kill": "another controller leads",
             "etcd_kill": "the member is unhealthy (the quorum goes on)",
             "redis_kill": "a balancer's quota falls back to its share",
             "partition": "the controllers mark the cut balancer unhealthy",
             "asymmetric": "the balancer reports the controllers unreachable",
             "split_brain": "the controllers mark the cut balancer unhealthy",
             "latency_spike": "nothing to detect", "slow_replica": "nothing to detect"}
_RECOVERED = {"replica_kill": "restarted replica healthy again",
              "replica_500": "replica healthy and no longer ejected",
              "balancer_kill": "region back at its own balancer, seen by controllers and peers",
              "leader_kill": "a leader, the killed controller restarted",
              "etcd_kill": "all three members healthy, a leader",
              "redis_kill": "every balancer back on Redis",
              "partition": "region back at its own balancer, seen by controllers and peers",
              "asymmetric": "the balancer reaches the controllers again",
              "split_brain": "region back at its own balancer and its replicas at one balancer only",
              "latency_spike": "(link restored)", "slow_replica": "(replica restored)"}


def spread(values: list[float | None], unit: str = "") -> str:
    """``median [min, max]`` of the values that are not None, or "n/a"."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):.2f} [{min(vals):.2f}, {max(vals):.2f}]{unit}"


def _by_kind(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        for f in run["faults"]:
            out[f["fault"]["kind"]].append(f)
    return out


def _fault_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    kinds = _by_kind(runs)
    for kind in KINDS:
        fs = kinds.get(kind)
        if not fs:
            continue
        outcomes: dict[str, int] = defaultdict(int)
        for f in fs:
            for k, v in f["outcomes"].items():
                outcomes[k] += v
        errors = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if k != "ok") or "none"
        rows.append([kind, str(len(fs)), str(sum(f["requests"] for f in fs)), str(sum(f["lost"] for f in fs)),
                     str(sum(f["duplicated"] for f in fs)), errors,
                     f"{sum(f['client_retries'] for f in fs)} ({sum(f['retries_executed_twice'] for f in fs)})",
                     spread([f["detected_s"] for f in fs]), spread([f["recovered_s"] for f in fs]),
                     spread([f["ttft_p90_during_ms"] for f in fs])])
    return rows


def _split_brain(runs: list[dict]) -> str:
    sb = [f for f in _by_kind(runs).get("split_brain", []) if "split_brain" in f]
    if not sb:
        return ""
    rows = [[f"{r['seed']}", f["fault"]["target"], f"{f['split_brain']['overlap_s']:.2f}",
             str(f["split_brain"].get("overlap_from_s")), str(f["split_brain"].get("overlap_after_heal_s", "")),
             str(f["split_brain"]["shared"]), str(f["split_brain"]["peak_pending"]),
             str(f["split_brain"]["peak_outstanding"]), str(f["fault"]["notes"].get("stale_epoch_refusals", "")),
             str(f["lost"]), str(f["duplicated"])]
            for r in runs for f in r["faults"] if f["fault"]["kind"] == "split_brain" and "split_brain" in f]
    return "\n".join([
        "## Split brain", "",
        "One balancer cut from the controllers both ways while it keeps serving its region and its peers. The "
        "controllers fail its region over to the closest live balancer, which then pushes to the same replicas "
        "(static stability: the cut balancer keeps its last membership). Overlap: how long both balancers listed "
        "the region's replicas (sampled every 0.3 s); pending: the engine queue of a shared replica at a balancer's "
        "last probe; outstanding: both balancers' requests in flight on one shared replica; stale-epoch refusals: "
        "heartbeats of the cut balancer the controllers refused (409 stale_epoch) from the cut to 20 s after the heal, after which it "
        "re-read membership and dropped the replicas it no longer served (skylb/balancer/membership.py); none "
        "means the failback reached it first.", "",
        markdown_table(["seed", "region", "overlap s", "overlap began s after the cut", "overlap left after heal s",
                        "shared replicas", "peak pending", "peak outstanding", "stale-epoch refusals", "lost",
                        "duplicated"], rows), "",
        f"Overlap {spread([f['split_brain']['overlap_s'] for f in sb], ' s')}; peak pending "
        f"{max(f['split_brain']['peak_pending'] for f in sb)}, peak outstanding "
        f"{max(f['split_brain']['peak_outstanding'] for f in sb)} (per replica, its batch is "
        f"{runs[0]['settings']['max_num_seqs']}).", ""])


def _redis(runs: list[dict]) -> str:
    rk = [(r, f) for r in runs for f in r["faults"] if f["fault"]["kind"] == "redis_kill"]
    if not rk:
        return ""
    cap = rk[0][1]["quota_cap"]
    rows = [[str(r["seed"]), str(cap), str(r["admitted_peak_before_faults"]), str(f["admitted_peak_during"]),
             str(max(0, f["admitted_peak_during"] - cap))] for r, f in rk]
    return "\n".join([
        "## Redis down: the quota's fallback", "",
        f"The model has a concurrency cap of {cap} requests over all balancers, counted in Redis. With Redis "
        "killed, each balancer enforces its share (1/3) locally, knowing nothing of the slots still held in Redis. "
        "Admitted: most requests streaming at once, all regions (the clients' view: response headers received, "
        "stream not ended).", "",
        markdown_table(["seed", "cap", "peak before the faults", "peak with Redis down", "over the cap"], rows), ""])


def _schedule(run: dict) -> str:
    rows = [[f["fault"]["name"], f"{f['fault']['started_s']:.1f}", f"{(f['fault']['ended_s'] or 0):.1f}",
             str(f["detected_s"]), str(f["recovered_s"]), str(f["requests"]), str(f["lost"]), str(f["duplicated"]),
             ", ".join(f"{k}={v}" for k, v in sorted(f["fault"]["notes"].items()))]
            for f in run["faults"]]
    return "\n".join([f"### Seed {run['seed']}", "",
                      f"Deployment up in {run['startup_s']} s; load for {run['load_s']} s; {run['requests']} "
                      f"requests: {run['outcomes']}; {run['executions']} executions in the replicas' logs "
                      f"({run['unattributed_executions']} not traced to a client attempt: their balancer died "
                      f"before logging); machine load (1 min) {run['machine_load_before']['load_1m']} before, "
                      f"{run['machine_load_after']['load_1m']} after, {run['machine_load_after']['cores']} cores.", "",
                      markdown_table(["fault", "start s", "end s", "detected s", "recovered s", "requests", "lost",
                                      "duplicated", "notes"], rows), ""])


def _balancers_text(n: int) -> str:
    """How the report names ``n`` balancers per region."""
    return ("one balancer" if n == 1 else
            f"{n} balancers (siblings; each replica owned by one of them; a balancer's faults hit one of them)")


def _sibling_takeover(runs: list[dict]) -> str:
    """A sibling's kill: how soon its replicas served through its live siblings, and any cross-region failover."""
    kills = [(r["seed"], f) for r in runs for f in r["faults"] if "sibling_takeover" in f]
    if not kills:
        return ""
    rows = [[str(seed), f["fault"]["target"], str(f["sibling_takeover"]["served_by_siblings_s"]),
             str(f["sibling_takeover"]["cross_region_s"]), str(f["lost"]), str(f["duplicated"])] for seed, f in kills]
    moved = [f["sibling_takeover"]["served_by_siblings_s"] for _, f in kills]
    return "\n".join([
        "## A sibling killed", "",
        "One of a region's balancers SIGKILLed under load: its replicas move to its live siblings (the controllers "
        "give them new owners; no cross-region failover while a sibling lives). Served by siblings: from the kill "
        "to the first sample where the live siblings list every replica of the region healthy; cross-region: "
        "sampled time the region was assigned to another region's balancer meanwhile.", "",
        markdown_table(["seed", "balancer", "served by siblings s", "cross-region s", "lost", "duplicated"], rows),
        "", f"Served by siblings {spread(moved, ' s')} (target: within 3 s).", ""])


def format_markdown(result: dict[str, Any]) -> str:
    """The report of ``run_chaos``'s result."""
    runs = result["runs"]
    s = runs[0]["settings"]
    lost = sum(f["lost"] for r in runs for f in r["faults"]) + sum(r["outcomes"].get("lost", 0) for r in runs)
    dup = sum(len(r["duplicated_attempts"]) + r["outcomes"].get("duplicated", 0) for r in runs)
    kinds_rows = [[k, _DETECTED[k], _RECOVERED[k]] for k in KINDS if k in _by_kind(runs)]
    return "\n".join([
        "# Chaos: the whole deployment under a schedule of faults", "",
        f"{len(runs)} run{'s' if len(runs) != 1 else ''} (seeds {', '.join(str(r['seed']) for r in runs)}), "
        f"{'the short schedule' if runs[0]['short'] else 'the full schedule'}: three regions, each with "
        f"{s['replicas_per_region']} emulated vLLM replicas (time scale {s['time_scale']}, batch "
        f"{s['max_num_seqs']}) and {_balancers_text(s.get('balancers_per_region', 1))}; three controllers on a "
        f"three-member etcd; Redis for the quota; "
        f"BIND for DNS; every balancer-balancer, balancer-controller, controller-balancer, balancer-Redis and "
        f"controller-etcd path through its own latency link (bench/chaos/cluster.py; a cut is a blackhole: data "
        f"held, not refused). Not cuttable here: the controllers' health checks of the replicas (a replica's one "
        f"URL serves its balancer too) and etcd's member-to-member traffic. Load: "
        f"{s['clients_per_region']} closed-loop clients per region running the sessions of {s['trace']} "
        f"(lengths x {s['token_scale']}); each client is one user's HTTP client: it resolves through BIND from "
        f"its region's address (TTL 1 s), keeps its connections alive as an SDK does (a held connection keeps "
        f"reaching the balancer it reached), and on a connection error before the first byte resolves again and "
        f"retries once. Machine: {runs[0]['machine_load_after']['cores']} cores shared with other work, load "
        f"average (1 min) {spread([r['machine_load_before']['load_1m'] for r in runs])} at the runs' starts and "
        f"{spread([r['machine_load_after']['load_1m'] for r in runs])} at their ends; every process under "
        f"`nice`.", "",
        f"**Over all runs: {lost} lost, {dup} duplicated** (target 0 and 0: "
        f"{'met' if lost == 0 and dup == 0 else 'MISSED'}).", "",
        "## Per fault kind", "",
        "Requests: those whose time in flight overlapped the fault (from its start to its recovery). Errors: the "
        "outcomes other than ok (error_event: a stream ended with an error chunk; http_N: an error answer; "
        "unreachable: both attempts failed to connect; stream_cut: the connection broke mid-response, its balancer "
        "killed). Retries: client retries (in brackets, those where both "
        "attempts ran on a replica). Detection from the fault's start, recovery from its heal, TTFT p90 of the "
        "requests sent during the fault: median [min, max] over the runs. "
        f"TTFT p90 outside every fault: {spread([r['ttft_p90_outside_ms'] for r in runs], ' ms')}.", "",
        markdown_table(["fault", "runs", "requests", "lost", "duplicated", "errors", "retries", "detected s",
                        "recovered s", "TTFT p90 during ms"], _fault_rows(runs)), "",
        markdown_table(["fault", "detected when", "recovered when"], kinds_rows), "",
        _split_brain(runs), _sibling_takeover(runs), _redis(runs),
        "## Schedules", "", *(_schedule(r) for r in runs)])
