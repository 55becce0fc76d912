"""What a simulated run measured (SkyLB paper §5 metrics), computed from a finished ``Cluster``.

* Throughput: requests completed (at the client) per second and output tokens per second, over the measurement
  window [warmup_s, stop_at) of simulated time (paper Fig. 8a-d, 9a, 10).
* TTFT (client send -> first token at the client) mean / p10 / p25 / p50 / p75 / p90, and E2E (send -> last
  token) the same, in seconds, over requests *sent* in the window (paper Fig. 8e-l: box = p25-p75, whiskers
  p10-p90, mean marked).
* Prefix hit rate: cached prompt tokens / prompt tokens (the engine's prefix cache counters), same requests.
* Outstanding variance: the variance across replicas of their outstanding requests (waiting + running at the
  engine), averaged over samples taken every 100 ms in the window (paper §5.1 "variance in outstanding requests").
* Mean pending per replica (waiting at the engine, i.e. blind-pushing queues), and the balancers' mean queue.
* KV usage: the mean over samples and replicas of the fraction of KV blocks held by running requests (is the
  replica memory-bound?).
* Forwarded fraction: requests placed by a peer balancer; remote fraction: requests served by a replica outside
  the client's region (a single US balancer serves remotely without forwarding); network mean: the network
  latency in each request's TTFT (the request path there and the first token's path back), s.
* Served / sent share by region: the fraction of the window's requests served by each region's replicas, and sent
  by each region's clients (where the load landed, against where it came from).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from collections.abc import Sequence

from bench.report import percentile

__all__ = ["RunSummary", "summarize", "replicas_needed"]


@dataclass
class RunSummary:
    """One run's figures. Times in seconds; rates per second of simulated time; fractions 0-1."""

    scenario: str
    system: str
    replicas: int
    layout: str
    seed: int
    window_s: float
    sent: int
    completed: int
    throughput_rps: float
    throughput_tps: float
    ttft_mean: float
    ttft_p10: float
    ttft_p25: float
    ttft_p50: float
    ttft_p75: float
    ttft_p90: float
    e2e_mean: float
    e2e_p10: float
    e2e_p25: float
    e2e_p50: float
    e2e_p75: float
    e2e_p90: float
    hit_rate: float
    outstanding_var: float
    pending_mean: float
    queue_mean: float
    kv_usage_mean: float
    forwarded_frac: float
    remote_frac: float
    network_mean: float
    sim_end_s: float
    served_share: dict[str, float]
    sent_share: dict[str, float]
    wall_s: float = 0.0
    events: int = 0

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def _pct(values: Sequence[float], q: float) -> float:
    v = percentile(values, q)
    return float("nan") if v is None else v


def summarize(cluster, *, scenario: str, system: str, layout: str, warmup_s: float, seed: int = 0,
              wall_s: float = 0.0) -> RunSummary:
    """The RunSummary of a finished ``cluster`` (bench.sim.cluster.Cluster) with window [warmup_s, stop_at)."""
    start, end = warmup_s, cluster.stop_at
    window = max(end - start, 1e-9)
    records = cluster.records
    done_in = [f for f in records if start <= f.done_at < end]
    sent_in = [f for f in records if start <= f.sent_at < end]
    ttft = [f.first_token_at - f.sent_at for f in sent_in]
    e2e = [f.done_at - f.sent_at for f in sent_in]
    prompt = sum(f.result.prompt_tokens for f in sent_in)
    cached = sum(f.result.cached_tokens for f in sent_in)
    samples = [s for s in cluster.samples if start <= s[0] < end]
    var = statistics.fmean(statistics.pvariance(s[1]) for s in samples) if samples and len(samples[0][1]) > 1 \
        else 0.0
    pending = statistics.fmean(statistics.fmean(s[2]) for s in samples) if samples else 0.0
    queue = statistics.fmean(sum(s[3]) for s in samples) if samples else 0.0
    kv = statistics.fmean(statistics.fmean(s[4]) for s in samples) if samples else 0.0
    n = max(len(sent_in), 1)
    return RunSummary(
        scenario=scenario, system=system, replicas=len(cluster.replicas), layout=layout, seed=seed,
        window_s=window, sent=len(records), completed=len(records),
        throughput_rps=len(done_in) / window,
        throughput_tps=sum(f.result.completion_tokens for f in done_in) / window,
        ttft_mean=statistics.fmean(ttft) if ttft else float("nan"),
        ttft_p10=_pct(ttft, 10), ttft_p25=_pct(ttft, 25), ttft_p50=_pct(ttft, 50), ttft_p75=_pct(ttft, 75),
        ttft_p90=_pct(ttft, 90),
        e2e_mean=statistics.fmean(e2e) if e2e else float("nan"),
        e2e_p10=_pct(e2e, 10), e2e_p25=_pct(e2e, 25), e2e_p50=_pct(e2e, 50), e2e_p75=_pct(e2e, 75),
        e2e_p90=_pct(e2e, 90),
        hit_rate=cached / prompt if prompt else 0.0,
        outstanding_var=var, pending_mean=pending, queue_mean=queue, kv_usage_mean=kv,
        forwarded_frac=sum(f.forwarded for f in sent_in) / n,
        remote_frac=sum(f.replica.region != f.region for f in sent_in) / n,
        network_mean=sum(2 * f.back_s for f in sent_in) / n,
        sim_end_s=cluster.loop.now, wall_s=wall_s, events=cluster.loop.events,
        served_share=_shares(f.replica.region for f in sent_in), sent_share=_shares(f.region for f in sent_in),
    )


def _shares(regions) -> dict[str, float]:
    """Fraction of the items per region, regions sorted by name."""
    counts: dict[str, int] = {}
    for r in regions:
        counts[r] = counts.get(r, 0) + 1
    total = sum(counts.values()) or 1
    return {r: counts[r] / total for r in sorted(counts)}


def replicas_needed(throughput_by_replicas: dict[int, float], target: float, *, tolerance: float = 0.0) -> int | None:
    """The smallest replica count whose throughput reaches ``target`` x (1 - tolerance); None if none does.

    Paper §5.2 / Fig. 10: "SkyLB achieves comparable throughput with only 9 replicas as the region-local deployment
    achieves with 12".
    """
    for n in sorted(throughput_by_replicas):
        if throughput_by_replicas[n] >= target * (1.0 - tolerance):
            return n
    return None
