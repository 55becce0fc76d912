"""SGLang's HTTP server: the OpenAI API, /metrics (with ``--enable-metrics``), /v1/loads, /get_load, /health.

Sources (sgl-project/sglang, python/sglang/srt): ``metrics/collector.py`` (``sglang:num_queue_reqs`` "The number
of requests in the waiting queue.", ``sglang:num_running_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate``,
with the SGLang scheduler model ``sglang:new_token_ratio``; labels ``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``), ``entrypoints/v1_loads.py`` (``GET /v1/loads``:
``{"timestamp", "version", "dp_rank_count", "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs",
"num_used_tokens", "max_total_num_tokens", "token_usage", ...}], "aggregate": {...}}``), ``entrypoints/
http_server.py`` (legacy ``GET /get_load``: a list of ``{"dp_rank", "num_reqs", "num_waiting_reqs",
"num_tokens"}``; ``/health`` 200 with an empty body; the flat ``ErrorResponse`` ``{"object": "error", "message",
"type", "param", "code"}``, also written as ``data: {...}`` when a stream fails, followed by ``data: [DONE]``);
shared/reference/engines.md.

Emulated as one data-parallel rank (dp_rank 0, tp_rank 0). Usage carries ``prompt_tokens_details.cached_tokens``
as SGLang does with ``--enable-cache-report``. Without ``--enable-metrics`` (the emulator's ``--no-metrics``)
/metrics is FastAPI's 404. Unknown model names get a 404 in the flat shape.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bench.emulator.model import EngineModel
from bench.emulator.personalities.base import ApiError, PersonalityOptions
from bench.emulator.personalities.openai import OpenAIServing

__all__ = ["SglangPersonality", "SGLANG_VERSION"]

#: The SGLang release whose API this personality follows (/v1/loads exists; /get_load kept for old routers).
SGLANG_VERSION = "0.5.5"


def _load(model: EngineModel) -> dict[str, Any]:
    """Rank 0's numbers: used tokens are the KV blocks in use (tokens), token_usage their fraction (0-1)."""
    p = model.params
    capacity = p.num_blocks * p.block_size
    used = round(model.kv_usage * capacity)
    hit_rate = model.prefix_cache_hits / model.prefix_cache_queries if model.prefix_cache_queries else 0.0
    return {"running": model.num_running, "waiting": model.num_waiting, "used": used, "capacity": capacity,
            "token_usage": model.kv_usage, "cache_hit_rate": hit_rate, "max_running": p.max_num_seqs}


class _SglangCollector:
    """SGLang's scheduler metrics, read from the model at scrape time."""

    _LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank"]

    def __init__(self, model: EngineModel, model_name: str):
        self._model = model
        self._values = [model_name, "unified", "0", "0"]

    def _one(self, family: type, name: str, doc: str, value: float):
        metric = family(name, doc, labels=self._LABELS)
        metric.add_metric(self._values, value)
        return metric

    def collect(self):
        """Yield the metric families (prometheus_client Collector protocol)."""
        m, load = self._model, _load(self._model)
        yield self._one(GaugeMetricFamily, "sglang:num_running_reqs", "The number of running requests.",
                        load["running"])
        yield self._one(GaugeMetricFamily, "sglang:num_used_tokens", "The number of used tokens.", load["used"])
        yield self._one(GaugeMetricFamily, "sglang:token_usage", "The token usage.", load["token_usage"])
        yield self._one(GaugeMetricFamily, "sglang:max_total_num_tokens", "Maximum total number of tokens.",
                        load["capacity"])
        yield self._one(GaugeMetricFamily, "sglang:num_queue_reqs",
                        "The number of requests in the waiting queue.", load["waiting"])
        yield self._one(GaugeMetricFamily, "sglang:cache_hit_rate", "The prefix cache hit rate.",
                        load["cache_hit_rate"])
        ratio = getattr(m, "new_token_ratio", None)  # only the SGLang scheduler model (--admission sglang) has one
        if ratio is not None:
            yield self._one(GaugeMetricFamily, "sglang:new_token_ratio", "The new token ratio.", ratio)
        yield self._one(CounterMetricFamily, "sglang:prompt_tokens", "Number of prefill tokens processed.",
                        m.prompt_tokens_total)
        yield self._one(CounterMetricFamily, "sglang:generation_tokens", "Number of generation tokens processed.",
                        m.generation_tokens_total)
        yield self._one(CounterMetricFamily, "sglang:cached_tokens",
                        "Number of cached prompt tokens.", m.prefix_cache_hits)


