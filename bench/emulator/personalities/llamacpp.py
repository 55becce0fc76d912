"""llama.cpp's ``llama-server``: the OpenAI API, /metrics (with ``--metrics``), /health, /slots, /props.

Sources (ggml-org/llama.cpp, tools/server): ``server-context.cpp`` (``get_health`` answers ``{"status": "ok"}``;
``get_metrics`` answers 501 "This server does not support metrics endpoint. Start it with `--metrics`" when
metrics are off, else Prometheus text written by hand: ``# HELP llamacpp:NAME``, ``# TYPE``, one unlabelled
sample, counters ``prompt_tokens_total`` (excluding cached tokens), ``prompt_tokens_cached_total``,
``tokens_predicted_total``, gauges ``requests_processing``, ``requests_deferred``), ``server-http.cpp`` (while the
model loads, every route but /models, /v1/models and /api/tags answers 503 ``{"error": {"message": "Loading
model", "type": "unavailable_error", "code": 503}}``), ``server-task.cpp`` (``usage.prompt_tokens_details
.cached_tokens``; ``timings`` on the final response and on the last streamed chunk), ``utils``'
``format_error_response`` (``{"error": {"code", "message", "type"}}``, no ``param``; types
invalid_request_error 400, not_found_error 404, server_error 500, not_supported_error 501, unavailable_error
503); a failure after a stream started is an ``error: {"code", "message", "type"}`` line with no ``[DONE]``;
shared/reference/engines.md (``-np/--parallel N`` slots with continuous batching).

``--parallel N`` is the number of slots (= the emulator's running-batch slots, default 4: llama-server's
``-np auto``). A single-model server ignores the request's ``model`` and echoes it back, as llama-server does;
with several ``--model`` (router mode) an unknown name gets 404.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from bench.emulator.model import FinishedRequest
from bench.emulator.personalities.base import ApiError, Generation
from bench.emulator.personalities.openai import OpenAIServing

__all__ = ["LlamaCppPersonality", "LLAMACPP_BUILD"]

#: The build this personality claims in ``system_fingerprint`` and /props.
LLAMACPP_BUILD = "b6900-skylb-emulator"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}
#: Routes llama-server answers while the model is still loading.
_OPEN_WHILE_LOADING = frozenset({"/models", "/v1/models", "/api/tags"})
METRICS_DISABLED = "This server does not support metrics endpoint. Start it with `--metrics`"
#: ``handle_embeddings_impl`` without ``--embeddings`` (ERROR_TYPE_NOT_SUPPORTED: 501).
EMBEDDINGS_DISABLED = "This server does not support embeddings. Start it with `--embeddings`"


def error_body(status: int, message: str) -> dict[str, Any]:
    """llama.cpp's ``{"error": {"code", "message", "type"}}``."""
    return {"error": {"code": status, "message": message, "type": _ERROR_TYPES.get(status, "server_error")}}


