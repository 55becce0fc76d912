"""The figures of one chaos run, per fault, from the client records, the observer's timeline and the logs.

Per fault (times in s):

- ``detected_s``: from the fault's start to the first sample where the system shows it knows (the kind's own sign:
  a replica unhealthy or ejected at its balancer, a balancer unhealthy at the controllers, a new leader, an etcd
  member unhealthy, the balancers' quota on its Redis fallback, a balancer that cannot reach the controllers);
  None where the system has nothing to detect (a latency spike, a slow replica: routing just adapts);
- ``recovered_s``: from the heal (restart or mended link) to the first sample where everything is as before the
  fault (the restarted part healthy, the region back at its own balancer, the fallback over);
- requests that overlapped the fault's window (from its start to its end plus its recovery): by outcome,
  ``lost``, ``duplicated`` (one attempt id finished on two replicas, by the replicas' logs, or a client saw two
  completions in one stream), client retries (counted apart, and whether both attempts ran);
- TTFT p90 of the requests sent during the fault, beside that of requests sent outside every fault.

Split brain: ``overlap_s``, how long some replica of the region was listed by two balancers at once (its own and
another region's after a failover, or two siblings'), and the peak pending requests (engine queue at the last probe)
and outstanding requests (both balancers' together) on those shared replicas meanwhile. A sibling's kill (two or
more balancers per region): ``sibling_takeover`` (see :func:`sibling_takeover`). Redis: ``admitted_peak`` (requests
streaming at once, all regions) during the outage against the cap and against the peak outside it.

Samples key balancers by their cluster name; ``balancers`` (``ChaosCluster.balancers``) maps each to its region. A
balancer's fault (kill, split brain, asymmetric) targets a balancer name, a partition a region, a replica's fault a
replica id (``<region>-<k>``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.chaos.client import Record
from bench.chaos.faults import Fault
from bench.replay.report import percentile

__all__ = ["measure_fault", "measure_run"]


def _first(samples: list[dict], after: float, pred) -> float | None:
    for s in samples:
        if s["t"] >= after:
            try:
                if pred(s):
                    return s["t"]
            except (KeyError, TypeError, AttributeError):
                continue
    return None


def _names(of: dict[str, str], region: str) -> list[str]:
    """The names of ``region``'s balancers (``of``: balancer name -> region, ``ChaosCluster.balancers``)."""
    return [b for b, r in of.items() if r == region]


def _replica(s: dict, of: dict[str, str], region: str, rid: str) -> dict | None:
    """Replica ``rid`` as ``region``'s balancers see it: a healthy listing first, else any (None: unlisted)."""
    seen = [b["replicas"][rid] for n in _names(of, region)
            if (b := s["b"].get(n)) is not None and rid in b["replicas"]]
    return next((r for r in seen if r["h"]), seen[0] if seen else None)


def _home(s: dict, of: dict[str, str], region: str) -> bool:
    """``region`` served by its own balancers, each healthy at the controllers, reaching them, and seen available by
    every other region's balancers."""
    names = _names(of, region)
    return (s["assign"][region][0] == region
            and all(s["ctl"].get(n) and s["b"][n] is not None and s["b"][n]["ctl"] for n in names)
            and all(b is None or sum(1 for p, up in b["peers"].items() if up and p.split("@")[0] == region)
                    >= len(names) for o, b in s["b"].items() if of[o] != region))


def _served_by_siblings(s: dict, of: dict[str, str], name: str, replicas: int) -> bool:
    """Every replica of ``name``'s region listed healthy by one of its live siblings (not ``name``)."""
    region = of[name]
    listed = {rid for n in _names(of, region) if n != name and (b := s["b"].get(n)) is not None
              for rid, r in b["replicas"].items() if rid.startswith(f"{region}-") and r["h"]}
    return len(listed) >= replicas


