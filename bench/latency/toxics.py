"""Toxics: what the latency proxy does to the bytes of one direction of one connection.

Semantics and JSON follow Shopify Toxiproxy v2 (README "Toxics" and "HTTP API", toxics/*.go,
toxic_collection.go). A toxic is shown by the API as
``{"name": str, "type": str, "stream": "upstream"|"downstream", "toxicity": float, "attributes": {str: int}}``;
``upstream`` is client -> server, ``downstream`` is server -> client. Attributes are integers (Toxiproxy decodes them
into int64, so ``37.5`` is a 400 there and here too).

Types implemented (times in ms, sizes in bytes unless said):

- ``latency`` {latency, jitter}: every chunk read is written ``latency +/- jitter`` (uniform) after it was read.
  Pipelined: chunks keep their order and a stream's throughput is not divided by the latency.
- ``bandwidth`` {rate}: at most ``rate`` KB/s (1 KB = 1000 bytes, as Toxiproxy); big chunks go out in 100 ms slices.
- ``slow_close`` {delay}: the end of the stream (EOF) is passed on ``delay`` after it arrived.
- ``timeout`` {timeout}: holds all data; closes the connection ``timeout`` after the toxic started on it
  (0: never closes). Removing the toxic lets the held data through (Toxiproxy v2.2+).
- ``reset_peer`` {timeout}: on the first data (or EOF), drops it and resets the connection (TCP RST) after
  ``timeout``. Unlike Toxiproxy, which sets SO_LINGER 0 only on connections opened while the toxic existed, the
  reset is always an RST here.
- ``limit_data`` {bytes}: passes the first ``bytes`` bytes of the stream, then closes the connection.
- ``noop``: passes everything.

``toxicity`` is the probability that the toxic applies to a given link (one direction of one connection); as in
Toxiproxy it is drawn when the toxic starts on the link (connection opened, toxic added or updated).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, ClassVar, Protocol

__all__ = [
    "UPSTREAM", "DOWNSTREAM", "STREAMS", "ApiError", "bad_request", "Chunk", "Emit", "ConnectionControl",
    "ToxicState", "Toxic", "ToxicSpec", "toxic_types",
]

UPSTREAM = "upstream"  #: client -> server (Toxiproxy's meaning)
DOWNSTREAM = "downstream"  #: server -> client
STREAMS = (UPSTREAM, DOWNSTREAM)


class ApiError(Exception):
    """An API failure returned as Toxiproxy does: HTTP ``status`` and body ``{"error": message, "status": status}``."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message = message
        self.status = status

    def to_json(self) -> dict[str, Any]:
        """The response body, ``{"error": str, "status": int}``."""
        return {"error": self.message, "status": self.status}


def bad_request(detail: str) -> ApiError:
    """Toxiproxy's ``ErrBadRequestBody`` (400) with a detail."""
    return ApiError(f"bad request body: {detail}", 400)


@dataclass(slots=True)
class Chunk:
    """Bytes read from one side in one read, and ``ts``: the event-loop time (s) they were read.

    A latency toxic moves ``ts`` to the chunk's release time, so a second latency toxic adds its own delay on top.
    """

    data: bytes
    ts: float


#: Passes a chunk to the rest of the chain (the next toxic, or the socket); returns once it has been written.
Emit = Callable[[Chunk], Awaitable[None]]


class ConnectionControl(Protocol):
    """What a toxic may do to the connection it sits on."""

    def close(self) -> None:
        """Close both sides gracefully (FIN), after data already passed on is flushed."""

    def reset(self) -> None:
        """Reset both sides (TCP RST)."""


