"""The OpenAI-compatible API every engine serves (/v1/completions, /v1/chat/completions, /v1/models,
/v1/embeddings), with hooks for what differs per engine: error shape, model-name rules, usage and extra fields,
how a mid-stream error is written.

The defaults are vLLM's (``vllm/entrypoints/openai``: response fields, the "model does not exist" and
context-length messages, ``data: {"error": ...}`` then ``data: [DONE]`` for a failure after the stream started).
Source for the wire format: shared/reference/engines.md, "OpenAI-compatible API, as a balancer sees it".

Tools (chat only): with ``tools`` and ``tool_choice`` "required" or a named function, the answer is one call of
that function (the first tool for "required"); with ``tool_choice`` "auto" or absent, the emulated model calls the
first tool unless the conversation's last message is a tool result, which it answers in text; "none" never calls.
The call's ``arguments`` are a JSON object with each property of the function's ``parameters`` schema
(:func:`example_arguments`). The shapes are vLLM's (``vllm/entrypoints/openai/serving_chat.py``): ``content`` null,
``tool_calls`` ``[{"id": "chatcmpl-tool-...", "type": "function", "function": {"name", "arguments"}}]``,
``finish_reason`` "tool_calls"; streamed, the first tool-call delta carries the id, type and name with empty
arguments, and the arguments follow in pieces, one per generated token.

Not emulated: ``n`` > 1 (400), ``stop`` sequences, ``logprobs`` (always null), ``echo``, images.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from aiohttp import web

from bench.emulator.model import FinishedRequest, chat_tokens, text_tokens
from bench.emulator.personalities.base import ApiError, Generation, Personality, embed

__all__ = ["OpenAIServing", "GenerateRequest", "parse_generate", "chat_prompt", "completion_prompt"]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions body.

    ``model`` is the name responses carry; ``max_tokens`` None means up to the model length (or a simulated EOS).
    """

    model: str
    prompt_tokens: list[str]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    #: The function this answer calls (a chat request's ``tools`` entry's ``function``), or None for text.
    tool: dict | None = None


