"""Configuration of a SkyLB deployment: one YAML file, validated with pydantic.

The same file drives every process: `skylb controller` reads ``controller``, `skylb balancer --region R` reads
``balancer`` (defaults for all regions) merged with ``regions.R.balancer``, and `skylb local` reads everything
(regions, replicas per region, emulator, latency matrix, workload). Unknown keys are errors, so a typo never passes
silently; the ``emulator``, ``latency`` and ``workload`` sections belong to the demo and the benchmarks, which
validate them themselves (bench/launch/settings.py, bench/replay/workload.py). Units are in the key names (``_ms``, ``_s``,
``_tokens``, ``_chars``).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, create_model,
                      field_validator, model_serializer, model_validator)

from skylb import environment
from skylb.core.fleet_rules import FleetSettings
from skylb.core.policies import options_class, policy_options
from skylb.dns_settings import DnsConfig
from skylb.quota.limits import Quotas
from skylb.quota.settings import QuotaSettings
from skylb.quota.priorities import PrioritySettings
from skylb.balancer.embed_cache import EmbeddingCacheSettings
from skylb.balancer.tracing import TracingSettings

__all__ = [
    "ConfigError",
    "ControllerConfig", "HealthCheck", "Failover",
    "BalancerConfig", "BalancerOverrides",
    "EtcdStoreConfig",
    "RetryPolicy",
    "OutlierDetection",
    "ClientConnections",
    "RegionConfig",
    "DeploymentConfig",
    "load_config", "balancer_environment", "balancer_settings",
    "default_config_path",
]


class ConfigError(ValueError):
    """Raised when a config file is missing, is not YAML, or fails validation (message names the bad key)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class EtcdStoreConfig(_Strict):
    """Membership in etcd (``controller.store: etcd``): two or three controllers share it and elect a leader, the
    one that runs health checks and failover (controller/leader.py); any of them serves the API."""

    #: Client URLs of the etcd cluster's members; a controller moves to the next when one does not answer.
    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:2379"], min_length=1)
    #: Key prefix of this deployment's membership and leader key (several deployments may share one etcd).
    prefix: str = Field("/skylb", pattern=r"^/[A-Za-z0-9/._-]*$")
    #: The leader's lease, whole seconds: a leader that dies is replaced about this long after (etcd's minimum: 2).
    lease_ttl_s: int = Field(5, ge=1)

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, endpoints: list[str]) -> list[str]:
        for url in endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"etcd endpoint {url!r} is not a URL such as http://127.0.0.1:2379")
        return endpoints


class HealthCheck(_Strict):
    """The controller's active health check of every replica and balancer (HAProxy's ``inter``, ``fastinter``,
    ``rise`` and ``fall``, with HAProxy's defaults but ``fastinter``): each replica is probed every ``interval_s``
    through its engine adapter (the same probe the balancers use), each balancer on its ``/healthz``; ``fall``
    failures in a row mark it unhealthy (a replica leaves every balancer's candidates, a balancer's region fails over)
    through a membership revision; ``rise`` successes in a row bring it back."""

    enabled: bool = True
    #: Seconds between two checks of one replica (HAProxy ``inter``: 2 s).
    interval_s: float = Field(2.0, gt=0)
    #: Seconds a check may take before it counts as failed.
    timeout_s: float = Field(1.0, gt=0)
    #: Consecutive successes that make an unhealthy replica healthy (HAProxy ``rise``: 2).
    rise: int = Field(2, ge=1)
    #: Consecutive failures that make a healthy replica unhealthy (HAProxy ``fall``: 3).
    fall: int = Field(3, ge=1)
    #: Seconds between checks while a verdict is changing, after a first failure or success that disagrees with it
    #: (HAProxy ``fastinter``); with the defaults a dead balancer is detected 2 + 2 x 0.5 = 3 s after its last good
    #: check at worst, under two intervals.
    fastinter_s: float = Field(0.5, gt=0)


