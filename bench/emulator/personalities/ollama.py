"""Ollama's server: its native API (/api/*, NDJSON streaming) and its OpenAI-compatible /v1/*; NO load metric.

Sources (ollama/ollama): ``server/routes.go`` (``GET``/``HEAD /`` answer "Ollama is running"; ``/api/version``,
``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/generate``, ``/api/chat``, ``/api/embed``, ``/api/embeddings``
and the /v1 routes; ``streamResponse`` writes ``application/x-ndjson``, one JSON object per line, and an error
after the stream started as a ``{"error": "..."}`` line; ``stream`` defaults to true; an empty prompt (or no
messages) just loads the model: ``done_reason`` "load", or "unload" with ``keep_alive: 0``; ``handleScheduleError``:
404 ``model "x" not found, try pulling it first``, 503 for ``ErrMaxQueue`` "server busy, please try again.
maximum pending requests exceeded"; ``/api/show`` answers 404 ``model 'x' not found``), ``api/types.go``
(durations in nanoseconds: ``total_duration``, ``load_duration``, ``prompt_eval_duration``, ``eval_duration``;
counts ``prompt_eval_count``, ``eval_count``; generate's ``context``), ``openai/openai.go`` (/v1 errors are
``{"error": {"message", "type", "param": null, "code": null}}`` with type invalid_request_error 400,
not_found_error 404, api_error otherwise); ``envconfig`` (``OLLAMA_NUM_PARALLEL`` default 1,
``OLLAMA_MAX_QUEUE`` default 512); shared/reference/engines.md.

Newer Ollama releases word the up-front check of /api/generate and /api/chat as ``model 'x' not found``; the
emulator uses the ``try pulling it first`` wording of ``handleScheduleError`` for every inference route. A name
without a tag means ``:latest`` and names match case-insensitively, as Ollama resolves them. ``options.num_predict``
caps the output (negative: no cap); ``options.ignore_eos`` (an emulator extra, ignored by real Ollama) makes a
request generate exactly ``num_predict`` tokens. The deprecated ``context`` request field is ignored.

Model lifecycle (bench/emulator/ollama_lifecycle.py, Ollama's documented behaviour): models start on disk, not
loaded; a native request (``/api/generate``, ``/api/chat``, ``/api/embed``, ``/api/embeddings``) for a model not
loaded waits its load time (``load_duration`` says how long), evicting idle models least recently used first when
memory is short; ``keep_alive`` per request; ``/api/ps`` lists the loaded models. The ``/v1/*`` routes do not go
through the lifecycle. Model management: ``/api/pull`` (any name pulls: the emulator has no registry; streamed
progress lines as Ollama's), ``DELETE /api/delete``, ``/api/copy``, ``/api/create`` (``from`` a local model).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any, AsyncIterator

import structlog
from aiohttp import web

from bench.emulator.model import FinishedRequest, chat_tokens, text_tokens
from bench.emulator.ollama_lifecycle import LifecycleOptions, OutOfMemory, parse_keep_alive
from bench.emulator.personalities.base import ApiError, Generation, embed, token_ids
from bench.emulator.personalities.openai import OpenAIServing

__all__ = ["OllamaPersonality", "OLLAMA_VERSION", "QUEUE_FULL"]

log = structlog.get_logger("bench.emulator")

#: The Ollama release this personality follows.
OLLAMA_VERSION = "0.12.6"
DEFAULT_MAX_QUEUE = 512
QUEUE_FULL = "server busy, please try again.  maximum pending requests exceeded"
_SIZE = 4_920_734_720  # bytes of an 8B Q4_K_M GGUF
_DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": "8.0B", "quantization_level": "Q4_K_M"}


def canonical(name: str) -> str:
    """Ollama's matching form of a model name: lower case, ``:latest`` when no tag is given."""
    last = name.rsplit("/", 1)[-1]
    return (name if ":" in last else f"{name}:latest").lower()


def not_found(name: str) -> str:
    """Ollama's 404 message for an unknown model on an inference route."""
    return f'model "{name}" not found, try pulling it first'


