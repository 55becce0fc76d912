"""`skylb emulator`: emulated inference replicas that speak an engine's HTTP API, several ports in one process.

Each ``--port`` is one independent replica: its own :class:`~bench.emulator.model.EngineModel` (continuous
batching, KV cache, prefix cache), driven in real time by an asyncio task (:class:`Replica`), behind an HTTP app
built by the engine's *personality* (:mod:`bench.emulator.personalities`: vllm, sglang, llamacpp, tgi, ollama).
The personality owns everything an engine's clients see (routes, request parsing, response and error shapes,
metrics); the replica owns the timing. Adding an engine is adding a Personality subclass
(``class XPersonality(Personality, name="x")``) in that package; ``--engine`` lists every registered one.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import structlog
import zmq
from aiohttp import web

from skylb import aio
from bench.emulator.faults import UPSTREAM_ID, Faults, add_fault_routes, fault_middleware
from bench.emulator.kv_publisher import KVEventPublisher, KVEventsConfig, add_kv_event_routes
from bench.emulator.model import ADMISSIONS, EngineModel, EngineParams, FinishedRequest, TokenOutput, make_engine
from bench.emulator.ollama_lifecycle import LifecycleOptions, parse_keep_alive
from bench.emulator.personalities import PERSONALITIES, ApiError, Personality, PersonalityOptions
from skylb import logs
from skylb.logs import configure_logging

__all__ = [
    "Replica",
    "Personality",
    "PersonalityOptions",
    "PERSONALITIES",
    "ApiError",
    "serve",
    "params_from_args",
    "options_from_args",
    "add_arguments",
    "main",
]

log = structlog.get_logger("bench.emulator")

#: How long shutdown waits for in-flight requests before cancelling them (s), for all replicas of the process at
#: once. Short: a test's teardown stops replicas still serving the long requests that kept them busy, and 2 s per
#: replica, one after another, added 2-4 s to such a test; an engine stopped under load ends its streams anyway.
SHUTDOWN_TIMEOUT_S = 0.5


class Replica:
    """One emulated engine: an EngineModel stepped in real time, and a token queue per in-flight request.

    ``run()`` loops: plan a step, sleep until its end (the model's durations already include ``time_scale``),
    complete it, hand each token to its request's queue. Times given to the model are ``time.monotonic()`` (s).
    """

    def __init__(self, model: EngineModel, *, name: str, log_requests: bool = True,
                 kv_events: KVEventPublisher | None = None):
        self.model = model
        self.name = name
        self.log_requests = log_requests
        #: Publishes each step's KV-cache events (vLLM ``--kv-events-config``); None: events are off.
        self.kv_events = kv_events
        #: Injected faults (bench/emulator/faults.py): ``slowdown`` stretches every step.
        self.faults = Faults()
        #: request id -> the X-Request-Id it arrived with, for the request_finished line.
        self._upstream_ids: dict[str, str] = {}
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()

    def submit(self, request_id: str, prompt_tokens: list[str], max_tokens: int | None, *,
               ignore_eos: bool) -> asyncio.Queue[TokenOutput]:
        """Queue a request in the model; returns the queue its tokens arrive on. Raises the model's ValueErrors."""
        self.model.submit(request_id, prompt_tokens, max_tokens, ignore_eos=ignore_eos, now=time.monotonic())
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        upstream_id = UPSTREAM_ID.get()
        if upstream_id is not None and self.log_requests:
            self._upstream_ids[request_id] = upstream_id
        self._wake.set()
        return queue

    def publish_kv_events(self) -> None:
        """Send the model's KV-cache events recorded since the last call as one batch (after each engine step, as
        vLLM's engine core publishes, and after a prefix-cache reset); nothing when events are off or none came."""
        if self.kv_events is not None and (events := self.model.take_kv_events()):
            self.kv_events.publish(events)

    def release(self, request_id: str) -> None:
        """Forget a request's queue; if the model still holds it (the client went away), cancel it there."""
        self._streams.pop(request_id, None)
        upstream_id = self._upstream_ids.pop(request_id, None)
        if self.model.cancel(request_id, now=time.monotonic()):
            self._wake.set()
            if self.log_requests:
                log.info("request_cancelled", replica=self.name, request_id=request_id,
                         upstream_request_id=upstream_id)

    async def run(self) -> None:
        """Drive the model until cancelled."""
        model = self.model
        while True:
            began = time.monotonic()
            step = model.start_step(began)
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep to the step's planned end, not for its duration, so loop overhead does not accumulate; again if
            # woken early (uvloop's timers have 1 ms resolution), so no step is shorter than the model says. An
            # injected slowdown stretches the step (the model's own timings stay as planned).
            end = began + (step.end - began) * self.faults.slowdown
            while (remaining := end - time.monotonic()) > 0:
                await asyncio.sleep(remaining)
            model.complete_step(step)
            self.publish_kv_events()
            for out in step.outputs:
                queue = self._streams.get(out.request_id)
                if queue is None:
                    continue  # cancelled during the step: its client is gone
                queue.put_nowait(out)
                if out.finished is not None and self.log_requests:
                    self._log_finished(out.finished)

    def _log_finished(self, f: FinishedRequest) -> None:
        log.info("request_finished", replica=self.name, request_id=f.request_id,
                 upstream_request_id=self._upstream_ids.pop(f.request_id, None), prompt_tokens=f.prompt_tokens,
                 cached_tokens=f.cached_tokens, completion_tokens=f.completion_tokens,
                 finish_reason=f.finish_reason, queue_ms=round(f.queue_s * 1000, 3),
                 ttft_ms=round(f.ttft_s * 1000, 3), e2e_ms=round(f.e2e_s * 1000, 3),
                 num_preemptions=f.num_preemptions)


# ---- process ------------------------------------------------------------------------------------------------------

async def serve(*, engine: str, host: str, ports: list[int], params: EngineParams, options: PersonalityOptions,
                log_requests: bool = True, stop: asyncio.Event | None = None, fault_control: bool = False,
                kv_events: KVEventsConfig | None = None) -> int:
    """Serve one replica per port until ``stop`` is set (or SIGTERM/SIGINT); returns the exit status.
    ``fault_control``: serve ``/emulator/faults`` (bench/emulator/faults.py) on each replica, and
    ``/emulator/kv-events`` with events on. ``kv_events``: publish KV-cache events (bench/emulator/kv_publisher.py);
    the i-th port's replica on the configured ports + i."""
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    tasks: list[asyncio.Task] = []
    publishers: list[KVEventPublisher] = []

    def replica_died(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("replica_loop_failed", error=repr(task.exception()))
            stop.set()

    status = 0
    try:
        for i, port in enumerate(ports):
            model = make_engine(params)
            publisher = None
            if kv_events is not None and kv_events.enabled:
                model.enable_kv_events()
                publisher = KVEventPublisher(kv_events, host=host, offset=i)
                publishers.append(publisher)
                publisher.start()
                log.info("kv_events_publishing", replica=f"{host}:{port}", endpoint=publisher.endpoint,
                         replay_endpoint=publisher.replay_endpoint, topic=kv_events.topic)
            replica = Replica(model, name=f"{host}:{port}", log_requests=log_requests, kv_events=publisher)
            personality = PERSONALITIES[engine](replica, options=options)
            app = personality.build_app()
            _add_faults(app, personality, replica, fault_control)
            if fault_control and publisher is not None:
                add_kv_event_routes(app, publisher)
            # handler_cancellation: a client that disconnects cancels its handler, which cancels the request.
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=SHUTDOWN_TIMEOUT_S)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, port).start()
            task = asyncio.create_task(replica.run(), name=f"replica {host}:{port}")
            task.add_done_callback(replica_died)
            tasks.append(task)
        log.info("emulator_started", engine=engine, host=host, ports=ports, models=list(options.models),
                 time_scale=params.time_scale, max_num_seqs=params.max_num_seqs,
                 kv_cache_tokens=params.kv_cache_tokens, block_size=params.block_size)
        await stop.wait()
    except (OSError, zmq.ZMQError) as exc:  # a port in use
        log.error("emulator_bind_failed", error=str(exc))
        status = 1
    finally:
        # Stop accepting and let in-flight requests finish (bounded) while the replicas still run.
        await asyncio.gather(*(runner.cleanup() for runner in runners))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for publisher in publishers:
            await publisher.close()
        log.info("emulator_stopped", ports=ports)
    return status