class Failover(_Strict):
    """Regional failover of balancers (SkyLB paper §4.2, "Failure recovery of load balancers"): when every balancer
    of a region is unhealthy or draining, the controller assigns the region's replicas to the closest region whose
    balancer is live (by ``rtt_ms``), and back when the region's own balancer is healthy again."""

    enabled: bool = True
    #: Round trips between regions, ms, keyed "a-b" (symmetric). A pair missing here
    #: counts as farther than every listed one; ties go to the region whose name sorts first.
    rtt_ms: dict[str, float] = Field(default_factory=dict)

    def rtt(self, a: str, b: str) -> float:
        """The round trip between regions ``a`` and ``b`` in ms (0 for a == b, infinity when not listed)."""
        if a == b:
            return 0.0
        return self.rtt_ms.get(f"{a}-{b}", self.rtt_ms.get(f"{b}-{a}", float("inf")))


class ClientConnections(_Strict):
    """Deadlines on clients and a cap on their connections, as well-known proxies set them (nginx's
    ``client_header_timeout``, ``client_body_timeout`` and ``keepalive_timeout``, HAProxy's ``timeout http-request``
    and ``maxconn``), so a client sending one byte a second cannot hold a connection for ever, nor many such clients
    every file descriptor (skylb/listener.py). The balancer's (``balancer.client_connections``: peers and the
    controller connect to it as clients too) and the controller's (``controller.client_connections``: balancers'
    long polls and heartbeats, skylb-ctl) are apart."""

    #: A request's head (request line and headers) must be complete within this many seconds of its first byte,
    #: the first request's within this of the connection opening; else 408 and the connection is closed (closed
    #: without an answer when no byte came) (nginx ``client_header_timeout``: 60 s).
    header_timeout_s: float = Field(60.0, gt=0)
    #: A request's body must be complete within this many seconds of its head, plus one second for every
    #: ``body_min_rate_bytes_s`` bytes received (Apache's ``RequestReadTimeout body=60,MinRate=500``); else 408 in
    #: the API's shape and the connection is closed. A deadline, not a gap between reads (nginx
    #: ``client_body_timeout``), which a client sending a byte a second never reaches.
    body_timeout_s: float = Field(60.0, gt=0)
    #: The least body rate that keeps extending the body's deadline, bytes/s; 0: the deadline is ``body_timeout_s``
    #: whatever the size (the largest body, ``max_body_bytes``, must then fit in it).
    body_min_rate_bytes_s: float = Field(500.0, ge=0)
    #: An idle keep-alive connection (no request since the last answer ended) is closed after this many seconds
    #: (aiohttp's ``keepalive_timeout``; nginx ``keepalive_timeout``: 75 s).
    keepalive_timeout_s: float = Field(75.0, gt=0)
    #: Open client connections at most; one more is answered 503 with Retry-After and closed (nginx ``limit_conn``
    #: answers 503). Every queued or streaming request holds one, so keep it above ``max_queue`` plus the requests
    #: in flight, and below the process's file descriptor limit (LimitNOFILE=65536 in deploy/systemd) halved, since
    #: a request in flight also holds a connection to its replica.
    max_connections: int = Field(16_384, gt=0)


class ControllerConfig(_Strict):
    """Where the controller listens and keeps its SQLite membership store, how it checks the health of replicas
    and balancers, and how it fails a region's replicas over to another region's balancer."""

    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535)
    db: str = ".skylb-run/controller.sqlite"
    #: Where membership lives: "sqlite" (the file ``db``, one controller) or "etcd" (``etcd``, several).
    store: Literal["sqlite", "etcd"] = "sqlite"
    etcd: EtcdStoreConfig = Field(default_factory=EtcdStoreConfig)
    health: HealthCheck = Field(default_factory=HealthCheck)
    failover: Failover = Field(default_factory=Failover)
    #: The per-region DNS answer the controller updates (RFC 2136) on failover and recovery; None: no DNS updates.
    dns: DnsConfig | None = None
    #: Required as ``Authorization: Bearer <token>`` on every change of membership (POST, DELETE); None: the API is
    #: open (a warning at start). $SKYLB_ADMIN_TOKEN, then the file $SKYLB_ADMIN_TOKEN_FILE or ``admin_token_file``,
    #: override it (controller/auth.py; README "Security").
    admin_token: str | None = None
    admin_token_file: str | None = None
    #: The balancers' shared secret: their heartbeats (POST /v1/balancers) must carry it as ``X-SkyLB-Token``
    #: (or the admin token); $SKYLB_PEER_TOKEN overrides it.
    peer_token: str | None = None
    #: Deadlines on reading requests, idle keep-alive and a cap on open connections, as the balancer's
    #: (``ClientConnections``). Every balancer holds one long poll (``GET /v1/membership?wait=``, at most 60 s, well
    #: inside the keep-alive) and heartbeats; the defaults leave room for thousands.
    client_connections: ClientConnections = Field(default_factory=ClientConnections)


