"""What a balancer says about itself: the peer status (msgpack, for peers), the operator view (JSON), /healthz,
/metrics and /v1/models. Handlers take the Balancer from the application (``BALANCER``)."""

from __future__ import annotations

import dataclasses
import time

from aiohttp import web

from skylb.balancer.api import openai_error
from skylb.balancer.balancer import Balancer
from skylb.balancer.ollama_fleet import replica_thermal
from skylb.balancer.metrics import CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE
from skylb.balancer.protocol import TOKEN_HEADER, encode_status, token_ok
from skylb.balancer.retry_after import retry_after_s
from skylb.core import PeerStatus
from skylb.core.model_cards import model_entry
from skylb.engines.auto import detected_engine
from skylb.quota.buckets import LocalLimits
from skylb.quota.wiring import quota_status

__all__ = ["BALANCER", "ROUTES", "detailed_status", "quotas_in_force", "readiness", "model_entry", "handle_status",
           "handle_health", "handle_healthz", "handle_readyz", "handle_metrics", "handle_models"]

BALANCER = web.AppKey("balancer", Balancer)


def detailed_status(balancer: Balancer) -> dict:
    """A JSON-able view for operators: the peer status plus every replica and peer with its availability and the
    reason it is unavailable, the policy, and the controller's reachability and membership revision (None, and
    ``static_membership`` true, for a balancer started with --replica); ``time`` is when the view was taken (unix
    s), ``kv_usage`` a replica's KV cache use at its latest probe (0-1, None when its engine does not say),
    ``kv_reserved_tokens`` the KV tokens an engine that reserves output (SGLang) keeps for its running requests'
    outputs, as this balancer estimates them (skylb/core/state.py ``decode_reserve_tokens``; None for others),
    ``kv_events`` the block index and, per replica with an event endpoint, whether its stream is live
    (skylb/balancer/kv_routing.py ``KVRouting.status``; None when ``balancer.kv_events`` is off),
    ``placed_by_rule`` the placements since start by the profile's plugin that made them (``Decision.rule``)."""
    now, router = balancer.now(), balancer.router
    membership = balancer.membership
    return {
        **_peer_status(router.status(now)),
        "policy": balancer.cfg.policy,
        "controller_reachable": balancer.controller_reachable(),
        "membership_revision": membership.revision if membership else None,
        "static_membership": balancer.static_membership is not None,  # --replica flags: no controller, no revision
        "time": round(time.time(), 3),
        "draining": balancer.draining,
        "in_flight": balancer.in_flight(),
        "forwarded_per_s": balancer.forwarded_rate(),
        "placed_by_rule": dict(sorted(balancer.placed_by_rule.items())),
        "tries": _tries(router.policy),
        "served_regions": balancer.served_epochs,
        "ollama_fleet": balancer.fleet.status(),
        "quotas": quotas_in_force(balancer),
        "quota": quota_status(balancer.limits, balancer.quota_gate, now),
        # Per replica with an event endpoint: whether its stream is live (exact matches) or the trie is used.
        "kv_events": balancer.kv.status() if balancer.kv is not None else None,
        "replicas": [
            {"id": r.id, "url": r.url, "healthy": r.healthy, "pending": r.pending,
             # --engine auto: the engine detected (skylb/engines/auto.py), once known.
             "engine": (detected_engine(r.url) or r.engine) if r.engine == "auto" else r.engine,
             "running": r.running, "outstanding": r.outstanding, "kv_usage": r.kv_usage, "draining": r.draining,
             # SGLang: KV tokens it keeps for the running batch's outputs, as this balancer estimates them.
             "kv_reserved_tokens": round(r.decode_reserve_tokens(now)) if r.output_reserve_ratio else None,
             "served": r.served,
             "admission_capacity": r.slots if r.slots is not None else r.capacity.limit,
             "ejections": r.ejections, "ejected_for_s": _left(r.ejected_until, now),
             "available": router.replica_available(r, now),
             "reason": router.replica_unavailable_reason(r, now),
             "probe_age_ms": None if r.probed_at is None else round((now - r.probed_at) * 1000, 1),
             # Adaptive probing: this replica's probe interval now (skylb/balancer/probe_backoff.py).
             "probe_interval_ms": _probe_interval_ms(balancer, "replica", r.id),
             "models": sorted(r.models or ()), "apis": sorted(r.apis),
             "measured": r.rates.summary(),
             "thermal": replica_thermal(r, now, balancer.cfg.ollama_fleet.recent_window_s)}
            for r in router.replicas.values()],
        "peers": [
            {"region": p.region, "url": p.url, "sibling": p.sibling, "healthy": p.healthy,
             "available_replicas": p.available_replicas,
             "queue_len": p.queue_len, "forwarded": p.forwarded, "models": p.models, "outstanding": p.outstanding,
             "wait_ms": _ms(p.wait_s), "queue_age_ms": _ms(p.queue_age_s), "rtt_ms": _ms(p.rtt_s),
             "dispatch_rate": p.dispatch_rate, "prefixes": len(p.prefixes),
             "kv_summary_blocks": None if p.blocks is None else len(p.blocks),
             "probe_interval_ms": _probe_interval_ms(balancer, "peer", p.region),
             "ejections": p.ejections, "ejected_for_s": _left(p.ejected_until, now),
             "available": router.peer_available(p, now),
             "reason": router.peer_unavailable_reason(p, now)}
            for p in router.peers.values()],
    }


