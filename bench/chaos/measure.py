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

Split brain: ``overlap_s``, how long the region's replicas were in both its own balancer's and another's status,
and the peak pending requests (engine queue at the last probe) and outstanding requests (both balancers' together)
on those shared replicas meanwhile. Redis: ``admitted_peak`` (requests streaming at once, all regions) during the
outage against the cap and against the peak outside it.
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


def _replica(s: dict, region: str, rid: str) -> dict | None:
    b = s["b"].get(region)
    return None if b is None else b["replicas"].get(rid)


def _home(s: dict, region: str) -> bool:
    """``region`` served by its own balancer, healthy, seen by its peers and reaching the controllers."""
    b = s["b"][region]
    return (s["ctl"][region] and s["assign"][region][0] == region and b is not None and b["ctl"]
            and all(s["b"][o] is None or s["b"][o]["peers"].get(region) for o in s["b"] if o != region))


def _signs(f: Fault, leader_before: int | None):
    """(detected predicate or None, recovered predicate) of a fault's kind."""
    k, t = f.kind, f.target
    if k == "replica_kill":
        rid = f.notes.get("replica", "")
        return ((lambda s: not (_replica(s, t, rid) or {}).get("h", False)),
                (lambda s: (_replica(s, t, rid) or {}).get("h") is True))
    if k == "replica_500":
        region = t.rsplit("-", 1)[0]
        return ((lambda s: (_replica(s, region, t) or {}).get("ej") or not (_replica(s, region, t) or {}).get("h")),
                (lambda s: (r := _replica(s, region, t)) is not None and r["h"] and not r["ej"]))
    if k == "balancer_kill":
        return (lambda s: s["ctl"][t] is False), (lambda s: _home(s, t))
    if k in ("partition", "split_brain"):
        return (lambda s: s["ctl"][t] is False), (lambda s: _home(s, t) and not _shared(s, t))
    if k == "asymmetric":
        return (lambda s: s["b"][t]["ctl"] is False), (lambda s: _home(s, t))
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
    """``region``'s replicas that another region's balancer also lists while its own does too."""
    own = s["b"].get(region)
    if own is None:
        return []
    mine = [rid for rid in own["replicas"] if rid.startswith(f"{region}-")]
    return [rid for rid in mine if any(o != region and s["b"][o] is not None and rid in s["b"][o]["replicas"]
                                       for o in s["b"])]


def split_brain(samples: list[dict], f: Fault) -> dict[str, Any]:
    """Overlap duration (s) and peak pending/outstanding on the shared replicas during a split brain of
    ``f.target``; ``overlap_s`` counts the sampled span (first to last sample with a shared replica, plus one
    sampling interval)."""
    region, rows = f.target, []
    for s in samples:
        if s["t"] < f.started_s:
            continue
        shared = _shared(s, region)
        if shared:
            pending = [(_replica(s, o, rid) or {}).get("p") or 0 for rid in shared for o in s["b"]]
            outstanding = [sum((_replica(s, o, rid) or {}).get("o") or 0 for o in s["b"]) for rid in shared]
            rows.append((s["t"], max(pending), max(outstanding), len(shared)))
    if not rows:
        return {"overlap_s": 0.0, "overlap_from_s": None, "peak_pending": 0, "peak_outstanding": 0, "shared": 0}
    tick = samples[1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.3
    return {"overlap_s": round(rows[-1][0] - rows[0][0] + tick, 2), "overlap_from_s": round(rows[0][0] - f.started_s, 2),
            "overlap_after_heal_s": round(max(0.0, rows[-1][0] + tick - f.ended_s), 2),
            "peak_pending": max(r[1] for r in rows), "peak_outstanding": max(r[2] for r in rows),
            "shared": max(r[3] for r in rows)}


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
                  executed: set[str], *, leader_before: int | None, quota_cap: int) -> dict[str, Any]:
    """The figures of one fault (see the module docstring)."""
    detect, recover = _signs(f, leader_before)
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
        out["split_brain"] = split_brain(samples, f)
    if f.kind == "redis_kill":
        out["admitted_peak_during"] = _admitted_peak(records, f.started_s, f.ended_s or f.started_s)
        out["quota_cap"] = quota_cap
    return out


def measure_run(faults: list[Fault], samples: list[dict], records: list[Record],
                executions: dict[str, list[str]], *, leader_before: int | None, quota_cap: int) -> dict[str, Any]:
    """Every fault's figures, and the run's totals (outcomes, TTFT p90 outside every fault, executions)."""
    dup_attempts = {a for a, replicas in executions.items() if not a.startswith("?") and len(replicas) > 1}
    windows = [(f.started_s, (f.ended_s or f.started_s) + 1.0) for f in faults if f.started_s is not None]
    quiet = [r.ttft_s * 1000 for r in records if r.ttft_s is not None
             and not any(a <= r.sent_s <= b or a <= r.ended_s <= b for a, b in windows)]
    end = max((r.ended_s for r in records), default=0.0)
    quiet_spans = [(0.0, windows[0][0])] if windows else [(0.0, end)]
    executed = {a for a in executions if not a.startswith("?")}
    return {"faults": [measure_fault(f, samples, records, dup_attempts, executed, leader_before=leader_before,
                                     quota_cap=quota_cap) for f in faults if f.started_s is not None],
            "outcomes": dict(Counter(r.outcome for r in records)), "requests": len(records),
            "duplicated_attempts": sorted(dup_attempts),
            "unattributed_executions": sum(len(v) for k, v in executions.items() if k.startswith("?")),
            "executions": sum(len(v) for v in executions.values()),
            "ttft_p90_outside_ms": percentile(quiet, 90) if quiet else None,
            "admitted_peak_before_faults": max((_admitted_peak(records, a, b) for a, b in quiet_spans), default=0)}
