"""Re-framing of streamed answers: cut an upstream SSE or NDJSON byte stream into whole events, byte for byte.

Why the relay re-frames instead of passing chunks through as they come: a chunk boundary can fall inside an event,
and when the upstream then fails the relay must end the stream with an error event of its own; written after half an
event it would be spliced into that event and the client's parser would see garbage. So only whole events go to the
client, the tail waits for its end, and a failure drops the tail and appends a well-formed error event. The framer
also says whether the stream ended properly (SSE ``data: [DONE]``, an NDJSON object with ``"done": true``, an
error event of the engine's own, or the OpenAI Responses API's last event: ``response.completed``, ``.failed``,
``.incomplete`` or ``error``, after which vLLM sends no ``[DONE]``) and whether an event is garbage (not JSON), so a truncated or garbled stream is
reported to the client and counted against the replica instead of ending silently.
Sources: Ollama's API docs ("Streaming responses": NDJSON), the OpenAI API reference ("Streaming"), the WHATWG
HTML Standard §9.2 "Server-sent events" (field lines, blank line ends an event, lines starting with ``:`` are
comments).
"""

from __future__ import annotations

import json
import re

__all__ = ["StreamFramer", "FramingError", "MAX_EVENT_BYTES", "stream_kind"]

#: The longest event accepted (bytes); a "stream" that goes longer without an event end is not SSE / NDJSON.
MAX_EVENT_BYTES = 4 << 20
_SSE_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_SSE_FIELDS = frozenset({b"data", b"event", b"id", b"retry", b"error"})
#: The ``type`` of a Responses API event that ends its stream (OpenAI API reference, "Streaming events").
_LAST_RESPONSE_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})


class FramingError(ValueError):
    """The upstream stream is not well-formed SSE / NDJSON (an event that is not JSON, or one too long)."""


def stream_kind(content_type: str) -> str | None:
    """``"sse"`` for ``text/event-stream``, ``"ndjson"`` for ``application/x-ndjson``, else None."""
    media = content_type.split(";", 1)[0].strip().lower()
    return {"text/event-stream": "sse", "application/x-ndjson": "ndjson"}.get(media)


class StreamFramer:
    """Incremental framer for one streamed answer.

    Args:
        kind: "sse" or "ndjson". max_event_bytes: the longest event accepted (bytes).

    ``feed(chunk)`` returns the bytes of the events that chunk completed, unchanged and concatenated (b"" while an
    event is still open) and raises FramingError on garbage. ``finish()`` at the end of the upstream stream returns
    a last event that lacked only its terminator (b"" otherwise). ``done`` tells whether a terminal event went by.
    """

    def __init__(self, kind: str, *, max_event_bytes: int = MAX_EVENT_BYTES):
        if kind not in ("sse", "ndjson"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self.kind = kind
        self.max_event_bytes = max_event_bytes
        self.done = False
        self._tail = b""

    @property
    def pending(self) -> bytes:
        """The bytes of the event still open (not yet sent on)."""
        return self._tail

    def feed(self, chunk: bytes) -> bytes:
        """Add ``chunk``; return the whole events it completed (bytes unchanged). Raises FramingError."""
        if self.kind == "sse" and not self._tail and b"\r" not in chunk:
            # The usual chunk (vLLM, SGLang, llama.cpp): whole LF-terminated events, each one "data: {...}" line;
            # split once instead of searching event by event (the relay frames every token of every stream).
            *events, tail = chunk.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: ") and b"\n" not in event:
                    self._check_data(event[6:])
                else:
                    self._check_sse(event)
            if len(tail) > self.max_event_bytes:
                raise FramingError(f"an event is longer than {self.max_event_bytes} bytes")
            self._tail = tail
            return chunk[:len(chunk) - len(tail)]
        data = self._tail + chunk
        out_end = 0
        pos = 0
        while True:
            if self.kind == "sse":
                m = _SSE_END.search(data, pos)
                if m is None:
                    break
                self._check_sse(data[pos:m.start()])
                pos = m.end()
            else:
                nl = data.find(b"\n", pos)
                if nl < 0:
                    break
                self._check_ndjson(data[pos:nl])
                pos = nl + 1
            out_end = pos
        self._tail = data[out_end:]
        if len(self._tail) > self.max_event_bytes:
            raise FramingError(f"an event is longer than {self.max_event_bytes} bytes")
        return data[:out_end]

    def finish(self) -> bytes:
        """The stream ended: return the open event if it is whole but for its terminator; raises FramingError if it
        is garbage. Afterwards ``done`` says whether the stream ended properly."""
        tail, self._tail = self._tail, b""
        if not tail.strip():
            return b""
        if self.kind == "sse":
            self._check_sse(tail.rstrip(b"\r\n"))
        else:
            self._check_ndjson(tail)
        return tail

    def _check_sse(self, event: bytes) -> None:
        data_lines = []
        for line in event.splitlines():
            if not line or line.startswith(b":"):  # a comment (vLLM's ": keep-alive")
                continue
            field, _, value = line.partition(b":")
            if field not in _SSE_FIELDS:
                raise FramingError(f"not an SSE field: {line[:80]!r}")
            value = value[1:] if value.startswith(b" ") else value
            if field == b"error":  # llama.cpp's mid-stream error line: the engine ended the stream itself
                self.done = True
            elif field == b"data":
                data_lines.append(value)
        if data_lines:
            self._check_data(b"\n".join(data_lines))

    def _check_data(self, payload: bytes) -> None:
        """An SSE event's data: ``[DONE]`` or JSON (an error or a Responses API last event ends the stream)."""
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        obj = _json(payload, "SSE data")
        if isinstance(obj, dict) and _ends(obj):
            self.done = True

    def _check_ndjson(self, line: bytes) -> None:
        if not line.strip():
            return
        obj = _json(line, "NDJSON line")
        if not isinstance(obj, dict):
            raise FramingError("an NDJSON line is not a JSON object")
        if obj.get("done") is True or "error" in obj:
            self.done = True


def _ends(obj: dict) -> bool:
    """An SSE event's object ends its stream: an error, or a Responses API last event (a ``type`` that is no string is
    none, and is not looked up: a list there is unhashable)."""
    if "error" in obj:
        return True
    kind = obj.get("type")
    return type(kind) is str and kind in _LAST_RESPONSE_EVENTS


def _json(payload: bytes, what: str):
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FramingError(f"{what} is not JSON: {payload[:80]!r}") from None