def quotas_in_force(balancer: Balancer) -> dict:
    """The quotas in force: {"source": "controller" | "config", "revision": the controller's quota revision (None
    for the config's), "quotas": the document, "shares": this region's share of each bucket ({"default",
    "buckets"}; None when the buckets are not in-process)}."""
    membership = balancer.membership
    revision = membership.quotas_revision if membership else None
    limits = balancer.limits
    shares = ({"default": limits.share, "buckets": dict(limits.shares)} if isinstance(limits, LocalLimits)
              else None)
    return {"source": "config" if revision is None else "controller", "revision": revision,
            "quotas": balancer.quotas.model_dump(exclude_none=True), "shares": shares}


def _tries(policy) -> dict:
    """The policy's prefix tries (replica trie, regional snapshot), each {"bytes", "chars", "nodes", "records"}."""
    tries = {}
    for name in ("replica_trie", "snapshot_trie", "tree"):
        trie = getattr(policy, name, None)
        if trie is not None:
            tries[name] = {"bytes": trie.stored_bytes, "max_bytes": trie.max_bytes, "chars": trie.stored_chars,
                           "nodes": trie.nodes, "records": len(trie)}
    return tries


def _probe_interval_ms(balancer: Balancer, kind: str, name: str) -> float | None:
    """The probe interval of target (``kind``, ``name``) now, ms (None before the probers start)."""
    probers = balancer.probers
    if probers is None:
        return None
    return round(probers.backoff.factor((kind, name)) * probers.interval_s * 1000, 1)


def _left(until: float | None, now: float) -> float | None:
    """Seconds until ``until`` from ``now`` (rounded to ms), None when it passed or is not set."""
    return None if until is None or until <= now else round(until - now, 3)


def _peer_status(status: PeerStatus) -> dict:
    """``status`` as a dict for operators: the prefix hashes shared with siblings (up to MAX_STATUS_PREFIXES) and
    the region summary's block hashes (up to MAX_SUMMARY_BLOCKS) counted, not listed."""
    out = dataclasses.asdict(status)
    out["prefixes"] = None if status.prefixes is None else len(status.prefixes)
    out["blocks"] = None if status.blocks is None else len(status.blocks)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


async def handle_status(request: web.Request) -> web.Response:
    """``GET /skylb/v1/status``: msgpack for peers (token checked); ``?format=json`` gives operators detail."""
    balancer = request.app[BALANCER]
    if request.query.get("format") == "json":
        return web.json_response(detailed_status(balancer))
    if not token_ok(balancer.cfg.peer_token, request.headers.get(TOKEN_HEADER)):
        return openai_error(403, "missing or wrong peer token", type_="permission_error")
    return web.Response(body=encode_status(balancer.router.status(balancer.now())),
                        content_type="application/msgpack")