class SglangPersonality(OpenAIServing, name="sglang"):
    """SGLang in front of the replica."""

    owned_by = "sglang"
    engine_flags = frozenset({"metrics"})

    def __init__(self, replica, *, options: PersonalityOptions):
        super().__init__(replica, options=options)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SglangCollector(replica.model, self.model_name))

    def routes(self, app: web.Application) -> None:
        """SGLang's native and OpenAI routes that a balancer or a client uses."""
        self.openai_routes(app)
        self.add(app, "GET", "/metrics", self.metrics)
        self.add(app, "GET", "/health", self.health)
        self.add(app, "GET", "/health_generate", self.health)
        self.add(app, "GET", "/v1/loads", self.loads)
        self.add(app, "GET", "/get_load", self.get_load)
        self.add(app, "GET", "/get_model_info", self.model_info)
        self.add(app, "GET", "/get_server_info", self.server_info)

    # ---- dialect hooks ----------------------------------------------------------------------------------------

    def error_response(self, err: ApiError) -> web.Response:
        """SGLang's flat ErrorResponse."""
        return web.json_response(self._error_body(err), status=err.status)

    @staticmethod
    def _error_body(err: ApiError) -> dict[str, Any]:
        return {"object": "error", "message": err.message, "type": err.err_type, "param": err.param,
                "code": err.status}

    def stream_error(self, err: ApiError) -> bytes:
        """``data: {flat error}`` (``create_streaming_error_response``), then ``data: [DONE]``."""
        return b"data: " + json.dumps(self._error_body(err)).encode() + b"\n\n"

    def model_card(self, name: str) -> dict[str, Any]:
        """SGLang's ModelCard."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "sglang", "root": name,
                "max_model_len": self.replica.model.params.model_len}

    def chat_choice(self, text: str, reason: str) -> dict[str, Any]:
        """SGLang's ChatCompletionResponseChoice."""
        return {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                        "tool_calls": None},
                "logprobs": None, "finish_reason": reason, "matched_stop": None}

    def completion_choice(self, text: str, reason: str | None) -> dict[str, Any]:
        """SGLang's CompletionResponseChoice."""
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": None}

    def response_fields(self) -> dict[str, Any]:
        """SGLang responses carry no system_fingerprint."""
        return {}

    # ---- native endpoints -------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body once the server is up (503 only while starting or stopping)."""
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text with ``--enable-metrics``; FastAPI's 404 without it."""
        if not self.options.metrics:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def loads(self, request: web.Request) -> web.Response:
        """``GET /v1/loads``: per-DP-rank load (one rank here) and the aggregate."""
        load = _load(self.replica.model)
        rank = {"dp_rank": 0, "num_running_reqs": load["running"], "num_waiting_reqs": load["waiting"],
                "num_used_tokens": load["used"], "num_total_tokens": load["used"],
                "max_total_num_tokens": load["capacity"], "token_usage": round(load["token_usage"], 4),
                "gen_throughput": 0.0, "cache_hit_rate": round(load["cache_hit_rate"], 4),
                "utilization": round(load["running"] / load["max_running"], 4),
                "max_running_requests": load["max_running"],
                "num_total_reqs": load["running"] + load["waiting"]}
        aggregate = {"total_running_reqs": load["running"], "total_waiting_reqs": load["waiting"],
                     "total_reqs": load["running"] + load["waiting"], "avg_token_usage": rank["token_usage"],
                     "avg_throughput": 0.0, "avg_utilization": rank["utilization"]}
        return web.json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": SGLANG_VERSION,
                                  "dp_rank_count": 1, "loads": [rank], "aggregate": aggregate})

    async def get_load(self, request: web.Request) -> web.Response:
        """Legacy ``GET /get_load``: ``[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]``."""
        load = _load(self.replica.model)
        return web.json_response([{"dp_rank": 0, "num_reqs": load["running"] + load["waiting"],
                                   "num_waiting_reqs": load["waiting"], "num_tokens": load["used"]}])

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /get_model_info``."""
        return web.json_response({"model_path": self.model_name, "tokenizer_path": self.model_name,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": "default"})

    async def server_info(self, request: web.Request) -> web.Response:
        """``GET /get_server_info`` (the few fields a client reads, plus a marker that this is the emulator)."""
        p = self.replica.model.params
        return web.json_response({"version": SGLANG_VERSION, "model_path": self.model_name,
                                  "served_model_name": self.model_name, "max_running_requests": p.max_num_seqs,
                                  "max_total_num_tokens": p.num_blocks * p.block_size,
                                  "enable_metrics": self.options.metrics, "emulator": "skylb"})
