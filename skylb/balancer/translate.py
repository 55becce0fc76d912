"""Either API in front of either engine: an Ollama-API request for a model that only OpenAI-dialect replicas serve
(vLLM, SGLang, llama.cpp, TGI, any OpenAI-compatible server) is translated to the OpenAI API, and the answer turned
back into Ollama's shape (SSE chunks into Ollama's NDJSON stream, ending with its ``done`` object).

Requests (Ollama ``docs/api.md``; the OpenAI API reference, "Chat", "Completions", "Embeddings"):

* ``/api/chat`` -> ``/v1/chat/completions``; ``/api/generate`` -> ``/v1/chat/completions`` with the ``system`` and
  ``prompt`` as messages (Ollama applies the model's chat template to a prompt; the OpenAI server applies it to
  messages), or -> ``/v1/completions`` with ``raw: true`` (Ollama: "no formatting will be applied to the prompt");
  ``/api/embed`` and ``/api/embeddings`` -> ``/v1/embeddings``.
* ``options``: the inverse of Ollama's own OpenAI compatibility layer (``openai/openai.go``: ``max_tokens`` is
  ``num_predict``, and ``temperature``, ``top_p``, ``seed``, ``stop``, ``frequency_penalty``, ``presence_penalty``
  keep their names); ``top_k``, ``min_p`` and ``repeat_penalty`` (as ``repetition_penalty``) become the sampling
  extensions vLLM and SGLang read. Options that only tune Ollama's runner (``num_ctx``, ``num_gpu``, ``num_thread``,
  ...) do not change the answer and are dropped; sampling options with no OpenAI counterpart (``mirostat``,
  ``typical_p``, ...) set to anything but their neutral value, ``template``, ``suffix``, ``context`` and images in
  raw mode cannot be translated: :class:`Untranslatable`.
* ``format`` ("json" or a JSON schema) -> ``response_format``; ``images`` -> ``image_url`` content parts (data
  URLs); ``tools`` pass unchanged (the same shape); ``tool_calls`` of earlier turns get ids, and ``tool`` messages the
  id of the call they answer, in order.

Answers: content deltas become ``{"message": {"role": "assistant", "content": ...}, "done": false}`` lines (``response``
for generate), reasoning deltas (``reasoning_content``) Ollama's ``thinking``, streamed tool calls are gathered and
sent in one message, and ``data: [DONE]`` becomes the ``done`` object: ``done_reason`` (the finish reason),
``prompt_eval_count`` and ``eval_count`` (the ``usage`` asked for with ``stream_options.include_usage``),
``total_duration`` (ns, from the request's arrival at the balancer), ``eval_duration`` (ns, first to last token as
the balancer relayed them) and, where the engine reports its own (llama.cpp's ``timings``), ``prompt_eval_duration``
and ``eval_duration`` from the engine. ``load_duration`` is not known (OpenAI servers keep their model loaded) and is
left out, as Ollama's clients allow.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from skylb.balancer.framing import FramingError

__all__ = ["Translation", "StreamTranslator", "Untranslatable", "translate_request", "OPENAI_PATHS", "load_answer",
           "error_body"]

#: The OpenAI endpoint each Ollama endpoint is translated to (``/api/generate`` in raw mode: ``/v1/completions``).
OPENAI_PATHS = {"/api/chat": "/v1/chat/completions", "/api/generate": "/v1/chat/completions",
                "/api/embed": "/v1/embeddings", "/api/embeddings": "/v1/embeddings"}
#: Ollama option -> the OpenAI (or vLLM / SGLang extension) field it becomes.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
            "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "top_k": "top_k",
            "min_p": "min_p", "repeat_penalty": "repetition_penalty"}
#: Options of Ollama's runner (memory, threads, batching, context size): they do not change the answer.
_RUNNER_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread",
                             "numa", "low_vram", "vocab_only", "f16_kv", "logits_all", "num_keep"})
#: Sampling options without an OpenAI counterpart, with the value that turns each off (then it is dropped).
_NEUTRAL = {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "typical_p": 1.0, "tfs_z": 1.0,
            "repeat_last_n": None, "penalize_newline": None}
_SSE_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_IMAGE_TYPES = ((b"\x89PNG", "image/png"), (b"GIF8", "image/gif"), (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


class Untranslatable(ValueError):
    """The Ollama request has something the OpenAI API cannot express; ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


