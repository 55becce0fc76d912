"""A trace-driven discrete-event simulator of SkyLB deployments, reproducing the paper's evaluation (§5).

It drives the same routing core as the live balancer (``skylb.core.Router`` and its policies) and the emulator's
engine model (``bench.emulator.model.make_engine``: vLLM's or, with ``EngineParams(admission="sglang")``,
SGLang's scheduler) in simulated time, so a result is a statement about the code
that serves traffic. Modules, in the order a request meets them:

* ``workloads``: what clients send (conversations, Tree of Thoughts, Mixed Tree, the Mooncake trace).
* ``cluster``: clients, network latencies, balancers (Router + probe loops) and replicas (EngineModel).
* ``engine``: the event loop and its clock.
* ``systems``: the compared systems (RR, LL, CH, SGL, GKE, region-local, SkyLB-CH, SkyLB, oracle, BP/SP-O/SP-P)
  as configurations of the core.
* ``metrics``: throughput, TTFT / E2E percentiles, hit rate, load variance, forwarded fraction.
* ``scenarios``: workload x systems x deployments, and the paper's targets.
* ``capacity``: closed-loop clients on one replica: how many outstanding requests run before requests wait
  (the paper's §3.3 "20 to 50"); ``python -m bench.sim.capacity``.

Run it with ``skylb bench sim --scenario NAME`` or ``skylb bench all`` (bench/bench_cli.py).
"""

from bench.sim.cluster import BalancerSetup, Cluster, Network
from bench.sim.engine import EventLoop
from bench.sim.metrics import RunSummary, replicas_needed, summarize
from bench.sim.scenarios import SCENARIOS, RunSpec, execute, runs_of
from bench.sim.systems import SYSTEMS, System, build
from bench.sim.workloads import SimRequest, Workload

__all__ = [
    "BalancerSetup", "Cluster", "EventLoop", "Network", "RunSpec", "RunSummary", "SCENARIOS", "SYSTEMS", "SimRequest",
    "System", "Workload", "build", "execute", "replicas_needed", "runs_of", "summarize",
]