class ToxicState:
    """One toxic on one link (one direction of one connection): its per-link state, timer and interruptible waits.

    Toxiproxy runs every toxic of a link as a goroutine that can be interrupted (toxic updated or removed); here the
    link's writer calls the toxic per chunk, and an interrupt wakes whatever wait the toxic is in.
    """

    def __init__(self, spec: ToxicSpec, conn: ConnectionControl):
        self.spec = spec
        self.conn = conn
        self.removed = False
        self.engaged = False  # toxicity drawn: does the toxic apply to this link right now
        self.data: Any = spec.toxic.new_state()  # kept across updates, like Toxiproxy's StatefulToxic state
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def toxic(self) -> Toxic:
        """The toxic's current attributes (replaced on update)."""
        return self.spec.toxic

    @property
    def holding(self) -> bool:
        """True while the toxic applies: not removed and its toxicity draw succeeded."""
        return self.engaged and not self.removed

    def start(self) -> None:
        """Draw toxicity and start the toxic's timers (link opened, toxic added, or toxic updated)."""
        self.engaged = random.random() < self.spec.toxicity
        if self.engaged:
            self.toxic.on_start(self)

    def stop(self) -> None:
        """Cancel the timer and interrupt any wait (the toxic is being updated, removed, or the link ends)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def restart(self) -> None:
        """Apply an update: stop, then start again with the new attributes and a new toxicity draw."""
        self.stop()
        self.start()

    def remove(self) -> None:
        """The toxic was removed: let whatever it holds go on."""
        self.removed = True
        self.stop()

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` after ``delay_s`` seconds unless the toxic is stopped first (one timer per state)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(0.0, delay_s), callback)

    async def sleep(self, delay_s: float | None) -> bool:
        """Wait ``delay_s`` seconds (None: until interrupted). True if the wait ran out, False if interrupted."""
        if delay_s is not None and delay_s <= 0:
            return True
        if self.removed:
            return False
        waiter: asyncio.Future[bool] = self._loop.create_future()
        self._waiter = waiter
        handle = None if delay_s is None else self._loop.call_later(delay_s, _resolve, waiter, True)
        try:
            return await waiter
        finally:
            if handle is not None:
                handle.cancel()
            if self._waiter is waiter:
                self._waiter = None


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


class Toxic:
    """Base of every toxic type: integer attributes plus what the toxic does to chunks, to EOF and to its link.

    Subclasses register with ``class X(Toxic, name="type"):`` and list their attributes in ``fields``.
    """

    type_name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]] = ()
    _registry: ClassVar[dict[str, type[Toxic]]] = {}

    def __init_subclass__(cls, *, name: str, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls.type_name = name
        Toxic._registry[name] = cls

    def __init__(self, **attributes: int):
        for field in self.fields:
            setattr(self, field, int(attributes.get(field, 0)))

    @classmethod
    def create(cls, type_name: str) -> Toxic | None:
        """A toxic of ``type_name`` with every attribute 0, or None for an unknown type."""
        toxic_cls = cls._registry.get(type_name)
        return toxic_cls() if toxic_cls is not None else None

    def attributes(self) -> dict[str, int]:
        """The attributes as the API shows them."""
        return {field: getattr(self, field) for field in self.fields}

    def with_attributes(self, raw: Any) -> Toxic:
        """A copy with the attributes in ``raw`` (a JSON object) applied; unknown keys are ignored, as Toxiproxy.

        Raises ApiError 400 when ``raw`` is not an object or a known attribute is not a non-negative integer.
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise bad_request("attributes must be an object")
        merged = self.attributes()
        for field in self.fields:
            if field in raw:
                value = raw[field]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise bad_request(f"attribute {field!r} of a {self.type_name} toxic must be a non-negative "
                                      f"integer, got {value!r}")
                merged[field] = value
        return type(self)(**merged)

    # -- behaviour, overridden by subclasses ------------------------------------------------------------------

    def new_state(self) -> Any:
        """Per-link state created when the toxic first lands on a link; kept across updates."""
        return None

    def on_start(self, st: ToxicState) -> None:
        """Called when the toxic starts applying to a link (after a successful toxicity draw)."""

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        """Handle one chunk: pass it (or parts of it) on with ``await emit(...)``, or drop it."""
        await emit(chunk)

    async def on_eof(self, st: ToxicState) -> None:
        """Called when the stream ended; return to let the end pass on (half-close the other side)."""


