"""Stage 6 (optional, on with quotas), model group: a request naming a group alias (``quotas.groups``) gets one of
the group's models, chosen by weighted deficit round robin and admitted by its limits (skylb/quota/groups.py).

Source: "LLM-Load-Balancer" (the quota-aware router's README), iteration 1 "Scheduling Model (WDRR + Concurrency +
TPM)" and iteration 2 D (jittered waits). The request waits up to ``quota.wait_s`` while no model admits, else gets
429 with a jittered Retry-After (503 when no model of the group is served now). The body's ``model`` is rewritten to
the chosen one, the response names it (``X-SkyLB-Model``, :func:`add_model_header`), and the admission is released
by an end hook, whatever the ending. A request carrying ``X-SkyLB-Lease`` with a live lease of its tenant for this
group or model (the lease API, skylb/balancer/lease_api.py) was charged when the lease was granted: it gets the
lease's model and is not charged again (``ctx.charged``), whether or not it names a group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from aiohttp import web

from skylb.balancer.auth import tenant_of
from skylb.balancer.ollama_fleet import with_model
from skylb.balancer.protocol import LEASE_HEADER, MODEL_HEADER
from skylb.balancer.stages.context import RequestContext
from skylb.quota.estimate import is_embedding_path, request_tokens
from skylb.quota.groups import Admitted, ModelGate
from skylb.quota.leases import LeaseBook
from skylb.quota.settings import QuotaSettings

__all__ = ["ModelGroupStage", "CHOSEN_MODEL", "add_model_header"]

#: Request key: the model chosen for a group request (read when the response's headers are prepared).
CHOSEN_MODEL = web.RequestKey("skylb_chosen_model", str) if hasattr(web, "RequestKey") else "skylb_chosen_model"


class ModelGroupStage:
    """Sets ``ctx.charged`` for a leased request; for a group alias, ``ctx.parsed.model`` and ``ctx.body`` to the
    chosen model.

    Args: gate: the model groups' gate; leases: the lease API's leases; settings: ``balancer.quota`` (``wait_s``,
    ``default_max_tokens``); now(): the balancer's clock, s; retry_after_s: Retry-After when no model is served.
    """

    name = "model_group"

    def __init__(self, *, gate: ModelGate, leases: LeaseBook, settings: QuotaSettings, now: Callable[[], float],
                 retry_after_s: int):
        self.gate, self.leases, self.settings = gate, leases, settings
        self.now = now
        self.retry_after_s = retry_after_s

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        # The caller's own tenant (its API key), as the lease API and the group's buckets count it.
        name, tenant = ctx.parsed.model, tenant_of(ctx.http)
        leased = self.leases.leased_model(ctx.http.headers.get(LEASE_HEADER), tenant=tenant, name=name,
                                          now=self.now())
        ctx.charged = leased is not None
        if not self.gate.is_group(name):
            return None
        ctx.charged = True  # the group's gate charges the tenant's and the chosen model's buckets
        if leased is not None:
            self._choose(ctx, leased)
            return None
        tokens = request_tokens(ctx.parsed.text, ctx.parsed.max_tokens, embedding=is_embedding_path(ctx.http.path),
                                default_max_tokens=self.settings.default_max_tokens)
        outcome = await self.gate.admit(name, tokens, tenant, self.settings.wait_s, api=ctx.route_api)
        if isinstance(outcome, Admitted):
            ctx.on_end(lambda ctx: self.gate.release(outcome))
            self.leases.count(name, outcome.model, "request")
            self._choose(ctx, outcome.model)
            return None
        if not outcome.served:
            return ctx.reject(503, f"no model of group '{name}' is served by a replica or peer reachable now; retry "
                                   "later", "model_unavailable", type_="service_unavailable",
                              retry_after_s=self.retry_after_s)
        retry_after = max(1, math.ceil(self.gate.wait_ms(outcome) / 1000))
        return ctx.reject(429, f"no model of group '{name}' admitted the request within {self.settings.wait_s:g} s "
                               f"({outcome.reason} of {outcome.key}); retry after {retry_after} s", "rate_limited",
                          type_="rate_limit_exceeded", retry_after_s=retry_after)

    @staticmethod
    def _choose(ctx: RequestContext, model: str) -> None:
        ctx.http[CHOSEN_MODEL] = model
        ctx.parsed.model, ctx.body = model, with_model(ctx.body, model)


async def add_model_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: a group request's response (streamed or not) names the model that served it,
    unless the relay already named it (a fallback model of an Ollama fleet, for one, wins)."""
    model = request.get(CHOSEN_MODEL)
    if model is not None:
        response.headers.setdefault(MODEL_HEADER, model)