def readiness(balancer: Balancer) -> dict:
    """Whether a request could be placed now: {"ready": some local replica or peer is healthy, "replicas" and
    "peers": {"healthy": n, "total": n}, "unhealthy": [{"replica", "url", "reason"}] for each local replica that is
    not (at most 10)}."""
    replicas = [r for r in balancer.router.replicas.values() if not r.draining]
    peers = list(balancer.router.peers.values())
    healthy = sum(r.healthy for r in replicas)
    healthy_peers = sum(p.healthy for p in peers)
    return {"ready": bool(healthy or healthy_peers),
            "replicas": {"healthy": healthy, "total": len(replicas)},
            "peers": {"healthy": healthy_peers, "total": len(peers)},
            "unhealthy": [{"replica": r.id, "url": r.url, "reason": r.error or "not probed yet"}
                          for r in replicas if not r.healthy][:10]}


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``, as vLLM, SGLang and llama-server answer it (load generators such as guidellm check it before
    a run): 200 with an empty body while the balancer serves, 503 once it is shutting down (SIGTERM). /healthz says
    more."""
    balancer = request.app[BALANCER]
    if balancer.shutting_down:
        return web.Response(status=503, headers={"Retry-After": str(retry_after_s(balancer.cfg.retry_after_s))})
    return web.Response(status=200)


async def handle_healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: 200 while the process serves, a liveness answer: a balancer whose replicas are all down
    still forwards, queues and answers (and the controller fails a region over on it); the body says whether the
    operator is draining it, how many requests it still holds, and its readiness (``readiness``: ``ready`` false
    while no replica or peer is healthy, with each unhealthy replica and why). 503 with status "draining" once it
    is shutting down (SIGTERM), so load balancers and the controller stop sending it requests."""
    balancer = request.app[BALANCER]
    if balancer.shutting_down:
        return web.json_response({"status": "draining", "region": balancer.region,
                                  "in_flight": balancer.in_flight()}, status=503,
                                 headers={"Retry-After": str(retry_after_s(balancer.cfg.retry_after_s))})
    return web.json_response({"status": "draining" if balancer.draining else "ok", "region": balancer.region,
                              "in_flight": balancer.in_flight(), **readiness(balancer)})


async def handle_readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: whether this balancer should receive new clients now (Kubernetes' readiness probe, a cloud
    load balancer's target check): 200 {"status": "ready", ...readiness} while it serves, is not drained by the
    operator and has a healthy replica or peer (a sibling counts); 503 with ``status`` "shutting_down",
    "draining" or "not_ready" otherwise, so clients go to its siblings meanwhile. /healthz stays the liveness
    answer."""
    balancer = request.app[BALANCER]
    ready = readiness(balancer)
    status = ("shutting_down" if balancer.shutting_down else "draining" if balancer.draining
              else "ready" if ready["ready"] else "not_ready")
    return web.json_response({"status": status, "region": balancer.region, **ready},
                             status=200 if status == "ready" else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text; OpenMetrics text, with the TTFT histogram's exemplars (trace ids), when the
    balancer traces and the scraper accepts ``application/openmetrics-text`` (Prometheus asks for it first; it keeps
    exemplars with ``--enable-feature=exemplar-storage``). Without tracing there is no exemplar, and the answer stays
    Prometheus text whatever is asked."""
    balancer = request.app[BALANCER]
    if balancer.tracing is not None and "application/openmetrics-text" in request.headers.get("Accept", ""):
        return web.Response(body=balancer.metrics.render_openmetrics(),
                            headers={"Content-Type": OPENMETRICS_CONTENT_TYPE})
    return web.Response(body=balancer.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the union of models the local replicas (and peers) serve, each with what its replicas
    say of it, then what the healthy peers serving it report of theirs (``PeerStatus.model_cards``; merged by
    skylb/core/model_cards.py ``model_entry``), then the model group aliases (with ``skylb_group``: their models),
    in OpenAI's list shape."""
    balancer = request.app[BALANCER]
    replicas = sorted((r for r in balancer.router.replicas.values() if not r.draining), key=lambda r: r.id)
    peers = sorted((p for p in balancer.router.peers.values() if p.healthy and p.model_cards),
                   key=lambda p: (not p.sibling, p.region))
    data = [model_entry(m, [r.model_cards[m] for r in replicas if m in r.model_cards]
                        + [p.model_cards[m] for p in peers if m in p.model_cards])
            for m in balancer.served_models()]
    # Model group aliases (skylb/balancer/model_groups.py), with the models that serve them.
    data += [{"id": alias, "object": "model", "created": 0, "owned_by": "skylb", "skylb_group": sorted(members)}
             for alias, members in sorted(balancer.quotas.groups.items())]
    return web.json_response({"object": "list", "data": data})


#: The status routes: /v1/models, /health, /healthz, /metrics, /skylb/v1/status.
ROUTES = [web.get("/v1/models", handle_models), web.get("/health", handle_health), web.get("/healthz", handle_healthz),
          web.get("/readyz", handle_readyz),
          web.get("/metrics", handle_metrics), web.get("/skylb/v1/status", handle_status)]