class RetryPolicy(_Strict):
    """Retries before the first byte (Envoy's ``retry_policy`` and ``retry_budget``): a request whose target refused
    it, timed out before its first byte or answered 500/502/503/504 before any byte reached the client goes back to the
    head of the queue, after a jittered backoff, and is routed again to another target (never the one that just
    failed while another is usable). Once a byte reached the client it is never retried (no spliced generations)."""

    #: How many times one request is retried at most (Envoy's ``num_retries``; SkyLB's default 2).
    num_retries: int = Field(2, ge=0)
    #: Retries running at once may be at most this percentage of the requests this balancer holds (queued and in
    #: flight) (Envoy's ``retry_budget.budget_percent``: 20).
    budget_percent: float = Field(20.0, ge=0, le=100)
    #: ... but never fewer than this many at once (Envoy's ``retry_budget.min_retry_concurrency``: 3).
    min_retry_concurrency: int = Field(3, ge=0)
    #: Backoff before retry n: a uniformly random time in [0, min(base x 2^(n-1), max)] ("full jitter"), ms
    #: (Envoy's ``retry_back_off``: base 25 ms, max 250 ms, i.e. 10 x base).
    base_interval_ms: float = Field(25.0, ge=0)
    max_interval_ms: float = Field(250.0, ge=0)

    @model_validator(mode="after")
    def _max_not_below_base(self) -> "RetryPolicy":
        if self.max_interval_ms < self.base_interval_ms:
            raise ValueError("max_interval_ms must be at least base_interval_ms")
        return self


class OutlierDetection(_Strict):
    """Passive health checking (Envoy's ``outlier_detection``, with Envoy's names and defaults): a replica or peer
    that fails requests is ejected (gets no requests) for ``base_ejection_time_s`` x the number of times it was
    ejected (at most ``max_ejection_time_s``), then returns. The count drops by one for every ``interval_s`` it
    stays un-ejected. At most ``max_ejection_percent`` of the targets are ejected at once, rounded down but at least
    one; when fewer than ``healthy_panic_threshold`` percent of the targets are healthy and not ejected (panic),
    ejection is ignored, so an outage of most targets never leaves every request without one."""

    #: Consecutive 5xx answers (any status >= 500, gateway failures included) that eject a target (Envoy's
    #: ``consecutive_5xx``: 5); 0 never ejects on this count.
    consecutive_5xx: int = Field(5, ge=0)
    #: Consecutive gateway failures (refused, reset, timed out before the first byte, 502, 503, 504) that eject a
    #: target (Envoy's ``consecutive_gateway_failure``: 5); 0 never ejects on this count.
    consecutive_gateway_failure: int = Field(5, ge=0)
    #: The first ejection's length, s; the n-th lasts n times this (Envoy's ``base_ejection_time``: 30 s).
    base_ejection_time_s: float = Field(30.0, gt=0)
    #: The longest ejection, s (Envoy's ``max_ejection_time``: 300 s).
    max_ejection_time_s: float = Field(300.0, gt=0)
    #: The ejection count drops by one for each of these spent un-ejected, s (Envoy's ``interval``: 10 s).
    interval_s: float = Field(10.0, gt=0)
    #: The most targets (local replicas; peers counted apart) ejected at once, percent, rounded down but at least
    #: one (Envoy's ``max_ejection_percent``: 10, "at least one host").
    max_ejection_percent: float = Field(10.0, ge=0, le=100)
    #: Panic threshold, percent: below this share of healthy, un-ejected targets ejection is ignored (Envoy's
    #: ``healthy_panic_threshold``: 50); 0 disables panic.
    healthy_panic_threshold: float = Field(50.0, ge=0, le=100)


