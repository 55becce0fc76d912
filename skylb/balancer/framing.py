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
from typing import Callable

__all__ = ["StreamFramer", "FramingError", "MAX_EVENT_BYTES", "stream_kind"]

#: The longest event accepted (bytes); a "stream" that goes longer without an event end is not SSE / NDJSON.
MAX_EVENT_BYTES = 4 << 20
_SSE_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_SSE_FIELDS = frozenset({b"data", b"event", b"id", b"retry", b"error"})
#: The ``type`` of a Responses API event that ends its stream (OpenAI API reference, "Streaming events").
_LAST_RESPONSE_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
#: json.loads' decoder (its defaults), for events decoded without json.loads' per-call checks (``_object_alone``).
_DECODER = json.JSONDecoder()


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
        on_object: called with the JSON object (a dict) of every event ``feed`` or ``finish`` passes on, in stream
            order, once all the events they return are checked (so never with one of a chunk that held garbage); the
            relay's usage tap reads token counts from them instead of decoding the events a second time.

    ``feed(chunk)`` returns the bytes of the events that chunk completed, unchanged and concatenated (b"" while an
    event is still open) and raises FramingError on garbage. ``finish()`` at the end of the upstream stream returns
    a last event that lacked only its terminator (b"" otherwise). ``done`` tells whether a terminal event went by.
    """

    def __init__(self, kind: str, *, max_event_bytes: int = MAX_EVENT_BYTES,
                 on_object: Callable[[dict], None] | None = None):
        if kind not in ("sse", "ndjson"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self.kind = kind
        self.max_event_bytes = max_event_bytes
        self.on_object = on_object
        self.done = False
        self._tail = b""

    @property
    def pending(self) -> bytes:
        """The bytes of the event still open (not yet sent on)."""
        return self._tail

    def feed(self, chunk: bytes) -> bytes:
        """Add ``chunk``; return the whole events it completed (bytes unchanged). Raises FramingError."""
        if (self.kind == "sse" and not self._tail and chunk.startswith(b"data: {")
                and chunk.find(b"\n") == len(chunk) - 2 and chunk[-1] == 10 and b"\r" not in chunk):
            # The usual chunk of all: one token's event, "data: {...}" and its blank line; no split, no list.
            obj = _object_alone(chunk, 6, 2)
            if obj is not None:
                self._seen(obj)
                if self.on_object is not None:
                    self.on_object(obj)
                return chunk
        objects = []
        if self.kind == "sse" and not self._tail and b"\r" not in chunk:
            # Then (vLLM, SGLang, llama.cpp): whole LF-terminated events, each one "data: {...}" line; split once
            # instead of searching event by event (the relay frames every token of every stream).
            *events, tail = chunk.split(b"\n\n")
            for event in events:
                if b"\n" in event:
                    obj = self._check_sse(event)
                elif event.startswith(b"data: {"):
                    obj = _object_alone(event, 6)
                    obj = self._check_data(event[6:]) if obj is None else self._seen(obj)
                elif event.startswith(b"data: "):
                    obj = self._check_data(event[6:])
                else:
                    obj = self._check_sse(event)
                if obj is not None:
                    objects.append(obj)
            if len(tail) > self.max_event_bytes:
                raise FramingError(f"an event is longer than {self.max_event_bytes} bytes")
            self._tail = tail
            if objects and self.on_object is not None:
                for obj in objects:
                    self.on_object(obj)
            return chunk[:len(chunk) - len(tail)]
        data = self._tail + chunk
        out_end = 0
        pos = 0
        while True:
            if self.kind == "sse":
                m = _SSE_END.search(data, pos)
                if m is None:
                    break
                obj = self._check_sse(data[pos:m.start()])
                pos = m.end()
            else:
                nl = data.find(b"\n", pos)
                if nl < 0:
                    break
                obj = self._check_ndjson(data[pos:nl])
                pos = nl + 1
            if obj is not None:
                objects.append(obj)
            out_end = pos
        self._tail = data[out_end:]
        if len(self._tail) > self.max_event_bytes:
            raise FramingError(f"an event is longer than {self.max_event_bytes} bytes")
        if objects and self.on_object is not None:
            for obj in objects:
                self.on_object(obj)
        return data[:out_end]

    def finish(self) -> bytes:
        """The stream ended: return the open event if it is whole but for its terminator; raises FramingError if it
        is garbage. Afterwards ``done`` says whether the stream ended properly."""
        tail, self._tail = self._tail, b""
        if not tail.strip():
            return b""
        obj = self._check_sse(tail.rstrip(b"\r\n")) if self.kind == "sse" else self._check_ndjson(tail)
        if obj is not None and self.on_object is not None:
            self.on_object(obj)
        return tail

    def _check_sse(self, event: bytes) -> dict | None:
        """One SSE event (its lines): raises FramingError on a line that is no SSE field; its data's object."""
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
        return self._check_data(b"\n".join(data_lines)) if data_lines else None

    def _check_data(self, payload: bytes) -> dict | None:
        """An SSE event's data: ``[DONE]`` or JSON (an error or a Responses API last event ends the stream); the
        object it decodes to when that is one."""
        if payload.strip() == b"[DONE]":
            self.done = True
            return None
        obj = _json(payload, "SSE data")
        return self._seen(obj) if isinstance(obj, dict) else None

    def _seen(self, obj: dict) -> dict:
        """An SSE event's object: it may end the stream."""
        if "error" in obj or "type" in obj and _ends(obj):
            self.done = True
        return obj

    def _check_ndjson(self, line: bytes) -> dict | None:
        """One NDJSON line: a JSON object (or blank), else FramingError; "done": true or an error ends the stream."""
        obj = _object_alone(line, 0) if line[:1] == b"{" else None
        if obj is None:
            if not line.strip():
                return None
            obj = _json(line, "NDJSON line")
            if not isinstance(obj, dict):
                raise FramingError("an NDJSON line is not a JSON object")
        if obj.get("done") is True or "error" in obj:
            self.done = True
        return obj


def _object_alone(data: bytes, start: int, after: int = 0) -> dict | None:
    """The JSON object that ``data[start:len(data) - after]`` (starting with "{") is, decoded by json.loads' own
    decoder without its per-call work (encoding detection, whitespace regexes: about 1.5 of the 6 us the framer spent
    on a token's event); None when those bytes are anything but one object alone in UTF-8 (garbage, another encoding,
    whitespace around it), and json.loads then judges them, so what counts as JSON stays its say. json.loads reads
    bytes that start with "{" as UTF-8 unless the next byte is NUL (UTF-16), which this decoder rejects after a "{".
    The ``after`` bytes at the end (an event's blank line) are decoded but not judged."""
    try:
        text = data.decode("utf-8", "surrogatepass")
        obj, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return obj if end == len(text) - after else None


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
