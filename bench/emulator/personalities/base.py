"""What every personality shares: the registry, the options, client errors, and one request's token stream.

A *personality* is everything one engine's clients see (routes, request parsing, response and error shapes,
metrics) in front of one emulated replica (:class:`bench.emulator.server.Replica`, which owns the timing).
Personalities register themselves with ``class X(Personality, name="engine")``; `skylb emulator --engine NAME`
picks one.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, ClassVar

import structlog
from aiohttp import web

from bench.emulator.model import TokenOutput

if TYPE_CHECKING:  # the server imports this package; importing it back at run time would be circular
    from bench.emulator.server import Replica

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDING_DIM",
    "PERSONALITIES",
    "ApiError",
    "Generation",
    "Personality",
    "PersonalityOptions",
    "embed",
    "token_ids",
]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: Dimension of the emulator's deterministic embedding vectors (all-MiniLM-L6-v2's, a common small embedder).
EMBEDDING_DIM = 384

log = structlog.get_logger("bench.emulator")

#: engine name -> Personality subclass (filled by ``Personality.__init_subclass__``).
PERSONALITIES: dict[str, type["Personality"]] = {}


@dataclass(frozen=True)
class PersonalityOptions:
    """The flags a personality reads (see ``skylb emulator --help``); engine-specific ones are None when unset.

    Attributes:
        models: served model names, the first is the default (a replica may serve several: one batch for all).
        sse_keepalive_ms: emit ``: keep-alive`` SSE comment lines when a stream is idle this long (ms).
        fail_after_tokens: end every generation with an error after this many tokens (streamed: an error chunk
            under HTTP 200, the engine's own way; not streamed: HTTP 500 in the dialect's error shape).
        load_seconds: llama.cpp only: answer 503 "Loading model" for this long after start (s).
        metrics: False serves as if metrics were not enabled (SGLang without ``--enable-metrics``: /metrics 404;
            llama.cpp without ``--metrics``: /metrics 501).
        embeddings: llama.cpp only: False answers /v1/embeddings 501 "This server does not support embeddings.
            Start it with `--embeddings`", as llama-server started without ``--embeddings``.
        disabled_paths: routes not served (404), as on an engine version that lacks them (e.g. SGLang's
            /v1/loads before it existed).
        max_queue: Ollama only: ``OLLAMA_MAX_QUEUE``, pending requests beyond it get 503 (requests).
        max_concurrent_requests: TGI only: ``--max-concurrent-requests``, in-flight requests beyond it get 429.
        ollama: Ollama only: the model lifecycle options (bench/emulator/ollama_lifecycle.py ``LifecycleOptions``:
            load times, model sizes, memory, keep_alive); None: the defaults.
    """

    models: tuple[str, ...] = (DEFAULT_MODEL,)
    sse_keepalive_ms: float | None = None
    fail_after_tokens: int | None = None
    load_seconds: float = 0.0
    metrics: bool = True
    embeddings: bool = True
    disabled_paths: frozenset[str] = field(default_factory=frozenset)
    max_queue: int | None = None
    max_concurrent_requests: int | None = None
    ollama: Any = None

    @property
    def model(self) -> str:
        """The default (first) served model name."""
        return self.models[0]


class ApiError(Exception):
    """A client-visible error; each personality renders it in its engine's error shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


class Generation:
    """One request inside a replica: submit on creation, iterate its tokens, ``close()`` to release it.

    ``close()`` cancels the request in the engine when it has not finished (a client went away), so its slot and
    KV blocks free at once. Raises the model's ValueError (e.g. RequestTooLong) from the constructor.
    """

    def __init__(self, replica: "Replica", prompt_tokens: list[str], max_tokens: int | None, *, ignore_eos: bool,
                 prefix: str = "req"):
        self.replica = replica
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.received_at = time.monotonic()
        self._queue = replica.submit(self.request_id, prompt_tokens, max_tokens, ignore_eos=ignore_eos)
        self._getter: asyncio.Future | None = None

    async def next_token(self, *, idle_s: float | None = None,
                         on_idle: Callable[[], Awaitable[None]] | None = None) -> TokenOutput:
        """The next token; while none comes for ``idle_s`` seconds, await ``on_idle()`` (keep-alives) and go on.

        One pending ``queue.get()`` is kept across idle periods, so a token that arrives as the idle timer fires
        is never lost (``asyncio.wait_for`` on a queue can drop one when it cancels).
        """
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._queue.get())
        while True:
            done, _ = await asyncio.wait({self._getter}, timeout=idle_s)
            if done:
                out = self._getter.result()
                self._getter = None
                return out
            if on_idle is not None:
                await on_idle()

    async def tokens(self) -> AsyncIterator[TokenOutput]:
        """Every token of the request, the last one carrying ``finished``."""
        while True:
            out = await self.next_token()
            yield out
            if out.finished is not None:
                return

    def close(self) -> None:
        """Release the request (cancel it in the engine if still there); idempotent."""
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
        self.replica.release(self.request_id)


