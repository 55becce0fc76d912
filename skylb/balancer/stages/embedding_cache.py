"""Stage 3 (optional, ``balancer.embedding_cache.enabled``): answer a repeated embedding request from memory.

"Why I Built a Priority Queue for Ollama" (embedding cache): identical embedding requests get the same vectors, so
a hit never reaches the queue. The key covers the path, the body and who asks (tenant, or the client's own
credential when the balancer has no client keys: skylb/balancer/embed_cache.py). A miss registers an end hook that
keeps the replica's whole 200 answer (not streamed) for the next identical request.
"""

from __future__ import annotations

from aiohttp import web

from skylb.balancer.embed_cache import EmbeddingCache
from skylb.balancer.protocol import ROUTE_HEADER
from skylb.balancer.stages.context import RequestContext

__all__ = ["EmbeddingCacheStage"]


class EmbeddingCacheStage:
    """``cache``: the answers kept; ``client_keys``: clients authenticate with SkyLB keys (then their
    Authorization header is not part of the key)."""

    name = "embedding_cache"

    def __init__(self, cache: EmbeddingCache, *, client_keys: bool):
        self.cache = cache
        self.client_keys = client_keys

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        request = ctx.http
        key = self.cache.key(request.path, ctx.body, tenant=ctx.tenant,
                             authorization=None if self.client_keys else request.headers.get("Authorization"))
        if key is None:
            return None
        hit = self.cache.get(key)
        if hit is not None:
            hit.headers[ROUTE_HEADER] = "cache"
            ctx.reason = "embedding_cache_hit"
            return hit

        def keep(ctx: RequestContext) -> None:
            outcome = ctx.outcome
            if outcome is not None and outcome.status == 200 and outcome.error is None \
                    and isinstance(outcome.response, web.Response) and not ctx.parsed.stream:
                self.cache.put(key, outcome.response.body, outcome.response.content_type)
        ctx.on_end(keep)
        return None
