"""Ollama fleets in the routing core: model thermal state, elimination and fit, hot preference, pre-warm choice.

Pure: no I/O, no clock reads (``now`` is an argument, s on the balancer's clock). The probers fill the state from
``/api/ps`` and ``/api/tags`` (skylb/balancer/probers.py, skylb/engines/ollama.py); the router asks
``FleetRules.candidates`` which local replicas may take a request (skylb/core/router.py); the balancer's fleet
module acts on its answers (pre-warm, fallback; skylb/balancer/ollama_fleet.py).

Source: the Ollama fleet router's "Routing Engine" guide: stage 1 elimination (model on disk, enough free memory
to load it, not paused), signal 1 model thermal state (hot: loaded now; recent: loaded within the last 30 minutes,
the OS likely still caches its file; disk; absent), the goal ``total_time = queue_wait_time + cold_load_time +
inference_time`` (a hot model beats an idle replica that must load it), stage 4 pre-warm (the runner-up loads the
model when the winner's queue passes a threshold, default 3).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FleetSettings", "ModelSlot", "FleetView", "FleetReplica", "FleetRules", "Thermal", "canonical", "thermal",
           "load_s", "HOT", "RECENT", "DISK", "ABSENT"]

Thermal = Literal["hot", "recent", "disk", "absent"]
HOT: Thermal = "hot"
RECENT: Thermal = "recent"
DISK: Thermal = "disk"
ABSENT: Thermal = "absent"


def canonical(name: str) -> str:
    """Ollama's matching form of a model name: lower case, ``:latest`` when no tag is given."""
    last = name.rsplit("/", 1)[-1]
    return (name if ":" in last else f"{name}:latest").lower()


def resolve_name(model: str, served: Collection[str]) -> str:
    """The served name a request for ``model`` means: ``model`` itself when served, else the one served name with
    the same :func:`canonical` form (``gemma3`` -> ``gemma3:latest``, ``Gemma3:Latest`` -> ``gemma3:latest``, as
    Ollama resolves names: types/model/name.go, ParseName's default ``:latest`` fill and EqualFold), else ``model``
    unchanged (unknown, or two served names equally close)."""
    if not model or model in served:
        return model
    want = canonical(model)
    matches = [name for name in served if canonical(name) == want]
    return matches[0] if len(matches) == 1 else model


class FleetSettings(BaseModel):
    """``balancer.ollama_fleet``: how the balancer routes across Ollama replicas (README "Ollama fleets").

    Everything that changes routing is off by default. Thermal state is always tracked for Ollama replicas (it
    costs one ``GET /api/ps`` per probe round) and shown in status.

    Attributes:
        recent_window_s: a model unloaded less than this ago is "recent" rather than "disk" (s; "Routing
            Engine": 30 min).
        hot_preference: prefer replicas where the request's model is hot over ones that must load it, by the cost
            queue wait + load time (off: every replica serving the model is equal).
        default_load_s: load time assumed for a model before one was measured on a replica (s).
        service_s: time one queued request is assumed to hold an Ollama slot, for the queue wait of a busy hot
            replica (s); 0: a busy hot replica is never waited for, an idle one that must load is used instead.
        memory_bytes: per replica id, its memory for loaded models (bytes); default_memory_bytes for the others
            (None: unknown, no fit check). A replica whose free memory (budget - the sizes in /api/ps) cannot hold
            the model, even after unloading idle models, is not a candidate.
        paused: replica ids the operator paused: not candidates (their in-flight requests finish).
        prewarm: pre-warm on (stage 4); prewarm_threshold: more queued requests for a model at the balancer than
            this trigger it ("Routing Engine", "Stage 4: Pre-Warm": "exceeds the pre-warm
            threshold (default: 3)"); prewarm_keep_alive: the
            keep_alive sent with the empty generate.
        fallbacks: per model, fallback models in order, tried after ``fallback_hold_s`` seconds when no replica
            (local or peer) can take the primary.
        num_ctx: per model, ``options.num_ctx`` pinned to an integer, or "strip" to remove it, so clients cannot
            make Ollama reload a model with another context size.
        embedding_slot: Ollama replicas with one generation slot (``max_concurrency`` 1 or unset) take one
            embedding request beside a generation (a separate concurrency count).
    """

    model_config = ConfigDict(extra="forbid")

    recent_window_s: float = Field(1800.0, ge=0)
    hot_preference: bool = False
    default_load_s: float = Field(10.0, ge=0)
    service_s: float = Field(0.0, ge=0)
    memory_bytes: dict[str, int] = Field(default_factory=dict)
    default_memory_bytes: int | None = Field(None, gt=0)
    paused: list[str] = Field(default_factory=list)
    prewarm: bool = False
    prewarm_threshold: int = Field(3, ge=1)
    prewarm_keep_alive: str = "5m"
    fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    fallback_hold_s: float = Field(30.0, ge=0)
    num_ctx: dict[str, int | Literal["strip"]] = Field(default_factory=dict)
    embedding_slot: bool = False