def _signs(f: Fault, leader_before: int | None, of: dict[str, str]):
    """(detected predicate or None, recovered predicate) of a fault's kind (targets: see the module docstring)."""
    k, t = f.kind, f.target
    region = of.get(t, t.rsplit("-", 1)[0])  # a balancer's region, or a replica id's (``us-2`` -> ``us``)
    if k == "replica_kill":
        rid = f.notes.get("replica", "")
        return ((lambda s: not (_replica(s, of, t, rid) or {}).get("h", False)),
                (lambda s: (_replica(s, of, t, rid) or {}).get("h") is True))
    if k == "replica_500":
        return ((lambda s: (r := _replica(s, of, region, t) or {}).get("ej") or not r.get("h")),
                (lambda s: (r := _replica(s, of, region, t)) is not None and r["h"] and not r["ej"]))
    if k == "balancer_kill":
        return (lambda s: s["ctl"][t] is False), (lambda s: _home(s, of, region))
    if k == "partition":
        return ((lambda s: all(s["ctl"][n] is False for n in _names(of, t))),
                (lambda s: _home(s, of, t) and not _shared(s, t)))
    if k == "split_brain":
        return (lambda s: s["ctl"][t] is False), (lambda s: _home(s, of, region) and not _shared(s, region))
    if k == "asymmetric":
        return (lambda s: s["b"][t]["ctl"] is False), (lambda s: _home(s, of, region))
    if k == "leader_kill":
        return ((lambda s: s["leader"] is not None and s["leader"] != leader_before),
                (lambda s: s["leader"] is not None and s["ctl"] is not None))
    if k == "etcd_kill":
        j = int(t)
        return (lambda s: not s["etcd"][j]), (lambda s: all(s["etcd"]) and s["leader"] is not None)
    if k == "redis_kill":
        return ((lambda s: any(b and b["fallback"] for b in s["b"].values())),
                (lambda s: all(b and b["fallback"] is False for b in s["b"].values())))
    return None, (lambda s: True)


def _shared(s: dict, region: str) -> list[str]:
    """``region``'s replicas that two balancers list at once (two regions' after a failover, or two siblings')."""
    listed: Counter = Counter(rid for b in s["b"].values() if b is not None
                              for rid in b["replicas"] if rid.startswith(f"{region}-"))
    return [rid for rid, n in listed.items() if n > 1]