def _now_iso() -> str:
    """The wall clock as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Translation:
    """One Ollama request as an OpenAI request, and the way back.

    Attributes:
        endpoint: the Ollama path ("/api/chat", ...). path: the OpenAI path it is sent to. body: the OpenAI body,
        bytes. model: the served model name. arrived_at: the request's arrival on ``now``'s clock, s. now(): a
        monotonic clock, s (the balancer's event-loop time). think: the request's ``think`` (False hides thinking).
    """

    endpoint: str
    path: str
    body: bytes
    model: str
    arrived_at: float
    now: Callable[[], float] = time.monotonic
    think: Any = None

    @property
    def chat(self) -> bool:
        """True when answers carry a ``message`` (``/api/chat``), False for ``response`` (``/api/generate``)."""
        return self.endpoint == "/api/chat"

    def stream(self) -> "StreamTranslator":
        """A translator for one attempt's SSE stream (a retry starts a fresh one)."""
        return StreamTranslator(self)

    def answer(self, data: Any) -> bytes:
        """A whole OpenAI answer (decoded JSON) as the Ollama answer (bytes); an error object as Ollama's.
        Raises FramingError for an answer that is not in the OpenAI API's shape."""
        try:
            return self._answer(data)
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            raise FramingError(f"an answer not in the OpenAI API's shape ({type(exc).__name__}: {exc})") from None

    def _answer(self, data: Any) -> bytes:
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        if "error" in data:
            return error_body(data)
        if self.endpoint in ("/api/embed", "/api/embeddings"):
            return json.dumps(self._embeddings(data)).encode()
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        text = message.get("content") if message else choice.get("text")
        if text is not None and not isinstance(text, str):
            raise TypeError("the answer's text is not a string")
        out = self.delta(text or "", _reasoning(message), _tool_calls(message.get("tool_calls")))
        out.update(self.final(choice.get("finish_reason"), data.get("usage"), data.get("timings"), None))
        return json.dumps(out).encode()

    def _embeddings(self, data: dict) -> dict:
        vectors = [d.get("embedding") for d in sorted(data.get("data") or [], key=lambda d: d.get("index", 0))]
        if self.endpoint == "/api/embeddings":  # the older endpoint: one vector, nothing else
            return {"embedding": vectors[0] if vectors else []}
        out = {"model": self.model, "embeddings": vectors,
               "total_duration": _ns(self.now() - self.arrived_at)}
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        if isinstance(usage.get("prompt_tokens"), int):
            out["prompt_eval_count"] = usage["prompt_tokens"]
        return out

    def delta(self, text: str, thinking: str | None, tool_calls: list | None) -> dict:
        """An Ollama object carrying ``text`` (and thinking, tool calls), ``done`` false."""
        out: dict[str, Any] = {"model": self.model, "created_at": _now_iso()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking and self.think is not False:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking and self.think is not False:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def final(self, finish_reason: Any, usage: Any, timings: Any, eval_s: float | None) -> dict:
        """The fields of the ``done`` object (module docstring), ``eval_s`` the measured decode time, s."""
        out: dict[str, Any] = {"done": True, "done_reason": finish_reason if isinstance(finish_reason, str)
                               else "stop", "total_duration": _ns(self.now() - self.arrived_at)}
        usage = usage if isinstance(usage, dict) else {}
        for ours, theirs in (("prompt_eval_count", "prompt_tokens"), ("eval_count", "completion_tokens")):
            if type(usage.get(theirs)) is int:
                out[ours] = usage[theirs]
        if eval_s is not None:
            out["eval_duration"] = _ns(eval_s)
        timings = timings if isinstance(timings, dict) else {}  # llama.cpp's own, ms
        for ours, theirs in (("prompt_eval_duration", "prompt_ms"), ("eval_duration", "predicted_ms")):
            if type(timings.get(theirs)) in (int, float):
                out[ours] = _ns(timings[theirs] / 1000.0)
        return out


class StreamTranslator:
    """One attempt's OpenAI SSE stream into Ollama NDJSON: ``feed(events)`` takes whole SSE events (as the relay's
    framer cuts them) and returns the NDJSON lines they make (b"" for events with nothing to say)."""

    def __init__(self, translation: Translation):
        self.t = translation
        self.finish_reason: Any = None
        self.usage: Any = None
        self.timings: Any = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.calls: dict[int, dict[str, str]] = {}
        #: An error event went by: the stream ended there (vLLM still sends ``[DONE]`` after it).
        self.failed = False

    def feed(self, events: bytes) -> bytes:
        """The NDJSON lines for the whole SSE ``events`` (bytes). Raises FramingError for a chunk that is not in the
        OpenAI API's shape."""
        try:
            return self._feed(events)
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError) as exc:
            # RecursionError: JSON nested past Python's limit (json.loads raises it, not a ValueError)
            raise FramingError(f"a chunk not in the OpenAI API's shape ({type(exc).__name__}: {exc})") from None

    def _feed(self, events: bytes) -> bytes:
        out = []
        for event in _SSE_END.split(events):
            payload, error = _sse_payload(event)
            if error is not None:  # llama.cpp's "error:" line
                self.failed = True
                out.append({"error": error})
            elif payload is None:
                continue
            elif payload.strip() == b"[DONE]":
                out.extend(self._end())
            else:
                out.extend(self._chunk(json.loads(payload)))
        return b"".join(json.dumps(o).encode() + b"\n" for o in out)

    def _chunk(self, chunk: Any) -> list[dict]:
        if not isinstance(chunk, dict):
            return []
        if "error" in chunk:
            self.failed = True
            return [json.loads(error_body(chunk))]
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        out = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                raise TypeError("a choice is not an object")
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content") if delta else choice.get("text")
            if text is not None and not isinstance(text, str):
                raise TypeError("a chunk's text is not a string")
            thinking = _reasoning(delta)
            for call in delta.get("tool_calls") or []:
                self._gather(call)
            if text or thinking:
                now = self.t.now()
                self.first_token_at = self.first_token_at or now
                self.last_token_at = now
                out.append(self.t.delta(text or "", thinking, None))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _gather(self, call: Any) -> None:
        """A streamed tool call's fragment (OpenAI sends the name once, the arguments in pieces)."""
        if not isinstance(call, dict):
            return
        slot = self.calls.setdefault(call.get("index", len(self.calls)), {"name": "", "arguments": ""})
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def _end(self) -> list[dict]:
        if self.failed:
            return []
        out = []
        if self.calls:
            calls = [{"function": c} for _, c in sorted(self.calls.items())]
            out.append(self.t.delta("", None, _tool_calls(calls)))
        eval_s = (self.last_token_at - self.first_token_at) if self.first_token_at is not None else None
        final = self.t.delta("", None, None)
        final.update(self.t.final(self.finish_reason, self.usage, self.timings, eval_s))
        out.append(final)
        return out


def _sse_payload(event: bytes) -> tuple[bytes | None, str | None]:
    """(the data of one SSE event, or None; the text of an ``error:`` field, or None)."""
    data = []
    for line in event.splitlines():
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if name == b"error":
            return None, value.decode("utf-8", "replace")
        if name == b"data":
            data.append(value)
    return (b"\n".join(data) if data else None), None


def error_body(data: dict) -> bytes:
    """An OpenAI error object (``{"error": {"message": ...}}`` or ``{"error": "..."}``) as Ollama's ``{"error":
    "..."}``."""
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return json.dumps({"error": str(message or "the replica answered an error")}).encode()


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _reasoning(delta: dict) -> str | None:
    """Reasoning text (vLLM and SGLang ``reasoning_content``; newer vLLM ``reasoning``), or None."""
    value = delta.get("reasoning_content") or delta.get("reasoning")
    return value if isinstance(value, str) and value else None


def _tool_calls(calls: Any) -> list | None:
    """OpenAI tool calls as Ollama's: ``{"function": {"name", "arguments": {...}}}`` (arguments decoded)."""
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = {"_raw": arguments}  # the model wrote no JSON: keep what it wrote
        out.append({"function": {"name": function.get("name") or "", "arguments": arguments}})
    return out or None


def load_answer(endpoint: str, model: str) -> dict:
    """Ollama's answer to a request with nothing to generate (``docs/api.md``, "Load a model": an empty prompt or
    message list loads the model and answers at once, ``done_reason`` "load"); an OpenAI server always has its model
    loaded."""
    out: dict[str, Any] = {"model": model, "created_at": _now_iso()}
    if endpoint == "/api/chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason="load")
    return out


# ---- requests ------------------------------------------------------------------------------------------------------

def translate_request(endpoint: str, data: dict, *, model: str, arrived_at: float,
                      now: Callable[[], float] = time.monotonic) -> Translation | None:
    """The OpenAI request for the Ollama request ``data`` (decoded, already validated by the parse stage) at
    ``endpoint``, asking for ``model``; None when it asks only to load the model (``load_answer``).
    Raises Untranslatable naming what has no OpenAI counterpart."""
    if endpoint in ("/api/embed", "/api/embeddings"):
        return Translation(endpoint, OPENAI_PATHS[endpoint], json.dumps(_embed_body(endpoint, data, model)).encode(),
                           model, arrived_at, now)
    path = OPENAI_PATHS[endpoint]
    if endpoint == "/api/chat":
        if not data.get("messages"):
            return None
        body: dict[str, Any] = {"messages": _messages(data["messages"])}
    else:
        for name in ("template", "suffix", "context"):
            if data.get(name):
                raise Untranslatable(f"'{name}' has no OpenAI counterpart", param=name)
        if not data.get("prompt"):
            return None
        if data.get("raw"):
            if data.get("images"):
                raise Untranslatable("images in raw mode have no OpenAI counterpart", param="images")
            path, body = "/v1/completions", {"prompt": data["prompt"]}
        else:
            messages = [{"role": "system", "content": data["system"]}] if data.get("system") else []
            messages.append({"role": "user", "content": data["prompt"], "images": data.get("images")})
            body = {"messages": _messages(messages)}
    body.update(model=model, stream=bool(data.get("stream", True)))
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}  # the counts of the done object
    body.update(_options(data.get("options") or {}))
    body.update(_format(data.get("format")))
    if data.get("tools") and path.endswith("/chat/completions"):
        if not isinstance(data["tools"], list):
            raise Untranslatable("'tools' must be a list", param="tools")
        body["tools"] = data["tools"]
    return Translation(endpoint, path, json.dumps(body).encode(), model, arrived_at, now, data.get("think"))


