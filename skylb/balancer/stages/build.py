"""The chain built from the settings, in one place (as Envoy builds its HTTP filter chain from configuration):

    parse -> classify -> [embedding_cache] -> translate -> resolve_model -> responses -> [num_ctx] -> [model_group]
    -> [quota] -> [block_hashes] -> route

A stage in brackets is present only when its feature is on: ``balancer.embedding_cache.enabled``,
``balancer.ollama_fleet.num_ctx`` (any model pinned), ``balancer.quota.enabled`` (model groups and the quota gate),
``balancer.kv_events`` (routing by the replicas' KV-cache events).
A feature that is off is absent from the chain, not an ``if`` in the request's path.
"""

from __future__ import annotations

from collections.abc import Callable

from skylb.balancer.dispatcher import Dispatcher
from skylb.balancer.embed_cache import EmbeddingCache
from skylb.balancer.metrics import BalancerMetrics
from skylb.balancer.ollama_fleet import Fleet
from skylb.balancer.relay import Relay
from skylb.balancer.responses import ResponseBook
from skylb.balancer.retry import RetryBudget
from skylb.balancer.kv_routing import KVRouting
from skylb.balancer.stages.block_hashes import BlockHashStage
from skylb.balancer.stages.chain import Chain, Stage
from skylb.balancer.stages.classify import ClassifyStage
from skylb.balancer.stages.embedding_cache import EmbeddingCacheStage
from skylb.balancer.stages.finish import RequestLog
from skylb.balancer.stages.model_group import ModelGroupStage
from skylb.balancer.stages.num_ctx import NumCtxStage
from skylb.balancer.stages.parse import ParseStage
from skylb.balancer.stages.quota import QuotaStage
from skylb.balancer.stages.resolve_model import ResolveModelStage
from skylb.balancer.stages.responses import ResponsesStage
from skylb.balancer.stages.route import RouteStage
from skylb.balancer.stages.translate import TranslateStage
from skylb.config import BalancerConfig
from skylb.core import Router
from skylb.quota.gate import QuotaGate
from skylb.quota.groups import ModelGate
from skylb.quota.leases import LeaseBook
from skylb.quota.limits import Quotas

__all__ = ["build_chain", "STAGE_ORDER"]

#: Every stage's name in chain order (optional ones included).
STAGE_ORDER = ("parse", "classify", "embedding_cache", "translate", "resolve_model", "responses", "num_ctx",
               "model_group", "quota", "block_hashes", "route")


def build_chain(cfg: BalancerConfig, *, region: str, router: Router, dispatcher: Dispatcher, relay: Relay,
                fleet: Fleet, metrics: BalancerMetrics, budget: RetryBudget, now: Callable[[], float],
                in_flight: Callable[[], int], quotas: Callable[[], Quotas], quota_gate: QuotaGate,
                group_gate: ModelGate, leases: LeaseBook, embed_cache: EmbeddingCache | None, client_keys: bool,
                recently_served: Callable[..., bool], request_log: RequestLog, responses: ResponseBook,
                kv: KVRouting | None = None) -> Chain:
    """The request chain of one balancer, its stages given only the parts each needs (module docstring)."""
    groups = cfg.quota.enabled
    stages: list[Stage] = [
        ParseStage(max_body_bytes=cfg.max_body_bytes, session_header=cfg.session_header, peer_token=cfg.peer_token),
        ClassifyStage(quotas=quotas, priorities_enabled=cfg.priorities.enabled)]
    if embed_cache is not None:
        stages.append(EmbeddingCacheStage(embed_cache, client_keys=client_keys))
    is_group = group_gate.is_group if groups else (lambda name: False)
    stages.append(TranslateStage(served_models=router.served_models, is_group=is_group, any_served=fleet.any_served,
                                 now=now))
    stages.append(ResolveModelStage(
        served_models=router.served_models, models_known=router.models_known,
        is_group=is_group, any_served=fleet.any_served,
        recently_served=recently_served, retry_after_s=cfg.retry_after_s, unreachable=router.unreachable_unlisted,
        wait_s=cfg.no_target_timeout_s))
    stages.append(ResponsesStage(responses, pinned_reason=router.pinned_unavailable_reason, now=now))
    if cfg.ollama_fleet.num_ctx:
        stages.append(NumCtxStage(cfg.ollama_fleet))
    if groups:
        stages.append(ModelGroupStage(gate=group_gate, leases=leases, settings=cfg.quota, now=now,
                                      retry_after_s=cfg.retry_after_s))
        stages.append(QuotaStage(quota_gate))
    if kv is not None:
        stages.append(BlockHashStage(kv, router=router, session=lambda: relay.session,
                                     authorization=relay.replica_authorization))
    stages.append(RouteStage(cfg, router=router, dispatcher=dispatcher, relay=relay, fleet=fleet, metrics=metrics,
                             budget=budget, now=now, in_flight=in_flight, region=region))
    return Chain(stages, request_log=request_log)