def _now() -> str:
    """RFC 3339 UTC time, as Ollama's ``created_at``."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


class OllamaPersonality(OpenAIServing, name="ollama"):
    """Ollama in front of the replica; ``--parallel`` is ``OLLAMA_NUM_PARALLEL`` (default 1)."""

    default_model = "llama3.1:8b"
    default_max_num_seqs = 1
    engine_flags = frozenset({"max_queue"})
    owned_by = "library"
    done_after_error = False

    def __init__(self, replica, *, options):
        super().__init__(replica, options=options)
        self._served = {canonical(m): m for m in options.models}
        self._modified_at = _now()
        self.fleet: LifecycleOptions = options.ollama or LifecycleOptions()
        #: Models on disk and loaded (pure; driven with time.monotonic()).
        self.lifecycle = self.fleet.lifecycle(options.models)

    @property
    def max_queue(self) -> int:
        """Pending requests admitted before 503 (``OLLAMA_MAX_QUEUE``)."""
        return DEFAULT_MAX_QUEUE if self.options.max_queue is None else self.options.max_queue

    def routes(self, app: web.Application) -> None:
        """Ollama's native and OpenAI-compatible routes."""
        self.add(app, "GET", "/", self.root)
        self.add(app, "HEAD", "/", self.root)
        self.add(app, "GET", "/api/version", self.version)
        self.add(app, "GET", "/api/tags", self.tags)
        self.add(app, "GET", "/api/ps", self.ps)
        self.add(app, "POST", "/api/show", self.show)
        self.add(app, "POST", "/api/generate", self.generate)
        self.add(app, "POST", "/api/chat", self.chat)
        self.add(app, "POST", "/api/embed", self.embed)
        self.add(app, "POST", "/api/embeddings", self.embeddings_legacy)
        self.add(app, "POST", "/api/pull", self.pull)
        self.add(app, "DELETE", "/api/delete", self.delete)
        self.add(app, "POST", "/api/copy", self.copy)
        self.add(app, "POST", "/api/create", self.create)
        self.openai_routes(app)

    # ---- OpenAI layer hooks (/v1/*) ---------------------------------------------------------------------------

    def error_response(self, err: ApiError) -> web.Response:
        """/v1 errors: OpenAI's nested shape with Ollama's types, param and code null."""
        err_type = {400: "invalid_request_error", 404: "not_found_error"}.get(err.status, "api_error")
        return web.json_response({"error": {"message": err.message, "type": err_type, "param": None,
                                            "code": None}}, status=err.status)

    def stream_error(self, err: ApiError) -> bytes:
        body = {"error": {"message": err.message, "type": "api_error", "param": None, "code": None}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def resolve_model(self, requested: str | None) -> str:
        """The request's name when served (``:latest`` implied, any case); 400 when missing, 404 when unknown."""
        if not requested:
            raise ApiError(400, "model is required")
        if canonical(requested) not in self._served:
            raise ApiError(404, not_found(requested))
        return requested

    def check_admission(self) -> None:
        """503 when ``OLLAMA_MAX_QUEUE`` requests are already pending."""
        if self.replica.model.num_waiting >= self.max_queue:
            raise ApiError(503, QUEUE_FULL)

    def failure(self) -> ApiError:
        k = self.options.fail_after_tokens
        return ApiError(500, f"emulated runner failure after {k} tokens (--fail-after-tokens {k})")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": self.owned_by}

    def usage(self, fin: FinishedRequest) -> dict[str, Any]:
        return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                "total_tokens": fin.prompt_tokens + fin.completion_tokens}

    def chat_choice(self, text: str, reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}

    def completion_choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "finish_reason": reason}

    def delta_choice(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": reason}

    def response_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": "fp_ollama"}

    def chunk_fields(self) -> dict[str, Any]:
        return {"system_fingerprint": "fp_ollama"}

    # ---- native errors ----------------------------------------------------------------------------------------

    @staticmethod
    def native_error(err: ApiError) -> web.Response:
        """``{"error": "message"}``."""
        return web.json_response({"error": err.message}, status=err.status)

    # ---- metadata ---------------------------------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        """``GET``/``HEAD /``: the liveness text."""
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        """``GET /api/version``."""
        return web.json_response({"version": OLLAMA_VERSION})

    def _entry(self, name: str) -> dict[str, Any]:
        spec = self.lifecycle.disk.get(name)
        return {"name": name, "model": name, "size": spec.size_bytes if spec else _SIZE,
                "digest": hashlib.sha256(name.encode()).hexdigest(), "details": dict(_DETAILS)}

    async def tags(self, request: web.Request) -> web.Response:
        """``GET /api/tags``: the models on disk."""
        return web.json_response({"models": [{**self._entry(n), "modified_at": self._modified_at}
                                             for n in self.lifecycle.disk]})

    async def ps(self, request: web.Request) -> web.Response:
        """``GET /api/ps``: loaded models (fully on the GPU: ``size_vram`` = ``size``), most recently used first,
        with ``expires_at`` (RFC 3339) from their keep_alive."""
        mono, wall = time.monotonic(), datetime.now(timezone.utc)
        models = []
        for m, at in self.lifecycle.ps(mono):
            expires = (wall + timedelta(seconds=at - mono)).isoformat().replace("+00:00", "Z")
            models.append({**self._entry(m.name), "expires_at": expires, "size_vram": m.spec.size_bytes,
                           "context_length": m.num_ctx})
        return web.json_response({"models": models})

    async def _served_name(self, request: web.Request) -> str:
        """The served model a request body names (``model``, or the deprecated ``name``); ApiError 400 when it names
        none, 404 (Ollama's ``model 'x' not found``) when it is not served here."""
        body = _body(await request.read())
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        if canonical(name) not in self._served:
            raise ApiError(404, f"model '{name}' not found")
        return name

    async def show(self, request: web.Request) -> web.Response:
        """``POST /api/show`` ``{"model"}`` (or the deprecated ``{"name"}``): model details."""
        try:
            name = await self._served_name(request)
        except ApiError as err:
            return self.native_error(err)
        served = self._served[canonical(name)]
        modelfile = (f'# Modelfile generated by "ollama show"\n# To build a new Modelfile based on this, replace '
                     f'FROM with:\n# FROM {served}\n\nFROM {served}\nTEMPLATE "{{{{ .Prompt }}}}"\n')
        return web.json_response({
            "license": "", "modelfile": modelfile, "parameters": "", "template": "{{ .Prompt }}",
            "details": dict(_DETAILS),
            "model_info": {"general.architecture": "llama", "general.parameter_count": 8_030_261_248,
                           "llama.context_length": self.replica.model.params.model_len,
                           "llama.embedding_length": 4096},
            "capabilities": ["completion"], "modified_at": self._modified_at})

    # ---- embeddings -------------------------------------------------------------------------------------------

    async def embed(self, request: web.Request) -> web.Response:
        """``POST /api/embed``: ``input`` a string or a list of strings -> ``embeddings`` (unit vectors)."""
        try:
            body = _body(await request.read())
            model = self._model(body)
            value = body.get("input")
            if isinstance(value, str):
                texts = [value] if value else []
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                texts = value
            elif value is None:
                texts = []
            else:
                raise ApiError(400, "invalid input type")
            dims = body.get("dimensions")
            if dims is not None and (type(dims) is not int or dims < 0):
                raise ApiError(400, "dimensions must be a non-negative integer")
            keep = self._keep_alive(body)
            async with self._loaded(model, keep) as load_s:
                vectors = [_truncate(embed(t), dims) for t in texts]
        except ApiError as err:
            return self.native_error(err)
        return web.json_response({"model": model, "embeddings": vectors, "total_duration": _ns(load_s),
                                  "load_duration": _ns(load_s),
                                  "prompt_eval_count": sum(len(t.split()) for t in texts)})

    async def embeddings_legacy(self, request: web.Request) -> web.Response:
        """``POST /api/embeddings``: ``prompt`` -> ``embedding`` (an empty prompt just loads the model)."""
        try:
            body = _body(await request.read())
            model = self._model(body)
            prompt = body.get("prompt") or ""
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string")
            async with self._loaded(model, self._keep_alive(body)):
                pass
        except ApiError as err:
            return self.native_error(err)
        return web.json_response({"embedding": embed(prompt) if prompt else []})

    def _keep_alive(self, body: dict) -> float | None:
        """The request's ``keep_alive`` in seconds (None: forever); 400 when malformed."""
        try:
            return parse_keep_alive(body.get("keep_alive"), self.fleet.keep_alive_s)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    @contextlib.asynccontextmanager
    async def _loaded(self, model: str, keep_alive_s: float | None, body: dict | None = None) -> AsyncIterator[float]:
        """Hold ``model`` loaded for one request: load it first when needed, or reload it when the request's
        ``options.num_ctx`` differs (waiting the load time; yields the seconds waited), release it with the
        request's keep_alive at the end. 500 when it does not fit memory, 400 for a bad num_ctx."""
        name = self._served[canonical(model)]
        options = (body or {}).get("options")
        num_ctx = options.get("num_ctx") if isinstance(options, dict) else None
        if num_ctx is not None and (type(num_ctx) is not int or num_ctx < 1):
            raise ApiError(400, "num_ctx must be a positive integer")
        now = time.monotonic()
        loads = self.lifecycle.loads
        try:
            ready = self.lifecycle.acquire(name, now, num_ctx)
        except OutOfMemory as exc:
            raise ApiError(500, str(exc)) from exc
        if self.lifecycle.loads != loads:
            log.info("model_load", replica=self.replica.name, model=name, num_ctx=self.lifecycle.loaded[name].num_ctx,
                     load_ms=round((ready - now) * 1000, 1))
        try:
            if ready > now:
                await asyncio.sleep(ready - now)
            yield ready - now
        finally:
            self.lifecycle.release(name, time.monotonic(), keep_alive_s)

    def _model(self, body: dict) -> str:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        if canonical(name) not in self._served:
            raise ApiError(404, not_found(name))
        return name

    # ---- model management -------------------------------------------------------------------------------------

    def _add_model(self, name: str) -> None:
        """Put ``name`` on disk (default size and load time unless the flags give its own)."""
        self._served[canonical(name)] = name
        self.lifecycle.disk[name] = self.fleet.spec(name)

    def _remove_model(self, name: str) -> None:
        served = self._served.pop(canonical(name))
        self.lifecycle.unload(served)
        self.lifecycle.loaded.pop(served, None)
        self.lifecycle.disk.pop(served, None)

    async def _status_lines(self, request: web.Request, body: dict, lines: list[dict],
                            done: Any) -> web.StreamResponse:
        """Progress as Ollama sends it: NDJSON status lines (``stream`` default true), or the last one alone;
        ``done()`` runs just before the final ``success`` line (the change takes effect then)."""
        if body.get("stream") is False:
            await asyncio.sleep(self.fleet.pull_s)
            done()
            return web.json_response(lines[-1])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        pause = self.fleet.pull_s / max(1, len(lines) - 1)
        for i, line in enumerate(lines):
            if i:
                await asyncio.sleep(pause)
            if i == len(lines) - 1:
                done()
            await resp.write(json.dumps(line).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def pull(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/pull`` ``{"model", "stream"}``: download a model (any name: no registry here), streaming
        Ollama's progress lines (``pulling manifest``, ``pulling <digest>`` with ``total``/``completed`` bytes,
        ``verifying sha256 digest``, ``writing manifest``, ``success``); the model is on disk once it succeeded."""
        try:
            body = _body(await request.read())
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "model is required")
        except ApiError as err:
            return self.native_error(err)
        name = self._served.get(canonical(name), name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest")
        size = self.fleet.spec(name).size_bytes
        digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
        lines: list[dict] = [{"status": "pulling manifest"}]
        lines += [{"status": f"pulling {digest[7:19]}", "digest": digest, "total": size,
                   "completed": size * k // 4} for k in range(1, 5)]
        lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}]
        return await self._status_lines(request, body, lines, lambda: self._add_model(name))

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /api/delete`` ``{"model"}``: 200 with an empty body, 404 ``model 'x' not found``."""
        try:
            name = await self._served_name(request)
        except ApiError as err:
            return self.native_error(err)
        self._remove_model(name)
        return web.Response(status=200)

    async def copy(self, request: web.Request) -> web.Response:
        """``POST /api/copy`` ``{"source", "destination"}``: 200 with an empty body, 404 when the source is not
        on disk."""
        try:
            body = _body(await request.read())
            source, dest = body.get("source"), body.get("destination")
            if not isinstance(source, str) or not source or not isinstance(dest, str) or not dest:
                raise ApiError(400, "source and destination are required")
            if canonical(source) not in self._served:
                raise ApiError(404, f"model '{source}' not found")
        except ApiError as err:
            return self.native_error(err)
        self._add_model(dest if ":" in dest.rsplit("/", 1)[-1] else f"{dest}:latest")
        return web.Response(status=200)

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/create`` ``{"model", "from", "system", "stream", ...}``: a new model from a local one,
        streaming Ollama's status lines (``reading model metadata`` ... ``success``); 404 when ``from`` is not on
        disk (real Ollama would pull it)."""
        try:
            body = _body(await request.read())
            name, base = body.get("model"), body.get("from")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "model is required")
            if not isinstance(base, str) or not base:
                raise ApiError(400, "neither 'from' or 'files' was specified")
            if canonical(base) not in self._served:
                raise ApiError(404, f"model '{base}' not found")
        except ApiError as err:
            return self.native_error(err)
        name = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
        digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
        lines = [{"status": "reading model metadata"}, {"status": "creating system layer"},
                 {"status": f"using already created layer {digest}"}, {"status": "writing manifest"},
                 {"status": "success"}]
        return await self._status_lines(request, body, lines, lambda: self._add_model(name))

    # ---- generation -------------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/generate`` (``prompt``, ``system``, ``raw``, ``options``, ``stream`` default true)."""
        try:
            body = _body(await request.read())
            model = self._model(body)
            prompt = _str(body, "prompt")
            system = _str(body, "system")
            if not prompt:
                return await self._load_answer(body, model, chat=False)
            if body.get("raw") is True:
                tokens = text_tokens(prompt)
            else:  # Ollama renders a generate request through the chat template, as a user message
                tokens = chat_tokens(([("system", system)] if system else []) + [("user", prompt)])
        except ApiError as err:
            return self.native_error(err)
        return await self._run(request, body, model, tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/chat`` (``messages``, ``options``, ``stream`` default true)."""
        try:
            body = _body(await request.read())
            model = self._model(body)
            messages = body.get("messages") or []
            if not isinstance(messages, list):
                raise ApiError(400, "messages must be a list")
            if not messages:
                return await self._load_answer(body, model, chat=True)
            pairs = []
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ApiError(400, "each message needs a string role")
                content = m.get("content") or ""
                if not isinstance(content, str):
                    raise ApiError(400, "message content must be a string")
                pairs.append((m["role"], content))
            tokens = chat_tokens(pairs)
        except ApiError as err:
            return self.native_error(err)
        return await self._run(request, body, model, tokens, chat=True)

    async def _load_answer(self, body: dict, model: str, *, chat: bool) -> web.Response:
        """An empty prompt loads the model and sets its keep_alive (``keep_alive: 0`` unloads it instead, unless
        requests use it): one JSON object once loaded."""
        keep = self._keep_alive(body)
        if keep == 0:
            self.lifecycle.unload(self._served[canonical(model)])
            reason = "unload"
        else:
            async with self._loaded(model, keep, body):
                reason = "load"
        piece = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return web.json_response({"model": model, "created_at": _now(), **piece, "done": True,
                                  "done_reason": reason})

    async def _run(self, request: web.Request, body: dict, model: str, tokens: list[str], *,
                   chat: bool) -> web.StreamResponse:
        try:
            options = body.get("options") or {}
            if not isinstance(options, dict):
                raise ApiError(400, "options must be an object")
            num_predict = options.get("num_predict")
            if num_predict is not None and type(num_predict) is not int:
                raise ApiError(400, "num_predict must be an integer")
            max_tokens = num_predict if num_predict is not None and num_predict > 0 else None
            stream = body.get("stream")
            stream = True if stream is None else bool(stream)
            keep = self._keep_alive(body)
            self.check_admission()
            async with self._loaded(model, keep, body) as load_s:
                gen = self.start(tokens, max_tokens,
                                 ignore_eos=bool(options.get("ignore_eos")) and bool(max_tokens), prefix="ollama")
                try:
                    if stream:
                        return await self._stream_ndjson(request, gen, model, tokens, chat=chat, load_s=load_s)
                    return await self._collect_native(gen, model, tokens, chat=chat, load_s=load_s)
                finally:
                    gen.close()  # also runs when the client went away: the request leaves the engine at once
        except ApiError as err:
            return self.native_error(err)

    def _piece(self, text: str, *, chat: bool) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}} if chat else {"response": text}

    def _final(self, gen: Generation, model: str, tokens: list[str], words: list[str], fin: FinishedRequest, *,
               text: str, chat: bool, load_s: float = 0.0) -> dict[str, Any]:
        """The ``done: true`` object: durations (ns) from the request's real timeline in the emulated engine
        (``load_s``: the model's load time this request waited, s)."""
        final = {"model": model, "created_at": _now(), **self._piece(text, chat=chat), "done": True,
                 "done_reason": fin.finish_reason,
                 "total_duration": _ns(fin.finished_at - gen.received_at + load_s), "load_duration": _ns(load_s),
                 "prompt_eval_count": fin.prompt_tokens - fin.cached_tokens,
                 "prompt_eval_duration": _ns(fin.first_token_at - fin.admitted_at),
                 "eval_count": fin.completion_tokens, "eval_duration": _ns(fin.finished_at - fin.first_token_at)}
        if not chat:  # generate's conversation state: the ids of the prompt and the reply
            final["context"] = token_ids(tokens + words)
        return final

    async def _collect_native(self, gen: Generation, model: str, tokens: list[str], *,
                              chat: bool, load_s: float = 0.0) -> web.Response:
        words: list[str] = []
        async for out in gen.tokens():
            if self.should_fail(out.index):
                return self.native_error(self.failure())
            words.append(out.text)
        return web.json_response(self._final(gen, model, tokens, words, out.finished, text=" ".join(words),
                                             chat=chat, load_s=load_s))

    async def _stream_ndjson(self, request: web.Request, gen: Generation, model: str, tokens: list[str], *,
                             chat: bool, load_s: float = 0.0) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        words: list[str] = []
        try:
            async for out in gen.tokens():
                if self.should_fail(out.index):
                    await resp.write(json.dumps({"error": self.failure().message}).encode() + b"\n")
                    break
                words.append(out.text)
                text = out.text if out.index == 0 else " " + out.text  # pieces concatenate to the full text
                line = {"model": model, "created_at": _now(), **self._piece(text, chat=chat), "done": False}
                await resp.write(json.dumps(line).encode() + b"\n")
                if out.finished is not None:
                    final = self._final(gen, model, tokens, words, out.finished, text="", chat=chat,
                                        load_s=load_s)
                    await resp.write(json.dumps(final).encode() + b"\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away: _run's finally cancels the request
        return resp


def _body(raw: bytes) -> dict:
    if not raw.strip():
        raise ApiError(400, "missing request body")
    try:
        body = json.loads(raw)
    except RecursionError:  # Go's decoder stops at 10,000 levels with this error; Python's recursion first
        raise ApiError(400, "exceeded max depth") from None
    except ValueError as exc:
        raise ApiError(400, f"invalid character in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _str(body: dict, key: str) -> str:
    value = body.get(key) or ""
    if not isinstance(value, str):
        raise ApiError(400, f"{key} must be a string")
    return value


def _truncate(vec: list[float], dims: int | None) -> list[float]:
    """Ollama's ``dimensions``: keep the first ``dims`` components and re-normalise."""
    if not dims or dims >= len(vec):
        return vec
    head = vec[:dims]
    norm = sum(v * v for v in head) ** 0.5
    return [v / norm for v in head] if norm else head
