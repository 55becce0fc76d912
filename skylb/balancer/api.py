"""The OpenAI-compatible API as the balancer reads it: parse a request into routing fields, and error responses.

Only the fields routing needs are read (model, stream, the prompt text, the session key); the body is forwarded
unchanged so engine extras (vLLM ``ignore_eos``, llama.cpp ``cache_prompt``, ...) pass through.
Source: shared/reference/engines.md, "OpenAI-compatible API, as a balancer sees it".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

__all__ = ["ParsedRequest", "BadRequest", "parse_openai", "openai_error"]


class BadRequest(ValueError):
    """The client's request is invalid; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ParsedRequest:
    """The routing view of an OpenAI request: model, prompt text for the trie, session key, stream flag, body."""

    model: str
    text: str
    session_key: str | None
    stream: bool
    body: bytes


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text parts in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is None:
        return ""
    raise BadRequest("message content must be a string or a list of content parts", param="messages")


def parse_openai(path: str, body: bytes, *, session_header_value: str | None) -> ParsedRequest:
    """Parse a ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings`` body.

    The session key is the session header when present, else ``prompt_cache_key``, else ``user``.
    Raises BadRequest with a message naming the field for invalid JSON or missing / mistyped fields.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
        parts = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest("each message must be an object with a string 'role'", param="messages")
            parts.append(f"{m['role']}: {_content_text(m.get('content'))}\n")
        text = "".join(parts)
    else:
        field = "input" if path.endswith("/embeddings") else "prompt"
        prompt = data.get(field)
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
        elif isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            text = " ".join(map(str, prompt))  # token ids still share prefixes
        else:
            raise BadRequest(f"'{field}' is required and must be a string, a list of strings or token ids",
                             param=field)
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    key = session_header_value or data.get("prompt_cache_key") or data.get("user")
    return ParsedRequest(model=model, text=text, session_key=key if isinstance(key, str) else None,
                         stream=stream, body=body)


def openai_error(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                 headers: dict | None = None) -> web.Response:
    """A JSON error response in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)
