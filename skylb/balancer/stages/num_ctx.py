"""Stage 5 (optional, ``balancer.ollama_fleet.num_ctx`` set): pin an Ollama request's context size.

Ollama fleet router "Routing Engine" guide, signal 7: a request with another ``options.num_ctx`` than the loaded
model's makes Ollama reload the model; pinning (or stripping) it per model keeps one client from reloading it for
all. OpenAI-dialect requests carry no ``num_ctx`` and pass unchanged.
"""

from __future__ import annotations

from aiohttp import web

from skylb.balancer.ollama_fleet import pin_num_ctx
from skylb.balancer.stages.context import RequestContext
from skylb.core.fleet_rules import FleetSettings

__all__ = ["NumCtxStage"]


class NumCtxStage:
    """Rewrites ``ctx.body``'s ``options.num_ctx`` by ``settings.num_ctx`` ({model: size or "strip"})."""

    name = "num_ctx"

    def __init__(self, settings: FleetSettings):
        self.settings = settings

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        if ctx.route_api == "ollama":  # a request translated to the OpenAI API has no options
            ctx.body = pin_num_ctx(self.settings, ctx.parsed.model, ctx.body)
        return None
