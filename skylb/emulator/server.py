"""`skylb emulator`: emulated inference replicas that speak an engine's HTTP API, several ports in one process.

Each ``--port`` is one independent replica: its own :class:`~skylb.emulator.model.EngineModel` (continuous
batching, KV cache, prefix cache), driven in real time by an asyncio task (:class:`Replica`), behind an HTTP app
built by the engine's *personality* (:class:`Personality`; only vLLM for now, see :class:`VllmPersonality`). The
personality owns everything an engine's clients see (routes, request parsing, response and error shapes,
/metrics); the replica owns the timing. Adding SGLang, llama.cpp, TGI or Ollama is adding a Personality subclass
(``class SglangPersonality(Personality, name="sglang")``) and listing it in ``--engine``.

Sources for the vLLM personality: vLLM's OpenAI server (``vllm/entrypoints/openai``: error shape, the "model does
not exist" and context-length messages) and its Prometheus logger (``vllm/v1/metrics/loggers.py``: metric names,
help texts, labels ``model_name`` and ``engine``); shared/reference/engines.md.

Not emulated: ``n`` > 1 (400), ``stop`` sequences, ``logprobs`` (always null), ``echo``, tools, images, embeddings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from skylb.emulator.model import (
    EngineModel,
    EngineParams,
    FinishedRequest,
    TokenOutput,
    chat_tokens,
    text_tokens,
)

__all__ = [
    "Replica",
    "Personality",
    "VllmPersonality",
    "PERSONALITIES",
    "ApiError",
    "serve",
    "params_from_args",
    "add_arguments",
    "main",
]

log = structlog.get_logger("skylb.emulator")

#: How long shutdown waits for in-flight requests before cancelling them (s).
SHUTDOWN_TIMEOUT_S = 2.0
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class Replica:
    """One emulated engine: an EngineModel stepped in real time, and a token queue per in-flight request.

    ``run()`` loops: plan a step, sleep until its end (the model's durations already include ``time_scale``),
    complete it, hand each token to its request's queue. Times given to the model are ``time.monotonic()`` (s).
    """

    def __init__(self, model: EngineModel, *, name: str, log_requests: bool = True):
        self.model = model
        self.name = name
        self.log_requests = log_requests
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()

    def submit(self, request_id: str, prompt_tokens: list[str], max_tokens: int | None, *,
               ignore_eos: bool) -> asyncio.Queue[TokenOutput]:
        """Queue a request in the model; returns the queue its tokens arrive on. Raises the model's ValueErrors."""
        self.model.submit(request_id, prompt_tokens, max_tokens, ignore_eos=ignore_eos, now=time.monotonic())
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._wake.set()
        return queue

    def release(self, request_id: str) -> None:
        """Forget a request's queue; if the model still holds it (the client went away), cancel it there."""
        self._streams.pop(request_id, None)
        if self.model.cancel(request_id, now=time.monotonic()):
            self._wake.set()
            if self.log_requests:
                log.info("request_cancelled", replica=self.name, request_id=request_id)

    async def run(self) -> None:
        """Drive the model until cancelled."""
        model = self.model
        while True:
            step = model.start_step(time.monotonic())
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep to the step's planned end, not for its duration, so loop overhead does not accumulate.
            await asyncio.sleep(max(0.0, step.end - time.monotonic()))
            model.complete_step(step)
            for out in step.outputs:
                queue = self._streams.get(out.request_id)
                if queue is None:
                    continue  # cancelled during the step: its client is gone
                queue.put_nowait(out)
                if out.finished is not None and self.log_requests:
                    self._log_finished(out.finished)

    def _log_finished(self, f: FinishedRequest) -> None:
        log.info("request_finished", replica=self.name, request_id=f.request_id, prompt_tokens=f.prompt_tokens,
                 cached_tokens=f.cached_tokens, completion_tokens=f.completion_tokens,
                 finish_reason=f.finish_reason, queue_ms=round(f.queue_s * 1000, 3),
                 ttft_ms=round(f.ttft_s * 1000, 3), e2e_ms=round(f.e2e_s * 1000, 3))


class ApiError(Exception):
    """A client error, answered in the personality's error shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


class Personality:
    """What one engine's clients see. Subclasses register with ``class X(Personality, name="engine")``."""

    name: ClassVar[str]

    def __init_subclass__(cls, *, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        PERSONALITIES[name] = cls

    def __init__(self, replica: Replica, *, model_name: str):
        self.replica = replica
        self.model_name = model_name

    def build_app(self) -> web.Application:
        """The aiohttp application serving this replica."""
        raise NotImplementedError


#: engine name -> Personality subclass (filled by ``__init_subclass__``).
PERSONALITIES: dict[str, type[Personality]] = {}


# ---- vLLM ---------------------------------------------------------------------------------------------------------

#: The vLLM release whose API and metric names this personality follows (kv_cache_usage_perc, no gpu_cache_*).
VLLM_VERSION = "0.12.0"


@dataclass(frozen=True)
class _GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    prompt_tokens: list[str]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool


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
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_queries",
                        "Prefix cache queries, in terms of number of queried tokens.", m.prefix_cache_queries)
        yield self._one(CounterMetricFamily, "vllm:prefix_cache_hits",
                        "Prefix cache hits, in terms of number of cached tokens.", m.prefix_cache_hits)
        yield self._one(CounterMetricFamily, "vllm:prompt_tokens",
                        "Number of prefill tokens processed.", m.prompt_tokens_total)
        yield self._one(CounterMetricFamily, "vllm:generation_tokens",
                        "Number of generation tokens processed.", m.generation_tokens_total)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*self._LABELS, "finished_reason"])
        for reason, count in m.requests_finished.items():
            success.add_metric([*self._values, reason], count)
        yield success