def split_brain(samples: list[dict], f: Fault, region: str) -> dict[str, Any]:
    """Overlap duration (s) and peak pending/outstanding on the shared replicas during a split brain of
    ``f.target`` (a balancer of ``region``); ``overlap_s`` counts the sampled span (first to last sample with a
    shared replica, plus one sampling interval)."""
    rows = []
    for s in samples:
        if s["t"] < f.started_s:
            continue
        shared = _shared(s, region)
        if shared:
            views = [b["replicas"] for b in s["b"].values() if b is not None]
            pending = [v[rid].get("p") or 0 for rid in shared for v in views if rid in v]
            outstanding = [sum(v[rid].get("o") or 0 for v in views if rid in v) for rid in shared]
            rows.append((s["t"], max(pending), max(outstanding), len(shared)))
    if not rows:
        return {"overlap_s": 0.0, "overlap_from_s": None, "peak_pending": 0, "peak_outstanding": 0, "shared": 0}
    tick = samples[1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.3
    return {"overlap_s": round(rows[-1][0] - rows[0][0] + tick, 2), "overlap_from_s": round(rows[0][0] - f.started_s, 2),
            "overlap_after_heal_s": round(max(0.0, rows[-1][0] + tick - f.ended_s), 2),
            "peak_pending": max(r[1] for r in rows), "peak_outstanding": max(r[2] for r in rows),
            "shared": max(r[3] for r in rows)}


def sibling_takeover(samples: list[dict], f: Fault, of: dict[str, str], replicas: int) -> dict[str, Any]:
    """A sibling's kill: ``served_by_siblings_s``, from the kill to the first sample where the region's live
    siblings list every replica of the region healthy (its replicas serving again through them), and
    ``cross_region_s``, how long (sampled) the region was assigned to another region's balancer between the kill and
    the restart (none is expected while a sibling lives)."""
    region = of[f.target]
    moved = _first(samples, f.started_s, lambda s: _served_by_siblings(s, of, f.target, replicas))
    window = [s for s in samples if f.started_s <= s["t"] and s["assign"] is not None
              and (f.ended_s is None or s["t"] <= f.ended_s)]
    tick = samples[1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.3
    return {"served_by_siblings_s": None if moved is None else round(moved - f.started_s, 2),
            "cross_region_s": round(tick * sum(1 for s in window if s["assign"][region][0] != region), 2)}


def _admitted_peak(records: list[Record], start: float, end: float) -> int:
    """Most requests streaming at once (response headers received, not yet ended) within [start, end]."""
    spans = [(r.headers_s, r.ended_s) for r in records if r.status == 200 and r.headers_s is not None]
    edges = sorted([(max(a, start), 1) for a, b in spans if a < end and b > start]
                   + [(min(b, end), -1) for a, b in spans if a < end and b > start])
    peak = now = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


def measure_fault(f: Fault, samples: list[dict], records: list[Record], dup_attempts: set[str],
                  executed: set[str], *, leader_before: int | None, quota_cap: int, balancers: dict[str, str],
                  replicas: int) -> dict[str, Any]:
    """The figures of one fault (see the module docstring); ``balancers``: name -> region
    (``ChaosCluster.balancers``), ``replicas``: per region."""
    detect, recover = _signs(f, leader_before, balancers)
    detected = _first(samples, f.started_s, detect) if detect else None
    recovered = _first(samples, f.ended_s, recover) if f.ended_s is not None else None
    until = (recovered if recovered is not None else (f.ended_s or f.started_s)) + 1.0
    window = [r for r in records if r.sent_s < until and r.ended_s > f.started_s]
    outcomes = Counter(r.outcome for r in window)
    during = [r.ttft_s * 1000 for r in records
              if r.ttft_s is not None and f.started_s <= r.sent_s <= (f.ended_s or f.started_s)]
    out = {"fault": f.to_dict(), "detected_s": None if detected is None else round(detected - f.started_s, 2),
           "recovered_s": None if recovered is None else round(recovered - f.ended_s, 2),
           "requests": len(window), "outcomes": dict(outcomes), "lost": outcomes.get("lost", 0),
           "duplicated": outcomes.get("duplicated", 0) + sum(1 for r in window
                                                               for a in r.attempts if a.request_id in dup_attempts),
           "client_retries": sum(1 for r in window if len(r.attempts) > 1),
           "retries_executed_twice": sum(1 for r in window if len(r.attempts) > 1 and all(
               a.request_id in executed for a in r.attempts)),
           "ttft_p90_during_ms": percentile(during, 90) if during else None}
    if f.kind == "split_brain":
        out["split_brain"] = split_brain(samples, f, balancers.get(f.target, f.target))
    siblings = sum(1 for r in balancers.values() if r == balancers.get(f.target))
    if f.kind == "balancer_kill" and siblings > 1:
        out["sibling_takeover"] = sibling_takeover(samples, f, balancers, replicas)
    if f.kind == "redis_kill":
        out["admitted_peak_during"] = _admitted_peak(records, f.started_s, f.ended_s or f.started_s)
        out["quota_cap"] = quota_cap
    return out


def measure_run(faults: list[Fault], samples: list[dict], records: list[Record],
                executions: dict[str, list[str]], *, leader_before: int | None, quota_cap: int,
                balancers: dict[str, str], replicas: int) -> dict[str, Any]:
    """Every fault's figures, and the run's totals (outcomes, TTFT p90 outside every fault, executions);
    ``balancers``: name -> region (``ChaosCluster.balancers``), ``replicas``: per region."""
    dup_attempts = {a for a, replicas in executions.items() if not a.startswith("?") and len(replicas) > 1}
    windows = [(f.started_s, (f.ended_s or f.started_s) + 1.0) for f in faults if f.started_s is not None]
    quiet = [r.ttft_s * 1000 for r in records if r.ttft_s is not None
             and not any(a <= r.sent_s <= b or a <= r.ended_s <= b for a, b in windows)]
    end = max((r.ended_s for r in records), default=0.0)
    quiet_spans = [(0.0, windows[0][0])] if windows else [(0.0, end)]
    executed = {a for a in executions if not a.startswith("?")}
    return {"faults": [measure_fault(f, samples, records, dup_attempts, executed, leader_before=leader_before,
                                     quota_cap=quota_cap, balancers=balancers, replicas=replicas)
                       for f in faults if f.started_s is not None],
            "outcomes": dict(Counter(r.outcome for r in records)), "requests": len(records),
            "duplicated_attempts": sorted(dup_attempts),
            "unattributed_executions": sum(len(v) for k, v in executions.items() if k.startswith("?")),
            "executions": sum(len(v) for v in executions.values()),
            "ttft_p90_outside_ms": percentile(quiet, 90) if quiet else None,
            "admitted_peak_before_faults": max((_admitted_peak(records, a, b) for a, b in quiet_spans), default=0)}
