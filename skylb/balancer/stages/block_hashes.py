"""Stage (before route): the request's KV-cache block hashes, from the engine's own tokenizer (skylb/balancer/
kv_routing.py), so the routing decision can read the block index (exact cache locality) without waiting on anything.

Only OpenAI chat and completion requests to be served here are hashed (Ollama's API, embeddings and pinned requests
are not: no engine that publishes KV-cache events serves them, or the target is fixed); only when a replica serving
the model publishes live events. Anything that fails leaves ``ctx.block_hashes`` None: the prefix trie decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from skylb.balancer.kv_routing import KVRouting, tokenize_body
from skylb.balancer.stages.context import RequestContext
from skylb.core import Router

__all__ = ["BlockHashStage"]


class BlockHashStage:
    """Sets ``ctx.block_hashes`` and ``ctx.prompt_tokens`` from one live event-publishing replica's tokenizer.

    Args: kv: the balancer's KV routing parts; router: its router (the replicas); session(): its upstream aiohttp
    session; authorization(http request): the Authorization a replica gets (the relay's), or None.
    """

    name = "block_hashes"

    def __init__(self, kv: KVRouting, *, router: Router, session: Callable[[], aiohttp.ClientSession],
                 authorization: Callable[[web.Request], str | None]):
        self.kv, self.router, self.session, self.authorization = kv, router, session, authorization

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        if not self.kv.endpoints or ctx.route_api != "openai" or ctx.embedding or ctx.pin is not None:
            return None
        replica = self.kv.tokenizer(self.router.replicas.values(), ctx.parsed.model)
        if replica is None:
            return None
        try:
            body = json.loads(ctx.body)  # the parse stage accepted it; a stage before may have rewritten it
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict):
            return None
        ask = tokenize_body(ctx.http.path, body)
        if ask is None:
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        found = await self.kv.block_hashes(self.session(), replica, ask, cache_salt=salt,
                                           authorization=self.authorization(ctx.http))
        if found is not None:
            ctx.block_hashes, ctx.prompt_tokens = found
        return None