@dataclass
class ModelSlot:
    """One model as an Ollama replica reports it: ``size_bytes`` (memory when loaded, bytes; None: unknown) and,
    when loaded, ``expires_at`` (the RFC 3339 text from /api/ps, shown as is)."""

    size_bytes: int | None = None
    expires_at: str | None = None


@dataclass
class FleetView:
    """What a balancer knows about one Ollama replica's models (``ReplicaState.fleet``).

    Attributes:
        disk: canonical name -> ModelSlot, from /api/tags (None until read).
        loaded: canonical name -> ModelSlot, from /api/ps at the latest probe (None until read).
        last_loaded: canonical name -> when it was last seen loaded (s, balancer clock): the "recent" tier.
        load_times: canonical name -> recent measured load times (s, at most 8).
        embeddings: embedding requests in flight there under the embedding slot.
    """

    disk: dict[str, ModelSlot] | None = None
    loaded: dict[str, ModelSlot] | None = None
    last_loaded: dict[str, float] = field(default_factory=dict)
    load_times: dict[str, deque] = field(default_factory=dict)
    embeddings: int = 0
    #: Whether any FleetView was made in this process: until one is, no replica has a fleet view to test.
    made: ClassVar[bool] = False

    def __post_init__(self) -> None:
        FleetView.made = True

    def observe_ps(self, models: dict[str, ModelSlot], now: float) -> None:
        """Record /api/ps's loaded models (canonical names) read at ``now``."""
        self.loaded = models
        for name in models:
            self.last_loaded[name] = now

    def observe_tags(self, models: dict[str, ModelSlot]) -> None:
        """Record /api/tags's models on disk (canonical names)."""
        self.disk = models

    def observe_load(self, model: str, seconds: float) -> None:
        """A measured load of ``model`` took ``seconds`` (s)."""
        self.load_times.setdefault(canonical(model), deque(maxlen=8)).append(max(0.0, seconds))

    def size_of(self, model: str) -> int | None:
        """The model's memory (bytes) from /api/ps or /api/tags, None when neither says."""
        name = canonical(model)
        for source in (self.loaded, self.disk):
            if source and name in source and source[name].size_bytes:
                return source[name].size_bytes
        return None


class FleetReplica(Protocol):
    """What the fleet rules read of a local replica: :class:`skylb.core.state.ReplicaState` has all of it (the
    state module holds a :class:`FleetView` per replica, so the rules name the replica by this shape instead of
    importing the state module back).

    Attributes:
        id: the replica id. fleet: its Ollama model state, None for other engines. models: the model ids it
            serves (None until learned). healthy: the latest probe succeeded. draining: gets no new requests.
        outstanding: this balancer's requests there that have not finished. max_concurrency, slots: its parallel
            slots when configured or reported (None: unknown).
    """

    id: str
    fleet: FleetView | None
    models: frozenset[str] | None
    healthy: bool
    draining: bool
    outstanding: int
    max_concurrency: int | None
    slots: int | None

    def serves(self, model: str, api: str) -> bool:
        """True when the replica serves ``model`` ("" = any model) in dialect ``api``."""


# A replica type that satisfies FleetReplica: ``candidates`` and ``runner_up`` give back replicas they were given.
_R = TypeVar("_R", bound=FleetReplica)


def thermal(replica: FleetReplica, model: str, now: float, recent_window_s: float = 1800.0) -> Thermal:
    """The model's thermal state on ``replica`` at ``now`` ("Routing Engine", signal 1): "hot" (in the latest
    /api/ps), "recent" (seen loaded within ``recent_window_s`` s), "disk" (listed by /api/tags or served), "absent".
    A replica without fleet state (not Ollama) counts its served models as hot: they are always loaded."""
    view = replica.fleet
    name = canonical(model)
    served = replica.models is not None and (model in replica.models or name in replica.models)
    if view is None:
        return HOT if served else ABSENT
    if view.loaded is not None and name in view.loaded:
        return HOT
    seen = view.last_loaded.get(name)
    on_disk = served or (view.disk is not None and name in view.disk)
    if not on_disk and view.disk is not None:
        return ABSENT
    if seen is not None and now - seen <= recent_window_s:
        return RECENT
    return DISK if on_disk else ABSENT


def load_s(replica: FleetReplica, model: str, default_s: float = 10.0, *, now: float | None = None) -> float:
    """Seconds ``replica`` needs to load ``model`` before serving it: 0 when hot (or not an Ollama replica), else
    the mean of its recent measured loads of that model (or of any model), else ``default_s``; infinite when the
    model is absent. Shared with the estimated-wait policy (cost = queue wait + load time + inference time)."""
    view = replica.fleet
    if view is None or (view.loaded is not None and canonical(model) in view.loaded):
        return 0.0
    if now is not None and thermal(replica, model, now) == ABSENT:
        return float("inf")
    samples = view.load_times.get(canonical(model)) or [t for d in view.load_times.values() for t in d]
    return sum(samples) / len(samples) if samples else default_s


