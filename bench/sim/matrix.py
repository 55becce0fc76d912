"""The robustness matrix: workloads x loads x systems x seeds, simulated, that judges the default routing policy.

Design decision 11 (../shared/DESIGN.md): no constant is fitted to one workload; the default policy (``SkyLB``) is
judged on a matrix of workloads and loads and must be first, or close, in every cell. Each run is the simulator of
bench/sim (the routing core the live balancer runs, bench/sim/cluster.py) on one workload at one load, one system,
one seed; `skylb bench matrix` (bench/bench_cli.py) runs them in worker processes and bench/sim/matrix_report.py
writes bench/results/matrix.md, matrix.json and the heat map matrix.png.

Workloads (:data:`WORKLOADS`; lengths and their sources in bench/sim/workloads.py and bench/sim/workloads_extra.py):

* ``conversation_1_8``: the Mooncake conversation trace, prompts x1/8, 4/4/4 replicas (the ``mooncake`` scenario).
* ``conversation_full``: the same trace at its real prompt lengths on the deployment bench/sim/regime.yaml sizes
  (20 replicas per region, the ``mooncake_full`` scenario).
* ``arena``, ``wildchat``, ``tot``, ``mixed_tree``: closed loop, as the paper's scenarios (bench/sim/scenarios.py).
* ``multi_tenant``: 150 tenants behind 6,000-token shared prefixes (x1/8), llm-d's benchmark; Poisson arrivals.
* ``tool_agent``: 5 agents with 3,000-6,000 tokens of system prompt and tools, sessions of short turns.
* ``heterogeneous``: review analysis on replicas of two speeds: in each region the second half of the replicas is
  :data:`SLOW_FACTOR` (4) times slower (``EngineParams.time_scale``; OllamaRouter's Table 3 implies 3.4-4.5,
  bench/results/heterogeneous-notes.md), as the seed's GPU host beside its CPU-only host.

Loads (a multiplier on the offered load; :data:`LOADS`, per workload up to where the best single balancer's P90
TTFT is seconds): closed loop, the clients per region (1x = the paper's scenario: 80 per region for Arena,
40/30/30 WildChat, 40/20/20 ToT, 2 + 20/20 Mixed Tree); a trace, its time compression (1x = real time);
the generated open-loop workloads, their arrival rate, where 1x is 0.8 of the deployment's saturated throughput:
each replica's throughput with a backlog of the workload's first 300 requests (:func:`saturated_rps`: one engine,
all submitted at once, run to the end), summed over the replicas (:func:`one_x_rps`; the report prints it).

Systems (bench/sim/systems.py): the default ``SkyLB``, ``SkyLB-paper``, ``SkyLB-CH``, single balancers ``RR``,
``LL``, ``CH``, ``SGL``, ``RegionLocal`` and ``Oracle`` (one run per candidate policy, the best per figure, as
bench/sim/scenarios.py ``execute`` does).

Time (:data:`TIMES`): an open-loop or trace run sends requests for 90 simulated seconds and measures over
[15 s, 90 s); a closed-loop run, 120 s measured from 20 s, because its multi-turn conversations need that long at
high load to reach their mix of context lengths (Arena at 4x: the best single balancer's P90 TTFT is 1.2 s over
[15 s, 90 s) and 5.7 s over [20 s, 120 s)). The paper's scenarios run 210 s; these are shortened so that the full
matrix fits in about 40 minutes on 2 cores (below). Requests sent before the end run to completion, so an
overloaded run simulates its whole backlog. ``--quick``: 30 s, measured from 5 s.

Tuning discipline (``--split``): ``dev`` is seeds 0-2 and, for the trace workloads, trace windows inside the first
40 minutes of the trace (each window starts at 0); ``val`` is seeds 3-5 and windows from minute 40 on (each starts
at 2,400 s of trace); ``all`` is seeds 0-5, each seed on its own split's window. Defaults are tuned on ``dev`` and
reported on ``val``. ``--seeds`` overrides the seeds, not the windows.

Duration, measured at commit 3076192 with ``skylb bench matrix --seeds 0 --jobs 2`` on this 2-core machine while it
was nearly idle (the run got 193% CPU): one seed of the full default matrix is 324 runs in 722 s of wall time
(1,394 CPU-seconds). Per cell (every system, the oracle's 5 candidates included), the wall seconds of its runs
summed, by load: conversation_1_8 6 / 9 / 18; conversation_full 23 / 88 / 113; arena 16 / 24 / 43 / 80; wildchat
9 / 14 / 19 / 28; tot 16 / 26 / 51 / 61 / 95; mixed_tree 11 / 21 / 35 / 47 / 95; multi_tenant 7 / 14 / 34 / 65;
tool_agent 7 / 12 / 15 / 24; heterogeneous 11 / 22 / 42 / 85 (one cell at 1x: 9 to 88 s). The default matrix
(3 seeds) is three times that: about 36 minutes on 2 workers, longer when other processes share the cores. To
fit about 40 minutes: 90 s and 120 s of simulated time instead of the paper's scenarios' 210 s, the trace
workloads stop at 2x (every system's P90 is tens of seconds there), and above 2x each workload's top load is
the first where the best single balancer's P90 reaches seconds, not beyond.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from bench.emulator.model import EngineParams, make_engine
from bench.sim.metrics import RunSummary, best_of, summarize
from bench.sim.regime import engine_params, regime, shape
from bench.sim.systems import SYSTEMS, build, replica_layout
from bench.sim.workloads import DEFAULT_TRACE, TOT_2, SimRequest, Workload, conversations, mixed_trees, mooncake, trees
from bench.sim.workloads_extra import mean_turns, multi_tenant, reviews, tool_agents

__all__ = ["MatrixWorkload", "MatrixRun", "WORKLOADS", "LOADS", "MATRIX_SYSTEMS", "DEFAULT", "SINGLES", "SPLITS",
           "TIMES", "QUICK", "SLOW_FACTOR", "cell_name", "parse_cell", "split_seeds",
           "runs_for", "execute_run", "trace_window", "saturated_rps", "one_x_rps", "replica_params", "parse_counts",
           "deployed"]

#: The default routing policy the matrix judges, the other systems, and the single balancers among them.
DEFAULT = "SkyLB"
MATRIX_SYSTEMS = ("SkyLB", "SkyLB-paper", "SkyLB-CH", "RR", "LL", "CH", "SGL", "RegionLocal", "Oracle")
SINGLES = ("RR", "LL", "CH", "SGL")
#: Simulated seconds (sending stops, measurement starts) by workload kind; "quick" for ``--quick``.
TIMES = {"open": (90.0, 15.0), "trace": (90.0, 15.0), "closed": (120.0, 20.0), "quick": (30.0, 5.0)}
#: How many times slower the slow replicas of ``heterogeneous`` are (bench/live/heterogeneous.py's slow_factor).
SLOW_FACTOR = 4.0
#: Where the validation split's trace windows start (trace seconds: minute 40), and its seeds.
VAL_START_S = 2400.0
SPLITS = {"dev": (0, 1, 2), "val": (3, 4, 5), "all": (0, 1, 2, 3, 4, 5)}
#: Open loop, generated: the offered load at 1x as a fraction of the deployment's saturated throughput.
ONE_X_UTILISATION = 0.8
REGIONS = ("us", "eu", "asia")
EVEN = (("us", 4), ("eu", 4), ("asia", 4))

#: ``--quick``: two small workloads, two loads, four systems, 30 simulated seconds, the split's first seed.
QUICK = {"workloads": ("multi_tenant", "wildchat"), "loads": (0.5, 1.0), "systems": ("SkyLB", "RR", "SGL", "Oracle")}


@dataclass(frozen=True)
class MatrixWorkload:
    """One workload row of the matrix.

    ``make(seed, load, split, stop_at)`` -> the Workload of one run (``split`` "dev" or "val" places a trace
    window; ``stop_at`` simulated seconds of sending); ``counts``: replicas per region; ``loads``: the default
    load multipliers; ``one_x``: what 1x means; ``kind``: "closed", "trace" or "open"; ``slow_half``: the second
    half of each region's replicas is :data:`SLOW_FACTOR` times slower (:func:`replica_params`).
    """

    name: str
    title: str
    kind: str
    make: Callable[[int, float, str, float], Workload]
    counts: tuple[tuple[str, int], ...]
    loads: tuple[float, ...]
    one_x: str
    slow_half: bool = False

    def replica_params(self, params: EngineParams) -> dict[str, EngineParams]:
        """Replica id -> engine parameters of the replicas that differ from ``params`` (the slow half when
        ``slow_half``); empty otherwise."""
        return replica_params(self.counts, params) if self.slow_half else {}


def replica_params(counts: Sequence[tuple[str, int]], params: EngineParams) -> dict[str, EngineParams]:
    """The slow replicas of a heterogeneous deployment: in each region the second half (ids ``{region}-r{i}`` with
    i >= n // 2) runs every step :data:`SLOW_FACTOR` times slower (``time_scale`` x SLOW_FACTOR)."""
    slow = replace(params, time_scale=params.time_scale * SLOW_FACTOR)
    return {f"{region}-r{i}": slow for region, n in counts for i in range(n // 2, n)}  # replica_layout's ids


def saturated_rps(params: EngineParams, requests: Sequence[SimRequest]) -> float:
    """Requests/s one replica of ``params`` completes with a backlog: ``requests`` all submitted at time 0 to one
    engine (bench/emulator/model.py ``make_engine``), run until the last finishes (the drain included)."""
    engine = make_engine(params)
    for r in requests:
        engine.submit(r.id, r.tokens, r.max_tokens or r.output_tokens, ignore_eos=True, now=0.0,
                      output_len=r.output_tokens)
    now = 0.0
    while (step := engine.start_step(now)) is not None:
        engine.complete_step(step)
        now = step.end
    return len(requests) / now if now > 0 else float("nan")


def _sample(name: str) -> list[SimRequest]:
    """The first 300 requests of a generated open-loop workload at a nominal rate (seed 0), for :func:`one_x_rps`."""
    if name == "multi_tenant":
        return multi_tenant(seed=0, rate_rps=1.0, duration_s=400.0).arrivals[:300]
    if name == "heterogeneous":
        return reviews(seed=0, rate_rps=1.0, duration_s=400.0).arrivals[:300]
    wl = tool_agents(seed=0, sessions_per_s=0.1, duration_s=400.0)
    return [r for c in wl.clients for r in c.programs(0)][:300]


@functools.lru_cache(maxsize=8)
def one_x_rps(name: str) -> float:
    """The 1x request rate (req/s) of a generated open-loop workload: :data:`ONE_X_UTILISATION` x the sum over its
    replicas of :func:`saturated_rps` on :func:`_sample` (computed once per process, a few seconds)."""
    wl, base = WORKLOADS[name], engine_params()
    sample = _sample(name)
    own = wl.replica_params(base)
    rates = {id(p): saturated_rps(p, sample) for p in {id(p): p for p in (base, *own.values())}.values()}
    total = sum(rates[id(own.get(rid, base))] for rid in replica_layout(dict(wl.counts)))
    return ONE_X_UTILISATION * total


def _trace(prompt_scale: float) -> Callable[[int, float, str, float], Workload]:
    """A Mooncake trace window at time compression ``load``: from 0 (dev) or :data:`VAL_START_S` (val), the
    ``stop_at`` x load trace seconds that fill the run (a dev window never passes minute 40)."""
    def make(seed: int, load: float, split: str, stop_at: float) -> Workload:
        start = 0.0 if split == "dev" else VAL_START_S
        window = stop_at * load if split != "dev" else min(stop_at * load, VAL_START_S)
        real = prompt_scale >= 1.0
        return mooncake(seed=seed, path=DEFAULT_TRACE, start_s=start, time_compression=load, window_s=window,
                        prompt_scale=prompt_scale, max_output=regime().mooncake.max_output if real else 1024,
                        max_total_tokens=engine_params().model_len)
    return make


@functools.lru_cache(maxsize=1)
def _tool_turns() -> float:
    """Mean requests per tool-agent session (seed 0's first 400 s at 0.1 sessions/s): session rate = rate / it."""
    return mean_turns(tool_agents(seed=0, sessions_per_s=0.1, duration_s=400.0))


def _per_region(counts: Mapping[str, int], load: float) -> dict[str, int]:
    """Clients per region x ``load``, rounded, at least 1."""
    return {r: max(1, round(n * load)) for r, n in counts.items()}


def _open(name: str) -> Callable[[int, float, str, float], Workload]:
    """A generated open-loop workload at ``load`` x :func:`one_x_rps` for ``stop_at`` s."""
    def make(seed: int, load: float, split: str, stop_at: float) -> Workload:
        rate = one_x_rps(name) * load
        if name == "multi_tenant":
            return multi_tenant(seed=seed, rate_rps=rate, duration_s=stop_at)
        if name == "heterogeneous":
            return reviews(seed=seed, rate_rps=rate, duration_s=stop_at)
        return tool_agents(seed=seed, sessions_per_s=rate / _tool_turns(), duration_s=stop_at)
    return make


_FULL = regime().mooncake.replicas_per_region
_OPEN_1X = f"{ONE_X_UTILISATION:g} of the deployment's saturated throughput (one_x_rps)"
WORKLOADS: dict[str, MatrixWorkload] = {w.name: w for w in (
    MatrixWorkload("conversation_1_8", "Mooncake conversation trace, prompts x1/8", "trace", _trace(0.125), EVEN,
                   (0.5, 1.0, 2.0), "real time (the mooncake scenario, about 3.4 req/s)"),
    MatrixWorkload("conversation_full", "Mooncake conversation trace, real prompt lengths", "trace", _trace(1.0),
                   tuple((r, _FULL) for r in REGIONS), (0.5, 1.0, 2.0),
                   "real time (the mooncake_full scenario, 0.8 of the deployment's prefill capacity)"),
    MatrixWorkload("arena", "ChatBot Arena-like conversations", "closed",
                   lambda seed, load, split, stop: conversations(shape("arena"), _per_region(
                       {"us": 80, "eu": 80, "asia": 80}, load), seed=seed), EVEN, (0.5, 1.0, 2.0, 4.0),
                   "80 clients per region (paper Fig. 8)"),
    MatrixWorkload("wildchat", "WildChat-like conversations", "closed",
                   lambda seed, load, split, stop: conversations(shape("wildchat"), _per_region(
                       {"us": 40, "eu": 30, "asia": 30}, load), seed=seed), (("us", 3), ("eu", 2), ("asia", 3)),
                   (0.5, 1.0, 2.0, 4.0), "40/30/30 clients (paper Fig. 8)"),
    MatrixWorkload("tot", "Tree of Thoughts, 2 branches x depth 4", "closed",
                   lambda seed, load, split, stop: trees(TOT_2, _per_region({"us": 40, "eu": 20, "asia": 20}, load),
                                                         seed=seed), EVEN, (0.5, 1.0, 2.0, 4.0, 5.0),
                   "40/20/20 clients (paper Fig. 8)"),
    MatrixWorkload("mixed_tree", "Mixed Tree: 4-branch trees in the US, 2-branch elsewhere", "closed",
                   lambda seed, load, split, stop: mixed_trees(seed=seed, big_clients=max(1, round(2 * load)),
                                                               small_clients=max(1, round(20 * load))),
                   EVEN, (0.5, 1.0, 2.0, 4.0, 8.0), "2 US clients of 4-branch trees, 20 of 2-branch per other region"),
    MatrixWorkload("multi_tenant", "150 tenants behind 6,000-token shared prefixes (x1/8), llm-d's benchmark",
                   "open", _open("multi_tenant"), EVEN, (0.5, 1.0, 2.0, 3.0), _OPEN_1X),
    MatrixWorkload("tool_agent", "Tool agents: long system prompts and tools, sessions of short turns", "open",
                   _open("tool_agent"), EVEN, (0.5, 1.0, 2.0, 4.0), _OPEN_1X),
    MatrixWorkload("heterogeneous", f"Review analysis on replicas of two speeds (half {SLOW_FACTOR:g}x slower)",
                   "open", _open("heterogeneous"), EVEN, (0.5, 1.0, 1.5, 2.0), _OPEN_1X, slow_half=True),
)}
#: Every load some workload runs by default.
LOADS = tuple(sorted({x for w in WORKLOADS.values() for x in w.loads}))


def parse_counts(spec: str) -> tuple[tuple[str, int], ...]:
    """Replicas per region from ``"us=2,eu=4,asia=6"``, in :data:`REGIONS` order: every region of the simulated
    network once (bench/sim/cluster.py knows the round trips between these three only), each with at least one
    replica. Raises ValueError naming what is wrong."""
    counts: dict[str, int] = {}
    for item in spec.split(","):
        region, sep, n = item.strip().partition("=")
        if not sep or region not in REGIONS or region in counts or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"replica counts {spec!r}: expected REGION=N for each of {', '.join(REGIONS)} "
                             f"once, N >= 1 (e.g. us=2,eu=4,asia=6)")
        counts[region] = int(n)
    if set(counts) != set(REGIONS):
        raise ValueError(f"replica counts {spec!r}: missing {', '.join(r for r in REGIONS if r not in counts)}")
    return tuple((r, counts[r]) for r in REGIONS)


def deployed(workload: MatrixWorkload, counts: tuple[tuple[str, int], ...] | None) -> MatrixWorkload:
    """``workload`` on other replicas per region (``parse_counts``), or unchanged for None: the same clients and
    requests, so a deployment's regions may differ in size (the matrix's own deployments are even but for
    WildChat's). An open-loop workload's 1x stays its own deployment's rate (``one_x_rps``), so compare loads
    between deployments of the same total only."""
    return workload if counts is None else replace(workload, counts=counts)


def cell_name(workload: str, load: float) -> str:
    """The name of one cell, also the RunSummary's ``scenario``: "arena@2x"."""
    return f"{workload}@{load:g}x"


def parse_cell(name: str) -> tuple[str, float]:
    """("arena", 2.0) from "arena@2x" (the inverse of :func:`cell_name`)."""
    workload, load = name.rsplit("@", 1)
    return workload, float(load.rstrip("x"))


def split_seeds(split: str) -> tuple[int, ...]:
    """The seeds of ``split`` ("dev", "val" or "all"); KeyError for another name."""
    return SPLITS[split]


def trace_window(split: str, seed: int) -> str:
    """The trace window of one run: the split's, or under "all" the split its seed belongs to (0-2 dev)."""
    if split != "all":
        return split
    return "dev" if seed in SPLITS["dev"] else "val"


@dataclass(frozen=True)
class MatrixRun:
    """One simulation of the matrix (picklable, for worker processes): ``system`` on ``workload`` at ``load`` x
    its 1x, with ``seed``; ``split`` places trace windows; ``quick``: 30 simulated seconds instead of 120."""

    workload: str
    load: float
    system: str
    seed: int
    split: str = "dev"
    quick: bool = False
    #: Replicas per region instead of the workload's own (``parse_counts``; None: its own).
    counts: tuple[tuple[str, int], ...] | None = None
    #: The engines' waiting-queue order instead of the regime's ("lpm" or "fcfs", ``EngineParams.schedule_policy``;
    #: None: the regime's). An open-loop workload's 1x stays the regime's rate, so a cell offers the same load.
    schedule_policy: str | None = None
    #: Options of the default's routing policy (name, value), applied wherever that policy runs (the default,
    #: RegionLocal, the oracle's candidate of it): a candidate default judged on the matrix without a code change.
    options: tuple[tuple[str, object], ...] = ()

    @property
    def scenario(self) -> str:
        """The cell's name ("arena@2x"), for progress bars and the RunSummary."""
        return cell_name(self.workload, self.load)

    @property
    def cost(self) -> float:
        """A rough relative cost, to start the long runs first: replicas x load x (candidates for the oracle)."""
        replicas = sum(n for _, n in (self.counts or WORKLOADS[self.workload].counts))
        return replicas * self.load * max(1, len(SYSTEMS[self.system].candidates))


def runs_for(workloads: Sequence[str], systems: Sequence[str], seeds: Sequence[int], *, split: str = "dev",
             loads: Sequence[float] | None = None, quick: bool = False,
             counts: tuple[tuple[str, int], ...] | None = None,
             schedule_policy: str | None = None,
             options: Mapping[str, object] | None = None) -> list[MatrixRun]:
    """Every run of the matrix: each workload at ``loads`` (default: its own :data:`MatrixWorkload.loads`), each
    system, each seed; on ``counts`` replicas per region when given (``deployed``); with the engines' waiting queues
    in ``schedule_policy`` order when given ("lpm", "fcfs"; None: the regime's); with ``options`` of the default's
    policy wherever it runs (:attr:`MatrixRun.options`). Raises KeyError for an unknown workload or system,
    ValueError for an unknown ``schedule_policy``, skylb.core.policies.PolicyError for an option the default's
    policy does not declare or a bad value."""
    for s in systems:
        SYSTEMS[s]  # noqa: B018 (fail early on a misspelt system)
    if schedule_policy is not None:
        replace(engine_params(), schedule_policy=schedule_policy)  # EngineParams checks the name
    if options:
        from skylb.core.policies import policy_options
        policy_options(SYSTEMS[DEFAULT].policy, options)  # fail before any run
    chosen = tuple(sorted((options or {}).items()))
    return [MatrixRun(w, load, s, seed, split, quick, counts, schedule_policy, chosen) for w in workloads
            for load in (loads or WORKLOADS[w].loads) for s in systems for seed in seeds]


def _with_options(policy: str, options: tuple[tuple[str, object], ...]):
    """The live defaults with ``options`` for ``policy`` when it is the default's policy, else None (the defaults
    as they are)."""
    if not options or policy != SYSTEMS[DEFAULT].policy:
        return None
    from skylb.config import BalancerConfig
    return BalancerConfig.model_validate(BalancerConfig().model_dump() | {"policies": {policy: dict(options)}})


def execute_run(spec: MatrixRun) -> RunSummary:
    """Run one simulation of the matrix to completion and summarise it (top level, for worker processes). The
    oracle runs once per candidate policy on the same workload and keeps per figure the best (``best_of``)."""
    wl = deployed(WORKLOADS[spec.workload], spec.counts)
    system = SYSTEMS[spec.system]
    stop_at, warmup = TIMES["quick" if spec.quick else wl.kind]
    t0 = time.perf_counter()
    workload = wl.make(spec.seed, spec.load, trace_window(spec.split, spec.seed), stop_at)
    params = engine_params()
    if spec.schedule_policy is not None:
        params = replace(params, schedule_policy=spec.schedule_policy)
    own = wl.replica_params(params)
    runs = []
    for variant in [replace(system, policy=p) for p in system.candidates] or [system]:
        t1 = time.perf_counter()
        cluster = build(variant, workload, dict(wl.counts), seed=spec.seed, stop_at=stop_at, params=params,
                        replica_params=own, settings=_with_options(variant.policy, spec.options)).run()
        runs.append(summarize(cluster, scenario=spec.scenario, system=spec.system, layout=system.layout,
                              warmup_s=warmup, seed=spec.seed, wall_s=time.perf_counter() - t1))
    if not system.candidates:
        return runs[0]
    best = best_of(runs, system=spec.system, labels=system.candidates)
    best.wall_s = time.perf_counter() - t0
    return best