class OpenAIServing(Personality):
    """The OpenAI-compatible routes on top of a replica; subclasses are the engines (vLLM's shapes by default)."""

    #: ``owned_by`` of /v1/models cards.
    owned_by: ClassVar[str] = "vllm"

    # ---- hooks ------------------------------------------------------------------------------------------------

    def error_response(self, err: ApiError) -> web.Response:
        """The engine's error body for ``err`` (vLLM: nested, code = HTTP status)."""
        body = {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.status}}
        return web.json_response(body, status=err.status)

    def resolve_model(self, requested: str | None) -> str:
        """The served model a request names (None: the default); 404 for another name (vLLM's message)."""
        if requested is None:
            return self.model_name
        if requested not in self.options.models:
            raise ApiError(404, f"The model `{requested}` does not exist.", err_type="NotFoundError", param="model")
        return requested

    def model_card(self, name: str) -> dict[str, Any]:
        """One entry of ``GET /v1/models`` (vLLM's card)."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": self.owned_by, "root": name,
                "parent": None, "max_model_len": self.replica.model.params.model_len, "permission": []}

    def usage(self, fin: FinishedRequest) -> dict[str, Any]:
        """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (vLLM, llama.cpp, OpenAI itself)."""
        return {"prompt_tokens": fin.prompt_tokens, "total_tokens": fin.prompt_tokens + fin.completion_tokens,
                "completion_tokens": fin.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}

    def chat_choice(self, text: str, reason: str) -> dict[str, Any]:
        """A non-streamed chat choice."""
        return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": [],
                                        "reasoning_content": None},
                "logprobs": None, "finish_reason": reason, "stop_reason": None}

    def completion_choice(self, text: str, reason: str | None) -> dict[str, Any]:
        """A completion choice (streamed chunks use it too, with ``reason`` None until the last)."""
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}

    def delta_choice(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        """A streamed chat choice."""
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def final_fields(self, gen: Generation, fin: FinishedRequest) -> dict[str, Any]:
        """Extra top-level fields of the last response object (llama.cpp's ``timings``); none by default."""
        return {}

    def response_fields(self) -> dict[str, Any]:
        """Extra top-level fields of every response object (vLLM: ``system_fingerprint``: null)."""
        return {"system_fingerprint": None}

    def chunk_fields(self) -> dict[str, Any]:
        """Extra top-level fields of every streamed chunk; none by default (vLLM)."""
        return {}

    def check_admission(self) -> None:
        """Raise an ApiError to refuse a request before it reaches the engine (TGI's overload); accept by default."""

    def failure(self) -> ApiError:
        """The error ``--fail-after-tokens`` injects."""
        k = self.options.fail_after_tokens
        return ApiError(500, f"emulated engine failure after {k} tokens (--fail-after-tokens {k})",
                        err_type="InternalServerError")

    def stream_error(self, err: ApiError) -> bytes:
        """A mid-stream error under HTTP 200 (vLLM: ``data: {"error": {...}}``, then the stream's ``[DONE]``)."""
        body = {"error": {"message": err.message, "type": err.err_type, "param": err.param, "code": err.status}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    #: Whether ``data: [DONE]`` still follows a mid-stream error (vLLM and SGLang: yes; llama.cpp: no).
    done_after_error: ClassVar[bool] = True

    # ---- routes -----------------------------------------------------------------------------------------------

    def openai_routes(self, app: web.Application) -> None:
        """Register the OpenAI-compatible routes."""
        self.add(app, "POST", "/v1/completions", self.completions)
        self.add(app, "POST", "/v1/chat/completions", self.chat_completions)
        self.add(app, "GET", "/v1/models", self.models)
        self.add(app, "POST", "/v1/embeddings", self.embeddings)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: every served model."""
        return web.json_response({"object": "list", "data": [self.model_card(m) for m in self.options.models]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (``prompt``: a string, a one-string list, or token ids)."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (``messages``: role and text content)."""
        return await self._generate(request, chat=True)

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings: ``input`` a string or a list of strings (or token ids); deterministic vectors.

        ``encoding_format`` "float" (the default) gives lists of numbers, "base64" each vector's float32 values,
        little-endian, base64-encoded, as vLLM does (``encoding_pooling_output`` in vllm/entrypoints/openai) and as
        the official openai client asks by default; another value is a 400. Embeddings do not go through the
        continuous-batching model: they are cheap and do not hold decode slots.
        """
        try:
            body = _json_body(await request.read())
            model = self.resolve_model(_optional_str(body, "model"))
            texts = _embedding_inputs(body.get("input"))
            encoding = _optional_str(body, "encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise ApiError(400, "`encoding_format` must be 'float' or 'base64'.", param="encoding_format")
        except ApiError as err:
            return self.error_response(err)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(embed(t), encoding)}
                for i, t in enumerate(texts)]
        n = sum(len(t.split()) for t in texts)
        return web.json_response({"object": "list", "data": data, "model": model,
                                  "usage": {"prompt_tokens": n, "total_tokens": n}})

    # ---- generation -------------------------------------------------------------------------------------------

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            parsed = parse_generate(await request.read(), chat=chat, resolve_model=self.resolve_model)
            self.check_admission()
            gen = self.start(parsed.prompt_tokens, parsed.max_tokens, ignore_eos=parsed.ignore_eos,
                             prefix="chatcmpl" if chat else "cmpl")
        except ApiError as err:
            return self.error_response(err)
        try:
            if parsed.stream:
                return await self._stream(request, gen, parsed, chat=chat)
            return await self._collect(gen, parsed, chat=chat)
        finally:
            # Runs on normal completion and when the handler is cancelled (client disconnect): a request still
            # in the model is cancelled there, so its slot and blocks free at once.
            gen.close()

    async def _collect(self, gen: Generation, parsed: GenerateRequest, *, chat: bool) -> web.Response:
        words: list[str] = []
        async for out in gen.tokens():
            if self.should_fail(out.index):
                return self.error_response(self.failure())
            words.append(out.text)
        fin = out.finished
        text = " ".join(words)
        if parsed.tool is not None:
            choice = self.chat_choice("", "tool_calls")
            call = _tool_call(gen.request_id, parsed.tool)
            choice["message"].update(content=None, tool_calls=[{**call, "function": {
                **call["function"], "arguments": "".join(_argument_pieces(parsed.tool, 1))}}])
        elif chat:
            choice = self.chat_choice(text, fin.finish_reason)
        else:
            choice = self.completion_choice(text, fin.finish_reason)
        body = {"id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": parsed.model, "choices": [choice], "usage": self.usage(fin),
                **self.response_fields(), **self.final_fields(gen, fin)}
        return web.json_response(body)

    async def _stream(self, request: web.Request, gen: Generation, parsed: GenerateRequest, *,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        keepalive_ms = self.options.sse_keepalive_ms
        idle_s = keepalive_ms / 1000 if keepalive_ms else None

        async def keepalive() -> None:
            await resp.write(b": keep-alive\n\n")  # an SSE comment: clients and relays must ignore it

        async def send(choices: list[dict], **extra: Any) -> None:
            chunk = {"id": gen.request_id, "object": obj, "created": created, "model": parsed.model,
                     "choices": choices, **self.chunk_fields(), **extra}
            # One write per chunk: aiohttp sends it at once (chunked transfer), so tokens stream as produced.
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        pieces = iter(_argument_pieces(parsed.tool, parsed.max_tokens)) if parsed.tool is not None else None
        try:
            if chat:
                await send([self.delta_choice({"role": "assistant", "content": ""}, None)])
            if pieces is not None:
                await send([self.delta_choice({"tool_calls": [{"index": 0, **_tool_call(gen.request_id,
                                                                                       parsed.tool)}]}, None)])
            while True:
                out = await gen.next_token(idle_s=idle_s, on_idle=keepalive)
                if self.should_fail(out.index):
                    await resp.write(self.stream_error(self.failure()))
                    if self.done_after_error:
                        await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
                text = out.text if out.index == 0 else " " + out.text  # chunks concatenate to the full text
                fin = out.finished
                reason = fin.finish_reason if fin is not None else None
                extra = self.final_fields(gen, fin) if fin is not None and not parsed.include_usage else {}
                if pieces is not None:
                    # The last token carries whatever of the arguments is left, so a short answer is still whole.
                    piece = "".join(pieces) if fin is not None else next(pieces, "")
                    delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                    choice = self.delta_choice(delta, None if fin is None else "tool_calls")
                elif chat:
                    choice = self.delta_choice({"content": text}, reason)
                else:
                    choice = self.completion_choice(text, reason)
                await send([choice], **extra)
                if fin is not None:
                    break
            if parsed.include_usage:
                await send([], usage=self.usage(fin), **self.final_fields(gen, fin))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream: _generate's finally cancels the request; nothing to log
        return resp


# ---- request parsing ----------------------------------------------------------------------------------------------

def parse_generate(raw: bytes, *, chat: bool, resolve_model: Callable[[str | None], str]) -> GenerateRequest:
    """Validate a body the way vLLM's pydantic models do, for the fields the emulator uses; raises ApiError."""
    body = _json_body(raw)
    model = resolve_model(_optional_str(body, "model"))
    tokens = chat_prompt(body) if chat else completion_prompt(body)
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
    stream = optional_bool(body, "stream")
    ignore_eos = optional_bool(body, "ignore_eos")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "`stream_options` must be an object.", param="stream_options")
    if options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = optional_bool(options or {}, "include_usage")
    return GenerateRequest(model=model, prompt_tokens=tokens, max_tokens=max_tokens, stream=stream,
                           include_usage=include_usage, ignore_eos=ignore_eos,
                           tool=_called_tool(body) if chat else None)


def _called_tool(body: dict) -> dict | None:
    """The function a chat request's answer calls (module docstring), or None; ApiError 400 for malformed
    ``tools`` or ``tool_choice`` (vLLM's messages where it has them)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ApiError(400, "`tools` must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                       param="tools")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise ApiError(400, f"Tool choice {name!r} names no function of `tools`.", param="tool_choice")
        return functions[name]
    if choice not in ("auto", "required", "none"):
        raise ApiError(400, "`tool_choice` must be 'none', 'auto', 'required' or a named function.",
                       param="tool_choice")
    if not functions or choice == "none":
        return None
    if choice == "required":
        return next(iter(functions.values()))
    messages = body.get("messages") or [{}]
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    return None if last.get("role") == "tool" else next(iter(functions.values()))


def example_arguments(schema: Any) -> Any:
    """A value of JSON-schema ``schema``, deterministic: an enum's first value, "emulated" for a string, 0, false,
    an empty list, and for an object every property in ``properties``."""
    if not isinstance(schema, dict):
        return {}
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        return {name: example_arguments(sub) for name, sub in props.items()}
    return {"string": "emulated", "integer": 0, "number": 0, "boolean": False, "array": []}.get(kind)


def _tool_call(request_id: str, function: dict) -> dict:
    """The head of a tool call (vLLM's id prefix), with empty arguments."""
    return {"id": f"chatcmpl-tool-{request_id.rsplit('-', 1)[-1]}", "type": "function",
            "function": {"name": function["name"], "arguments": ""}}


def _argument_pieces(function: dict, max_tokens: int | None) -> list[str]:
    """The call's arguments (JSON text) cut into at most ``max_tokens`` pieces (one per streamed token)."""
    text = json.dumps(example_arguments(function.get("parameters")))
    n = max(1, min(len(text), max_tokens or len(text)))
    size = -(-len(text) // n)
    return [text[i:i + size] for i in range(0, len(text), size)]


def parse_json_body(raw: bytes) -> dict:
    """A request body that must be a JSON object; ApiError 400 otherwise."""
    return _json_body(raw)


def _json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "Invalid JSON body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"`{key}` must be a string.", param=key)
    return value


def optional_bool(body: dict, key: str) -> bool:
    """``body[key]`` as a bool (absent or null: False); ApiError 400 for another type."""
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise ApiError(400, f"`{key}` must be a boolean, got {value!r}.", param=key)
    return value


def completion_prompt(body: dict) -> list[str]:
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


def chat_prompt(body: dict) -> list[str]:
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


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """``vector`` as the response carries it: the list itself ("float") or its float32 little-endian bytes in base64."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _embedding_inputs(value: Any) -> list[str]:
    """``input`` of an embeddings request as texts: a string, a list of strings, token ids, or lists of ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(type(v) is int for v in value):
            return [" ".join(map(str, value))]
        if all(isinstance(v, list) and all(type(t) is int for t in v) for v in value):
            return [" ".join(map(str, v)) for v in value]
    raise ApiError(400, "`input` must be a string, a list of strings, or token ids.", param="input")