class BalancerConfig(_Strict):
    """One balancer's routing and probing settings (source: SkyLB paper §3.3, Algorithm 1)."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    #: The URL peers and the controller use to reach this balancer; default http://host:port.
    advertise_url: str | None = None
    #: This balancer's name among its region's balancers (siblings): 1-128 letters, digits, '.', ':', '-', '_';
    #: default: the advertised URL's host:port. A balancer restarted elsewhere with the same id replaces itself.
    balancer_id: str | None = Field(None, pattern=r"^[A-Za-z0-9.:_-]{1,128}$")
    #: The routing policy, a name from the registry (skylb.core.policies): skylb (prefix trie + selective pushing,
    #: the default), skylb-ch (hash ring + selective pushing), and the baselines round-robin, least-load,
    #: consistent-hash, sglang (blind pushing) and sglang-selective.
    policy: str = "skylb"
    #: Options per policy name, used when that policy is chosen (so switching policy needs no edit here); each
    #: policy declares its options and unknown ones are errors, e.g. ``{skylb: {match_threshold: 0.5}}``.
    policies: dict[str, dict[str, Any]] = Field(default_factory=dict)
    probe_interval_ms: float = Field(100.0, gt=0)
    #: Adaptive probing (skylb/balancer/probe_backoff.py): a replica whose probes only show this balancer's own
    #: requests, or a peer whose status did not change and got no request, is probed at twice its interval after
    #: each such answer, up to this many probe intervals; any other answer brings it back to one. 1: every target
    #: every interval (the SkyLB paper's prototype). Probing costs about 1 ms of CPU per probe.
    probe_backoff_max_intervals: int = Field(8, ge=1, le=100)
    #: A probe older than this many intervals makes its replica or peer unavailable.
    stale_after_intervals: float = Field(5.0, gt=0)
    #: A peer's status older than this many intervals plus two round trips to it makes it unavailable (when sooner
    #: than ``stale_after_intervals``): a partitioned peer, whose status probe hangs, is unavailable within 3
    #: probe intervals and no request waits on it; 0 uses ``stale_after_intervals`` alone.
    peer_stale_after_intervals: float = Field(3.0, ge=0)
    probe_timeout_ms: float = Field(1000.0, gt=0)
    #: Seconds between two reads of a replica's model list (a model pulled, loaded or deleted later is seen within
    #: this); the first read is at its first healthy probe.
    models_refresh_s: float = Field(30.0, gt=0)
    #: tau: the largest peer queue length at which the peer is still available (Algorithm 1, line 12).
    tau: int = Field(2, ge=0)
    session_header: str = "X-Session-ID"
    #: Optional ceiling on requests sent to one replica between two of its probes; 0 = none. Not needed for good
    #: results: each replica's admission capacity is learned from its probes (``learn_capacity``).
    max_dispatch_per_probe: int = Field(0, ge=0)
    #: Learn how many requests each replica runs at once from its probes' running and waiting counts, and send it
    #: no more than that between probes (skylb/core/capacity.py); False: only pending requests (and llama.cpp's
    #: reported slots) make a replica unavailable, the SkyLB paper's rule.
    learn_capacity: bool = True
    #: With a learned capacity: how many requests may wait in a replica's own queue beyond its batch. One waiting
    #: request takes a slot the moment the engine frees it, at the engine's next step, with no round trip through the
    #: balancer; and a batch that keeps one request waiting shows its true size at every probe, so the learned
    #: capacity settles on it. Measured in the simulator on the live three-region benchmark's workload
    #: (bench/sim/peers_twin.py, seeds 0-4): P90 TTFT 2429 -> 1829 ms, throughput 23.35 -> 24.13 req/s, learned
    #: limits 3-5 -> 4 on batches of 4, requests waiting at an engine 0.2 -> 0.7 on average; in one region
    #: (bench/live/baselines.py's workload) P90 1070 -> 1063 ms, at most 2 waiting either way. 0: none. Unset: the
    #: policy's own, 1 for ``skylb`` and 0 for ``skylb-paper`` and ``skylb-ch``, whose rule (SkyLB paper §3.3) is
    #: that no request waits in an engine.
    pending_allowance: int | None = Field(None, ge=0)
    #: How often the dispatcher re-checks the head of the queue when nothing changed (ms).
    dispatch_tick_ms: float = Field(10.0, gt=0)
    #: Requests waiting longer than this get 503 in the API's shape (s).
    queue_timeout_s: float = Field(600.0, gt=0)
    #: A queued request whose model no usable replica here or peer serves (all unhealthy, stale, ejected or
    #: draining) gets 503 with Retry-After once that has lasted this long (s): it waits at most this plus one
    #: dispatch tick past the moment its model's last usable target went, not ``queue_timeout_s``. A request that
    #: arrives within this long of its model leaving the membership (its last replica removed or failed a health
    #: check) waits in the queue the same way rather than getting that 503 at once.
    no_target_timeout_s: float = Field(5.0, gt=0)
    max_queue: int = Field(10_000, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    #: Longest wait from sending a streamed request to a replica or peer until its first byte, s (Envoy's per-try
    #: timeout, which applies only before a byte went downstream). Past it the attempt fails and, with nothing sent
    #: to the client yet, the request is retried elsewhere. Not a total: a long generation is never cut by it.
    first_byte_timeout_s: float = Field(60.0, gt=0)
    #: The same for a request that is not streamed, whose first byte is its whole answer, s (long generations take
    #: minutes before any byte: aiohttp's total of 300 s would cut them).
    response_timeout_s: float = Field(600.0, gt=0)
    #: Longest gap between two chunks of a response once it started, s (Envoy's ``stream_idle_timeout``); an engine
    #: that stalls longer ends the stream with a well-formed error event.
    idle_timeout_s: float = Field(30.0, gt=0)
    #: On SIGTERM: how long the balancer keeps serving what it holds (queued and in-flight requests) after it stops
    #: accepting new ones and fails its readiness check, s; what is left after that gets a well-formed error.
    drain_timeout_s: float = Field(30.0, ge=0)
    #: The controller's base URL, or several (a list, or one string with commas) when controllers share etcd:
    #: the balancer uses one and moves to the next when it does not answer.
    controller_url: str | list[str] | None = None
    #: Seconds between two heartbeats to the controller (registration, and the quota demand that moves each
    #: region's share of the limits when no Redis is configured; controller/shares.py).
    heartbeat_s: float = Field(10.0, gt=0)
    #: How this balancer reaches each peer region, when not the peer's advertised URL (a latency proxy, say).
    peer_urls: dict[str, str] = Field(default_factory=dict)
    #: Where the last membership from the controller is kept, so a restart works while the controller is down.
    state_dir: str = ".skylb-run"
    #: Shared secret for balancer-to-balancer requests (peer status, forwarded requests, /metrics) and for this
    #: balancer's heartbeats to the controller; None disables those checks (a warning at start). Better set through
    #: $SKYLB_PEER_TOKEN than here (skylb/balancer/auth.py; README "Security").
    peer_token: str | None = None
    #: Client API keys accepted as ``Authorization: Bearer <key>`` on /v1/* and /api/*; none (and no keys file and no
    #: $SKYLB_API_KEYS): the client APIs are open. Keys need a peer token (else a client could claim to be a peer).
    api_keys: list[str] = Field(default_factory=list)
    #: A file of client API keys, one a line (``#`` comments); $SKYLB_API_KEYS_FILE overrides it. A line may name
    #: the key's tenant after it: ``<key> <tenant>``.
    api_keys_file: str | None = None
    #: Tenants by name, each with its client API keys (accepted like ``api_keys``). A request's tenant is the one
    #: its key belongs to; without one (no keys, or a key of no tenant) it is ``default``. Quotas, weights and
    #: priority classes are set per tenant (``quotas``; skylb/quota/limits.py).
    tenants: dict[str, list[str]] = Field(default_factory=dict)
    #: Tenant and model limits, model groups (skylb/quota/limits.py); a controller's copy replaces it at runtime.
    quotas: Quotas = Field(default_factory=Quotas)
    #: How quotas are enforced: Redis or in-process buckets, the wait before 429, token estimates
    #: (skylb/quota/settings.py).
    quota: QuotaSettings = Field(default_factory=QuotaSettings)
    #: Accepted on /metrics as ``Authorization: Bearer <token>`` besides the peer token; $SKYLB_METRICS_TOKEN
    #: overrides it.
    metrics_token: str | None = None
    #: Sent to local replicas as ``Authorization: Bearer <key>`` (an engine started with --api-key); with client API
    #: keys on, the client's own Authorization never reaches a replica or peer. $SKYLB_REPLICA_API_KEY overrides it.
    replica_api_key: str | None = None
    #: PEM certificate chain and private key: with both, the listener speaks HTTPS (and advertise_url defaults to
    #: https://host:port).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: The largest request body accepted (bytes); a larger one gets 413 in the API's shape.
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    #: How long a model stays known after the last replica or peer serving it went away (s): a request for it
    #: gets 503 with Retry-After meanwhile (its region may come back), 404 only after.
    model_memory_s: float = Field(3600.0, ge=0)
    #: The base of the Retry-After of 503 answers without an estimate of their own (model served nowhere right now,
    #: shutting down, a queue 503 before any dispatch rate is known), s; each answer draws from [base, 1.5 x base].
    retry_after_s: int = Field(5, ge=1)
    retry_policy: RetryPolicy = Field(default_factory=RetryPolicy)
    #: Deadlines on reading clients' requests, idle keep-alive and a cap on open connections (``ClientConnections``).
    client_connections: ClientConnections = Field(default_factory=ClientConnections)
    outlier_detection: OutlierDetection = Field(default_factory=OutlierDetection)
    #: Ollama fleets: thermal state, fit, hot preference, pre-warm, fallbacks, num_ctx pinning, embedding slot
    #: (skylb/core/fleet_rules.py ``FleetSettings``; README "Ollama fleets"); routing changes are off by default.
    ollama_fleet: FleetSettings = Field(default_factory=FleetSettings)
    #: Priority classes and tenants in the queue (skylb/quota/priorities.py): ``{enabled: false, aging_s: 60}``.
    priorities: PrioritySettings = Field(default_factory=PrioritySettings)
    #: Answers to repeated embedding requests from memory (skylb/balancer/embed_cache.py):
    #: ``{enabled: false, ttl_s: 300, max_bytes: 8388608}``.
    embedding_cache: EmbeddingCacheSettings = Field(default_factory=EmbeddingCacheSettings)
    #: OpenTelemetry spans of each request, sent over OTLP/HTTP (skylb/balancer/tracing.py): ``{otlp_endpoint: null,
    #: sample_ratio: 1.0}``; off unless an endpoint is set here or in $OTEL_EXPORTER_OTLP_ENDPOINT.
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    #: Route by the replicas' KV-cache events (exact cache locality, skylb/balancer/kv_routing.py) for replicas
    #: whose membership entry names an event endpoint (``kv_events``); false: the prefix trie alone, no subscriber.
    kv_events: bool = True
    #: The bound of the block index, in blocks (distinct block hashes; about 107 bytes each, bench/results/
    #: kv_index.md); beyond it the least recently stored blocks are forgotten.
    kv_index_max_blocks: int = Field(1_000_000, ge=1)
    #: The longest wait for a replica's ``/tokenize`` answer before a request is queued, ms; past it the request is
    #: routed by the prefix trie.
    kv_tokenize_timeout_ms: float = Field(100.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        # read_timeout_s (a gap between two bytes) became idle_timeout_s; old files keep working.
        if isinstance(data, dict) and "read_timeout_s" in data:
            data = dict(data)
            value = data.pop("read_timeout_s")
            data.setdefault("idle_timeout_s", value)
        return data

    @field_validator("policy")
    @classmethod
    def _policy_registered(cls, name: str) -> str:
        options_class(name)  # raises PolicyError (a ValueError) naming the known policies
        return name

    @model_validator(mode="after")
    def _tls_pair(self) -> "BalancerConfig":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        return self

    @field_validator("policies")
    @classmethod
    def _policy_options_valid(cls, policies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, options in policies.items():
            policy_options(name, options)  # raises PolicyError naming the bad option and the declared ones
        return policies


class _Partial(_Strict):
    """Base of the partial models: a dump holds only the keys that were given (so a config written back from a
    loaded one, as `skylb local` does, sets no key to None that its author left out)."""

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional and unset by default, for settings that override some of a full section.

    Each field keeps its type and constraints (``ge``, ``gt``, ...) and also accepts None; a field whose type is a
    model becomes that model's partial, so nested keys are checked the same way; unknown keys stay errors, and the
    model's ``mode="before"`` validators (renamed keys) still run. Rules that relate several fields (``tls_pair``,
    a retry's base and max) and per-field checks (a registered policy) run on the merged result instead
    (``DeploymentConfig.balancer_for``). Its ``model_dump()`` holds only the keys given.
    """
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = _partial(annotation)
        if info.metadata:
            annotation = Annotated[annotation, *info.metadata]
        fields[name] = (annotation | None, Field(None, description=info.description))
    before = {f"_{name}": model_validator(mode="before")(classmethod(decorator.func.__func__))
              for name, decorator in model.__pydantic_decorators__.model_validators.items()
              if decorator.info.mode == "before"}
    return create_model(f"{model.__name__}Overrides", __base__=_Partial, __module__=__name__,
                        __doc__=f"Some keys of {model.__name__}, each optional.", __validators__=before, **fields)