class LlamaCppPersonality(OpenAIServing, name="llamacpp"):
    """llama-server in front of the replica."""

    owned_by = "llamacpp"
    default_max_num_seqs = 4
    engine_flags = frozenset({"metrics", "embeddings", "load_seconds"})
    done_after_error = False

    def routes(self, app: web.Application) -> None:
        """llama-server's routes a balancer or an OpenAI client uses."""
        self.openai_routes(app)
        self.add(app, "GET", "/models", self.models)
        self.add(app, "GET", "/health", self.health)
        self.add(app, "GET", "/v1/health", self.health)
        self.add(app, "GET", "/metrics", self.metrics)
        self.add(app, "GET", "/slots", self.slots)
        self.add(app, "GET", "/props", self.props)
        self.add(app, "GET", "/", self.index)

    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``; 501 when started without ``--embeddings`` (``--no-embeddings``)."""
        if not self.options.embeddings:
            return web.json_response(error_body(501, EMBEDDINGS_DISABLED), status=501)
        return await super().embeddings(request)

    def middlewares(self) -> list:
        """The loading gate: 503 "Loading model" for ``--load-seconds`` after start."""

        @web.middleware
        async def loading(request: web.Request, handler):
            if time.monotonic() - self.started_at >= self.options.load_seconds \
                    or request.path in _OPEN_WHILE_LOADING:
                return await handler(request)
            if request.path == "/" or request.path.endswith(".html"):
                return web.Response(status=503, text="<html><body>Loading model</body></html>",
                                    content_type="text/html")
            return web.json_response({"error": {"message": "Loading model", "type": "unavailable_error",
                                                "code": 503}}, status=503)

        return [loading]

    # ---- dialect hooks ----------------------------------------------------------------------------------------

    def error_response(self, err: ApiError) -> web.Response:
        """Nested, without ``param``."""
        return web.json_response(error_body(err.status, err.message), status=err.status)

    def stream_error(self, err: ApiError) -> bytes:
        """``error: {"code", "message", "type"}`` (an SSE event named error); no ``[DONE]`` follows."""
        return b"error: " + json.dumps(error_body(err.status, err.message)["error"]).encode() + b"\n\n"

    def resolve_model(self, requested: str | None) -> str:
        """One model: the request's name is echoed back, whatever it is. Several (router mode): 404 if unknown."""
        if requested is None:
            return self.model_name
        if len(self.options.models) > 1 and requested not in self.options.models:
            raise ApiError(404, f"model '{requested}' not found")
        return requested

    def model_card(self, name: str) -> dict[str, Any]:
        """llama-server's card with its ``meta``."""
        p = self.replica.model.params
        return {"id": name, "object": "model", "created": self.created, "owned_by": "llamacpp",
                "meta": {"vocab_type": 2, "n_vocab": 128256, "n_ctx_train": p.model_len, "n_embd": 4096,
                         "n_params": 8030261248, "size": 4920734720}}

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the OpenAI list plus llama-server's Ollama-style ``models`` list."""
        names = self.options.models
        return web.json_response({
            "models": [{"name": n, "model": n, "modified_at": "", "size": "", "digest": "", "type": "model",
                        "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                    "parameter_size": "", "quantization_level": ""}} for n in names],
            "object": "list", "data": [self.model_card(n) for n in names]})

    def chat_choice(self, text: str, reason: str) -> dict[str, Any]:
        return {"finish_reason": reason, "index": 0, "message": {"role": "assistant", "content": text}}

    def completion_choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}

    def delta_choice(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"finish_reason": reason, "index": 0, "delta": delta}

    def response_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": LLAMACPP_BUILD}

    def chunk_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": LLAMACPP_BUILD}

    def final_fields(self, gen: Generation, fin: FinishedRequest) -> dict[str, Any]:
        """``timings``: prompt (uncached tokens, admission to first token) and generation (ms, tokens/s)."""
        prompt_n = fin.prompt_tokens - fin.cached_tokens
        prompt_ms = max(0.0, (fin.first_token_at - fin.admitted_at) * 1000)
        predicted_n = fin.completion_tokens
        predicted_ms = max(0.0, (fin.finished_at - fin.first_token_at) * 1000)
        return {"timings": {
            "cache_n": fin.cached_tokens,
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0}}

    # ---- native endpoints -------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """``{"status": "ok"}`` (the loading gate answers 503 before this runs)."""
        return web.json_response({"status": "ok"})

    async def index(self, request: web.Request) -> web.Response:
        """The web UI's place: a stub page."""
        return web.Response(text="<html><body>llama.cpp server (SkyLB emulator)</body></html>",
                            content_type="text/html")

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text as llama-server writes it; 501 without ``--metrics``."""
        if not self.options.metrics:
            return web.json_response(error_body(501, METRICS_DISABLED), status=501)
        m = self.replica.model
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             max(0, m.prompt_tokens_total - m.prefix_cache_hits)),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", m.prefix_cache_hits),
            ("tokens_predicted_total", "Number of generation tokens processed", m.generation_tokens_total),
        ]
        gauges = [
            ("requests_processing", "Number of requests processing", m.num_running),
            ("requests_deferred", "Number of requests deferred", m.num_waiting),
        ]
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", headers={"Content-Type": "text/plain; version=0.0.4"})

    async def slots(self, request: web.Request) -> web.Response:
        """``GET /slots``: one entry per slot; the first ``requests_processing`` slots are busy."""
        m = self.replica.model
        busy = m.num_running
        if request.query.get("fail_on_no_slot") and busy >= m.params.max_num_seqs:
            return web.json_response(error_body(503, "no slot available"), status=503)
        return web.json_response([
            {"id": i, "id_task": -1, "n_ctx": m.params.model_len, "speculative": False, "is_processing": i < busy,
             "params": {"n_predict": -1, "stream": False},
             "next_token": {"has_next_token": i < busy, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                            "stopping_word": ""}}
            for i in range(m.params.max_num_seqs)])

    async def props(self, request: web.Request) -> web.Response:
        """``GET /props``: slots, context and which endpoints are on."""
        p = self.replica.model.params
        return web.json_response({
            "default_generation_settings": {"n_ctx": p.model_len, "params": {"n_predict": -1}},
            "total_slots": p.max_num_seqs, "model_alias": self.model_name, "model_path": self.model_name,
            "modalities": {"vision": False, "audio": False}, "endpoint_slots": True, "endpoint_props": False,
            "endpoint_metrics": self.options.metrics, "build_info": LLAMACPP_BUILD, "is_sleeping": False})