def _add_faults(app: web.Application, personality: Personality, replica: Replica, fault_control: bool) -> None:
    """The fault middleware (first, so an injected error comes before the engine's own gates) and, with
    ``fault_control``, the route that switches the faults."""

    def error_response(status: int, message: str) -> web.Response:
        render = getattr(personality, "error_response", None)
        if render is None:
            return web.json_response({"error": message}, status=status)
        return render(ApiError(status, message, err_type="InternalServerError"))

    app.middlewares.insert(0, fault_middleware(replica.faults if fault_control else None, error_response))
    if fault_control:
        add_fault_routes(app, replica.faults)


#: Engine-specific PersonalityOptions fields -> the flag that sets them (refused for engines that ignore them).
_ENGINE_FLAGS = {"metrics": "--no-metrics", "embeddings": "--no-embeddings", "load_seconds": "--load-seconds",
                 "max_queue": "--max-queue",
                 "max_concurrent_requests": "--max-concurrent-requests"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `skylb emulator` (timing defaults: EngineParams, Llama-3.1-8B on one NVIDIA L4)."""
    d = EngineParams()
    logs.add_arguments(parser)
    parser.add_argument("--engine", choices=sorted(PERSONALITIES), default="vllm",
                        help="which engine's HTTP API, metrics and errors to speak (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, action="append", required=True, metavar="PORT",
                        help="TCP port of one replica; repeat for several independent replicas in this process")
    parser.add_argument("--model", action="append", default=None, metavar="NAME",
                        help="served model name (/v1/models id, Ollama tag, metrics label); repeat for a replica "
                             "serving several models in one batch; a request naming another model gets the "
                             "engine's 404 (default: meta-llama/Llama-3.1-8B-Instruct, for ollama llama3.1:8b)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help="multiplies every emulated duration; 0.01 runs 100x faster than an L4 "
                             "(default: %(default)s)")
    parser.add_argument("--max-num-seqs", "--parallel", dest="max_num_seqs", type=int, default=None,
                        help="running-batch slots: vLLM --max-num-seqs, SGLang --max-running-requests, llama.cpp "
                             "--parallel, Ollama OLLAMA_NUM_PARALLEL (requests; default: 256, llamacpp 4, "
                             "ollama 1)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget per iteration for decodes plus prefill chunks, vLLM "
                             f"--max-num-batched-tokens (tokens; default: max({d.max_num_batched_tokens}, "
                             "--max-num-seqs); 2048 is vLLM V1's default on GPUs under 70 GB)")
    parser.add_argument("--admission", choices=ADMISSIONS, default="vllm",
                        help="the scheduler model: vLLM V1's, or SGLang v0.4's (reserved-token admission, "
                             "retraction, radix cache; bench/emulator/sglang_model.py) (default: %(default)s)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help=f"KV cache capacity (tokens; default: {d.kv_cache_tokens} for vLLM admission = about "
                             "4.2 GB left on a 24 GB L4 after 16 GB of fp16 weights, at 128 KiB per Llama-3.1-8B "
                             "token; for SGLang admission the same from mem_fraction_static 0.88)")
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
    parser.add_argument("--no-scheduler-reserve-full-isl", dest="scheduler_reserve_full_isl",
                        action="store_false",
                        help="admit a waiting request when its first prefill chunk fits the free KV blocks, as vLLM "
                             "before vllm-project/vllm#37307 (2026); default: only when its whole prompt fits")
    parser.add_argument("--eos-max-tokens", type=int, default=d.eos_max_tokens,
                        help="without ignore_eos, a request stops after 1 + hash(prompt) %% min(max_tokens, this) "
                             "tokens (tokens; default: %(default)s)")
    parser.add_argument("--no-request-log", dest="log_requests", action="store_false",
                        help="do not write a JSON log line per finished or cancelled request")
    streaming = parser.add_argument_group("streaming fidelity (for testing relays)")
    streaming.add_argument("--sse-keepalive-ms", type=float, default=None, metavar="MS",
                           help="send ': keep-alive' SSE comment lines while a stream is idle this long (ms; "
                                "default: never)")
    streaming.add_argument("--fail-after-tokens", type=int, default=None, metavar="K",
                           help="fail every generation after K tokens: streamed, with the engine's mid-stream "
                                "error under HTTP 200 (vLLM 'data: {\"error\": ...}', llama.cpp 'error: {...}', "
                                "Ollama an {\"error\"} line); not streamed, HTTP 500 (default: never)")
    streaming.add_argument("--disable-endpoint", action="append", default=[], metavar="PATH",
                           help="do not serve PATH (404), as an engine version that lacks it (e.g. /v1/loads); "
                                "repeatable")
    streaming.add_argument("--fault-control", action="store_true",
                           help="serve PUT /emulator/faults to slow the replica down or make it answer errors at "
                                "run time (chaos benchmarks; default: off)")
    parser.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                        help="publish KV-cache events as vLLM does, with vLLM's own flag and JSON, e.g. "
                             '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                             '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (a * host binds --host; '
                             "the i-th --port's replica uses the ports + i; --admission vllm only)")
    engine = parser.add_argument_group("engine-specific")
    engine.add_argument("--no-metrics", dest="metrics", action="store_false",
                        help="sglang, llamacpp: serve as if started without --enable-metrics / --metrics "
                             "(SGLang /metrics 404, llama.cpp /metrics 501)")
    engine.add_argument("--no-embeddings", dest="embeddings", action="store_false",
                        help="llamacpp: serve as if started without --embeddings (/v1/embeddings answers 501)")
    engine.add_argument("--load-seconds", type=float, default=None, metavar="S",
                        help="llamacpp: answer 503 'Loading model' for S seconds after start (default: 0)")
    engine.add_argument("--max-queue", type=int, default=None, metavar="N",
                        help="ollama: OLLAMA_MAX_QUEUE, pending requests beyond N get 503 'server busy' "
                             "(default: 512)")
    engine.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                        help="tgi: in-flight requests beyond N get 429 'Model is overloaded' (default: 128)")
    lc = LifecycleOptions()
    engine.add_argument("--ollama-load-s", type=float, default=None, metavar="S",
                        help="ollama: seconds a model takes to load on first use or after eviction (real seconds, "
                             f"not scaled by --time-scale; default: {lc.load_s})")
    engine.add_argument("--ollama-model-bytes", type=int, default=None, metavar="BYTES",
                        help=f"ollama: memory of a loaded model (bytes; default: {lc.model_bytes}, an 8B Q4_K_M)")
    engine.add_argument("--ollama-model-size", action="append", default=[], metavar="NAME=BYTES",
                        help="ollama: one model's own memory (bytes); repeatable")
    engine.add_argument("--ollama-model-load-s", action="append", default=[], metavar="NAME=S",
                        help="ollama: one model's own load time (s); repeatable")
    engine.add_argument("--ollama-memory-bytes", type=int, default=None, metavar="BYTES",
                        help="ollama: the replica's memory for loaded models; idle models are evicted, least "
                             "recently used first, to fit a new one (bytes; default: unlimited)")
    engine.add_argument("--ollama-max-loaded-models", type=int, default=None, metavar="N",
                        help=f"ollama: OLLAMA_MAX_LOADED_MODELS (default: {lc.max_loaded})")
    engine.add_argument("--ollama-keep-alive", default=None, metavar="DURATION",
                        help="ollama: OLLAMA_KEEP_ALIVE, how long a model stays loaded after its last request when "
                             "the request gives no keep_alive ('5m', '30s', seconds; negative: forever; default: 5m)")
    engine.add_argument("--ollama-pull-s", type=float, default=None, metavar="S",
                        help=f"ollama: how long /api/pull and /api/create take (s; default: {lc.pull_s})")


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def params_from_args(args: argparse.Namespace) -> EngineParams:
    """EngineParams from parsed flags (slots default per engine); raises ValueError on inconsistent values."""
    seqs = args.max_num_seqs
    if seqs is None:
        seqs = PERSONALITIES[getattr(args, "engine", "vllm")].default_max_num_seqs
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = max(EngineParams.max_num_batched_tokens, seqs)
    return EngineParams(
        max_num_seqs=seqs, max_num_batched_tokens=batched, kv_cache_tokens=args.kv_cache_tokens,
        block_size=args.block_size, max_model_len=args.max_model_len,
        prefill_ms_per_token=args.prefill_ms_per_token, decode_base_ms=args.decode_base_ms,
        decode_ms_per_seq=args.decode_ms_per_seq, decode_ms_per_kv_token=args.decode_ms_per_kv_token,
        eos_max_tokens=args.eos_max_tokens, time_scale=args.time_scale,
        scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
        admission=getattr(args, "admission", "vllm"))


def options_from_args(args: argparse.Namespace) -> PersonalityOptions:
    """PersonalityOptions from parsed flags; ValueError for bad values or a flag the engine does not honour."""
    personality = PERSONALITIES[args.engine]
    given = {"metrics": not args.metrics, "embeddings": not args.embeddings, "load_seconds": args.load_seconds is not None,
             "max_queue": args.max_queue is not None,
             "max_concurrent_requests": args.max_concurrent_requests is not None}
    for field_name, is_given in given.items():
        if is_given and field_name not in personality.engine_flags:
            raise ValueError(f"{_ENGINE_FLAGS[field_name]} does not apply to --engine {args.engine}")
    at_least = {"--sse-keepalive-ms": (args.sse_keepalive_ms, 0.001), "--load-seconds": (args.load_seconds, 0),
                "--fail-after-tokens": (args.fail_after_tokens, 0), "--max-queue": (args.max_queue, 0),
                "--max-concurrent-requests": (args.max_concurrent_requests, 1)}
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    models = tuple(dict.fromkeys(args.model or [personality.default_model]))  # repeated names count once
    ollama = _lifecycle_options(args)
    return PersonalityOptions(
        ollama=ollama,
        models=models, sse_keepalive_ms=args.sse_keepalive_ms, fail_after_tokens=args.fail_after_tokens,
        load_seconds=args.load_seconds or 0.0, metrics=args.metrics, embeddings=args.embeddings,
        disabled_paths=frozenset(args.disable_endpoint), max_queue=args.max_queue,
        max_concurrent_requests=args.max_concurrent_requests)


def _pairs(values: list[str], flag: str, kind: type) -> tuple:
    out = []
    for value in values:
        name, sep, number = value.rpartition("=")
        try:
            parsed = kind(number)
        except ValueError:
            parsed = None
        if not sep or not name or parsed is None or parsed < 0:
            raise ValueError(f"{flag} wants NAME=NUMBER (not negative), got {value!r}")
        out.append((name, parsed))
    return tuple(out)


def _lifecycle_options(args: argparse.Namespace) -> LifecycleOptions | None:
    """LifecycleOptions from the --ollama-* flags (None when none is given); ValueError for bad values or when the
    engine is not ollama."""
    flags = {"--ollama-load-s": args.ollama_load_s, "--ollama-model-bytes": args.ollama_model_bytes,
             "--ollama-model-size": args.ollama_model_size or None,
             "--ollama-model-load-s": args.ollama_model_load_s or None,
             "--ollama-memory-bytes": args.ollama_memory_bytes,
             "--ollama-max-loaded-models": args.ollama_max_loaded_models,
             "--ollama-keep-alive": args.ollama_keep_alive, "--ollama-pull-s": args.ollama_pull_s}
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return None
    if args.engine != "ollama":
        raise ValueError(f"{given[0]} does not apply to --engine {args.engine}")
    d = LifecycleOptions()
    for flag in ("--ollama-load-s", "--ollama-model-bytes", "--ollama-memory-bytes", "--ollama-pull-s"):
        if flags[flag] is not None and flags[flag] < 0:
            raise ValueError(f"{flag} must not be negative, got {flags[flag]}")
    if args.ollama_max_loaded_models is not None and args.ollama_max_loaded_models < 1:
        raise ValueError(f"--ollama-max-loaded-models must be at least 1, got {args.ollama_max_loaded_models}")
    keep = d.keep_alive_s if args.ollama_keep_alive is None else parse_keep_alive(args.ollama_keep_alive)
    return LifecycleOptions(
        load_s=d.load_s if args.ollama_load_s is None else args.ollama_load_s,
        model_bytes=d.model_bytes if args.ollama_model_bytes is None else args.ollama_model_bytes,
        sizes=_pairs(args.ollama_model_size, "--ollama-model-size", int),
        load_times=_pairs(args.ollama_model_load_s, "--ollama-model-load-s", float),
        memory_bytes=args.ollama_memory_bytes,
        max_loaded=d.max_loaded if args.ollama_max_loaded_models is None else args.ollama_max_loaded_models,
        keep_alive_s=keep, pull_s=d.pull_s if args.ollama_pull_s is None else args.ollama_pull_s)


def main(args: argparse.Namespace) -> int:
    """Run `skylb emulator`; returns the exit status (2 for bad flags)."""
    try:
        params = params_from_args(args)
        options = options_from_args(args)
    except ValueError as exc:
        print(f"skylb emulator: {exc}", file=sys.stderr)
        return 2
    kv_events = getattr(args, "kv_events_config", None)
    if kv_events is not None and kv_events.enabled and params.admission != "vllm":
        print("skylb emulator: --kv-events-config needs --admission vllm (the SGLang model publishes none)",
              file=sys.stderr)
        return 2
    bad = [p for p in args.port if not 0 < p < 65536]
    if bad or len(set(args.port)) != len(args.port):
        print(f"skylb emulator: --port values must be distinct and in 1-65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        configure_logging(level=args.log_level)
    except ValueError as exc:  # $SKYLB_LOG_LEVEL names no level
        print(f"skylb emulator: {exc}", file=sys.stderr)
        return 2
    return aio.run(serve(engine=args.engine, host=args.host, ports=args.port, params=params, options=options,
                             log_requests=args.log_requests, fault_control=args.fault_control, kv_events=kv_events))
