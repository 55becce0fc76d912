"""The systems compared in the SkyLB evaluation, each a configuration of the one routing core (paper §5.1-§5.2).

A system says where balancers run, which core policy each uses, which replicas each sees and whether balancers
forward to each other; ``build`` turns it plus a replica deployment into a ``Cluster``. No system re-implements
routing: every decision is ``skylb.core.Router.dispatch`` with a policy from ``skylb.core.policies``.

Single balancer in the US (paper §5.1: "For the baselines RR, LL, CH, and SGL, we deploy a single load balancer in
the US"): every client, wherever it is, sends to that balancer, which pushes blindly to all replicas of all regions.
A European request served in Europe therefore crosses the Atlantic twice each way (paper §3.1).

* RR: ``round-robin`` (stateless rotation). LL: ``least-load`` (fewest outstanding requests from this balancer).
* CH: ``consistent-hash``: ring hash of the session key (user id / question id; Envoy ring hash), blind.
* SGL: ``sglang``: SGLang router's cache_aware policy (sgl-router cache_aware.rs: approximate tree, match >= 0.3
  routes by prefix, else the smallest tree, least load when max - min > 64 and max > 1.5 min), blind.

One balancer per region (clients reach their own region's, as DNS would send them):

* GKE: the GKE multi-cluster Gateway stand-in (paper §5.1 and §6). Modelled as what that product does for this
  traffic without extra configuration: each client reaches the gateway of its nearest cluster, and GCP backend
  services spread requests over that cluster's endpoints round robin (``localityLbPolicy`` ROUND_ROBIN, the
  default); no prefix awareness, no queue, no cross-region spill-over while the local cluster is healthy
  (capacity-based spill-over needs a configured max rate per endpoint, which the paper does not mention).
* RegionLocal: region-local deployment (paper §5.2, Fig. 10, Fig. 1a): each region's balancer serves only its own
  replicas and never forwards. It uses SkyLB's own policy, so the comparison with SkyLB isolates cross-region
  traffic handling.
* SkyLB-CH: ``skylb-ch`` (hash ring + selective pushing) with forwarding to peers.
* SkyLB: ``skylb`` (prefix trie + regional snapshot + selective pushing on estimated wait: prefill backlog, engine
  queue and KV usage; placement by estimated time to first token; forwarding when a peer's estimate plus the round
  trip is better; skylb/core/policies/skylb.py) with forwarding to peers.

* SkyLB-paper: ``skylb-paper`` (the paper's rule kept as a policy: a replica is available while its last probe
  showed 0 pending requests) with forwarding to peers, for reproduction.

Upper bound:

* Oracle: one scheduler over all replicas with a global, fresh view and a free network, run once per candidate
  policy (:data:`ORACLE_CANDIDATES`: ``skylb``, ``skylb-paper``, ``sglang-selective``, ``sglang``,
  ``least-load``, those registered in ``skylb.core.policies``), keeping per figure the best candidate's value
  (bench/sim/metrics.py ``best_of``: per seed, the largest throughput and hit rate and the smallest of each
  TTFT / E2E statistic, each taken from whichever candidate did best on it). It is therefore a bound for each
  figure separately, not one run that achieves them all at once; the report lists every candidate. Each
  candidate runs in a single balancer that re-reads every replica's true pending count before each placement
  (no probe staleness, at most one placement per replica per look), with zero latency between clients,
  scheduler and replicas; its prefix trie sees every request (a global prefix view, paper Fig. 6 "optimal with
  a global view"). It is not an optimum of the scheduling problem, only the candidates' algorithms without the
  costs of being distributed: a system that beats it on a figure shows a better policy is missing from the
  candidates (the report checks this).

Selective pushing microbenchmark (paper §5.2, Fig. 9: "we extend the original [SGLang] router"): one balancer and
its replicas in one region.

* BP: ``sglang``, blind pushing (the original router).
* SP-O: ``sglang-selective`` with a fixed cap of 10 outstanding requests per replica: the replicas are configured
  with ``max_concurrency`` 10 and no pending metric, so the balancer derives pending = outstanding - 10 at each
  probe (skylb/engines/openai.py, as the live balancer does for engines without that metric). 10 is the SkyLB
  prototype's cap for replicas without an engine metric (reference/peers.md). Between two probes up to
  ``max_dispatch_per_probe`` (4) more requests may go to a replica that showed room, as in the live balancer.
* SP-P: ``sglang-selective`` on the engines' pending count (SkyLB's selective pushing), its queue looking ahead
  for a request whose prefix a free replica holds (``queue_lookahead`` 64; 0 is the paper's first come, first
  served).

Every balancer is built by ``skylb.core.build_router`` from the live defaults (skylb/config.py ``BalancerConfig``,
``settings_for``): probe interval 100 ms, state stale after 5 intervals, tau 2, at most 4 requests per replica
between two probes, and each policy's own defaults (skylb: trie chunks of 256 characters doubling after every 16,
prefix match threshold 0.5, load guard 32 / 1.0001; hash rings: 160 virtual nodes per member; SGLang: its defaults
but 256-character tree nodes, ``SIM_POLICY_OPTIONS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from bench.sim.cluster import BalancerSetup, Cluster, Network
from bench.sim.workloads import Workload
from skylb.config import BalancerConfig
from skylb.core.kv_index import BlockIndex
from skylb.core.policies import policy_names
from bench.emulator.model import EngineParams

__all__ = ["System", "SYSTEMS", "KV_SYSTEMS", "FIG8_SYSTEMS", "FIG9_SYSTEMS", "MOONCAKE_SYSTEMS", "ORACLE_CANDIDATES",
           "SIM_POLICY_OPTIONS", "replica_layout", "build", "settings_for"]

#: Options the simulated SGLang policies run with: 256-character tree nodes, the size every simulated run so far
#: has used (SGLang's per-character tree approximated; the policy's own default is 64), so figures stay comparable.
SIM_POLICY_OPTIONS = {"sglang": {"trie_chunk_chars": 256}, "sglang-selective": {"trie_chunk_chars": 256}}


def settings_for(policy: str, base: BalancerConfig | None = None, **overrides) -> BalancerConfig:
    """A balancer's settings in the simulator: ``base`` (default: the live defaults, ``BalancerConfig()``) with
    ``policy``, the simulated SGLang options unless ``base`` sets its own, and ``overrides``;
    ``skylb.core.build_router`` turns them into the Router. Raises pydantic.ValidationError on a bad override."""
    base = base or BalancerConfig()
    data = base.model_dump() | {"policy": policy, "policies": SIM_POLICY_OPTIONS | base.policies} | overrides
    return BalancerConfig.model_validate(data)


@dataclass(frozen=True)
class System:
    """One compared system.

    Attributes:
        key: short name used in tables and plots. label: a longer description for the report.
        layout: "single" (one balancer in ``home`` over every replica), "per_region" (one balancer per region over
            that region's replicas), "global" (the oracle: one scheduler, fresh view, free network) or
            "per_region_fresh" (one balancer per region over its replicas with the oracle's fresh view, the real
            network and no forwarding: what a region's balancer could do if it saw its replicas as they are;
            bench/sim/oracle_gap.py).
        policy: core policy name. forwarding: per-region balancers forward to each other.
        max_concurrency: replicas report no pending metric; the cap of SP-O. home: region of the single balancer.
        candidates: the oracle only: the policies it runs, one run each (``policy`` is then the first of them);
            bench/sim/scenarios.py ``execute`` keeps the best value of each figure.
        kv_events: the replicas publish KV-cache events into a block index and the balancers route by it (exact
            cache locality) rather than by their prefix tries alone.
    """

    key: str
    label: str
    layout: str
    policy: str
    forwarding: bool = False
    max_concurrency: int | None = None
    home: str = "us"
    candidates: tuple[str, ...] = ()
    kv_events: bool = False


#: The oracle's candidate policies (issue 8: SkyLB's, SGLang's cache-aware, least load), those registered.
ORACLE_CANDIDATES = tuple(p for p in ("skylb", "skylb-paper", "sglang-selective", "sglang", "least-load")
                          if p in policy_names())
#: Whether the paper's rule is registered as a policy of its own (skylb/core/policies).
_HAS_PAPER = "skylb-paper" in policy_names()


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("RR", "single balancer (US), round robin, blind pushing", "single", "round-robin"),
    System("LL", "single balancer (US), least load, blind pushing", "single", "least-load"),
    System("CH", "single balancer (US), consistent hashing, blind pushing", "single", "consistent-hash"),
    System("SGL", "single balancer (US), SGLang cache_aware, blind pushing", "single", "sglang"),
    System("GKE", "per-region gateway, round robin, no prefix awareness, no spill-over", "per_region",
           "round-robin"),
    System("RegionLocal", "per-region SkyLB balancer, own replicas only (no forwarding)", "per_region", "skylb"),
    System("SkyLB-CH", "per-region balancers, hash ring + selective pushing + forwarding", "per_region",
           "skylb-ch", forwarding=True),
    System("SkyLB", "per-region balancers, prefix trie + selective pushing on estimated wait + forwarding",
           "per_region", "skylb", forwarding=True),
    *([System("SkyLB-paper", "per-region balancers, the paper's rule (available = 0 pending at the last probe) "
              "+ forwarding", "per_region", "skylb-paper", forwarding=True)] if _HAS_PAPER else []),
    System("Oracle", "one scheduler, global fresh view, zero network latency; per figure the best of "
           + ", ".join(ORACLE_CANDIDATES), "global", ORACLE_CANDIDATES[0], candidates=ORACLE_CANDIDATES),
    System("BP", "SGLang cache_aware, blind pushing", "single", "sglang"),
    System("SP-O", "SGLang cache_aware, selective pushing by a cap of 10 outstanding per replica", "single",
           "sglang-selective", max_concurrency=10),
    System("SP-P", "SGLang cache_aware, selective pushing by pending requests, prefix-aware queue look-ahead",
           "single", "sglang-selective"),
)}

#: Systems whose replicas publish KV-cache events: kept out of SYSTEMS (every one of which the smoke test runs) and
#: run by the KV-routing benchmark (bench/sim/kv_routing.py).
KV_SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("SkyLB-KV", "per-region balancers, exact cache locality from the replicas' KV-cache events (the trie for "
           "replicas without) + selective pushing on estimated wait + forwarding", "per_region", "skylb",
           forwarding=True, kv_events=True),
)}

#: The systems of paper Fig. 8 (plus the paper's rule and the oracle), in plotting order.
FIG8_SYSTEMS = ("GKE", "RR", "LL", "CH", "SGL", "SkyLB-CH", "SkyLB", *(("SkyLB-paper",) if _HAS_PAPER else ()),
                "Oracle")
#: The Mooncake trace scenarios: Fig. 8's systems plus the region-local deployment (issue 8 targets).
MOONCAKE_SYSTEMS = (*FIG8_SYSTEMS[:-1], "RegionLocal", "Oracle")
#: The systems of paper Fig. 9.
FIG9_SYSTEMS = ("BP", "SP-O", "SP-P")


def replica_layout(counts: Mapping[str, int]) -> dict[str, str]:
    """Replica id -> region for ``counts`` (region -> replicas), ids like "us-r0"."""
    return {f"{region}-r{i}": region for region, n in counts.items() for i in range(n)}


def _sure_of_every_place(base: BalancerConfig | None) -> dict:
    """The simulated policy options with the default's ``untried_last`` off (unless ``base`` sets it): the oracle's
    fresh view ranks no free slot after another for a place a turnover left untried. It is a bound, not a
    deployable balancer, and the simulated engines' batches always have that place (bench/results/untried_place.md:
    with the rule, the oracle's P90 TTFT on replicas of two speeds at 1x was 0.61 s against 0.52)."""
    base = base or BalancerConfig()
    return SIM_POLICY_OPTIONS | base.policies | {"skylb": {"untried_last": False} | base.policies.get("skylb", {})}


def build(system: System, workload: Workload, counts: Mapping[str, int], *, seed: int, stop_at: float,
          network: Network | None = None, params: EngineParams | None = None,
          settings: BalancerConfig | None = None, replica_params: Mapping[str, EngineParams] | None = None) -> Cluster:
    """The Cluster of ``system`` over replicas ``counts`` (region -> replicas) running ``workload``; every balancer
    uses ``settings`` (default: the live defaults) with the system's policy (``settings_for``). ``replica_params``:
    replica id (``replica_layout``'s ids) -> engine parameters of a replica that differs from ``params`` (a slower
    one: ``time_scale`` > 1); bench/sim/cluster.py ``Cluster``."""
    base = settings
    replicas = replica_layout(counts)
    client_regions = workload.regions()
    regions = list(dict.fromkeys([*counts, *client_regions]))
    network = network or Network()
    settings = settings_for(system.policy, base)
    if system.layout == "single":
        setups = [BalancerSetup(system.home, tuple(replicas), settings, max_concurrency=system.max_concurrency)]
        entry = {r: system.home for r in client_regions}
    elif system.layout in ("per_region", "per_region_fresh"):
        fresh = system.layout == "per_region_fresh"  # the oracle's fresh look (as "global" below), no forwarding
        forwarding = system.forwarding and not fresh
        region_settings = settings_for(system.policy, base, stale_after_intervals=float("inf"),
                                       max_dispatch_per_probe=1, policies=_sure_of_every_place(base)) \
            if fresh else settings
        setups = [BalancerSetup(region, tuple(rid for rid, reg in replicas.items() if reg == region), region_settings,
                                forwarding=forwarding, max_concurrency=system.max_concurrency, fresh_view=fresh)
                  for region in regions]
        entry = {r: r for r in client_regions}
        if not forwarding:
            empty = [s.region for s in setups if not s.replicas and s.region in client_regions]
            if empty:
                raise ValueError(f"{system.key}: regions {empty} have clients but no replicas and no forwarding")
    elif system.layout == "global":
        # Fresh view: a probe before every placement, so staleness and the dispatch cap are moot (cap 1 per look).
        setups = [BalancerSetup("global", tuple(replicas), settings_for(
            system.policy, base, stale_after_intervals=float("inf"), max_dispatch_per_probe=1,
            policies=_sure_of_every_place(base)), fresh_view=True)]
        entry = {r: "global" for r in client_regions}
        network = Network(scale=0.0)
    else:
        raise ValueError(f"unknown layout {system.layout!r}")
    if system.kv_events:
        setups = [replace(s, kv_routing=True) for s in setups]
    return Cluster(workload=workload, replicas=replicas, balancers=setups, entry=entry, network=network,
                   params=params, seed=seed, stop_at=stop_at, probe_interval_s=settings.probe_interval_ms / 1000,
                   replica_params=replica_params, kv_index=BlockIndex() if system.kv_events else None)