def _embed_body(endpoint: str, data: dict, model: str) -> dict:
    body = {"model": model, "input": data.get("input", "") if endpoint == "/api/embed" else data.get("prompt", ""),
            "encoding_format": "float"}
    if isinstance(data.get("dimensions"), int) and not isinstance(data["dimensions"], bool):
        body["dimensions"] = data["dimensions"]
    return body


def _options(options: dict) -> dict:
    out = {}
    for name, value in options.items():
        if value is None or name in _RUNNER_OPTIONS:
            continue
        if name == "num_predict":
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                out["max_tokens"] = value  # -1 (no limit) and -2 (fill the context): the server's own limit
        elif name in _OPTIONS:
            out[_OPTIONS[name]] = value
        elif name in _NEUTRAL and value == _NEUTRAL[name]:
            continue
        else:
            raise Untranslatable(f"option '{name}' has no OpenAI counterpart", param=f"options.{name}")
    return out


def _format(fmt: Any) -> dict:
    if not fmt:
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}}
    raise Untranslatable("'format' must be \"json\" or a JSON schema", param="format")


def _messages(messages: list) -> list[dict]:
    """Ollama messages as OpenAI's: images as data-URL parts, tool calls with ids, tool results answering them."""
    out, call_ids, answered = [], [], 0
    for i, m in enumerate(messages):
        if not isinstance(m.get("content") or "", str):
            raise Untranslatable("a message's 'content' must be a string", param="messages")
        item: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("images"):
            if not isinstance(m["images"], list):
                raise Untranslatable("'images' must be a list of base64 texts", param="images")
            item["content"] = [{"type": "text", "text": item["content"]},
                               *({"type": "image_url", "image_url": {"url": _data_url(img)}} for img in m["images"])]
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in m["tool_calls"]):
                raise Untranslatable("'tool_calls' must be a list of {\"function\": {...}}", param="messages")
            call_ids = [f"call_{i}_{j}" for j in range(len(m["tool_calls"]))]
            answered = 0
            item["tool_calls"] = [{"id": cid, "type": "function", "function": {
                "name": c.get("function", {}).get("name", ""),
                "arguments": json.dumps(c.get("function", {}).get("arguments", {}))}}
                for cid, c in zip(call_ids, m["tool_calls"])]
        if m["role"] == "tool":
            if answered >= len(call_ids):
                raise Untranslatable("a 'tool' message answers no earlier tool call", param="messages")
            item["tool_call_id"] = call_ids[answered]
            answered += 1
        out.append(item)
    return out


def _data_url(image: Any) -> str:
    """An Ollama image (base64 text) as a data URL, its media type read from its first bytes (JPEG by default)."""
    if not isinstance(image, str):
        raise Untranslatable("each image must be base64 text", param="images")
    try:
        head = base64.b64decode(image[:16] + "=" * (-len(image[:16]) % 4))
    except ValueError:
        raise Untranslatable("an image is not base64", param="images") from None
    media = next((t for magic, t in _IMAGE_TYPES if head.startswith(magic)), "image/jpeg")
    return f"data:{media};base64,{image}"
