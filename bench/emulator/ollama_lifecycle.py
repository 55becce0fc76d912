"""A pure model of Ollama's model lifecycle on one server: models on disk, loaded models, memory, ``keep_alive``.

No asyncio, no clock reads: every method takes ``now`` (s, any monotonic epoch). The emulator's Ollama
personality (bench/emulator/personalities/ollama.py) drives it in real time.

Ollama's documented behaviour this follows (ollama/ollama ``docs/faq.md`` "How do I keep a model loaded in memory
or make it unload immediately?", "How does Ollama load models on multiple GPUs?", ``docs/api.md`` ``keep_alive``,
"Load a model", "Unload a model", "List Running Models"; ``envconfig``: ``OLLAMA_KEEP_ALIVE`` default 5m,
``OLLAMA_MAX_LOADED_MODELS`` default 3 per GPU; ``server/sched.go``):

* A request for a model that is on disk but not loaded loads it first: the request waits the model's load time.
  Concurrent requests for a model being loaded wait for the same load.
* ``keep_alive`` per request: a duration string ("10m", "24h", "1h30m", "-1m"), a number of seconds, 0 (unload as
  soon as the request is done), negative (keep loaded forever); absent: the server default (5 minutes). The expiry
  timer starts when the model's last in-flight request ends; a new request stops it.
* When a model must load and the memory budget (or ``max_loaded`` models) is short, idle loaded models (no request
  in flight) are unloaded, least recently used first, until it fits. If it still does not fit, the request fails
  with Ollama's memory error (real Ollama may also wait for busy runners; the emulator fails at once, so a test
  sees it rather than a hang).
* A request whose context size (``options.num_ctx``, default ``DEFAULT_NUM_CTX``) differs from the loaded
  model's reloads it (Ollama's scheduler ``needsReload``): the request waits a full load again.
* ``/api/ps`` lists loaded models with ``size`` (bytes), ``size_vram`` (bytes on the GPU: all of it here) and
  ``expires_at`` (a model kept forever shows a time far in the future, as Ollama does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["ModelSpec", "LoadedModel", "ModelLifecycle", "OutOfMemory", "parse_keep_alive", "DEFAULT_KEEP_ALIVE_S",
           "DEFAULT_MAX_LOADED", "FOREVER_S"]

#: ``OLLAMA_KEEP_ALIVE``'s default: 5 minutes (s).
DEFAULT_KEEP_ALIVE_S = 300.0
#: The context size a model is loaded with when a request gives no ``options.num_ctx`` (tokens; Ollama's default).
DEFAULT_NUM_CTX = 4096
#: ``OLLAMA_MAX_LOADED_MODELS``'s default for one GPU.
DEFAULT_MAX_LOADED = 3
#: What "forever" means for ``expires_at``: far in the future, as Ollama reports a negative keep_alive (s).
FOREVER_S = 10.0 * 365 * 24 * 3600

_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, default_s: float = DEFAULT_KEEP_ALIVE_S) -> float | None:
    """``keep_alive`` as Ollama reads it -> seconds to stay loaded after the last request, or None for forever.

    ``value``: None (the default, ``default_s``), a number of seconds, or a Go duration string ("5m", "1h30m",
    "0", "-1"; a bare number string is seconds). Negative: None (forever). Raises ValueError for anything else
    (Ollama answers 400 then).
    """
    if value is None:
        return default_s
    if isinstance(value, bool):
        raise ValueError(f"invalid keep_alive {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"invalid keep_alive duration {value!r}") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise ValueError(f"invalid keep_alive {value!r}")
    return None if seconds < 0 else seconds


class OutOfMemory(Exception):
    """The model does not fit the memory budget even after unloading every idle model."""


@dataclass(frozen=True)
class ModelSpec:
    """One model on disk: ``size_bytes`` (its memory when loaded, bytes) and ``load_s`` (load time, s)."""

    size_bytes: int
    load_s: float


@dataclass
class LoadedModel:
    """A loaded (or loading) model: ``ready_at`` when its load ends (s); ``in_flight`` requests using it;
    ``keep_alive_s`` the latest request's keep_alive (None: forever); ``expires_at`` when it unloads (None while
    requests are in flight or forever); ``last_used`` for LRU eviction (s)."""

    name: str
    spec: ModelSpec
    ready_at: float
    last_used: float
    in_flight: int = 0
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S
    expires_at: float | None = None
    num_ctx: int = DEFAULT_NUM_CTX
    #: An unload was asked while requests used it: it goes when the last one ends.
    unload_when_idle: bool = False


@dataclass
class ModelLifecycle:
    """Models on disk and in memory of one Ollama server.

    Args:
        memory_bytes: the memory budget for loaded models (bytes; None: unlimited).
        max_loaded: at most this many models loaded at once (``OLLAMA_MAX_LOADED_MODELS``).
        default_keep_alive_s: keep_alive when a request gives none (s; None: forever).
        disk: model name -> ModelSpec, the models on disk (``/api/tags``).
    """

    memory_bytes: int | None = None
    max_loaded: int = DEFAULT_MAX_LOADED
    default_keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S
    disk: dict[str, ModelSpec] = field(default_factory=dict)
    loaded: dict[str, LoadedModel] = field(default_factory=dict)
    #: Loads performed so far (a test counts pre-warm loads with it).
    loads: int = 0

    def used_bytes(self) -> int:
        """Memory held by loaded and loading models (bytes)."""
        return sum(m.spec.size_bytes for m in self.loaded.values())

    def expire(self, now: float) -> list[str]:
        """Unload every idle model whose keep_alive ran out by ``now``; returns their names."""
        gone = [n for n, m in self.loaded.items() if m.in_flight == 0 and m.expires_at is not None
                and m.expires_at <= now]
        for name in gone:
            del self.loaded[name]
        return gone

    def acquire(self, name: str, now: float, num_ctx: int | None = None) -> float:
        """A request for model ``name`` (context size ``num_ctx``, None: ``DEFAULT_NUM_CTX``) arrives at ``now``:
        load it if needed, or reload it with another context size; returns when it is ready (s, ``now`` when
        already loaded). The request counts as in flight until ``release``.

        Raises KeyError when the model is not on disk, OutOfMemory when it cannot fit.
        """
        self.expire(now)
        spec = self.disk[name]
        num_ctx = DEFAULT_NUM_CTX if num_ctx is None else num_ctx
        model = self.loaded.get(name)
        if model is not None and model.num_ctx != num_ctx:  # a reload with the new context size
            model.ready_at = max(now, model.ready_at) + spec.load_s
            model.num_ctx = num_ctx
            self.loads += 1
        if model is None:
            self._make_room(spec, now)
            model = LoadedModel(name, spec, ready_at=now + spec.load_s, last_used=now,
                                keep_alive_s=self.default_keep_alive_s, num_ctx=num_ctx)
            self.loaded[name] = model
            self.loads += 1
        model.in_flight += 1
        model.unload_when_idle = False  # a new request keeps it (its own keep_alive decides)
        model.last_used = now
        model.expires_at = None  # the expiry timer stops while a request uses the model
        return max(now, model.ready_at)

    def release(self, name: str, now: float, keep_alive_s: float | None) -> None:
        """A request for ``name`` ended at ``now`` with ``keep_alive_s`` (None: forever; 0: unload at once when
        idle). The timer starts when the last request ends."""
        model = self.loaded.get(name)
        if model is None:
            return
        model.in_flight = max(0, model.in_flight - 1)
        model.last_used = now
        model.keep_alive_s = keep_alive_s
        if model.in_flight == 0:
            if keep_alive_s == 0 or model.unload_when_idle:
                del self.loaded[name]
            else:
                model.expires_at = None if keep_alive_s is None else now + keep_alive_s

    def unload(self, name: str) -> bool:
        """Unload ``name`` (``keep_alive: 0`` on an empty request): now when idle (True), else once its requests in
        flight end (False)."""
        model = self.loaded.get(name)
        if model is None:
            return False
        if model.in_flight:
            model.unload_when_idle = True
            return False
        del self.loaded[name]
        return True

    def _make_room(self, spec: ModelSpec, now: float) -> None:
        """Unload idle models, least recently used first, until ``spec`` fits memory and ``max_loaded``."""
        def fits() -> bool:
            memory_ok = self.memory_bytes is None or self.used_bytes() + spec.size_bytes <= self.memory_bytes
            return memory_ok and len(self.loaded) < self.max_loaded
        idle = sorted((m for m in self.loaded.values() if m.in_flight == 0 and m.ready_at <= now),
                      key=lambda m: m.last_used)
        while not fits() and idle:
            del self.loaded[idle.pop(0).name]
        if self.memory_bytes is not None and spec.size_bytes > self.memory_bytes - self.used_bytes():
            need = spec.size_bytes / 2**30
            free = (self.memory_bytes - self.used_bytes()) / 2**30
            raise OutOfMemory(f"model requires more system memory ({need:.1f} GiB) than is available "
                              f"({free:.1f} GiB)")
        if len(self.loaded) >= self.max_loaded:
            raise OutOfMemory(f"cannot load another model: {self.max_loaded} models are loaded and busy "
                              f"(OLLAMA_MAX_LOADED_MODELS)")

    def ps(self, now: float) -> list[tuple[LoadedModel, float]]:
        """Loaded models with their ``expires_at`` (s on this clock): for a model in use, now + its keep_alive;
        forever: now + ``FOREVER_S``. Most recently used first, as Ollama lists them; a model still loading is not
        listed (Ollama adds a runner to its loaded set once the load finished)."""
        self.expire(now)
        out = []
        for m in sorted(self.loaded.values(), key=lambda m: -m.last_used):
            if m.ready_at > now:
                continue
            if m.expires_at is not None:
                at = m.expires_at
            elif m.keep_alive_s is None:
                at = now + FOREVER_S
            else:
                at = now + m.keep_alive_s
            out.append((m, at))
        return out


@dataclass(frozen=True)
class LifecycleOptions:
    """The emulator flags that shape an Ollama replica's lifecycle (``skylb emulator --engine ollama --help``).

    Attributes:
        load_s: load time of a model without its own (s, real seconds: NOT multiplied by ``--time-scale``).
        model_bytes: memory of a model without its own (bytes; default: an 8B Q4_K_M GGUF).
        sizes / load_times: per model name, its memory (bytes) / load time (s).
        memory_bytes: the replica's memory budget for loaded models (bytes; None: unlimited).
        max_loaded: ``OLLAMA_MAX_LOADED_MODELS``. keep_alive_s: ``OLLAMA_KEEP_ALIVE`` (s; None: forever).
        pull_s: how long an ``/api/pull`` takes (s, real seconds).
    """

    load_s: float = 0.0
    model_bytes: int = 4_920_734_720
    sizes: tuple[tuple[str, int], ...] = ()
    load_times: tuple[tuple[str, float], ...] = ()
    memory_bytes: int | None = None
    max_loaded: int = DEFAULT_MAX_LOADED
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S
    pull_s: float = 0.2

    def spec(self, name: str) -> ModelSpec:
        """The ModelSpec of ``name`` (its own size and load time when given, else the defaults)."""
        return ModelSpec(dict(self.sizes).get(name, self.model_bytes), dict(self.load_times).get(name, self.load_s))

    def lifecycle(self, models: tuple[str, ...]) -> ModelLifecycle:
        """A fresh ModelLifecycle with ``models`` on disk and nothing loaded (Ollama loads on first use)."""
        return ModelLifecycle(memory_bytes=self.memory_bytes, max_loaded=self.max_loaded,
                              default_keep_alive_s=self.keep_alive_s,
                              disk={name: self.spec(name) for name in models})
