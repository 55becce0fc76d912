"""vLLM's OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/responses (responses.py),
/v1/models, /v1/embeddings, /tokenize, /reset_prefix_cache, /metrics, /health, /version.

Sources: vLLM's OpenAI server (``vllm/entrypoints/openai``: error shape ``{"error": {"message", "type", "param",
"code"}}`` with code = the HTTP status, the "model does not exist" and context-length messages, a mid-stream
failure as ``data: {"error": ...}`` followed by ``data: [DONE]``) and its Prometheus logger
(``vllm/v1/metrics/loggers.py``: metric names, help texts, labels ``model_name`` and ``engine``);
shared/reference/engines.md.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bench.emulator import kv_hash
from bench.emulator.model import EngineModel
from bench.emulator.personalities.base import ApiError, PersonalityOptions
from bench.emulator.personalities.openai import OpenAIServing, chat_prompt, completion_prompt, parse_json_body
from bench.emulator.personalities.responses import ResponsesServing

__all__ = ["VllmPersonality", "VLLM_VERSION"]

#: The vLLM release whose API and metric names this personality follows (kv_cache_usage_perc, no gpu_cache_*).
VLLM_VERSION = "0.12.0"


class _VllmCollector:
    """Reads one replica's model at scrape time, as vLLM's PrometheusStatLogger reports it (engine index 0)."""

    _LABELS = ["model_name", "engine"]

    def __init__(self, model: EngineModel, model_name: str):
        self._model = model
        self._values = [model_name, "0"]

    def _one(self, family: type, name: str, doc: str, value: float):
        metric = family(name, doc, labels=self._LABELS)
        metric.add_metric(self._values, value)
        return metric

    def collect(self):
        """Yield the metric families (prometheus_client Collector protocol)."""
        m = self._model
        yield self._one(GaugeMetricFamily, "vllm:num_requests_running",
                        "Number of requests in model execution batches.", m.num_running)
        yield self._one(GaugeMetricFamily, "vllm:num_requests_waiting",
                        "Number of requests waiting to be processed.", m.num_waiting)
        yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", m.kv_usage)
        # vLLM's log_metrics_info: the CacheConfig as labels of a gauge of 1 (two of its fields here).
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(m.params.block_size), str(m.params.num_blocks)], 1.0)
        yield info
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_queries",
                        "Prefix cache queries, in terms of number of queried tokens.", m.prefix_cache_queries)
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_hits",
                        "Prefix cache hits, in terms of number of cached tokens.", m.prefix_cache_hits)
        yield self._one(CounterMetricFamily, "vllm:prompt_tokens",
                        "Number of prefill tokens processed.", m.prompt_tokens_total)
        yield self._one(CounterMetricFamily, "vllm:generation_tokens",
                        "Number of generation tokens processed.", m.generation_tokens_total)
        yield self._one(CounterMetricFamily, "vllm:num_preemptions",
                        "Cumulative number of preemption from the engine.", m.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._LABELS, "finished_reason"])
        for reason, count in m.requests_finished.items():
            success.add_metric([*self._values, reason], count)
        yield success


class VllmPersonality(OpenAIServing, ResponsesServing, name="vllm"):
    """vLLM (V1) in front of the replica; the OpenAI layer's defaults are vLLM's shapes."""

    def __init__(self, replica, *, options: PersonalityOptions):
        super().__init__(replica, options=options)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_VllmCollector(replica.model, self.model_name))

    def routes(self, app: web.Application) -> None:
        """Routes of vLLM's API server that a balancer or an OpenAI client uses."""
        self.openai_routes(app)
        self.responses_routes(app)
        self.add(app, "GET", "/metrics", self.metrics)
        self.add(app, "GET", "/health", self.health)
        self.add(app, "GET", "/version", self.version)
        self.add(app, "POST", "/tokenize", self.tokenize)
        self.add(app, "POST", "/reset_prefix_cache", self.reset_prefix_cache)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode ``POST /reset_prefix_cache`` (``vllm/entrypoints/serve/dev/cache/api_router.py``):
        ``{"success": bool}``, false while running requests hold blocks; a success publishes ``AllBlocksCleared``
        at once (with KV-cache events on)."""
        reset = getattr(self.replica.model, "reset_prefix_cache", None)  # the SGLang model has none
        success = bool(reset and reset())
        self.replica.publish_kv_events()
        return web.json_response({"success": success})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize`` (``vllm/entrypoints/openai/serving_tokenization.py``): a ``prompt`` or chat
        ``messages`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``; the token ids are the ones the
        emulator hashes its KV-cache blocks over (bench/emulator/kv_hash.py), so a balancer can compute the blocks
        a prompt would hit, as it would against vLLM."""
        try:
            body = parse_json_body(await request.read())
            self.resolve_model(body.get("model") if isinstance(body.get("model"), str) else None)
            words = chat_prompt(body) if "messages" in body else completion_prompt(body)
        except ApiError as err:
            return self.error_response(err)
        ids = kv_hash.token_ids(words)
        return web.json_response({"count": len(ids), "max_model_len": self.replica.model.params.model_len,
                                  "tokens": ids, "token_strs": None})

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body, as vLLM (it answers 503 only when the engine died)."""
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """``{"version": ...}`` like vLLM, plus a marker that this is the emulator."""
        return web.json_response({"version": VLLM_VERSION, "emulator": "skylb"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text format, read from the model at scrape time."""
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