@dataclass
class FleetRules:
    """The fleet's rules over local replicas, from ``FleetSettings`` (``settings``)."""

    settings: FleetSettings = field(default_factory=FleetSettings)

    def eliminated(self, replica: FleetReplica, model: str, now: float) -> str | None:
        """Why ``replica`` cannot serve ``model`` at all now ("Routing Engine", stage 1), or None: paused or draining,
        the model absent, or not enough memory to load it even after unloading idle models (models with no request of
        this balancer in flight there; Ollama unloads idle ones to make room)."""
        if replica.draining:
            return "draining"
        if replica.id in self.settings.paused:
            return "paused"
        if replica.fleet is None or not model:
            return None
        if thermal(replica, model, now, self.settings.recent_window_s) == ABSENT:
            return f"does not have {model}"
        memory = self.settings.memory_bytes.get(replica.id, self.settings.default_memory_bytes)
        if memory is None or replica.fleet.loaded is None or canonical(model) in replica.fleet.loaded:
            return None
        size = replica.fleet.size_of(model)
        if size is None:
            return None
        # Busy models cannot be unloaded; this balancer only knows its own in-flight requests, so with any in
        # flight every loaded model counts as busy (conservative), else all of them can go.
        held = sum(s.size_bytes or 0 for s in replica.fleet.loaded.values()) if replica.outstanding else 0
        if size > memory - held:
            return f"not enough memory to load {model}"
        return None

    def candidates(self, model: str, api: str, local: list[_R], replicas: list[_R],
                   now: float, wait_s=None, *, embedding: bool = False, usable=None) -> list[_R]:
        """The local replicas (of ``local``, those with room, none draining) the request may go to now: eliminated
        ones removed; with ``hot_preference``, only the cheapest by queue wait + load time, and none (the request
        waits) when a busy replica among ``replicas`` where the model is hot would serve it sooner than loading it
        would.

        ``wait_s(replica)``: a policy's estimated wait (s) or None; without one, a busy replica's wait is its
        requests beyond its slots times ``service_s``. ``embedding`` with ``embedding_slot`` on: an Ollama replica
        with one generation slot, busy, is a candidate too while no other embedding runs there ("Why I Built a
        Priority Queue for Ollama": a concurrent embed slot); ``usable(replica)`` says it is healthy, fresh, not
        draining, not ejected.
        """
        s = self.settings
        if embedding and s.embedding_slot and usable is not None:
            local = local + [r for r in replicas if r not in local and r.fleet is not None
                             and r.fleet.embeddings == 0 and (r.max_concurrency or 1) == 1
                             and r.serves(model, api) and usable(r, now)]
        # A replica without a fleet view (not Ollama) is eliminated only when draining or paused: tested here
        # rather than by a call per replica, on every decision.
        paused = s.paused
        if paused or FleetView.made:  # else each is kept: no fleet view, none paused, and ``local`` never drains
            local = [r for r in local if (r.fleet is None and not r.draining and r.id not in paused)
                     or (r.fleet is not None and self.eliminated(r, model, now) is None)]
        if not s.hot_preference or not model:
            return local

        def cost(r: FleetReplica) -> float:
            return _wait(r, wait_s, s.service_s) + load_s(r, model, s.default_load_s, now=now)
        if local:
            best = min(cost(r) for r in local)
            local = [r for r in local if cost(r) <= best]
        else:
            best = float("inf")
        if best > 0:
            busy_hot = [r for r in replicas if r not in local and r.serves(model, api) and not r.draining
                        and r.healthy and self.eliminated(r, model, now) is None
                        and r.fleet is not None and load_s(r, model, s.default_load_s) == 0.0]
            if s.service_s and any(_wait(r, wait_s, s.service_s) < best for r in busy_hot):
                return []
        return local

    def routed(self, request, replica: FleetReplica) -> None:
        """``request`` went to local ``replica``: an embedding there takes its embedding slot until ``finished``."""
        if request.embedding and replica.fleet is not None:
            replica.fleet.embeddings += 1

    def finished(self, request, replica: FleetReplica | None) -> None:
        """``request``'s response on local ``replica`` ended: free its embedding slot."""
        if request.embedding and replica is not None and replica.fleet is not None:
            replica.fleet.embeddings = max(0, replica.fleet.embeddings - 1)

    def runner_up(self, model: str, api: str, winner: FleetReplica, replicas: list[_R],
                  now: float) -> _R | None:
        """The replica to pre-warm ``model`` on ("Routing Engine", stage 4): not the winner, healthy, not
        eliminated, the model not hot there; the one with the fewest outstanding requests (ties: the lowest id).
        None if none."""
        options = [r for r in replicas if r is not winner and r.fleet is not None and r.healthy
                   and r.serves("", api) and self.eliminated(r, model, now) is None
                   and thermal(r, model, now, self.settings.recent_window_s) != HOT]
        return min(options, key=lambda r: (r.outstanding, r.id)) if options else None


def _wait(r: FleetReplica, wait_s, service_s: float) -> float:
    estimate = wait_s(r) if wait_s is not None else None
    if estimate is not None:
        return estimate
    slots = r.max_concurrency or r.slots or 1
    return max(0, r.outstanding + 1 - slots) * service_s
