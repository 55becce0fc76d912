"""What a simulated run measured (SkyLB paper §5 metrics), computed from a finished ``Cluster``.

* Throughput: requests completed (at the client) per second and output tokens per second, over the measurement
  window [warmup_s, stop_at) of simulated time (paper Fig. 8a-d, 9a, 10).
* TTFT (client send -> first token at the client) mean / p10 / p25 / p50 / p75 / p90, and E2E (send -> last
  token) the same, in seconds, over requests *sent* in the window (paper Fig. 8e-l: box = p25-p75, whiskers
  p10-p90, mean marked).
* Prefix hit rate: cached prompt tokens / prompt tokens (the engine's prefix cache counters), same requests; and
  beside it the ideal hit rate of the same requests (bench/sim/ideal.py: an infinite cache on one replica, at the
  engine's block size, fed with every request the run sent before), a limit no policy can pass; and the same
  with the cache bounded by the cluster's KV blocks pooled on one replica, least recently used evicted (what the
  deployment's memory allows with perfect routing).
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

Over seeds (:func:`aggregate`): each figure is the mean over the seeds' runs, with its min and max in ``spread``.
The oracle (:func:`best_of`): per seed, each figure is the best of its candidate policies' runs for that figure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from collections.abc import Sequence

from bench.sim.ideal import ideal_hit_rate
from bench.replay.report import percentile

__all__ = ["RunSummary", "summarize", "aggregate", "best_of", "replicas_needed", "HIGHER_IS_BETTER",
           "LOWER_IS_BETTER", "spread_text"]

#: Figures where more is better (the oracle keeps the largest of its candidates' values).
HIGHER_IS_BETTER = ("throughput_rps", "throughput_tps", "hit_rate", "ideal_hit_rate", "ideal_kv_hit_rate")
#: Figures where less is better (the oracle keeps the smallest), seconds.
LOWER_IS_BETTER = ("ttft_mean", "ttft_p10", "ttft_p25", "ttft_p50", "ttft_p75", "ttft_p90",
                   "e2e_mean", "e2e_p10", "e2e_p25", "e2e_p50", "e2e_p75", "e2e_p90")


@dataclass
class RunSummary:
    """One run's figures, or their mean over seeds. Times in seconds; rates per second of simulated time; fractions 0-1.

    ``seeds``: the seeds averaged (empty for one run); ``spread``: figure -> [min, max] over those seeds.
    ``candidates`` (the oracle only): candidate policy -> its own figures (mean over seeds after aggregation);
    ``best_of``: figure -> the candidate policy whose value was kept (per seed: "skylb 2, sglang 1" after
    aggregation).
    """

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
    ideal_hit_rate: float
    ideal_kv_hit_rate: float
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
    seeds: list[int] = field(default_factory=list)
    spread: dict[str, list[float]] = field(default_factory=dict)
    candidates: dict[str, dict[str, float]] = field(default_factory=dict)
    best_of: dict[str, str] = field(default_factory=dict)

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
    # Send order decides what "seen before" means; requests sent before the window still fill the ideal cache.
    ordered = sorted(records, key=lambda f: f.sent_at)
    # The same with the cache bounded by every replica's KV blocks pooled (LRU): what the cluster's memory allows.
    # The engine's cache granularity: vLLM's blocks, or single tokens under SGLang's radix cache (page size 1).
    block = 1 if cluster.params.admission == "sglang" else cluster.params.block_size
    capacity = sum(r.engine.params.kv_cache_tokens for r in cluster.replicas.values()) // block
    ideal_kv = ideal_hit_rate((f.req.tokens for f in ordered), block_tokens=block,
                              counted=(start <= f.sent_at < end for f in ordered), capacity_blocks=capacity)
    ideal = ideal_hit_rate((f.req.tokens for f in ordered), block_tokens=block,
                           counted=(start <= f.sent_at < end for f in ordered))
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
        hit_rate=cached / prompt if prompt else 0.0, ideal_hit_rate=ideal if ideal is not None else 0.0,
        ideal_kv_hit_rate=ideal_kv if ideal_kv is not None else 0.0,
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


#: Fields that identify a run rather than measure it (not averaged).
_KEYS = ("scenario", "system", "replicas", "layout", "seed", "seeds", "spread", "candidates", "best_of")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else float("nan")


def aggregate(runs: Sequence[RunSummary]) -> RunSummary:
    """The mean over seeds of ``runs`` (one scenario, system and deployment, one run per seed).

    Every numeric figure is the mean of the runs' values (NaN values are left out), ``spread[figure]`` its
    [min, max]; region shares are averaged per region; ``seeds`` lists the seeds. An oracle's ``candidates``
    figures are averaged per candidate and ``best_of`` counts, per figure, how often each candidate's value was
    kept. Raises ValueError for no runs or runs of different scenarios, systems or deployments.
    """
    if not runs:
        raise ValueError("no runs to aggregate")
    first = runs[0]
    if any((r.scenario, r.system, r.replicas) != (first.scenario, first.system, first.replicas) for r in runs):
        raise ValueError("aggregate() takes runs of one scenario, system and deployment")
    values: dict = {}
    spread: dict[str, list[float]] = {}
    for f in fields(RunSummary):
        if f.name in _KEYS:
            continue
        column = [getattr(r, f.name) for r in runs]
        if _is_number(column[0]):
            values[f.name] = _mean(column)
            finite = [v for v in column if not math.isnan(v)] or [float("nan")]
            spread[f.name] = [min(finite), max(finite)]
        elif isinstance(column[0], dict):
            regions = sorted({k for d in column for k in d})
            values[f.name] = {k: statistics.fmean(d.get(k, 0.0) for d in column) for k in regions}
    candidates: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(k for r in runs for k in r.candidates):
        figs = [r.candidates[name] for r in runs if name in r.candidates]
        candidates[name] = {k: _mean([c[k] for c in figs]) for k in figs[0]}
    best: dict[str, str] = {}
    for metric in dict.fromkeys(k for r in runs for k in r.best_of):
        counts: dict[str, int] = {}
        for r in runs:
            if metric in r.best_of:
                counts[r.best_of[metric]] = counts.get(r.best_of[metric], 0) + 1
        best[metric] = ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    values["completed"] = round(values["completed"])
    values["sent"] = round(values["sent"])
    values["events"] = round(values["events"])
    return replace(first, **values, seed=first.seed, seeds=[r.seed for r in runs], spread=spread,
                   candidates=candidates, best_of=best)


def best_of(runs: Sequence[RunSummary], *, system: str, labels: Sequence[str]) -> RunSummary:
    """The oracle's figures for one seed: per figure, the best value among its candidate policies' ``runs``.

    ``labels``: the candidate policy of each run. For each figure of :data:`HIGHER_IS_BETTER` the largest value
    is kept, for each of :data:`LOWER_IS_BETTER` the smallest, so the oracle is a bound for each figure
    separately (the candidate may differ from figure to figure: ``best_of`` says which). Descriptive figures
    (load variance, pending, queue, KV use, shares, network time) come from the candidate with the lowest P90
    TTFT. ``candidates`` keeps each candidate's headline figures. Raises ValueError for no runs.
    """
    if not runs:
        raise ValueError("no candidate runs")
    pairs = list(zip(labels, runs))
    ttft_key = lambda p: math.inf if math.isnan(p[1].ttft_p90) else p[1].ttft_p90  # noqa: E731
    label, base = min(pairs, key=ttft_key)
    values: dict = {}
    chosen: dict[str, str] = {}
    for metric in HIGHER_IS_BETTER + LOWER_IS_BETTER:
        sign = -1 if metric in HIGHER_IS_BETTER else 1
        valid = [p for p in pairs if not math.isnan(getattr(p[1], metric))] or pairs
        name, run = min(valid, key=lambda p: sign * getattr(p[1], metric))
        values[metric] = getattr(run, metric)
        chosen[metric] = name
    values["completed"] = max(r.completed for r in runs)
    headline = ("throughput_rps", "ttft_p50", "ttft_p90", "e2e_p90", "hit_rate")
    return replace(base, **values, system=system, candidates={n: {k: getattr(r, k) for k in headline}
                                                             for n, r in pairs},
                   best_of=chosen, wall_s=sum(r.wall_s for r in runs), events=sum(r.events for r in runs))


def spread_text(r: RunSummary, metric: str, fmt: str = "{:.2f}", unit: str = "") -> str:
    """``metric`` of ``r`` as "mean [min, max]" (just the mean for a single run), e.g. "2.41 s [2.30, 2.55]"."""
    value = getattr(r, metric)
    text = fmt.format(value) + unit
    lo_hi = r.spread.get(metric)
    if lo_hi and len(r.seeds) > 1:
        text += f" [{fmt.format(lo_hi[0])}, {fmt.format(lo_hi[1])}]"
    return text


def replicas_needed(throughput_by_replicas: dict[int, float], target: float, *, tolerance: float = 0.0) -> int | None:
    """The smallest replica count whose throughput reaches ``target`` x (1 - tolerance); None if none does.

    Paper §5.2 / Fig. 10: "SkyLB achieves comparable throughput with only 9 replicas as the region-local deployment
    achieves with 12".
    """
    for n in sorted(throughput_by_replicas):
        if throughput_by_replicas[n] >= target * (1.0 - tolerance):
            return n
    return None
