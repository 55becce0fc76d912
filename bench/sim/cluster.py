"""The simulated deployment: replicas (the emulator's engine model), balancers (the routing core), clients, network.

Source: SkyLB paper §3-§4 and Algorithm 1; the loop of each balancer mirrors skylb/balancer/balancer.py in simulated
time, so the decisions are made by the same ``skylb.core.Router`` and policy objects that serve live traffic:

* Probes: every ``probe_interval_s`` (100 ms) a balancer probes each of its replicas. The probe reaches the replica
  after the one-way latency, reads its pending and running counts *there and then*, and the answer is recorded
  (``Router.observe_replica``) one more one-way latency later. Between two probes the balancer works on the last
  answer, so its view is stale by up to one interval plus the round trip. Peers are probed the same way: the
  status (``Router.status``) is computed at the peer and recorded with ``Router.observe_peer``.
* Dispatch: after every event that can change a decision (a request arrives, a probe or status answer is recorded,
  a response ends) the balancer calls ``Router.dispatch(now)`` and applies the decisions: a request goes to a
  replica (one-way latency to the replica's region) or to a peer balancer (one-way inter-region latency), where it
  is queued again, marked as forwarded. The live balancer's 10 ms tick only re-runs the same check, so it is not
  needed here.
* Responses: the first token and the end of the stream travel back along the request's path, and each balancer
  on the path does what skylb/balancer/stages/route.py does when they pass it: on the first token (one one-way
  latency after the replica produced it) ``Router.first_token``; at the end of the stream first the measured
  speed, through the live code itself (skylb/balancer/usage.py ``observe``: the usage the emulator's vLLM
  personality reports, parsed by ``usage_of``; TTFT and end-to-end time measured from dispatch at that balancer,
  so only the dispatching balancer learns, a forwarding one's decision being a peer's), then ``Router.finished``.
  So the measured prefill rates (skylb/core/rates.py) and the estimated-wait tie-break act as they do live.
* Prompt length: the router's request is built as the live balancer builds it (skylb/balancer/stages/route.py),
  from the prompt text alone, so its token count is the balancer's estimate (skylb/core/estimate.py
  ``text_tokens``), which equals the engine's word count for the workloads' 3-character words
  (bench/replay/workload.py ``VOCABULARY``).
* Replicas: one ``bench.emulator.model.EngineModel`` each (continuous batching, KV capacity, block prefix cache
  with LRU; L4 / Llama-3.1-8B timings). One event per engine iteration, never one per token.
* KV-cache events (``kv_index``): each replica's engine records vLLM's events and, at the end of every step, they go
  through the live subscriber's own code (skylb/core/kv_events.py ``apply_events``) into the block index given (the
  whole deployment's) and into the own index of each balancer routing by them that owns the replica (as live, a
  balancer follows its own replicas' events only, so its peer status summarises its region's blocks), with no
  delay (vLLM publishes them within the step; the network's few ms are not modelled).
* Forward audit (``audit_forwards``): for every request a balancer forwards, whether some peer's region held at
  least ``audit_threshold`` of its prompt then (the engines' own caches), and whether it went to one that did
  (``forward_audit``).
* The oracle balancer (``fresh_view``) re-reads every replica's real state before each placement, with zero
  network latency: no staleness at all.
* Not modelled: failures and membership changes (every replica and peer stays healthy), the balancer's queue
  timeout (600 s by default: a simulated request waits as long as it must) and client cancellations.

Units: seconds of simulated time everywhere; latencies in the Network in milliseconds (as quoted in the paper).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from bench.sim.engine import EventLoop
from bench.sim.workloads import ClientSpec, SimRequest, Workload
from skylb.config import BalancerConfig
from skylb.core import Decision, PeerStatus, Request, build_router
from skylb.core.kv_events import apply_events
from skylb.core.kv_index import BlockIndex
from skylb.core.state import load_from_outstanding
from skylb.balancer.usage import observe as observe_usage, usage_of
from skylb.core.kv_hash import request_block_hashes
from bench.emulator import kv_hash
from bench.emulator.model import EngineParams, FinishedRequest, make_engine

__all__ = ["Network", "DEFAULT_RTT_MS", "farther", "BalancerSetup", "Flight", "SimReplica", "SimBalancer", "Cluster"]

#: Round-trip latencies between regions, ms (SkyLB paper §2.1 and §2.3: cross-region latency up to 200 ms).
DEFAULT_RTT_MS: dict[tuple[str, str], float] = {("us", "eu"): 80.0, ("us", "asia"): 150.0, ("eu", "asia"): 200.0}


@dataclass(frozen=True)
class Network:
    """Round-trip latencies: ``rtt_ms`` between regions (symmetric) and ``local_rtt_ms`` within a region.

    ``scale`` multiplies every latency (0 = the oracle's free network).
    """

    rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=lambda: dict(DEFAULT_RTT_MS))
    local_rtt_ms: float = 2.0
    scale: float = 1.0

    def one_way_s(self, a: str, b: str) -> float:
        """One-way latency from region ``a`` to region ``b``, s (half the round trip)."""
        if self.scale == 0.0:
            return 0.0
        if a == b:
            rtt = self.local_rtt_ms
        else:
            rtt = self.rtt_ms.get((a, b), self.rtt_ms.get((b, a)))
            if rtt is None:
                raise KeyError(f"no round-trip latency between {a!r} and {b!r}")
        return rtt * self.scale / 2000.0


def farther(rtt_scale: float) -> Network:
    """The default network with every round trip between regions x ``rtt_scale`` (within a region unchanged, unlike
    ``Network.scale``). Raises ValueError unless ``rtt_scale`` > 0."""
    if not rtt_scale > 0:
        raise ValueError(f"round-trip scale {rtt_scale!r}: expected a number > 0")
    return Network(rtt_ms={pair: ms * rtt_scale for pair, ms in DEFAULT_RTT_MS.items()})


@dataclass(frozen=True)
class BalancerSetup:
    """How one simulated balancer is built: where it runs, its settings, its replicas.

    Attributes:
        region: where it runs (its clients are the ones whose entry it is).
        replicas: the replica ids it routes to as *local* replicas (a single-region balancer may hold replicas
            of every region: the single-balancer baselines).
        settings: the balancer's settings (policy, policy options, availability rules), turned into a Router by
            ``skylb.core.build_router`` exactly as the live balancer does.
        forwarding: whether it has the other balancers as peers (SkyLB's cross-region traffic handling).
        max_concurrency: when set, its replicas report no pending metric and the balancer derives
            pending = max(0, outstanding - max_concurrency) at each probe, as skylb/engines/openai.py does (SP-O).
        fresh_view: the oracle: every placement sees every replica's real state (no probes, no staleness).
        kv_routing: its router reads the cluster's block index (exact cache locality from the replicas' KV-cache
            events, as a live balancer with ``kv_events`` replicas does) and each request's block hashes are
            computed as it arrives; needs the Cluster's ``kv_index``.
    """

    region: str
    replicas: tuple[str, ...]
    settings: BalancerConfig = field(default_factory=BalancerConfig)
    forwarding: bool = False
    max_concurrency: int | None = None
    fresh_view: bool = False
    kv_routing: bool = False


class Flight:
    """One request's journey: client -> balancer (-> peer balancer) -> replica, and its response back.

    Times are simulated seconds at the client (``sent_at``, ``first_token_at``, ``done_at``).
    """

    __slots__ = ("req", "client", "region", "sent_at", "origin", "origin_decision", "peer", "peer_decision",
                 "replica", "first_token_at", "done_at", "result", "back_s", "first_byte_at")

    def __init__(self, req: SimRequest, client: "_Client", region: str, sent_at: float):
        self.req = req
        self.client = client
        self.region = region
        self.sent_at = sent_at
        self.origin: SimBalancer | None = None
        self.origin_decision: Decision | None = None
        self.peer: SimBalancer | None = None
        self.peer_decision: Decision | None = None
        self.replica: SimReplica | None = None
        self.first_token_at: float | None = None
        self.done_at: float | None = None
        self.result: FinishedRequest | None = None
        self.back_s = 0.0  # latency of the response path, replica -> client, s
        #: balancer -> when the first token passed it, s (its relay's first byte: the TTFT it measures)
        self.first_byte_at: dict[str, float] = {}

    @property
    def forwarded(self) -> bool:
        """True when a peer balancer (another region) placed it."""
        return self.peer is not None

    @property
    def dispatcher(self) -> "SimBalancer":
        """The balancer that sent it to its replica."""
        return self.peer if self.peer is not None else self.origin


class SimReplica:
    """One inference replica: an EngineModel stepped by the event loop (one event per iteration)."""

    __slots__ = ("id", "region", "engine", "loop", "cluster", "flights", "busy")

    def __init__(self, cluster: "Cluster", replica_id: str, region: str, params: EngineParams):
        self.id = replica_id
        self.region = region
        self.engine = make_engine(params)
        if cluster.kv_index is not None:
            if not hasattr(self.engine, "enable_kv_events"):
                raise ValueError(f"replica {replica_id}: the {params.admission} engine model publishes no KV events")
            self.engine.enable_kv_events()
            cluster.kv_index.mark_live(replica_id)
        self.loop = cluster.loop
        self.cluster = cluster
        self.flights: dict[str, Flight] = {}
        self.busy = False

    def submit(self, flight: Flight) -> None:
        """The request reached the replica now: queue it in the engine and start stepping if idle."""
        flight.replica = self
        for hook in self.cluster.submit_hooks:
            hook(self, flight)
        req = flight.req
        self.flights[req.id] = flight
        self.engine.submit(req.id, req.tokens, req.max_tokens or req.output_tokens, ignore_eos=True,
                           now=self.loop.now, output_len=req.output_tokens)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        step = self.engine.start_step(self.loop.now)
        if step is None:
            self.busy = False
            return
        self.busy = True
        self.loop.at(step.end, self._complete, step)

    def _complete(self, step) -> None:
        self.engine.complete_step(step)
        if self.cluster.kv_index is not None:
            events = self.engine.take_kv_events()
            apply_events(self.cluster.kv_index, self.id, events)
            for index in self.cluster.kv_owners.get(self.id, ()):
                apply_events(index, self.id, events)
        for out in step.outputs:
            if out.index == 0:
                self.cluster.first_token(self.flights[out.request_id], step.end)
            if out.finished is not None:
                self.cluster.replica_finished(self.flights.pop(out.request_id), out.finished)
        self._start()
        for hook in self.cluster.step_hooks:
            hook()


class SimBalancer:
    """One balancer process in simulated time: a ``skylb.core.Router`` plus its probe loops.

    Mirrors skylb/balancer/balancer.py: ``receive`` is ``acquire`` (enqueue, then dispatch), ``release`` is
    ``release``, and the two probe loops call ``observe_replica`` / ``observe_peer``.
    """

    def __init__(self, cluster: "Cluster", setup: BalancerSetup):
        self.cluster = cluster
        self.loop = cluster.loop
        self.setup = setup
        self.region = setup.region
        # The queue bound is lifted: a simulated client is never refused, it waits (its latency is the figure).
        if setup.kv_routing and cluster.kv_index is None:
            raise ValueError(f"balancer {setup.region}: kv_routing needs the Cluster's kv_index")
        self.replicas = [cluster.replicas[r] for r in setup.replicas]
        # Its own index of its own replicas' events, as a live balancer follows only those.
        self.kv_index = BlockIndex() if setup.kv_routing else None
        if self.kv_index is not None:
            for r in self.replicas:
                self.kv_index.mark_live(r.id)
                cluster.kv_owners.setdefault(r.id, []).append(self.kv_index)
        self.router = build_router(setup.region, setup.settings, max_queue=10 ** 9, kv_index=self.kv_index)
        limits = {r.id: setup.max_concurrency for r in self.replicas} if setup.max_concurrency else None
        engine = "openai" if setup.max_concurrency else "vllm"
        self.router.set_replicas([(r.id, f"sim://{r.id}", engine) for r in self.replicas], max_concurrency=limits)
        by_region: dict[str, list[SimReplica]] = {}
        for r in self.replicas:
            by_region.setdefault(r.region, []).append(r)
        self._by_region = by_region
        self.peers: list[SimBalancer] = []

    # -- requests -----------------------------------------------------------------------------------------------
    def receive(self, flight: Flight, from_region: str | None) -> None:
        """A request arrived now, from a client (``from_region`` None) or forwarded by the peer in ``from_region``."""
        req = flight.req
        if from_region is None:
            flight.origin = self
        else:
            flight.peer = self
        waited = flight.origin_decision.queued_s if from_region is not None and flight.origin_decision else 0.0
        # As skylb/balancer/stages/route.py builds it: no prompt_tokens, the length is estimated from the text.
        self.router.enqueue(Request(id=req.id, text=req.text, arrived_at=self.loop.now,
                                    session_key=req.session_key, forwarded_from=from_region, waited_s=waited,
                                    max_tokens=req.max_tokens or req.output_tokens,  # what the engine is asked
                                    block_hashes=self.cluster.block_hashes(req) if self.setup.kv_routing else None))
        self.dispatch()

    def dispatch(self) -> None:
        """Place what the router lets go now and send each request on its way."""
        if not self.router.queue:
            return
        if self.setup.fresh_view:
            self._dispatch_fresh()
            return
        now, net, cluster = self.loop.now, self.cluster.network, self.cluster
        for d in self.router.dispatch(now):
            flight = cluster.flights[d.request.id]
            if flight.peer is self:
                flight.peer_decision = d
            else:
                flight.origin_decision = d
            if d.route == "local":
                replica = cluster.replicas[d.target]
                self.loop.at(now + net.one_way_s(self.region, replica.region), replica.submit, flight)
            else:
                peer = cluster.balancers[d.target]
                if cluster.audit_forwards:
                    cluster.audit_forward(self, peer, flight)
                self.loop.at(now + net.one_way_s(self.region, peer.region), peer.receive, flight, self.region)

    def _dispatch_fresh(self) -> None:
        """The oracle: observe every replica's true state, place at most one request per replica, repeat."""
        cluster, router = self.cluster, self.router
        while router.queue:
            now = self.loop.now
            for r in self.replicas:
                router.observe_replica(r.id, now=now, healthy=True, pending=r.engine.num_waiting,
                                       running=r.engine.num_running, kv_usage=r.engine.kv_usage)
            decisions = router.dispatch(now)
            if not decisions:
                return
            for d in decisions:
                flight = cluster.flights[d.request.id]
                flight.origin_decision = d
                cluster.replicas[d.target].submit(flight)

    def first_token(self, flight: Flight, decision: Decision) -> None:
        """The first token of ``decision`` passed this balancer: its prompt left the replica's prefill backlog."""
        flight.first_byte_at[self.region] = self.loop.now
        self.router.first_token(decision, self.loop.now)
        self.dispatch()

    def release(self, flight: Flight, decision: Decision) -> None:
        """The stream of ``decision`` ended here: learn the replica's speed from it, as skylb/balancer/usage.py
        ``observe`` does live (before the release), then free its slot and let the queue move."""
        first = flight.first_byte_at.get(self.region)
        ttft_s = None if first is None else first - decision.request.arrived_at  # RelayOutcome.ttft_s: from arrival
        observe_usage(self.router, decision, _StreamOutcome(_reported_usage(flight.result), ttft_s), self.loop.now)
        self.router.finished(decision)
        self.dispatch()

    # -- probes -------------------------------------------------------------------------------------------------
    def start_probing(self, phase_s: float) -> None:
        """Start the replica and peer probe loops, first round at ``phase_s`` (s)."""
        if self.setup.fresh_view:
            return
        self.loop.at(phase_s, self._probe_round)

    def _probe_round(self) -> None:
        if self.cluster.finished:
            return
        now, net = self.loop.now, self.cluster.network
        for region, replicas in self._by_region.items():
            self.loop.at(now + net.one_way_s(self.region, region), self._sample_replicas, replicas,
                         net.one_way_s(region, self.region))
        for peer in self.peers:
            self.loop.at(now + net.one_way_s(self.region, peer.region), self._sample_peer, peer,
                         net.one_way_s(peer.region, self.region))
        self.loop.at(now + self.cluster.probe_interval_s, self._probe_round)

    def _sample_replicas(self, replicas: list[SimReplica], back_s: float) -> None:
        snapshot = [(r.id, r.engine.num_waiting, r.engine.num_running, r.engine.kv_usage,
                     r.engine.params.num_blocks * r.engine.params.block_size,
                     # What the engine adapters say: SGLang reserves output tokens at admission (and the share of
                     # the running batch's it keeps, its new_token_ratio gauge), vLLM does not.
                     r.engine.params.clip_max_new_tokens if r.engine.params.admission == "sglang" else None,
                     r.engine.new_token_ratio if r.engine.params.admission == "sglang" else None)
                    for r in replicas]
        self.loop.at(self.loop.now + back_s, self._observe_replicas, snapshot)

    def _observe_replicas(self, snapshot: list[tuple[str, int, int, float, int, int | None, float | None]]) -> None:
        now, router, cap = self.loop.now, self.router, self.setup.max_concurrency
        for rid, pending, running, kv_usage, kv_tokens, reserve, ratio in snapshot:
            if cap:  # no pending metric: derive it from this balancer's own in-flight count, as live
                pending, running = load_from_outstanding(router.replicas[rid].outstanding, cap)
                kv_usage = kv_tokens = reserve = ratio = None
            router.observe_replica(rid, now=now, healthy=True, pending=pending, running=running, kv_usage=kv_usage,
                                   kv_capacity_tokens=kv_tokens, output_reserve_tokens=reserve,
                                   output_reserve_ratio=ratio)
        self.dispatch()

    def _sample_peer(self, peer: "SimBalancer", back_s: float) -> None:
        status = peer.router.status(self.loop.now)
        self.loop.at(self.loop.now + back_s, self._observe_peer, status, 2 * back_s)

    def _observe_peer(self, status: PeerStatus, rtt_s: float) -> None:
        self.router.observe_peer(status.region, now=self.loop.now, status=status, rtt_s=rtt_s)
        self.dispatch()


def _reported_usage(result: FinishedRequest):
    """The Usage the live balancer reads from this answer's last chunk: the emulator's vLLM personality's OpenAI
    ``usage`` (bench/emulator/personalities/openai.py), parsed by skylb/balancer/usage.py ``usage_of``."""
    return usage_of({"usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                               "total_tokens": result.prompt_tokens + result.completion_tokens,
                               "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}})


@dataclass(frozen=True)
class _StreamOutcome:
    """What skylb/balancer/usage.py ``observe`` reads of a relay's outcome (skylb/balancer/relay.py RelayOutcome):
    a whole, successful stream (status 200, no error) with its usage and TTFT from arrival at the balancer, s."""

    usage: object
    ttft_s: float | None
    status: int = 200
    error: str | None = None


class _Client:
    """A closed-loop client: runs its programs one after another; a request leaves when its parent completed."""

    __slots__ = ("cluster", "spec", "k", "children", "in_flight")

    def __init__(self, cluster: "Cluster", spec: ClientSpec):
        self.cluster = cluster
        self.spec = spec
        self.k = 0
        self.children: dict[str, list[SimRequest]] = {}
        self.in_flight = 0

    def next_program(self) -> None:
        cluster = self.cluster
        if cluster.loop.now >= cluster.stop_at:
            cluster.client_stopped()
            return
        program = self.spec.programs(self.k)
        if program is None:  # a finite workload: this client is done
            cluster.client_stopped()
            return
        self.k += 1
        self.children = {}
        roots = []
        for r in program:
            if r.parent is None:
                roots.append(r)
            else:
                self.children.setdefault(r.parent, []).append(r)
        for r in roots:
            self.send(r)
        if not roots:
            self.next_program()

    def send(self, req: SimRequest) -> None:
        self.in_flight += 1
        self.cluster.send(req, self, self.spec.region)

    def _send_later(self, req: SimRequest) -> None:
        # in_flight was counted when it was scheduled; past stop_at nothing more is sent.
        if self.cluster.loop.now < self.cluster.stop_at:
            self.cluster.send(req, self, self.spec.region)
            return
        self.in_flight -= 1
        if self.in_flight == 0:
            self.next_program()

    def done(self, flight: Flight) -> None:
        self.in_flight -= 1
        loop = self.cluster.loop
        if loop.now < self.cluster.stop_at:
            for child in self.children.pop(flight.req.id, ()):
                if child.think_s > 0:
                    self.in_flight += 1  # counted now, so the program is not over while the child waits
                    loop.after(child.think_s, self._send_later, child)
                else:
                    self.send(child)
        if self.in_flight == 0:
            self.next_program()


class _OpenLoopClient:
    """The trace replayer: sends every request at its arrival time (before ``stop_at``), ignoring completions."""

    __slots__ = ("cluster",)

    def __init__(self, cluster: "Cluster"):
        self.cluster = cluster

    def start(self, arrivals: list[SimRequest]) -> None:
        sent = [r for r in arrivals if r.arrival_s < self.cluster.stop_at]
        for r in sent:
            self.cluster.loop.at(r.arrival_s, self.cluster.send, r, self, r.region)
        self.cluster.loop.at(sent[-1].arrival_s if sent else 0.0, self.cluster.client_stopped)

    def done(self, flight: Flight) -> None:
        pass


class Cluster:
    """A whole simulated deployment running one workload.

    Args:
        workload: what the clients send. replicas: replica id -> region. balancers: one setup per balancer.
        entry: client region -> region of the balancer its requests go to (DNS, or the one central balancer).
        network: latencies. params: engine parameters of every replica (L4 / Llama-3.1-8B defaults).
        replica_params: replica id -> its own engine parameters, for the replicas that differ from ``params``
            (replicas of different speeds: ``EngineParams.time_scale`` multiplies every step's duration, so 4 is a
            replica four times slower; bench/sim/matrix.py's heterogeneous workload). None: all use ``params``.
        seed: seeds the client start times and probe phases. stop_at: no request is sent at or after this time
            (s); requests already sent run to completion (nothing is lost or duplicated).
        probe_interval_s: the probe interval of every balancer (paper §3.3 and the prototype: 0.1 s).
        sample_every_s: how often replica load is sampled for the time-averaged statistics.
        kv_index: a block index the replicas' KV-cache events are applied to (None: no events are recorded).

    After ``run()``: ``records`` (completed flights, in completion order) and ``samples``
    (time, per-replica outstanding, per-replica pending, per-balancer queue length, per-replica KV usage 0-1).
    """

    def __init__(self, *, workload: Workload, replicas: Mapping[str, str], balancers: list[BalancerSetup],
                 entry: Mapping[str, str], network: Network | None = None, params: EngineParams | None = None,
                 seed: int = 0, stop_at: float = 120.0, probe_interval_s: float = 0.1, sample_every_s: float = 0.1,
                 replica_params: Mapping[str, EngineParams] | None = None, kv_index: BlockIndex | None = None):
        self.loop = EventLoop()
        self.kv_index = kv_index
        #: replica id -> the block indexes of the balancers that follow its events (SimBalancer.kv_index).
        self.kv_owners: dict[str, list[BlockIndex]] = {}
        #: Whether to audit forwards (module docstring), the held fraction that counts, and the audit: one (time s,
        #: held by some peer's region, sent to a region that held it, sent to the one that held most, some holding
        #: region had room in the forwarding balancer's view) per forward.
        self.audit_forwards = False
        self.audit_threshold = 0.5
        self.forward_audit: list[tuple[float, bool, bool, bool, bool]] = []
        self._block_hashes: dict[str, tuple[int, ...]] = {}
        self.workload = workload
        self.network = network or Network()
        self.params = params or EngineParams()
        self.seed = seed
        self.stop_at = stop_at
        self.probe_interval_s = probe_interval_s
        self.sample_every_s = sample_every_s
        own = dict(replica_params or {})
        if set(own) - set(replicas):
            raise ValueError(f"replica_params names unknown replicas: {sorted(set(own) - set(replicas))}")
        self.replicas = {rid: SimReplica(self, rid, region, own.get(rid, self.params))
                         for rid, region in replicas.items()}
        self.step_hooks: list = []
        #: Called as hook(replica, flight) when a request reaches a replica, before the engine queues it (diagnostics:
        #: bench/sim/ttft_parts.py reads the replicas' state there).
        self.submit_hooks: list = []
        self.balancers: dict[str, SimBalancer] = {}
        for setup in balancers:
            if setup.region in self.balancers:
                raise ValueError(f"two balancers in region {setup.region!r}")
            self.balancers[setup.region] = SimBalancer(self, setup)
        for b in self.balancers.values():
            if b.setup.forwarding:
                b.peers = [p for p in self.balancers.values() if p is not b]
                b.router.set_peers([(p.region, f"sim://{p.region}") for p in b.peers])
            if b.setup.fresh_view:
                self.step_hooks.append(b.dispatch)  # the oracle reacts to every change of replica state
        self.entry = {region: self.balancers[b] for region, b in entry.items()}
        self.flights: dict[str, Flight] = {}
        self.records: list[Flight] = []
        self.samples: list[tuple[float, list[int], list[int], list[int], list[float]]] = []
        self._clients_running = 0
        self.finished = False

    # -- running ------------------------------------------------------------------------------------------------
    def block_hashes(self, req) -> tuple[int, ...]:
        """``req``'s block hashes as its replicas' engines hash them (the emulator's token ids, the engine model's
        block size; skylb/core/kv_hash.py), computed once per request, as a live balancer does before queueing."""
        hashes = self._block_hashes.get(req.id)
        if hashes is None:
            hashes = self._block_hashes[req.id] = request_block_hashes(kv_hash.token_ids(req.tokens),
                                                                       self.params.block_size)
        return hashes

    def audit_forward(self, origin: "SimBalancer", peer: "SimBalancer", flight: "Flight") -> None:
        """Record whether ``flight``'s request, forwarded by ``origin`` to ``peer`` now, went to a region whose
        replicas held at least ``audit_threshold`` of its prompt (``forward_audit``)."""
        tokens = flight.req.tokens
        held = {}
        for b in origin.peers:
            best = max((r.engine.cached_prefix_tokens(tokens) for r in b.replicas), default=0)
            held[b.region] = best / max(1, len(tokens))
        holders = {region for region, f in held.items() if f >= self.audit_threshold}
        deepest = max(held.values(), default=0.0)
        router, now = origin.router, self.loop.now
        # Checked after the decision, which counted this forward at its peer: a holder chosen counts as one with room.
        room = peer.region in holders or any(router.peer_available(router.peers[region], now, "", "openai")
                                             for region in holders)
        self.forward_audit.append((now, bool(holders), peer.region in holders,
                                   bool(holders) and held[peer.region] >= deepest, room))

    def run(self) -> "Cluster":
        """Run the workload to the end (every sent request completed); returns self."""
        rng = random.Random(f"{self.seed}:cluster")
        for b in self.balancers.values():
            b.start_probing(rng.uniform(0.0, self.probe_interval_s))
        if self.workload.arrivals:
            self._clients_running = 1
            _OpenLoopClient(self).start(self.workload.arrivals)
        for spec in self.workload.clients:
            self._clients_running += 1
            client = _Client(self, spec)
            start = rng.uniform(0.0, self.workload.start_spread_s)  # drawn always: seeds stay comparable
            self.loop.at(start if spec.start_s is None else spec.start_s, client.next_program)
        self.loop.at(0.0, self._sample)
        self.loop.run()
        if self.flights:
            raise RuntimeError(f"{len(self.flights)} requests never completed (first: {next(iter(self.flights))})")
        return self

    def client_stopped(self) -> None:
        """A client will send nothing more; the run ends when all have stopped and nothing is in flight."""
        self._clients_running -= 1
        self._check_finished()

    def _check_finished(self) -> None:
        if self._clients_running == 0 and not self.flights:
            self.finished = True

    def _sample(self) -> None:
        if self.finished:
            return
        reps = self.replicas.values()
        self.samples.append((self.loop.now, [r.engine.num_waiting + r.engine.num_running for r in reps],
                             [r.engine.num_waiting for r in reps], [len(b.router.queue) for b in self.balancers.values()],
                             [r.engine.kv_usage for r in reps]))
        self.loop.at(self.loop.now + self.sample_every_s, self._sample)

    # -- the request path ---------------------------------------------------------------------------------------
    def send(self, req: SimRequest, client, region: str) -> None:
        """A client in ``region`` sends ``req`` now to its entry balancer."""
        if req.id in self.flights:
            raise ValueError(f"request id {req.id!r} sent twice")
        flight = Flight(req, client, region, self.loop.now)
        self.flights[req.id] = flight
        balancer = self.entry[region]
        self.loop.at(self.loop.now + self.network.one_way_s(region, balancer.region), balancer.receive, flight, None)

    def first_token(self, flight: Flight, t: float) -> None:
        """The replica produced the first token at ``t``; it reaches the client after the response path latency."""
        net = self.network
        replica, dispatcher, origin = flight.replica, flight.dispatcher, flight.origin
        back = net.one_way_s(replica.region, dispatcher.region)
        if flight.peer is not None:
            back += net.one_way_s(flight.peer.region, origin.region)
        back += net.one_way_s(origin.region, flight.region)
        flight.back_s = back
        flight.first_token_at = t + back
        # The dispatching balancer relays the stream, so it sees the first token one hop later; a forwarding one
        # (the origin of a forwarded request) one more hop later (its decision is a peer's: nothing to update there,
        # but its relay measures the TTFT from its own first byte).
        at_dispatcher = t + net.one_way_s(replica.region, dispatcher.region)
        self.loop.at(at_dispatcher, dispatcher.first_token, flight,
                     flight.peer_decision if flight.peer is not None else flight.origin_decision)
        if flight.peer is not None:
            self.loop.at(at_dispatcher + net.one_way_s(flight.peer.region, origin.region), origin.first_token, flight,
                         flight.origin_decision)

    def replica_finished(self, flight: Flight, result: FinishedRequest) -> None:
        """The replica produced the last token now: release each balancer on the way back, then the client."""
        now, net = self.loop.now, self.network
        flight.result = result
        to_dispatcher = now + net.one_way_s(flight.replica.region, flight.dispatcher.region)
        if flight.peer is not None:
            self.loop.at(to_dispatcher, flight.peer.release, flight, flight.peer_decision)
            self.loop.at(to_dispatcher + net.one_way_s(flight.peer.region, flight.origin.region),
                         flight.origin.release, flight, flight.origin_decision)
        else:
            self.loop.at(to_dispatcher, flight.origin.release, flight, flight.origin_decision)
        self.loop.at(now + flight.back_s, self._client_done, flight)

    def _client_done(self, flight: Flight) -> None:
        flight.done_at = self.loop.now
        del self.flights[flight.req.id]
        self.records.append(flight)
        flight.client.done(flight)
        self._check_finished()