class NoopToxic(Toxic, name="noop"):
    """Passes everything unchanged (Toxiproxy toxics/noop.go)."""


class LatencyToxic(Toxic, name="latency"):
    """Writes each chunk ``latency`` +/- ``jitter`` ms (uniform) after it was read; pipelined, order kept.

    As Toxiproxy's toxics/latency.go: the wait is measured from the chunk's read time, so chunks queued behind a
    waiting chunk have already served part of their own delay. Updating or removing the toxic releases the chunk
    it holds at once (Toxiproxy: "exit fast without applying latency").
    """

    fields = ("latency", "jitter")
    latency: int
    jitter: int

    def delay_s(self) -> float:
        """One draw of the delay in seconds: latency + U(-jitter, +jitter) ms."""
        delay_ms = float(self.latency)
        if self.jitter > 0:
            delay_ms += random.uniform(-self.jitter, self.jitter)
        return delay_ms / 1000.0

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        loop = asyncio.get_running_loop()
        due = chunk.ts + self.delay_s()
        if not await st.sleep(due - loop.time()):
            due = loop.time()
        chunk.ts = max(chunk.ts, due)
        await emit(chunk)


@dataclass(slots=True)
class _BandwidthState:
    debt_s: float = 0.0  # time still owed for bytes already passed (may go slightly negative: timer overshoot)


class BandwidthToxic(Toxic, name="bandwidth"):
    """Limits the stream to ``rate`` KB/s (1 KB = 1000 bytes); chunks over 100 ms worth go out in 100 ms slices.

    As Toxiproxy's toxics/bandwidth.go. A rate of 0 means unlimited.
    """

    fields = ("rate",)
    rate: int

    def new_state(self) -> _BandwidthState:
        return _BandwidthState()

    def on_start(self, st: ToxicState) -> None:
        st.data.debt_s = 0.0  # Toxiproxy restarts the toxic's accounting when it is (re)started

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        if self.rate <= 0:
            await emit(chunk)
            return
        loop = asyncio.get_running_loop()
        data = chunk.data
        st.data.debt_s += len(data) / (self.rate * 1000.0)
        slice_bytes = self.rate * 100  # what 100 ms carries
        while len(data) > slice_bytes:
            if not await st.sleep(0.1):
                await emit(Chunk(data, chunk.ts))  # interrupted: never drop data
                return
            await emit(Chunk(data[:slice_bytes], chunk.ts))
            data = data[slice_bytes:]
            st.data.debt_s -= 0.1
        started = loop.time()
        if await st.sleep(st.data.debt_s):
            st.data.debt_s -= loop.time() - started
        await emit(Chunk(data, chunk.ts))


class SlowCloseToxic(Toxic, name="slow_close"):
    """Passes data unchanged; the end of the stream goes on ``delay`` ms after it arrived (toxics/slow_close.go)."""

    fields = ("delay",)
    delay: int

    async def on_eof(self, st: ToxicState) -> None:
        await st.sleep(self.delay / 1000.0)


class TimeoutToxic(Toxic, name="timeout"):
    """Holds all data; closes the connection ``timeout`` ms after the toxic started on it (0: never).

    As Toxiproxy v2.2+ toxics/timeout.go: data is held, not dropped, so removing the toxic lets it through.
    """

    fields = ("timeout",)
    timeout: int

    def on_start(self, st: ToxicState) -> None:
        if self.timeout > 0:
            st.call_later(self.timeout / 1000.0, st.conn.close)

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        while st.holding:
            await st.sleep(None)
        await emit(chunk)

    async def on_eof(self, st: ToxicState) -> None:
        while st.holding:
            await st.sleep(None)


@dataclass(slots=True)
class _ResetState:
    triggered: bool = False


