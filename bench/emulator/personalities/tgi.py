"""Hugging Face Text Generation Inference's router: the OpenAI API, /metrics, /health, /info.

Sources (huggingface/text-generation-inference, router/src): ``server.rs`` (routes ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/info``, ``/health`` (200, empty body), ``/metrics``; errors are
``ErrorResponse {"error": str, "error_type": str}`` with ``InferError`` mapped to 424 generation, 429 overloaded
("Model is overloaded"), 422 validation, 500 incomplete_generation; a failure after a stream started is a
``data: {"error", "error_type"}`` event; the request's ``model`` field is unused: responses name the served
``model_id``), ``main.rs`` (``--max-concurrent-requests``, default 128: more in-flight requests get 429), the
``tgi_queue_size``, ``tgi_batch_current_size`` and ``tgi_batch_current_max_tokens`` gauges (exported by
metrics-exporter-prometheus: ``# TYPE`` and one unlabelled sample); shared/reference/engines.md.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from bench.emulator.model import FinishedRequest
from bench.emulator.personalities.base import ApiError
from bench.emulator.personalities.openai import OpenAIServing

__all__ = ["TgiPersonality", "TGI_VERSION"]

#: The TGI release this personality follows.
TGI_VERSION = "3.3.4"
DEFAULT_MAX_CONCURRENT_REQUESTS = 128


class TgiPersonality(OpenAIServing, name="tgi"):
    """TGI in front of the replica."""

    engine_flags = frozenset({"max_concurrent_requests"})

    @property
    def max_concurrent_requests(self) -> int:
        """In-flight requests admitted before 429 (``--max-concurrent-requests``)."""
        limit = self.options.max_concurrent_requests
        return DEFAULT_MAX_CONCURRENT_REQUESTS if limit is None else limit

    def routes(self, app: web.Application) -> None:
        """TGI routes a balancer or an OpenAI client uses."""
        self.openai_routes(app)
        self.add(app, "GET", "/health", self.health)
        self.add(app, "GET", "/info", self.info)
        self.add(app, "GET", "/metrics", self.metrics)

    # ---- dialect hooks ----------------------------------------------------------------------------------------

    def error_response(self, err: ApiError) -> web.Response:
        """``{"error", "error_type"}``; the emulator's 400s are TGI's 422 validation errors."""
        status, err_type = err.status, err.err_type
        if status == 400:
            status, err_type = 422, "validation"
        return web.json_response({"error": err.message, "error_type": err_type}, status=status)

    def stream_error(self, err: ApiError) -> bytes:
        return b"data: " + json.dumps({"error": err.message, "error_type": err.err_type}).encode() + b"\n\n"

    done_after_error = False

    def failure(self) -> ApiError:
        k = self.options.fail_after_tokens
        return ApiError(424, f"Request failed during generation: emulated failure after {k} tokens "
                             f"(--fail-after-tokens {k})", err_type="generation")

    def check_admission(self) -> None:
        """429 "Model is overloaded" when ``--max-concurrent-requests`` requests are already in flight."""
        m = self.replica.model
        if m.num_waiting + m.num_running >= self.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", err_type="overloaded")

    def resolve_model(self, requested: str | None) -> str:
        """TGI ignores the request's ``model``: responses name the served model."""
        return self.model_name

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one served model, TGI's ModelInfo."""
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": self.model_name}
        return web.json_response({"object": "list", "data": [card]})

    def usage(self, fin: FinishedRequest) -> dict[str, Any]:
        """TGI's usage has no prompt_tokens_details."""
        return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                "total_tokens": fin.prompt_tokens + fin.completion_tokens}

    def chat_choice(self, text: str, reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    def completion_choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def delta_choice(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"role": "assistant", **delta}, "logprobs": None, "finish_reason": reason}

    def response_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": f"{TGI_VERSION}-native"}

    def chunk_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": f"{TGI_VERSION}-native"}

    # ---- native endpoints -------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body."""
        return web.Response(status=200)

    async def info(self, request: web.Request) -> web.Response:
        """``GET /info``: TGI's Info."""
        p = self.replica.model.params
        return web.json_response({
            "model_id": self.model_name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": self.max_concurrent_requests, "max_best_of": 2, "max_stop_sequences": 4,
            "max_input_tokens": p.model_len - 1, "max_total_tokens": p.model_len, "validation_workers": 2,
            "max_client_batch_size": 4, "router": "text-generation-router", "version": TGI_VERSION, "sha": None,
            "docker_label": None})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's gauges in metrics-exporter-prometheus's layout."""
        m = self.replica.model
        batch_tokens = m.num_running * m.params.block_size  # a rough stand-in for the batch's token budget
        done = sum(m.requests_finished[r] for r in ("stop", "length"))
        series = [("tgi_request_count", "counter", done + m.requests_finished["abort"] + m.num_running
                   + m.num_waiting),
                  ("tgi_request_success", "counter", done),
                  ("tgi_queue_size", "gauge", m.num_waiting),
                  ("tgi_batch_current_size", "gauge", m.num_running),
                  ("tgi_batch_current_max_tokens", "gauge", batch_tokens)]
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n\n" for name, kind, value in series)
        return web.Response(text=text, headers={"Content-Type": "text/plain; version=0.0.4"})