@web.middleware
async def _log_trace_context(request: web.Request, handler):
    """Log a ``trace_context`` line (path, ``traceparent``, ``tracestate``, ``X-Request-Id``) for each request that
    carries a W3C ``traceparent``, as an engine with tracing on continues it (vLLM's ``--otlp-traces-endpoint``
    reads these headers), so a test sees which trace context reached the replica."""
    traceparent = request.headers.get("traceparent")
    if traceparent is not None:
        log.info("trace_context", path=request.path, traceparent=traceparent,
                 tracestate=request.headers.get("tracestate"), request_id=request.headers.get("X-Request-Id"))
    return await handler(request)


class Personality:
    """What one engine's clients see. Subclasses register with ``class X(Personality, name="engine")``.

    Class attributes a subclass sets: ``default_model`` (served name when no ``--model``), ``default_max_num_seqs``
    (running slots when no ``--max-num-seqs``/``--parallel``) and ``engine_flags`` (the engine-specific option
    names of :class:`PersonalityOptions` it honours; `skylb emulator` refuses the others).
    """

    name: ClassVar[str]
    default_model: ClassVar[str] = DEFAULT_MODEL
    default_max_num_seqs: ClassVar[int] = 256
    engine_flags: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:  # shared bases (the OpenAI serving layer) register nothing
            cls.name = name
            PERSONALITIES[name] = cls

    def __init__(self, replica: "Replica", *, options: PersonalityOptions):
        self.replica = replica
        self.options = options
        self.created = int(time.time())
        self.started_at = time.monotonic()

    @property
    def model_name(self) -> str:
        """The default served model name."""
        return self.options.model

    def build_app(self) -> web.Application:
        """The aiohttp application serving this replica (``routes`` plus ``middlewares``; with the request log on,
        first a middleware that logs each request's W3C trace context)."""
        middlewares = [*([_log_trace_context] if self.replica.log_requests else []), *self.middlewares()]
        app = web.Application(client_max_size=64 * 1024 * 1024,  # long trace prompts are megabytes of words
                              middlewares=middlewares)
        self.routes(app)
        return app

    def routes(self, app: web.Application) -> None:
        """Register the engine's routes with ``self.add(app, method, path, handler)``."""
        raise NotImplementedError

    def middlewares(self) -> list:
        """aiohttp middlewares (llama.cpp's loading gate); none by default."""
        return []

    def add(self, app: web.Application, method: str, path: str, handler: Callable) -> None:
        """Register one route unless ``--disable-endpoint`` names its path (then aiohttp answers 404)."""
        if path not in self.options.disabled_paths:
            app.router.add_route(method, path, handler)

    def start(self, prompt_tokens: list[str], max_tokens: int | None, *, ignore_eos: bool,
              prefix: str = "req") -> Generation:
        """Submit a request to the replica; the model's ValueError (too long) becomes a 400 ApiError."""
        try:
            return Generation(self.replica, prompt_tokens, max_tokens, ignore_eos=ignore_eos, prefix=prefix)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    def should_fail(self, index: int) -> bool:
        """Whether ``--fail-after-tokens`` says the token at 0-based ``index`` must not be sent (an error instead)."""
        k = self.options.fail_after_tokens
        return k is not None and index >= k


def embed(text: str, dim: int = EMBEDDING_DIM) -> list[float]:
    """A deterministic unit vector for ``text``: a hashed bag of its words (signed feature hashing), L2-normed.

    Equal texts give equal vectors and texts sharing words point in similar directions; an empty text gives the
    zero vector. Cheap (one blake2b per word); no model is involved.
    """
    vec = [0.0] * dim
    for word in text.split():
        h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
        vec[h % dim] += 1.0 if (h >> 32) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vec))
    return [v / norm for v in vec] if norm else vec


def token_ids(words: list[str]) -> list[int]:
    """Stable fake token ids for words (0 .. 31999): what Ollama's ``context`` field carries."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % 32000 for w in words]
