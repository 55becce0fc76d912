"""The APIs as the balancer reads them (OpenAI and Ollama): parse a request into routing fields; error responses.

Only the fields routing needs are read (model, stream, the prompt text, the session key); the body is forwarded
unchanged so engine extras (vLLM ``ignore_eos``, llama.cpp ``cache_prompt``, ...) pass through.
Source: the OpenAI API reference ("Chat", "Completions", "Embeddings", "Models", "Responses": ``input``, ``instructions``,
``max_output_tokens``, ``previous_response_id``, ``store``) and Ollama's "OpenAI compatibility" docs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from aiohttp import web

from skylb.balancer.protocol import MAX_MODEL_ID_CHARS

__all__ = ["ParsedRequest", "BadRequest", "parse_openai", "parse_ollama", "openai_error", "ollama_error",
           "error_response"]


class BadRequest(ValueError):
    """The client's request is invalid; ``param`` names the offending field when there is one, ``reason`` is the
    label of the rejected-requests metric (invalid_json, invalid_field)."""

    def __init__(self, message: str, *, param: str | None = None, reason: str = "invalid_field"):
        super().__init__(message)
        self.param = param
        self.reason = reason


@dataclass
class ParsedRequest:
    """The routing view of an OpenAI request: model, prompt text for the trie, session key, stream flag, body."""

    model: str
    text: str
    session_key: str | None
    stream: bool
    body: bytes
    #: The most output tokens the request may generate, as it says (OpenAI ``max_completion_tokens`` or
    #: ``max_tokens``, times ``n``; Ollama ``options.num_predict`` when positive); None when it does not say.
    max_tokens: int | None = None
    #: OpenAI Responses API only: the stored response this one continues (``previous_response_id``), and whether
    #: the answer is to be stored (``store``, default true as in OpenAI's API).
    previous_response_id: str | None = None
    store: bool = True


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _load_object(body: bytes) -> dict:
    # Strict JSON: NaN / Infinity literals and floats that overflow to inf are rejected (engines disagree on them).
    # Python's decoder raises ValueError for integers over 4300 digits and RecursionError for deep nesting.
    try:
        data = json.loads(body, parse_float=_finite_float, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8", reason="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", reason="invalid_json") from None
    except ValueError as exc:  # json.JSONDecodeError and the hooks' errors
        raise BadRequest(f"request body is not valid JSON: {exc}", reason="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object", reason="invalid_json")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if len(model) > MAX_MODEL_ID_CHARS:  # never served, and not echoed into errors and log lines at its length
        raise BadRequest(f"'model' is {len(model)} characters long: no replica's model id is longer than "
                         f"{MAX_MODEL_ID_CHARS}", param="model")
    return data


def _messages_text(messages) -> str:
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string 'role'", param="messages")
        parts.append(f"{m['role']}: {_content_text(m.get('content'))}\n")
    return "".join(parts)


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text parts in order (images etc. pass through)
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise BadRequest("each content part must be an object", param="messages")
            text = part.get("text")
            if part.get("type", "text") == "text" and not isinstance(text, str):
                raise BadRequest("a text content part needs a string 'text'", param="messages")
            if isinstance(text, str):
                texts.append(text)
        return "".join(texts)
    if content is None:
        return ""
    raise BadRequest("message content must be a string or a list of content parts", param="messages")


def _check_counts(data: dict, fields: tuple[str, ...]) -> None:
    """Counts the engines would reject anyway, rejected here before they take a place in the queue."""
    for field in fields:
        value = data.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"'{field}' must be a positive integer", param=field)


def parse_openai(path: str, body: bytes, *, session_header_value: str | None) -> ParsedRequest:
    """Parse a ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings`` body.

    The session key is the session header when present, else ``prompt_cache_key``, else ``user``.
    Raises BadRequest with a message naming the field for invalid JSON or missing / mistyped fields.
    """
    data = _load_object(body)
    model = data["model"]
    if path.endswith("/responses"):
        return _parse_responses(data, body, session_header_value)
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
        text = _messages_text(messages)
    else:
        field = "input" if path.endswith("/embeddings") else "prompt"
        prompt = data.get(field)
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
        elif isinstance(prompt, list) and all(_is_token_id(p) for p in prompt):
            text = " ".join(map(str, prompt))  # token ids still share prefixes
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            text = "\n".join(" ".join(map(str, p)) for p in prompt)  # a batch of token-id prompts
        else:
            raise BadRequest(f"'{field}' is required and must be a string, a list of strings or token ids",
                             param=field)
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    _check_counts(data, ("max_tokens", "max_completion_tokens", "n"))
    key = session_header_value or data.get("prompt_cache_key") or data.get("user")
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
    return ParsedRequest(model=model, text=text, session_key=key if isinstance(key, str) else None,
                         stream=stream, body=body,
                         max_tokens=None if max_tokens is None else max_tokens * (data.get("n") or 1))


def _parse_responses(data: dict, body: bytes, session_header_value: str | None) -> ParsedRequest:
    """A ``/v1/responses`` body: ``instructions`` then ``input`` (a string, or items: messages whose content is a
    string or text parts, tool outputs) as the prompt text; ``max_output_tokens``; ``previous_response_id`` (it must
    begin with ``resp``, as OpenAI checks); ``store``. Raises BadRequest naming the field."""
    instructions, items = data.get("instructions"), data.get("input")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    if isinstance(items, str):
        text = items
    elif isinstance(items, list) and items:
        text = "".join(_item_text(item) for item in items)
    else:
        raise BadRequest("'input' is required and must be a string or a non-empty list of items", param="input")
    previous = data.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous.startswith("resp")):
        raise BadRequest(f"Invalid 'previous_response_id': {previous!r}. Expected an ID that begins with 'resp'.",
                         param="previous_response_id")
    for field in ("stream", "store"):
        if not isinstance(data.get(field, False), bool):
            raise BadRequest(f"'{field}' must be a boolean", param=field)
    _check_counts(data, ("max_output_tokens",))
    key = session_header_value or data.get("prompt_cache_key") or data.get("user")
    return ParsedRequest(model=data["model"], text=f"{instructions}\n{text}" if instructions else text,
                         session_key=key if isinstance(key, str) else None, stream=data.get("stream", False),
                         body=body, max_tokens=data.get("max_output_tokens"), previous_response_id=previous,
                         store=data.get("store", True))


def _item_text(item) -> str:
    """One Responses API input item as prompt text: a message's role and text, a tool output's text."""
    if not isinstance(item, dict):
        raise BadRequest("each input item must be an object", param="input")
    if "role" in item:
        if not isinstance(item["role"], str):
            raise BadRequest("an input message needs a string 'role'", param="input")
        content = item.get("content")
        if isinstance(content, list):  # input_text / output_text parts; images and files pass through
            content = [{"type": "text", "text": p.get("text")} if isinstance(p, dict) and
                       str(p.get("type", "")).endswith("text") else p for p in content]
        return f"{item['role']}: {_content_text(content)}\n"
    output = item.get("output")
    return output if isinstance(output, str) else ""


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_ollama(path: str, body: bytes, *, session_header_value: str | None) -> ParsedRequest:
    """Parse an Ollama ``/api/generate``, ``/api/chat``, ``/api/embed`` or ``/api/embeddings`` body.

    ``stream`` defaults to true as in Ollama (embeddings never stream). An empty prompt or message list is valid
    (Ollama loads the model). Source: Ollama's API docs (``docs/api.md``, "Load a model").
    Raises BadRequest naming the field.
    """
    data = _load_object(body)
    if path.endswith("/chat"):
        messages = data.get("messages", [])
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list", param="messages")
        text = _messages_text(messages)
    elif path.endswith("/embed"):
        value = data.get("input", "")
        if isinstance(value, str):
            text = value
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            text = "\n".join(value)
        else:
            raise BadRequest("'input' must be a string or a list of strings", param="input")
    else:  # /api/generate, /api/embeddings
        prompt, system = data.get("prompt", ""), data.get("system", "")
        if not isinstance(prompt, str) or not isinstance(system, str):
            raise BadRequest("'prompt' and 'system' must be strings", param="prompt")
        text = f"{system}\n{prompt}" if system else prompt
    stream = data.get("stream", not path.endswith(("/embed", "/embeddings")))
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if not isinstance(data.get("options") or {}, dict):
        raise BadRequest("'options' must be an object", param="options")
    num_predict = (data.get("options") or {}).get("num_predict")  # -1: no limit, -2: fill the context
    return ParsedRequest(model=data["model"], text=text, session_key=session_header_value, stream=stream,
                         body=body, max_tokens=num_predict if isinstance(num_predict, int)
                         and not isinstance(num_predict, bool) and num_predict > 0 else None)


def ollama_error(status: int, message: str, *, headers: dict | None = None) -> web.Response:
    """A JSON error response in Ollama's shape ``{"error": "message"}``."""
    return web.json_response({"error": message}, status=status, headers=headers)


def error_response(api: str, status: int, message: str, *, type_: str | None = None,
                   param: str | None = None) -> web.Response:
    """An error in the shape of ``api`` ("openai" or "ollama")."""
    if api == "ollama":
        return ollama_error(status, message)
    return openai_error(status, message, type_=type_, param=param)


def openai_error(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                 headers: dict | None = None, code: str | None = None) -> web.Response:
    """A JSON error response in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; ``code`` is
    the HTTP status unless a string code is given (OpenAI's own, e.g. ``previous_response_not_found``)."""
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": type_, "param": param, "code": code or status}}
    return web.json_response(body, status=status, headers=headers)
