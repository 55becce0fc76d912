"""Stage 4, resolve the model: the name a replica serves, or 404 / 503 when nobody serves it.

Names resolve as Ollama resolves them (``gemma3`` means ``gemma3:latest``, any case; Ollama's
``types/model/name.go``), and the body is rewritten to the served name. A model that no replica or peer reports
gets 404 in the API's shape, listing what is served (and saying so when the model is served in the other dialect
only: an Ollama client asking for a model of vLLM or llama.cpp replicas); one served within the last
``model_memory_s`` seconds (its replicas or region went away) gets 503 with Retry-After instead, since it is likely
back soon, and one served less than ``no_target_timeout_s`` ago waits in the queue as the requests queued when it
went did (the dispatcher answers 503 if it is not back within that time): a replica that a probe or a health check
lost for a moment, and the controller's membership with it, costs its clients a wait, not an error. A model
nobody reachable serves while some replica or peer has been unreachable since it joined (its models are unknown, it
may serve this one) gets 503 too: it names each with the reason (``connection refused``), so a balancer in front
of replicas that are down says so rather than "does not exist". A model group alias
or a model with a fallback chain (Ollama fleet router "Routing Engine" guide, fallback chain) counts as served when
one of its models is. Until the first model lists are read, every name passes (nothing is known yet).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from aiohttp import web

from skylb.balancer import retry_after
from skylb.balancer.ollama_fleet import with_model
from skylb.balancer.stages.context import RequestContext
from skylb.core.fleet_rules import resolve_name

__all__ = ["ResolveModelStage"]

#: How the 404 names each dialect and its endpoints.
_API_NAMES = {"openai": "OpenAI API (/v1/chat/completions, /v1/completions)",
              "ollama": "Ollama API (/api/chat, /api/generate)"}


class ResolveModelStage:
    """Rewrites ``ctx.parsed.model`` and ``ctx.body`` to the served name.

    Args:
        served_models(api, with_peers): the models served in a dialect, locally and (``with_peers``) by peers.
        models_known(): True once model lists were read. is_group(name): a model group alias.
        any_served(model, served): the model or one of its fallbacks is in ``served``.
        recently_served(api, model, with_peers, within_s): served within ``within_s`` (default ``model_memory_s``).
        retry_after_s: Retry-After, s. wait_s: a model served within this many seconds is let through to the queue
            (``no_target_timeout_s``; 0: never).
        unreachable(with_peers): (url, why) of the replicas (and peers) that may serve any model but cannot be
            reached (Router.unreachable_unlisted).
    """

    name = "resolve_model"

    def __init__(self, *, served_models: Callable[..., Collection[str]], models_known: Callable[[], bool],
                 is_group: Callable[[str], bool], any_served: Callable[[str, Collection[str]], bool],
                 recently_served: Callable[..., bool], retry_after_s: int,
                 unreachable: Callable[..., list[tuple[str, str]]], wait_s: float = 0.0):
        self.served_models = served_models
        self.models_known = models_known
        self.is_group = is_group
        self.any_served = any_served
        self.recently_served = recently_served
        self.retry_after_s = retry_after_s
        self.unreachable = unreachable
        self.wait_s = wait_s

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        parsed, with_peers = ctx.parsed, not ctx.forwarded
        served = self.served_models(ctx.route_api, with_peers=with_peers)
        group = self.is_group(parsed.model)
        if not group:
            resolved = resolve_name(parsed.model, served)
            if resolved != parsed.model:
                parsed.model, ctx.body = resolved, with_model(ctx.body, resolved)
        if group or self.any_served(parsed.model, served) or not self.models_known():
            return None
        if self.wait_s and self.recently_served(ctx.route_api, parsed.model, with_peers=with_peers,
                                                within_s=self.wait_s):
            return None  # it went a moment ago: queued, the request waits for it as those queued before did
        if self.recently_served(ctx.route_api, parsed.model, with_peers=with_peers):
            return ctx.reject(503, f"model '{parsed.model}' is served by no replica or peer reachable now; retry "
                                   "later", "model_unavailable", type_="service_unavailable",
                              retry_after_s=retry_after.retry_after_s(self.retry_after_s))
        unreachable = self.unreachable(with_peers=with_peers)
        if unreachable:
            return ctx.reject(503, _unreachable_message(parsed.model, served, unreachable), "replicas_unreachable",
                              type_="service_unavailable",
                              retry_after_s=retry_after.retry_after_s(self.retry_after_s))
        message = (f"model '{parsed.model}' not found" if ctx.api == "ollama" else
                   f"The model `{parsed.model}` does not exist.")
        hint = f" Models served here: {', '.join(sorted(served)) or 'none'}."
        other = "openai" if ctx.api == "ollama" else "ollama"
        if parsed.model in self.served_models(other, with_peers=with_peers):  # the other dialect's replicas have it
            hint += (f" '{parsed.model}' is served here through the {_API_NAMES[other]} only: its replicas do not "
                     f"speak the {_API_NAMES[ctx.api]}.")
        return ctx.reject(404, message + hint, "unknown_model", param="model")


def _unreachable_message(model: str, served: Collection[str], unreachable: list[tuple[str, str]]) -> str:
    """The 503's message: which targets cannot be reached and why (the first three), and what is served."""
    named = "; ".join(f"{url}: {why}" for url, why in unreachable[:3])
    if len(unreachable) > 3:
        named += f"; and {len(unreachable) - 3} more"
    if not served:
        return f"model '{model}' cannot be served now: no replica is reachable: {named}"
    return (f"model '{model}' is not served by a reachable replica, and some that may serve it cannot be reached: "
            f"{named}. Models served here: {', '.join(sorted(served))}.")