class VllmPersonality(Personality, name="vllm"):
    """vLLM's OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /metrics, /health,
    /version. Errors are ``{"error": {"message", "type", "param", "code"}}`` with code = the HTTP status."""

    def __init__(self, replica: Replica, *, model_name: str):
        super().__init__(replica, model_name=model_name)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_VllmCollector(replica.model, model_name))
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        """Routes of vLLM's API server that a balancer or an OpenAI client uses."""
        app = web.Application(client_max_size=64 * 1024 * 1024)  # long trace prompts are megabytes of words
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        return app

    # ---- small endpoints ------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 with an empty body, as vLLM (it answers 503 only when the engine died)."""
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """``{"version": ...}`` like vLLM, plus a marker that this is the emulator."""
        return web.json_response({"version": VLLM_VERSION, "emulator": "skylb"})

    async def models(self, request: web.Request) -> web.Response:
        """The OpenAI model list with the one served model."""
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model_name, "parent": None, "max_model_len": self.replica.model.params.model_len,
                "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text format, read from the model at scrape time."""
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---- generation -----------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (``prompt``: a string, a one-string list, or token ids)."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (``messages``: role and text content)."""
        return await self._generate(request, chat=True)

    @staticmethod
    def error_response(err: ApiError) -> web.Response:
        """vLLM's nested error body."""
        body = {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.status}}
        return web.json_response(body, status=err.status)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            parsed = self._parse(await request.read(), chat=chat)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                queue = self.replica.submit(request_id, parsed.prompt_tokens, parsed.max_tokens,
                                            ignore_eos=parsed.ignore_eos)
            except ValueError as exc:  # RequestTooLong (prompt + max_tokens > model length): the client's fault
                raise ApiError(400, str(exc)) from exc
        except ApiError as err:
            return self.error_response(err)
        try:
            if parsed.stream:
                return await self._stream(request, queue, request_id, parsed, chat=chat)
            return await self._collect(queue, request_id, chat=chat)
        finally:
            # Runs on normal completion and when the handler is cancelled (client disconnect): a request still
            # in the model is cancelled there, so its slot and blocks free at once.
            self.replica.release(request_id)

    async def _collect(self, queue: asyncio.Queue[TokenOutput], request_id: str, *, chat: bool) -> web.Response:
        words: list[str] = []
        while True:
            out = await queue.get()
            words.append(out.text)
            if out.finished is not None:
                break
        fin = out.finished
        text = " ".join(words)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "tool_calls": [], "reasoning_content": None},
                      "logprobs": None, "finish_reason": fin.finish_reason, "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
        body = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": _usage(fin), "system_fingerprint": None}
        return web.json_response(body)

    async def _stream(self, request: web.Request, queue: asyncio.Queue[TokenOutput], request_id: str,
                      parsed: _GenerateRequest, *, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices: list[dict], **extra: Any) -> None:
            chunk = {"id": request_id, "object": obj, "created": created, "model": self.model_name,
                     "choices": choices, **extra}
            # One write per chunk: aiohttp sends it at once (chunked transfer), so tokens stream as produced.
            await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

        try:
            if chat:
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
            while True:
                out = await queue.get()
                text = out.text if out.index == 0 else " " + out.text  # chunks concatenate to the full text
                reason = out.finished.finish_reason if out.finished is not None else None
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                              "stop_reason": None}
                await send([choice])
                if out.finished is not None:
                    break
            if parsed.include_usage:
                await send([], usage=_usage(out.finished))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream: _generate's finally cancels the request; nothing to log
        return resp

    # ---- request parsing ------------------------------------------------------------------------------------

    def _parse(self, raw: bytes, *, chat: bool) -> _GenerateRequest:
        """Validate a body the way vLLM's pydantic models do, for the fields the emulator uses."""
        try:
            body = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise ApiError(400, f"Invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "`model` must be a string.", param="model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", err_type="NotFoundError", param="model")
        tokens = _chat_prompt(body) if chat else _completion_prompt(body)
        # vLLM: max_completion_tokens wins over the deprecated max_tokens.
        max_tokens = None
        for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
            value = body.get(key)
            if value is not None:
                if type(value) is not int or value < 1:
                    raise ApiError(400, f"`{key}` must be an integer of at least 1, got {value!r}.", param=key)
                max_tokens = value
        n = body.get("n")
        if n is not None and (type(n) is not int or n < 1):
            raise ApiError(400, f"`n` must be a positive integer, got {n!r}.", param="n")
        if n is not None and n > 1:
            raise ApiError(400, f"n={n} is not supported by the SkyLB emulator (only n=1).", param="n")
        stream = _optional_bool(body, "stream")
        ignore_eos = _optional_bool(body, "ignore_eos")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError(400, "`stream_options` must be an object.", param="stream_options")
        if options and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        include_usage = _optional_bool(options or {}, "include_usage")
        return _GenerateRequest(prompt_tokens=tokens, max_tokens=max_tokens, stream=stream,
                                include_usage=include_usage, ignore_eos=ignore_eos)


def _usage(fin: FinishedRequest) -> dict[str, Any]:
    """OpenAI usage with vLLM's ``prompt_tokens_details.cached_tokens`` (always present here)."""
    return {"prompt_tokens": fin.prompt_tokens, "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "completion_tokens": fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _optional_bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise ApiError(400, f"`{key}` must be a boolean, got {value!r}.", param=key)
    return value


def _completion_prompt(body: dict) -> list[str]:
    """Tokens of ``prompt``: a string, a list of one string, token ids (each id is one token), or [[ids]]."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = text_tokens(prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        tokens = [str(t) for t in prompt]
    elif prompt is None:
        raise ApiError(400, "Field required: `prompt`.", param="prompt")
    else:
        raise ApiError(400, "`prompt` must be a string, a list of one string, or a list of token ids "
                            "(batched prompts are not supported by the SkyLB emulator).", param="prompt")
    if not tokens:
        raise ApiError(400, "The prompt cannot be empty.", param="prompt")
    return tokens


def _chat_prompt(body: dict) -> list[str]:
    """Tokens of ``messages``: ``<role>:`` then the words of the text content, per message."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "Field required: `messages`.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list.", param="messages")
    pairs: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string `role`.", param="messages")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported by the SkyLB "
                                        "emulator.", param="messages")
                parts.append(part["text"])
            text = " ".join(parts)
        else:
            raise ApiError(400, f"messages[{i}].content must be a string or a list of parts.", param="messages")
        pairs.append((message["role"], text))
    return chat_tokens(pairs)


# ---- process ------------------------------------------------------------------------------------------------------

async def serve(*, engine: str, host: str, ports: list[int], model_name: str, params: EngineParams,
                log_requests: bool = True, stop: asyncio.Event | None = None) -> int:
    """Serve one replica per port until ``stop`` is set (or SIGTERM/SIGINT); returns the exit status."""
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    tasks: list[asyncio.Task] = []

    def replica_died(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("replica_loop_failed", error=repr(task.exception()))
            stop.set()

    status = 0
    try:
        for port in ports:
            replica = Replica(EngineModel(params), name=f"{host}:{port}", log_requests=log_requests)
            app = PERSONALITIES[engine](replica, model_name=model_name).build_app()
            # handler_cancellation: a client that disconnects cancels its handler, which cancels the request.
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=SHUTDOWN_TIMEOUT_S)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, port).start()
            task = asyncio.create_task(replica.run(), name=f"replica {host}:{port}")
            task.add_done_callback(replica_died)
            tasks.append(task)
        log.info("emulator_started", engine=engine, host=host, ports=ports, model=model_name,
                 time_scale=params.time_scale, max_num_seqs=params.max_num_seqs,
                 kv_cache_tokens=params.kv_cache_tokens, block_size=params.block_size)
        await stop.wait()
    except OSError as exc:  # a port in use
        log.error("emulator_bind_failed", error=str(exc))
        status = 1
    finally:
        # Stop accepting and let in-flight requests finish (bounded) while the replicas still run.
        for runner in runners:
            await runner.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("emulator_stopped", ports=ports)
    return status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `skylb emulator` (defaults: EngineParams, Llama-3.1-8B on one NVIDIA L4)."""
    d = EngineParams()
    parser.add_argument("--engine", choices=sorted(PERSONALITIES), default="vllm",
                        help="which engine's HTTP API, metrics and errors to speak (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, action="append", required=True, metavar="PORT",
                        help="TCP port of one replica; repeat for several independent replicas in this process")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="served model name: /v1/models id, the metrics' model_name label; requests naming "
                             "another model get 404 (default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help="multiplies every emulated duration; 0.01 runs 100x faster than an L4 "
                             "(default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                        help="running-batch slots, vLLM --max-num-seqs (requests; default: %(default)s, vLLM's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget per iteration for decodes plus prefill chunks, vLLM "
                             f"--max-num-batched-tokens (tokens; default: max({d.max_num_batched_tokens}, "
                             "--max-num-seqs); 2048 is vLLM V1's default on GPUs under 70 GB)")
    parser.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens,
                        help="KV cache capacity (tokens; default: %(default)s = about 4.2 GB left on a 24 GB L4 "
                             "after 16 GB of fp16 weights, at 128 KiB per Llama-3.1-8B token)")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="KV block size; the prefix cache works in full blocks (tokens; default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + max_tokens accepted, else 400 (tokens; default: the KV capacity)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token,
                        help="prefill time per uncached prompt token (ms; default: %(default)s, from the SkyLB "
                             "paper's ~300 ms for a 512-token prompt on an L4)")
    parser.add_argument("--decode-base-ms", type=float, default=d.decode_base_ms,
                        help="fixed time of every iteration (ms; default: %(default)s = 16.06 GB of weights read "
                             "at the L4's 300 GB/s)")
    parser.add_argument("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq,
                        help="extra iteration time per decoding request (ms; default: %(default)s)")
    parser.add_argument("--decode-ms-per-kv-token", type=float, default=d.decode_ms_per_kv_token,
                        help="extra iteration time per context token of the decoding requests (ms; default: "
                             "%(default)s = 128 KiB of KV per token at 300 GB/s)")
    parser.add_argument("--eos-max-tokens", type=int, default=d.eos_max_tokens,
                        help="without ignore_eos, a request stops after 1 + hash(prompt) %% min(max_tokens, this) "
                             "tokens (tokens; default: %(default)s)")
    parser.add_argument("--no-request-log", dest="log_requests", action="store_false",
                        help="do not write a JSON log line per finished or cancelled request")


def params_from_args(args: argparse.Namespace) -> EngineParams:
    """EngineParams from parsed flags; raises ValueError on inconsistent values."""
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = max(EngineParams.max_num_batched_tokens, args.max_num_seqs)
    return EngineParams(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched, kv_cache_tokens=args.kv_cache_tokens,
        block_size=args.block_size, max_model_len=args.max_model_len,
        prefill_ms_per_token=args.prefill_ms_per_token, decode_base_ms=args.decode_base_ms,
        decode_ms_per_seq=args.decode_ms_per_seq, decode_ms_per_kv_token=args.decode_ms_per_kv_token,
        eos_max_tokens=args.eos_max_tokens, time_scale=args.time_scale)


def _configure_logging() -> None:
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )


def main(args: argparse.Namespace) -> int:
    """Run `skylb emulator`; returns the exit status (2 for bad flags)."""
    try:
        params = params_from_args(args)
    except ValueError as exc:
        print(f"skylb emulator: {exc}", file=sys.stderr)
        return 2
    bad = [p for p in args.port if not 0 < p < 65536]
    if bad or len(set(args.port)) != len(args.port):
        print(f"skylb emulator: --port values must be distinct and in 1-65535, got {args.port}", file=sys.stderr)
        return 2
    _configure_logging()
    return asyncio.run(serve(engine=args.engine, host=args.host, ports=args.port, model_name=args.model,
                             params=params, log_requests=args.log_requests))