#: A region's overrides of the shared ``balancer`` section (``regions.<r>.balancer``): BalancerConfig's keys, each
#: optional, with its type and bounds; a key BalancerConfig does not have is an error at load.
BalancerOverrides = _partial(BalancerConfig)


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it: a mapping in both merges key by key (recursively); any other value
    (a number, a string, a list, None) replaces the base's. Neither argument is changed."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class RegionConfig(_Strict):
    """One region of a deployment: its balancer's overrides and how many emulated replicas `skylb local` starts."""

    #: Overrides of the shared ``balancer`` section for this region, merged deeply (``balancer_for``).
    balancer: BalancerOverrides = Field(default_factory=BalancerOverrides)  # type: ignore[valid-type]
    replicas: int = Field(4, ge=0)


class DeploymentConfig(_Strict):
    """A whole deployment, as in configs/local-3region.yaml."""

    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    balancer: BalancerConfig = Field(default_factory=BalancerConfig)
    regions: dict[str, RegionConfig] = Field(
        default_factory=lambda: {name: RegionConfig() for name in ("us", "eu", "asia")}
    )
    #: The demo's sections, read and validated, unknown keys included, by the demo and the benchmarks, never by the
    #: balancer or the controller: ``emulator`` (the replicas `skylb local` starts) and ``latency`` (the round trips
    #: it injects between regions), bench/launch/settings.py; ``workload`` (what `skylb local` and `skylb replay` replay),
    #: bench/replay/workload.py ``WorkloadConfig``.
    emulator: dict[str, Any] = Field(default_factory=dict)
    latency: dict[str, Any] = Field(default_factory=dict)
    workload: dict[str, Any] = Field(default_factory=dict)

    @field_validator("regions")
    @classmethod
    def _regions_named(cls, regions: dict[str, RegionConfig]) -> dict[str, RegionConfig]:
        for name in regions:
            if not name or not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"region name {name!r} must be letters, digits, '-' or '_'")
        return regions

    @model_validator(mode="after")
    def _regions_balancers_valid(self) -> "DeploymentConfig":
        # Every region's merged settings are checked at load, not when that region's balancer starts.
        for region in self.regions:
            self.balancer_for(region)
        return self

    def balancer_for(self, region: str) -> BalancerConfig:
        """The balancer settings of ``region``: the shared ``balancer`` section with the region's overrides laid
        over it deeply (a region's ``retry_policy: {num_retries: 1}`` keeps the shared ``budget_percent``).

        Raises ConfigError if the region is not in ``regions`` or the merged settings are invalid (the message
        names the key as ``regions.<region>.balancer.<key>``).
        """
        if region not in self.regions:
            raise ConfigError(f"region {region!r} is not in the config (regions: {', '.join(self.regions)})")
        merged = _deep_merge(self.balancer.model_dump(), self.regions[region].balancer.model_dump())
        try:
            return BalancerConfig.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, prefix=f"regions.{region}.balancer")) from exc


