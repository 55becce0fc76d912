"""One region's balancer: the parts of the request flow assembled, started and stopped as one.

The parts, one module each (README "A request's path"): the dispatcher (queue -> routing decision), the probers
(replicas and peers), membership (from the controller, kept on disk; or static, from the command line), the relay,
the quota gate and model groups, the Ollama fleet's actions, the metrics, and the chain of stages every request
passes (skylb/balancer/stages/, built by ``build_chain`` from the settings). The routing core
(``skylb.core.Router``) holds the state they share; it is built from the settings by ``skylb.core.build_router``,
the same builder the simulator uses. The Balancer assembles and owns their lifecycles; it serves no request itself.
No stage or feature part receives it (each gets the narrow dependencies it needs); only the status, Ollama metadata
and model-management handlers read it from the application.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable

import aiohttp
import structlog

from skylb.balancer.dispatcher import Dispatcher
from skylb.balancer.embed_cache import EmbeddingCache
from skylb.balancer.ollama_fleet import Fleet
from skylb.balancer.kv_routing import KVRouting
from skylb.balancer.membership import MembershipWatcher
from skylb.balancer.metrics import BalancerMetrics
from skylb.balancer.probers import Probers
from skylb.balancer.relay import Relay
from skylb.balancer.responses import ResponseBook, retrieve_handler
from skylb.balancer.retry import RetryBudget
from skylb.balancer.stages import Chain, RequestLog, build_chain
from skylb.balancer.tracing import FLUSH_S, start_tracing
from skylb.config import BalancerConfig
from skylb.core import Decision, build_router
from skylb.quota.buckets import LimitBackend
from skylb.quota.groups import ModelGate
from skylb.quota.leases import LeaseBook
from skylb.quota.limits import Quotas
from skylb.quota.regional import apply_shares, demand_report
from skylb.quota.wiring import build_gate, build_limits, quota_loop

__all__ = ["Balancer", "DRAIN_END_S"]

#: The most a drain waits, after its timeout, for the requests it ended to write their error (s).
DRAIN_END_S = 5.0

log = structlog.get_logger("skylb.balancer")


class Balancer:
    """One region's balancer state and background loops.

    Args:
        cfg: the balancer's settings; region: its region; advertise_url: how peers and the controller reach it;
        client_keys: whether clients authenticate with SkyLB API keys (then their Authorization is not relayed).
        static_membership: a membership snapshot applied once at start instead of the controller's (static mode,
            skylb/balancer/static.py); None: membership comes from the controller, else from disk.

    Attributes (after ``start``): router, dispatcher, metrics, session (upstream aiohttp session), relay,
    membership, tracing (skylb/balancer/spans.py Tracing, or None when tracing is off), kv (KV-cache event routing,
    skylb/balancer/kv_routing.py, or None when ``kv_events`` is off).
    """

    def __init__(self, cfg: BalancerConfig, *, region: str, advertise_url: str, client_keys: bool = False,
                 static_membership: dict | None = None):
        self.cfg = cfg
        self.static_membership = static_membership
        self._peers_refused = False
        self.client_keys = client_keys
        #: The quotas in force: the config's, replaced by the controller's when it holds some (skylb/quota).
        self.quotas: Quotas = cfg.quotas
        #: Called with the new quotas after each ``apply_quotas`` (parts that derive state from them append here).
        self.quota_listeners: list[Callable[[Quotas], None]] = []
        #: Model groups and admissions (skylb/quota/groups.py): reads the quotas, limits and served models in force.
        self.gate = ModelGate(quotas=lambda: self.quotas, limits=lambda: self.limits, now=self.now,
                              served=lambda api: (self.router.served_models(api)
                                                  if self.router.models_known() else None))
        self.region = region
        self.advertise_url = advertise_url
        #: The block index of the replicas' KV-cache events and what feeds it, or None (``balancer.kv_events``).
        self.kv = (KVRouting(max_blocks=cfg.kv_index_max_blocks, region=region,
                             tokenize_timeout_s=cfg.kv_tokenize_timeout_ms / 1000) if cfg.kv_events else None)
        self.router = build_router(region, cfg, kv_index=self.kv.index if self.kv is not None else None)
        #: The replica and peer probers, once started (``start``).
        self.probers: Probers | None = None
        #: The tenants client API keys map to (set by the application that checks the keys).
        self.key_tenants: frozenset[str] = frozenset()
        self.metrics = BalancerMetrics(self.router, now=self.now, controller_reachable=self.controller_reachable,
                                       tenant_configured=self.tenant_configured)
        if self.kv is not None:
            self.kv.register(self.metrics.registry)
        # Priority classes: tenants' weights for deficit round robin, read from the quotas in force at each turn.
        self.router.set_tenant_weights(lambda tenant: self.quotas.tenant(tenant).weight)
        #: Answers to repeated embedding requests, or None when balancer.embedding_cache is off.
        self.embed_cache = EmbeddingCache.from_settings(cfg.embedding_cache, region=region,
                                                        registry=self.metrics.registry)
        self.dispatcher = Dispatcher(self.router, now=self.now, queue_timeout_s=cfg.queue_timeout_s,
                                     tick_s=cfg.dispatch_tick_ms / 1000,
                                     no_target_timeout_s=cfg.no_target_timeout_s, on_routed=self._count_routed)
        self.retry_budget = RetryBudget(cfg.retry_policy)
        #: Where quota buckets live: Redis shared by every balancer, or this process (``balancer.quota``).
        self.limits: LimitBackend = build_limits(cfg.quota, regions_share=self.regions_share)
        #: The quota gate: a request waits here before the queue (skylb/quota/gate.py).
        self.quota_gate = build_gate(cfg.quota, quotas=lambda: self.quotas, limits=self.limits, now=self.now,
                                     registry=self.metrics.registry, region=region,
                                     queue_timeout_s=cfg.queue_timeout_s, tenant_label=self.metrics.tenant_label)
        self.quota_listeners.append(self.quota_gate.wake_all)
        #: The lease API's leases (skylb/balancer/lease_api.py), which the model-group stage honours.
        self.leases = LeaseBook()
        #: Counts every response and writes its log line (the chain's end, and errors answered by middleware).
        self.request_log = RequestLog(self.metrics, region=region)
        #: Which target holds each stored OpenAI Responses API answer (skylb/balancer/responses.py).
        self.responses = ResponseBook(now=self.now)
        #: The handler of ``GET /v1/responses/{id}``, built at ``start``.
        self.retrieve_response = None
        #: The request's path, built at ``start`` (it needs the relay's session).
        self.chain: Chain | None = None
        #: Spans of each request, exported over OTLP (skylb/balancer/tracing.py); None while tracing is off.
        self.tracing = None
        self.session: aiohttp.ClientSession | None = None
        self.relay: Relay | None = None
        self.membership: MembershipWatcher | None = None
        #: {region: assignment epoch} of the regions whose replicas this balancer serves (sent with heartbeats).
        self.served_epochs: dict[str, int] = {region: 0}
        #: {replica id: owner epoch} of the replicas this balancer owns, sent with heartbeats; None until a view of
        #: the controller's (a controller without owners sends none).
        self.owned_epochs: dict[str, int] | None = None
        #: True while the operator drains this region's balancers (`skylb-ctl balancer drain`).
        self.draining = False
        #: True from SIGTERM on: /healthz answers 503 "draining", new requests get 503 (skylb/balancer/process.py).
        self.shutting_down = False
        #: Generation requests whose handler is running (queued, relaying, or backing off before a retry).
        self.active_requests = 0
        self._forwarded_at: deque[float] = deque(maxlen=10_000)
        #: Placements since start by the profile's plugin that made them (``Decision.rule``; the status's
        #: ``placed_by_rule``, as ``skylb_requests_routed_total``'s rule label counts them for Prometheus).
        self.placed_by_rule: Counter[str] = Counter()
        #: {(api, model): (last seen on a local replica, last seen locally or on a peer)}, balancer clock (s).
        self._models_seen: dict[tuple[str, str], tuple[float | None, float]] = {}
        self._tasks: list[asyncio.Task] = []
        #: Ollama fleets: pre-warm, fallbacks, load times (skylb/balancer/ollama_fleet.py).
        self.fleet = Fleet(cfg.ollama_fleet, router=self.router, dispatcher=self.dispatcher, now=self.now,
                           session=lambda: self.session, region=region, response_timeout_s=cfg.response_timeout_s)

    def now(self) -> float:
        """The balancer's clock: the event loop's monotonic time, s."""
        return asyncio.get_running_loop().time()

    def controller_reachable(self) -> bool:
        """True when the latest controller call succeeded (False: serving on the last membership it knew)."""
        return bool(self.membership and self.membership.controller_reachable)

    def tenant_configured(self, tenant: str) -> bool:
        """True for ``default``, a tenant of the quotas in force and a tenant client API keys map to (metric labels
        name only these)."""
        return tenant == "default" or tenant in self.quotas.tenants or tenant in self.key_tenants

    def _count_routed(self, decision: Decision) -> None:
        if decision.route != "local":
            self._forwarded_at.append(self.now())
        self.placed_by_rule[decision.rule or ""] += 1
        self.fleet.routed(decision)
        # The counter and histograms in the loop's next turn: the request goes on to its target first.
        asyncio.get_running_loop().call_soon(self._count_routed_metrics, decision)

    def _count_routed_metrics(self, decision: Decision) -> None:
        metrics = self.metrics
        metrics.child(metrics.routed, self.region, decision.route, decision.target, decision.rule or "").inc()
        metrics.child(metrics.queue_wait, self.region, decision.request.priority).observe(decision.queued_s)

    def forwarded_rate(self, window_s: float = 60.0) -> float:
        """Requests forwarded to peers per second over the last ``window_s`` seconds (at most the last 10,000)."""
        since = self.now() - window_s
        return round(sum(1 for t in self._forwarded_at if t >= since) / window_s, 3)

    async def start(self) -> None:
        """Open the upstream session, load membership, start the dispatcher, probers and controller watch."""
        cfg = self.cfg
        # No total and no socket-read timeout: the relay times each phase itself (first byte, then idle between
        # chunks), so a long generation is never cut; every other call here sets its own timeout. auto_decompress
        # (aiohttp's default): a replica that compresses although asked for identity (relay.py) still reaches
        # clients, probes and /api/show as plain bytes (its Content-Encoding is not relayed).
        timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self.relay = Relay(self.session, region=self.region, peer_token=cfg.peer_token,
                           session_header=cfg.session_header, forward_client_auth=not self.client_keys,
                           replica_api_key=cfg.replica_api_key, first_byte_timeout_s=cfg.first_byte_timeout_s,
                           response_timeout_s=cfg.response_timeout_s, idle_timeout_s=cfg.idle_timeout_s)
        self.chain = build_chain(
            cfg, region=self.region, router=self.router, dispatcher=self.dispatcher, relay=self.relay,
            fleet=self.fleet, metrics=self.metrics, budget=self.retry_budget, now=self.now, in_flight=self.in_flight,
            quotas=lambda: self.quotas, quota_gate=self.quota_gate, group_gate=self.gate, leases=self.leases,
            embed_cache=self.embed_cache, client_keys=self.client_keys, recently_served=self.model_recently_served,
            request_log=self.request_log, responses=self.responses, kv=self.kv)
        self.retrieve_response = retrieve_handler(
            self.responses, target_url=self.target_url, session=lambda: self.session, region=self.region,
            peer_token=cfg.peer_token, replica_auth=self.relay.replica_authorization)
        self.tracing = start_tracing(cfg.tracing, region=self.region, instance=self.advertise_url)
        if self.tracing is not None:  # off: the chain as built, no span on any request's path
            self.chain = self.tracing.traced(self.chain)
            log.info("tracing_on", region=self.region, otlp_endpoint=self.tracing.endpoint)
        self.membership = MembershipWatcher(
            region=self.region, advertise_url=self.advertise_url, controller_url=cfg.controller_url,
            state_dir=cfg.state_dir, apply=self.apply_membership, session=self.session,
            held_epochs=lambda: dict(self.served_epochs), token=cfg.peer_token, apply_quotas=self.apply_quotas,
            balancer_id=cfg.balancer_id,
            held_owned=lambda: None if self.owned_epochs is None else dict(self.owned_epochs),
            config_quotas=cfg.quotas, heartbeat_s=cfg.heartbeat_s,
            demand=lambda: demand_report(self.limits, self.now()), apply_shares=lambda a: apply_shares(self.limits, a))
        # The controller's view first: a balancer restarted after a failover must not serve, from its file, replicas
        # that moved to another balancer meanwhile. The file when the controller does not answer (static stability).
        if self.static_membership is not None:
            self.apply_membership(self.static_membership)
        elif not await self.membership.fetch_once(timeout_s=2.0):
            self.membership.load_persisted()
        self.membership.start()
        if self.kv is not None:
            self.kv.start()
        probers = Probers(self.router, self.session, now=self.now, on_round=self._probe_round_done,
                          interval_s=cfg.probe_interval_ms / 1000, timeout_s=cfg.probe_timeout_ms / 1000,
                          peer_token=cfg.peer_token, models_refresh_s=cfg.models_refresh_s,
                          max_backoff=cfg.probe_backoff_max_intervals)
        self._tasks = [asyncio.create_task(self.dispatcher.run()), *probers.tasks()]
        self.probers = probers
        if cfg.quota.enabled:  # off: no quota stage uses the limits, so nothing to keep up
            self._tasks.append(asyncio.create_task(quota_loop(cfg.quota, limits=self.limits, gate=self.quota_gate,
                                                              now=self.now, regions_share=self.regions_share)))

    async def drain(self, timeout_s: float) -> float:
        """Shut down gracefully: fail readiness and refuse new requests, serve what is held (queued requests are
        still routed) for up to ``timeout_s`` s, then end the rest: queued ones get 503, upstream calls are closed so
        their streams end with a well-formed error event. Returns the seconds it took."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.shutting_down = True
        while self.active_requests and loop.time() - started < timeout_s:
            await asyncio.sleep(0.02)
        if self.active_requests:
            self.dispatcher.close("balancer shutting down")
            if self.session:
                await self.session.close()  # every upstream read fails now: the relay ends its stream with an error
            deadline = loop.time() + DRAIN_END_S  # bounded: writing the error events takes milliseconds
            while self.active_requests and loop.time() < deadline:
                await asyncio.sleep(0.02)
        return loop.time() - started

    async def stop(self) -> None:
        """Stop every loop, fail queued requests with QueueTimeout, close the session."""
        if self.membership:
            await self.membership.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.fleet.stop()
        if self.kv is not None:
            await self.kv.close()
        self.dispatcher.fail_waiting("balancer shutting down")
        if self.session:
            await self.session.close()
        if self.tracing is not None and not await self.tracing.shutdown(FLUSH_S):
            log.warning("tracing_flush_timed_out", region=self.region, waited_s=FLUSH_S)

    def apply_quotas(self, quotas: Quotas) -> None:
        """Put ``quotas`` in force at once (no restart): set ``self.quotas``, then call every listener in
        ``self.quota_listeners`` with them, in order; a listener that raises is logged and the others still run.
        Called by the membership watcher when the controller's quotas change (skylb/balancer/membership.py)."""
        self.quotas = quotas
        for listener in list(self.quota_listeners):
            try:
                listener(quotas)
            except Exception:  # one broken listener must not keep the others on stale quotas
                log.exception("quota_listener_failed", region=self.region, listener=repr(listener))

    def apply_membership(self, snapshot: dict) -> None:
        """Apply a controller snapshot: the full membership, or this balancer's view (``"view"``: only the
        replicas it owns, and its siblings; controller/ownership.py ``view_for``).

        Local replicas: the healthy, not draining replicas this balancer owns (from a view), or of every region
        assigned to this balancer (its own region, and after a failover the regions it took over, SkyLB paper
        §4.2); one that leaves (unhealthy, draining, reassigned, given to a sibling) is drained: no new requests,
        its in-flight ones finish. Peers (``peers_of``): its region's other live balancers (siblings) and other
        regions' live balancers. ``draining`` is set when the operator drains this balancer's region.
        """
        assigned = {a["region"]: (a["balancer_region"], a["epoch"]) for a in snapshot.get("assignments", [])}
        served = {region for region, (by, _) in assigned.items() if by == self.region}
        if self.region not in assigned:  # a controller from before assignments, or a region not yet known
            served.add(self.region)
        self.served_epochs = {region: assigned.get(region, (self.region, 0))[1] for region in served}
        view = snapshot.get("view")
        mine = [r for r in snapshot.get("replicas", []) if view is not None or r.get("region") in served]
        self.owned_epochs = None if view is None else {r["id"]: r["owner_epoch"] for r in mine}
        replicas = [(r["id"], r["url"].rstrip("/"), r.get("engine", "vllm")) for r in mine
                    if r.get("healthy", True) is not False and not r.get("draining", False)]
        peers = self.peers_of(snapshot, served)
        if peers and not self.cfg.peer_token:
            # Forwarded requests prove themselves with the peer token; without one this balancer neither forwards
            # nor accepts forwarded requests (skylb/balancer/auth.py), so peers would only fail its requests.
            if not self._peers_refused:
                log.error("peers_need_peer_token", region=self.region, peers=sorted(r for r, _ in peers),
                          detail="membership names peer balancers but no peer token is configured: not forwarding; "
                                 "set $SKYLB_PEER_TOKEN (or balancer.peer_token) on every balancer")
            self._peers_refused = True
            peers = []
        self.draining = any(b.get("draining", False) for b in snapshot.get("balancers", [])
                            if b.get("region") == self.region and (view is None or b.get("url") == view["balancer"]))
        self.router.set_replicas(replicas, max_concurrency={r["id"]: r.get("max_concurrency") for r in mine})
        if self.kv is not None:  # every replica it serves, healthy or not: a stream outlives a failed probe
            self.kv.apply(mine)
        self.router.set_peers(peers)
        for name, peer in self.router.peers.items():
            peer.sibling = name.startswith(f"{self.region}@")
        if self.probers is not None:  # a replica the view just gave this balancer serves after one probe, not a round
            self.probers.probe_unprobed()
        self.dispatcher.wake()

    def peers_of(self, snapshot: dict, served: set[str]) -> list[tuple[str, str]]:
        """(peer name, URL) of every live (healthy, not draining) balancer of ``snapshot`` but this one.

        A sibling (this region's) is named ``<region>@<its id>``: a peer the router knows like any other, whose
        measured round trip (local) ranks it before every other region. Another region's balancer is named by its
        region when it is the region's only live one (``peer_urls`` may route it through a proxy), else
        ``<region>@<id>`` too, each sibling there a peer of its own (each owns part of its region's replicas, and a
        forwarded request is never forwarded again). Regions this balancer serves after a failover are left out.
        The URL: ``peer_urls["<region>@<id>"]`` when given (the most specific: that very balancer), else for a
        region's only live balancer ``peer_urls["<region>"]``, else the URL it registered.
        """
        # The view's URL: as the controller spells it (normalised), which the balancers list uses too.
        me = (snapshot.get("view") or {}).get("balancer") or self.advertise_url
        live = [b for b in snapshot.get("balancers", [])
                if b.get("healthy", True) is not False and not b.get("draining", False)
                and b.get("url", "").rstrip("/") != me.rstrip("/")]
        per_region: dict[str, int] = {}
        for b in live:
            per_region[b["region"]] = per_region.get(b["region"], 0) + 1
        peers = []
        for b in live:
            region, url = b["region"], b["url"].rstrip("/")
            if region == self.region:
                peers.append((f"{region}@{b.get('id') or url}", url))
            elif region not in served:
                name = f"{region}@{b.get('id') or url}"
                if per_region[region] == 1:  # named by its region; reached as that very balancer if configured so
                    peers.append((region, self.cfg.peer_urls.get(name) or self.cfg.peer_urls.get(region, url)))
                else:  # a region-wide URL (a proxy in front of one balancer) cannot tell its siblings apart
                    peers.append((name, self.cfg.peer_urls.get(name, url)))
        return [(name, url.rstrip("/")) for name, url in peers]

    def _probe_round_done(self) -> None:
        self.remember_models()
        self.fleet.check_prewarm()
        self.dispatcher.wake()

    def remember_models(self) -> None:
        """Note the models served now (after every probe round), so a model whose replicas or region went away
        is told apart from one nobody serves (``model_recently_served``)."""
        now = self.now()
        for api in ("openai", "ollama"):
            local = self.router.served_models(api, with_peers=False)
            for model in self.router.served_models(api):
                last_local = now if model in local else self._models_seen.get((api, model), (None, now))[0]
                self._models_seen[(api, model)] = (last_local, now)

    def model_recently_served(self, api: str, model: str, *, with_peers: bool = True,
                              within_s: float | None = None) -> bool:
        """True when a local replica (or, ``with_peers``, a peer) served ``model`` in dialect ``api`` within the
        last ``within_s`` seconds (default ``model_memory_s``): a request for it gets 503 + Retry-After rather
        than 404, or, within ``no_target_timeout_s``, waits in the queue for it to come back."""
        seen = self._models_seen.get((api, model))
        if seen is None:
            return False
        at = seen[1] if with_peers else seen[0]
        return at is not None and self.now() - at <= (self.cfg.model_memory_s if within_s is None else within_s)

    def target_url(self, route: str, target: str) -> str | None:
        """The base URL of a local replica (route "local") or a peer (route "peer"), None when it is not there."""
        state = (self.router.replicas if route == "local" else self.router.peers).get(target)
        return None if state is None else state.url

    def regions_share(self) -> float:
        """1 / the number of balancers this one knows in membership (itself and its live peers, siblings included):
        each balancer's even share of a limit it enforces alone."""
        return 1.0 / (1 + len(self.router.peers))

    def in_flight(self) -> int:
        """Requests this balancer holds: queued, or sent to a replica or a peer and not yet finished."""
        return (len(self.router.queue) + sum(r.outstanding for r in self.router.replicas.values())
                + sum(p.outstanding for p in self.router.peers.values()))

    def served_models(self, api: str = "openai") -> list[str]:
        """The models this region can serve in dialect ``api``: its replicas' and, by forwarding, its peers'."""
        return sorted(self.router.served_models(api))