class ResetPeerToxic(Toxic, name="reset_peer"):
    """On the first data or EOF, drops it and resets the connection (TCP RST) ``timeout`` ms later.

    As Toxiproxy's toxics/reset_peer.go; data after the trigger is dropped. Removing the toxic before the reset
    cancels it (the dropped data stays dropped).
    """

    fields = ("timeout",)
    timeout: int

    def new_state(self) -> _ResetState:
        return _ResetState()

    def on_start(self, st: ToxicState) -> None:
        if st.data.triggered:  # updated after triggering: re-arm with the new timeout
            st.call_later(self.timeout / 1000.0, st.conn.reset)

    def _trigger(self, st: ToxicState) -> None:
        if not st.data.triggered:
            st.data.triggered = True
            st.call_later(self.timeout / 1000.0, st.conn.reset)

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        self._trigger(st)  # the chunk is dropped

    async def on_eof(self, st: ToxicState) -> None:
        self._trigger(st)
        while st.holding:
            await st.sleep(None)


@dataclass(slots=True)
class _LimitState:
    sent: int = 0  # bytes passed on this link so far


class LimitDataToxic(Toxic, name="limit_data"):
    """Passes the first ``bytes`` bytes of the stream, then closes the connection (toxics/limit_data.go)."""

    fields = ("bytes",)
    bytes: int

    def new_state(self) -> _LimitState:
        return _LimitState()

    async def process(self, chunk: Chunk, st: ToxicState, emit: Emit) -> None:
        remaining = max(0, self.bytes - st.data.sent)
        data = chunk.data[:remaining]
        if data:
            await emit(Chunk(data, chunk.ts))
            st.data.sent += len(data)
        if self.bytes - st.data.sent <= 0:
            st.conn.close()


def toxic_types() -> list[str]:
    """The toxic type names this proxy accepts."""
    return sorted(Toxic._registry)


@dataclass(slots=True)
class ToxicSpec:
    """One toxic of a proxy as the API shows it (Toxiproxy's ToxicWrapper); ``toxic`` holds type and attributes."""

    name: str
    stream: str
    toxicity: float
    toxic: Toxic

    @property
    def type(self) -> str:
        """The toxic type name, e.g. ``"latency"``."""
        return self.toxic.type_name

    def to_json(self) -> dict[str, Any]:
        """``{"attributes", "name", "type", "stream", "toxicity"}`` as Toxiproxy marshals it."""
        return {"attributes": self.toxic.attributes(), "name": self.name, "type": self.type,
                "stream": self.stream, "toxicity": self.toxicity}

    @classmethod
    def from_json(cls, body: Any) -> ToxicSpec:
        """Parse a create request in Toxiproxy's order of checks (toxic_collection.go AddToxicJson).

        Defaults: stream ``downstream``, toxicity 1.0, name ``<type>_<stream>``. Raises ApiError 400 on a bad body,
        an invalid stream or an unknown type.
        """
        if not isinstance(body, dict):
            raise bad_request("expected a JSON object")
        stream = body.get("stream", DOWNSTREAM)
        if stream in ("", None):
            stream = DOWNSTREAM
        if not isinstance(stream, str) or stream.lower() not in STREAMS:
            raise ApiError("stream was invalid, can be either upstream or downstream", 400)
        stream = stream.lower()
        type_name = body.get("type")
        toxicity = _toxicity(body.get("toxicity", 1.0))
        name = body.get("name") or f"{type_name}_{stream}"
        if not isinstance(name, str):
            raise bad_request("name must be a string")
        toxic = Toxic.create(type_name) if isinstance(type_name, str) else None
        if toxic is None:
            raise ApiError("invalid toxic type", 400)
        return cls(name=name, stream=stream, toxicity=toxicity, toxic=toxic.with_attributes(body.get("attributes")))

    def parse_update(self, body: Any) -> tuple[Toxic, float]:
        """The attributes and toxicity an update request asks for; fields it leaves out keep their values."""
        if not isinstance(body, dict):
            raise bad_request("expected a JSON object")
        return self.toxic.with_attributes(body.get("attributes")), _toxicity(body.get("toxicity", self.toxicity))


def _toxicity(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"toxicity must be a number, got {value!r}")
    return float(value)
