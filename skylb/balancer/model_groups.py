"""Model groups in the request pipeline: a request naming a group alias (``quotas.groups``) gets one of the group's
models, chosen by WDRR and admitted by its limits (skylb/quota/groups.py), waiting up to ``quota.wait_s`` while no
model admits, else 429 with a jittered Retry-After. The body's ``model`` is rewritten to the chosen one (the JSON is
re-serialised for group requests only), the response says which model served it (``X-SkyLB-Model``), and the
admission is released when the request ends, whatever the ending (pipeline.py's ``finally``).

A request carrying ``X-SkyLB-Lease`` with a live admission lease for this group or model (skylb/balancer/
admission_api.py) is already admitted: it gets the lease's model and is not charged again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiohttp import web

from skylb.balancer.auth import tenant_of
from skylb.balancer.ollama_fleet import with_model
from skylb.balancer.protocol import MODEL_HEADER
from skylb.quota.estimate import is_embedding_path, request_tokens
from skylb.quota.groups import Admitted

__all__ = ["MODEL_HEADER", "LEASE_HEADER", "CHOSEN_MODEL", "GroupChoice", "choose_group_model",
           "add_model_header"]

#: Response header: the model that served a request sent to a model group.
#: Request header: the id of an admission lease (POST /skylb/v1/schedule) the request runs under.
LEASE_HEADER = "X-SkyLB-Lease"
#: Request key: the model chosen for a group request (read when the response's headers are prepared).
CHOSEN_MODEL = web.RequestKey("skylb_chosen_model", str) if hasattr(web, "RequestKey") else "skylb_chosen_model"


@dataclass
class GroupChoice:
    """The outcome for a group request: ``model`` and ``body`` (rewritten) and the ``admitted`` slot to release
    (None under a lease); or, when refused, ``status`` (429 or 503), ``message`` and ``retry_after_s``."""

    model: str | None = None
    body: bytes | None = None
    admitted: Admitted | None = None
    status: int | None = None
    message: str | None = None
    reason: str | None = None
    retry_after_s: int | None = None


async def choose_group_model(request: web.Request, balancer, api: str, group: str, body: bytes,
                             text: str, max_tokens: int | None) -> GroupChoice:
    """Choose and admit a model of ``group`` for this request (see the module docstring); its tokens are estimated
    as the quota gate estimates them (skylb/quota/estimate.py: prompt text, ``max_tokens`` cap)."""
    from skylb.balancer.lease_api import count_group_admission, lease_model  # it imports this module

    gate = balancer.gate
    leased = lease_model(request, request.headers.get(LEASE_HEADER), group)
    if leased is not None:
        request[CHOSEN_MODEL] = leased
        return GroupChoice(model=leased, body=with_model(body, leased))
    tokens = request_tokens(text, max_tokens, embedding=is_embedding_path(request.path),
                            default_max_tokens=balancer.cfg.quota.default_max_tokens)
    outcome = await gate.admit(group, tokens, tenant_of(request), balancer.cfg.quota.wait_s, api=api)
    if isinstance(outcome, Admitted):
        request[CHOSEN_MODEL] = outcome.model
        count_group_admission(request, group, outcome.model)
        return GroupChoice(model=outcome.model, body=with_model(body, outcome.model), admitted=outcome)
    retry_after = max(1, math.ceil(gate.wait_ms(outcome) / 1000))
    if not outcome.served:
        return GroupChoice(status=503, reason="model_unavailable", retry_after_s=balancer.cfg.retry_after_s,
                           message=f"no model of group '{group}' is served by a replica or peer reachable now; "
                                   "retry later")
    return GroupChoice(status=429, reason="rate_limited", retry_after_s=retry_after,
                       message=f"no model of group '{group}' admitted the request within "
                               f"{balancer.cfg.quota.wait_s:g} s ({outcome.reason} of {outcome.key}); "
                               f"retry after {retry_after} s")


async def add_model_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: a group request's response (streamed or not) names the model that served it,
    unless the relay already named it (a fallback model of an Ollama fleet, for one, wins)."""
    model = request.get(CHOSEN_MODEL)
    if model is not None:
        response.headers.setdefault(MODEL_HEADER, model)
