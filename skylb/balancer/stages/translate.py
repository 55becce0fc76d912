"""Stage 3b, translate: an Ollama-API request for a model that no Ollama replica or peer serves, but OpenAI-dialect
replicas (vLLM, SGLang, llama.cpp, TGI, ...) do, goes to them as an OpenAI request (skylb/balancer/translate.py); the
relay turns the answer back into Ollama's shape.

A model that an Ollama replica here or at a peer serves is never translated (that replica answers natively, with
its own timings and ``context``), even where a local OpenAI-dialect replica serves it too. A request that cannot
be translated gets 400 in Ollama's shape naming the API that serves the model and
what could not be said in it. A request with nothing to generate (an empty prompt or message list: Ollama loads the
model) is answered here, as Ollama answers it. Sources: Ollama's API docs (``docs/api.md``), the OpenAI API reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

from aiohttp import web

from skylb.balancer.stages.context import RequestContext
from skylb.balancer.translate import OPENAI_PATHS, Untranslatable, load_answer, translate_request
from skylb.core.fleet_rules import resolve_name

__all__ = ["TranslateStage"]


class TranslateStage:
    """Sets ``ctx.translation``, ``ctx.body`` (the OpenAI body) and ``ctx.parsed.model`` (the served name).

    Args:
        served_models(api, with_peers): the models served in a dialect, locally and (``with_peers``) by peers.
        is_group(name): a model group alias (answered in the request's own dialect). any_served(model, served): the
        model or one of its fallbacks is in ``served``. now(): the balancer's clock, s.
    """

    name = "translate"

    def __init__(self, *, served_models: Callable[..., Collection[str]], is_group: Callable[[str], bool],
                 any_served: Callable[[str, Collection[str]], bool], now: Callable[[], float]):
        self.served_models = served_models
        self.is_group = is_group
        self.any_served = any_served
        self.now = now

    async def handle(self, ctx: RequestContext) -> web.StreamResponse | None:
        if ctx.api != "ollama" or ctx.http.path not in OPENAI_PATHS:
            return None
        parsed, with_peers = ctx.parsed, not ctx.forwarded
        native = self.served_models("ollama", with_peers=with_peers)
        if self.is_group(parsed.model) or self.any_served(resolve_name(parsed.model, native), native):
            return None
        served = self.served_models("openai", with_peers=with_peers)
        model = resolve_name(parsed.model, served)
        if not self.any_served(model, served):
            return None  # served nowhere: resolve_model answers 404
        try:
            translation = translate_request(ctx.http.path, json.loads(ctx.body), model=model,
                                            arrived_at=ctx.arrived_at, now=self.now)
        except Untranslatable as exc:
            return ctx.reject(400, f"model '{model}' is served here through the OpenAI API "
                                   f"({OPENAI_PATHS[ctx.http.path]}) only, and this request cannot be translated to "
                                   f"it: {exc}. Send it to the OpenAI API instead.", "untranslatable",
                              param=exc.param)
        if translation is None:
            ctx.reason = "load_only"
            return web.json_response(load_answer(ctx.http.path, model))
        ctx.translation, ctx.body, parsed.model = translation, translation.body, model
        return None