def _explain(exc: ValidationError, *, prefix: str = "") -> str:
    """One line per error: the key's dotted path (under ``prefix``) and pydantic's message."""
    def line(error: dict) -> str:
        where = ".".join(str(p) for p in (prefix, *error["loc"]) if p != "")
        # A validator's own ValueError (often a ConfigError that already names its key) without "Value error, ".
        message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
        return f"{where}: {message}" if where else message
    return "; ".join(line(e) for e in exc.errors())


def balancer_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The balancer settings the environment overrides, as a partial ``balancer`` section: ``peer_token``
    ($SKYLB_PEER_TOKEN), ``metrics_token`` ($SKYLB_METRICS_TOKEN), ``replica_api_key`` ($SKYLB_REPLICA_API_KEY),
    ``api_keys_file`` ($SKYLB_API_KEYS_FILE) and ``quota.redis_url`` ($SKYLB_REDIS_URL), each only when set and not
    empty (skylb.environment). $SKYLB_API_KEYS adds keys rather than replacing them: the balancer's
    ``load_api_keys`` reads it."""
    found: dict[str, Any] = {key: value for key, var in (
        ("peer_token", environment.PEER_TOKEN), ("metrics_token", environment.METRICS_TOKEN),
        ("replica_api_key", environment.REPLICA_API_KEY), ("api_keys_file", environment.API_KEYS_FILE))
        if (value := environment.env(var, environ)) is not None}
    if (redis_url := environment.env(environment.REDIS_URL, environ)) is not None:
        found["quota"] = {"redis_url": redis_url}
    return found


def balancer_settings(deployment: DeploymentConfig, region: str, flags: Mapping[str, Any] | None = None, *,
                      environ: Mapping[str, str] | None = None) -> BalancerConfig:
    """The settings a balancer of ``region`` runs with, each layer laid deeply over the one before: the shared
    ``balancer`` section, ``regions.<region>.balancer``, the environment (``balancer_environment``), then
    ``flags`` (the command line's, as a partial section; None values are skipped).

    Raises ConfigError naming the region and key when a layer makes the settings invalid.
    """
    layers = [balancer_environment(environ), {k: v for k, v in (flags or {}).items() if v is not None}]
    merged = deployment.balancer_for(region).model_dump()
    for layer in layers:
        merged = _deep_merge(merged, layer)
    try:
        return BalancerConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from exc


def default_config_path() -> Path:
    """Path of the embedded default config (configs/local-3region.yaml, shipped inside the package)."""
    return Path(str(resources.files("skylb").joinpath("configs/local-3region.yaml")))


def load_config(path: str | Path | None) -> DeploymentConfig:
    """Read and validate a deployment config; None reads the embedded default.

    Raises ConfigError with the file name and the offending keys when the file is missing, not YAML, or invalid.
    """
    path = Path(path) if path is not None else default_config_path()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config {path}: {_explain(exc)}") from exc
