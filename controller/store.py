"""Durable membership: regions, balancers and replicas in one SQLite file, versioned by a revision number.

The controller is the only writer of membership, and this store is where it writes. Every write runs in one
transaction that also bumps ``revision``, so a reader that saw revision N and later sees N + k knows exactly that
something changed, and a restart resumes from the same revision (balancers watch from a revision, as etcd's watch API
resumes from one: etcd documentation, "etcd API", "Revisions" and "Watch API").

Calls are synchronous and short (one local transaction, well under a millisecond on an SSD); the server calls them
from its event loop directly rather than from a thread, which keeps every write strictly ordered.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, StringConstraints, TypeAdapter,
                      ValidationError, model_validator)

from skylb.core.kv_endpoint import KVEventsEndpoint
from skylb.quota.limits import Quotas

__all__ = [
    "ENGINES",
    "StoreError",
    "InvalidInput",
    "Conflict",
    "NotFound",
    "StoreUnavailable",
    "Replica",
    "Balancer",
    "Assignment",
    "Ownership",
    "Membership",
    "MembershipStore",
    "normalize_url",
    "validate_region",
    "validate_engine",
    "validate_balancer_id",
    "default_balancer_id",
    "validate_max_concurrency",
]

#: Engine names a replica may declare ("auto": the balancer detects the engine by probing it).
ENGINES: tuple[str, ...] = ("vllm", "sglang", "llamacpp", "tgi", "ollama", "openai", "auto")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS regions (
    name TEXT PRIMARY KEY,
    next_replica_n INTEGER NOT NULL DEFAULT 1  -- ids are never reused, so a stale balancer cannot confuse two
);
CREATE TABLE IF NOT EXISTS balancers (
    url TEXT PRIMARY KEY,
    region TEXT NOT NULL REFERENCES regions(name),
    last_seen REAL NOT NULL,
    healthy INTEGER NOT NULL DEFAULT 1,  -- the controller's active health check
    draining INTEGER NOT NULL DEFAULT 0,  -- `skylb-ctl balancer drain`: no new clients, its replicas served elsewhere
    id TEXT  -- unique within its region (default: the URL's host:port); NULL only in rows of an older controller
);
-- Which balancer pushes to each replica (controller/ownership.py): one at a time, so siblings of a region never
-- both fill one replica's room. The epoch grows at every change of owner; rows outlive their replica so that a
-- replica re-added under the same id never sees its epoch go back.
CREATE TABLE IF NOT EXISTS owners (
    replica_id TEXT PRIMARY KEY,
    balancer_url TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    handover_to TEXT  -- a live owner releasing it to this balancer (URL): neither pushes until the owner confirms
);
-- Which region's balancer serves a region's replicas (failover, SkyLB paper §4.2). No row: its own balancer,
-- epoch 0. Every change of serving region bumps the epoch, so a balancer holding an older one knows it is stale.
CREATE TABLE IF NOT EXISTS assignments (
    region TEXT PRIMARY KEY REFERENCES regions(name),
    balancer_region TEXT NOT NULL,
    epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS replicas (
    id TEXT PRIMARY KEY,
    region TEXT NOT NULL REFERENCES regions(name),
    url TEXT NOT NULL UNIQUE,
    engine TEXT NOT NULL,
    created_at REAL NOT NULL,
    max_concurrency INTEGER,  -- parallel slots of an engine without a pending metric; NULL: the adapter's default
    kv_events TEXT,  -- the engine's KV-cache event endpoint (tcp://host:port); NULL: it publishes none
    kv_events_replay TEXT,  -- its replay socket; NULL: none
    kv_block_size INTEGER,  -- tokens per block when not the one its events report; NULL: theirs
    healthy INTEGER NOT NULL DEFAULT 1,  -- the controller's active health check (controller/health.py)
    draining INTEGER NOT NULL DEFAULT 0  -- `skylb-ctl replica drain`: no new requests, in-flight ones finish
);
-- The quota document (skylb/quota/limits.py Quotas, as JSON) and the membership revision of its last change.
CREATE TABLE IF NOT EXISTS quotas (id INTEGER PRIMARY KEY CHECK (id = 1), doc TEXT, revision INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0);
"""


class StoreError(Exception):
    """Base of the store's expected failures; ``code`` is the HTTP status and ``type`` the error type to report."""

    code = 500
    type = "store_error"


class InvalidInput(StoreError):
    """A field is missing or malformed; ``field`` names it and the message says why."""

    code = 400
    type = "invalid_request_error"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Conflict(StoreError):
    """The replica's URL or id already exists."""

    code = 409
    type = "conflict"

    @classmethod
    def url_taken(cls, url: str, replica_id: str) -> Conflict:
        """The error for adding a replica whose URL ``url`` is already ``replica_id``'s."""
        return cls(f"url: {url} is already registered as replica {replica_id}")

    @classmethod
    def id_taken(cls, replica_id: str) -> Conflict:
        """The error for adding a replica with an id already in use."""
        return cls(f"id: replica {replica_id} already exists")


class NotFound(StoreError):
    """No replica (or balancer, or region) has the given id (URL, name)."""

    code = 404
    type = "not_found"

    @classmethod
    def replica(cls, replica_id: str) -> NotFound:
        """The error for an unknown replica id."""
        return cls(f"id: no replica {replica_id!r}")

    @classmethod
    def balancer(cls, url: str) -> NotFound:
        """The error for an unknown balancer URL."""
        return cls(f"url: no balancer at {url}")

    @classmethod
    def region(cls, region: str) -> NotFound:
        """The error for a region never seen."""
        return cls(f"region: no region {region!r}")

    @classmethod
    def region_balancers(cls, region: str) -> NotFound:
        """The error for draining a region with no registered balancer."""
        return cls(f"region: no balancer registered in region {region!r}")


class StoreUnavailable(StoreError):
    """The store's backend (etcd) did not answer, or kept changing under a write; the caller may try again."""

    code = 503
    type = "store_unavailable"


@dataclass(frozen=True)
class Replica:
    """One inference engine endpoint; ``created_at`` is unix time in seconds.

    ``max_concurrency`` (requests, >= 1, or None) is the replica's parallel slots, for engines that expose no
    pending metric (Ollama's OLLAMA_NUM_PARALLEL, a generic OpenAI server's limit): the balancer counts its own
    in-flight requests against it. None lets the engine adapter use its default.

    ``kv_events`` / ``kv_events_replay``: the engine's KV-cache event endpoints (vLLM ``--kv-events-config``'s
    ``endpoint`` and ``replay_endpoint`` as reachable from the balancer, ``tcp://HOST:PORT``), or None; with them its
    balancer routes by the engine's exact cache state (skylb/balancer/kv_routing.py). ``kv_block_size``: tokens per
    block, when the events' own should not be used (None).
    """

    id: str
    region: str
    url: str
    engine: str
    created_at: float
    max_concurrency: int | None = None
    healthy: bool = True
    draining: bool = False
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_block_size: int | None = None

    def to_dict(self) -> dict:
        """JSON shape: {"id", "region", "url", "engine", "created_at", "max_concurrency" (int or null),
        "kv_events", "kv_events_replay" (str or null), "kv_block_size" (int or null), "healthy"
        (the controller's health check: false takes the replica out of every balancer's candidates), "draining"
        (true: no new requests; in-flight ones finish)}."""
        return asdict(self)


@dataclass(frozen=True)
class Balancer:
    """A balancer as last registered; ``last_seen`` is unix time in seconds of its latest heartbeat.

    A region may run several balancers at once (siblings); ``id`` tells them apart within the region (default: the
    URL's ``host:port``). A registration at an id another URL holds is that balancer moved (a restarted pod).
    """

    region: str
    url: str
    last_seen: float
    healthy: bool = True
    draining: bool = False
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", default_balancer_id(self.url))

    def to_dict(self) -> dict:
        """JSON shape: {"region", "url", "last_seen", "healthy" (the controller's check), "draining", "id"}."""
        return asdict(self)


def default_balancer_id(url: str) -> str:
    """A balancer's id when it gives none: its URL's ``host:port`` (``http://10.0.0.2:8080`` -> ``10.0.0.2:8080``),
    or the host alone when the URL names no port."""
    return urlsplit(url).netloc or url


@dataclass(frozen=True)
class Ownership:
    """Which balancer pushes requests to replica ``replica`` (its URL ``balancer``), and the epoch of that choice.

    ``epoch`` (>= 1) grows by one at every change of owner, so a balancer still holding an older epoch for the
    replica is stale: its heartbeat is answered 409 ``stale_epoch`` and it drops the replica. ``handover_to`` (a
    URL, or None) is set while a live owner releases the replica to another balancer: neither pushes to it until
    the owner's heartbeat confirms it let go (controller/ownership.py).
    """

    replica: str
    balancer: str
    epoch: int
    handover_to: str | None = None

    def to_dict(self) -> dict:
        """JSON shape: {"replica", "balancer" (a URL), "epoch", "handover_to" (a URL or null)}."""
        return asdict(self)


@dataclass(frozen=True)
class Assignment:
    """Which region's balancer serves ``region``'s replicas, and the epoch of that choice.

    ``balancer_region == region`` normally; another region after a failover (SkyLB paper §4.2, "Failure recovery
    of load balancers"). ``epoch`` (>= 0) grows by one at every change, so a balancer that still holds an older
    epoch for ``region`` is stale: the controller refuses its heartbeat and balancers ignore older snapshots.
    """

    region: str
    balancer_region: str
    epoch: int = 0

    def to_dict(self) -> dict:
        """JSON shape: {"region", "balancer_region", "epoch"}."""
        return asdict(self)


@dataclass(frozen=True)
class Membership:
    """A consistent snapshot of the whole membership at one revision."""

    revision: int
    regions: list[str]
    balancers: list[Balancer]
    replicas: list[Replica]
    assignments: list[Assignment] = field(default_factory=list)
    #: The quota document (None: the controller holds none, balancers keep their config's) and the revision of its
    #: last change (0: never set).
    quotas: Quotas | None = None
    quotas_revision: int = 0
    #: The owner of each replica that has one (controller/ownership.py).
    owners: list[Ownership] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON shape: {"revision": int, "regions": [str], "balancers": [dict], "replicas": [dict],
        "assignments": [dict], "owners": [dict], "quotas": Quotas as JSON or null, "quotas_revision": int} (one
        assignment per region, its own balancer at epoch 0 unless failed over)."""
        return {
            "revision": self.revision,
            "regions": list(self.regions),
            "balancers": [b.to_dict() for b in self.balancers],
            "replicas": [r.to_dict() for r in self.replicas],
            "assignments": [a.to_dict() for a in self.assignments],
            "owners": [o.to_dict() for o in self.owners],
            "quotas": quotas_json(self.quotas),
            "quotas_revision": self.quotas_revision,
        }


def quotas_json(quotas: Quotas | None) -> dict | None:
    """``quotas`` as the API and the stores write it (unset limits left out), or None."""
    return None if quotas is None else quotas.model_dump(exclude_none=True)


# --- input validation (pydantic) ----------------------------------------------------------------------------------

#: What a valid value of each field looks like, for messages "<field>: <value> <rule>".
_RULES = {
    "region": "must be 1-64 letters, digits, '-' or '_'",
    "url": "is not a URL such as http://10.0.0.5:8000",
    "engine": f"is not a known engine (one of: {', '.join(ENGINES)})",
    "id": "must be 1-128 letters, digits, '.', '-' or '_'",
    "balancer_id": "must be 1-128 letters, digits, '.', ':', '-' or '_'",
    "max_concurrency": "must be an integer of at least 1 (parallel requests)",
    "kv_events": "is not a ZMQ endpoint such as tcp://10.0.0.5:5557",
    "kv_events_replay": "is not a ZMQ endpoint such as tcp://10.0.0.5:5558",
    "kv_block_size": "must be an integer of at least 1 (tokens per block)",
}
#: The message for a required field that is missing, null or blank.
_REQUIRED = {"region": "required, a region name such as us", "url": "required, a URL such as http://10.0.0.5:8000"}


_HOST = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?$", re.IGNORECASE)


def _host_ok(host: str) -> bool:
    """True for a DNS name (labels of letters, digits, '-', '_'; 253 characters at most) or an IP literal."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= 253 and _HOST.match(host) is not None


def _canonical_url(url: str) -> str:
    """``url`` in canonical form (see normalize_url); ValueError with the message to show otherwise."""
    url = url.strip()
    if not url:
        raise ValueError(_REQUIRED["url"])
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"{url!r} must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    if not _host_ok(parts.hostname):
        # A host with spaces, '%' escapes or other odd bytes is a typo or an attempt to smuggle something into the
        # balancers' requests; DNS names and IP literals need none of them.
        raise ValueError(f"{url!r} has an invalid host (a DNS name or an IP address)")
    if port == 0:
        raise ValueError(f"{url!r} has port 0; use a port in 1..65535")
    if parts.username is not None or parts.password is not None:
        # Membership is logged and served to every balancer; credentials do not belong in it.
        raise ValueError(f"{url!r} must not contain credentials")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not have a query or fragment")
    host = parts.hostname
    if ":" in host:  # IPv6 literal: urlsplit drops the brackets
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), "", ""))


# Strict: values come from JSON as they are, and "4" or true where a count belongs is a mistake to report.
_Region = Annotated[str, StringConstraints(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
_ReplicaId = Annotated[str, StringConstraints(strict=True, pattern=r"^[A-Za-z0-9._-]{1,128}$")]
_BalancerId = Annotated[str, StringConstraints(strict=True, pattern=r"^[A-Za-z0-9.:_-]{1,128}$")]
_Url = Annotated[str, Strict(), AfterValidator(_canonical_url)]
_Engine = Literal[ENGINES]  # type: ignore[valid-type]
_MaxConcurrency = Annotated[int, Strict(), Field(ge=1)]


def _kv_endpoint(value: str) -> str:
    """``value`` when it is a ZMQ endpoint a balancer can connect to; ValueError saying what is wrong otherwise."""
    KVEventsEndpoint(value)  # raises ValueError naming the accepted forms
    return value


_KVEndpoint = Annotated[str, Strict(), AfterValidator(_kv_endpoint)]


class _ReplicaInput(BaseModel):
    """A replica as add_replica receives it; fields are checked in this order and the first bad one is reported."""

    model_config = ConfigDict(frozen=True)

    region: _Region
    url: _Url
    engine: _Engine = "vllm"
    max_concurrency: _MaxConcurrency | None = None
    id: _ReplicaId | None = None
    kv_events: _KVEndpoint | None = None
    kv_events_replay: _KVEndpoint | None = None
    kv_block_size: _MaxConcurrency | None = None

    @model_validator(mode="after")
    def _replay_needs_events(self) -> "_ReplicaInput":
        if self.kv_events is None and (self.kv_events_replay is not None or self.kv_block_size is not None):
            raise InvalidInput("kv_events", "required with kv_events_replay or kv_block_size (the replica's KV-cache "
                                            "event endpoint, tcp://HOST:PORT)")
        return self


class _BalancerInput(BaseModel):
    """A balancer as register_balancer receives it."""

    model_config = ConfigDict(frozen=True)

    region: _Region
    url: _Url


_FIELDS = {"region": TypeAdapter(_Region), "url": TypeAdapter(_Url), "engine": TypeAdapter(_Engine),
           "balancer_id": TypeAdapter(_BalancerId | None),
           "max_concurrency": TypeAdapter(_MaxConcurrency | None)}


def _invalid(exc: ValidationError, *, field: str | None = None, kind: str | None = None) -> InvalidInput:
    """The first error in ``exc`` as InvalidInput naming ``field`` (default: the error's own field).

    ``kind`` picks the wording (a key of _RULES; default: the field's name).
    """
    error = exc.errors()[0]
    field = field or str(error["loc"][0])
    kind = kind or field
    value = error["input"]
    if error["type"] == "missing" or (value is None and kind in _REQUIRED):
        return InvalidInput(field, _REQUIRED[kind])
    if error["type"] == "value_error":  # raised by _canonical_url, whose message says what is wrong
        return InvalidInput(field, str(error["ctx"]["error"]))
    return InvalidInput(field, f"{value!r} {_RULES[kind]}")


def _parse(model: type[BaseModel], **fields: Any) -> Any:
    """``model`` built from ``fields``; InvalidInput naming the first bad field."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _check(kind: str, value: object, *, field: str | None = None) -> Any:
    """``value`` validated as a ``kind`` field (a key of _FIELDS); InvalidInput naming ``field`` (default: kind)."""
    try:
        return _FIELDS[kind].validate_python(value)
    except ValidationError as exc:
        raise _invalid(exc, field=field or kind, kind=kind) from None


def normalize_url(url: object, *, field: str = "url") -> str:
    """Validate an endpoint URL and return its canonical form (lower-case scheme and host, no trailing slash).

    Accepts http/https with a host and an optional port in 1..65535; a path (such as ``/v1``) is kept. Raises
    InvalidInput naming ``field`` otherwise. Canonical forms make "http://A:8000/" and "http://a:8000" one URL.
    """
    return _check("url", url, field=field)


def validate_region(region: object) -> str:
    """Return ``region`` if it is a valid region name (letters, digits, '-', '_'; 1-64 chars), else InvalidInput."""
    return _check("region", region)


def validate_engine(engine: object) -> str:
    """Return ``engine`` if it is one of ENGINES, else InvalidInput listing the known names."""
    return _check("engine", engine)


def validate_balancer_id(value: object) -> str | None:
    """Return ``value`` if it is None or a balancer id (1-128 letters, digits, '.', ':', '-', '_'), else
    InvalidInput naming ``id``."""
    return _check("balancer_id", value, field="id")


def validate_max_concurrency(value: object) -> int | None:
    """Return ``value`` if it is None or an int >= 1 (not a bool), else InvalidInput naming max_concurrency."""
    return _check("max_concurrency", value)


class MembershipStore:
    """Membership in a SQLite file at ``path`` (its directory is created if missing; ":memory:" for tests).

    Not thread-safe: use one store from one thread (the controller's event loop). controller/etcd_store.py has the
    same interface over etcd, for several controllers.
    """

    #: The backend's name, as `GET /healthz` reports it.
    kind = "sqlite"

    def __init__(self, path: str | Path):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so every write and its revision bump commit as
        # one transaction, and a second process writing the same file waits rather than interleaving.
        self._db = sqlite3.connect(str(path), isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a write the API acknowledged survives a power loss
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._migrate()

    def close(self) -> None:
        """Close the database file; the store is unusable afterwards."""
        self._db.close()

    # --- reads -------------------------------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The current revision: 0 for a new store, +1 for every write that changed membership."""
        return int(self._db.execute("SELECT value FROM meta WHERE key = 'revision'").fetchone()[0])

    def regions(self) -> list[str]:
        """Every region ever used, sorted by name."""
        return [row[0] for row in self._db.execute("SELECT name FROM regions ORDER BY name")]

    def get_replica(self, replica_id: str) -> Replica | None:
        """The replica with this id, or None."""
        row = self._db.execute("SELECT * FROM replicas WHERE id = ?", (replica_id,)).fetchone()
        return _replica(row) if row else None

    def list_replicas(self, region: str | None = None) -> list[Replica]:
        """Replicas sorted by region then id; only ``region``'s when given."""
        if region is None:
            rows = self._db.execute("SELECT * FROM replicas ORDER BY region, created_at, id")
        else:
            rows = self._db.execute("SELECT * FROM replicas WHERE region = ? ORDER BY created_at, id", (region,))
        return [_replica(row) for row in rows]

    def list_balancers(self) -> list[Balancer]:
        """Registered balancers sorted by region then URL."""
        rows = self._db.execute("SELECT * FROM balancers ORDER BY region, url")
        return [_balancer(row) for row in rows]

    def assignments(self) -> list[Assignment]:
        """One assignment per region, sorted by region (a region never failed over: its own balancer, epoch 0)."""
        stored = {row["region"]: Assignment(row["region"], row["balancer_region"], row["epoch"])
                  for row in self._db.execute("SELECT * FROM assignments")}
        return [stored.get(region, Assignment(region, region, 0)) for region in self.regions()]

    def quotas(self) -> tuple[Quotas | None, int]:
        """The quota document (None until the first change) and the revision of its last change (0: never)."""
        row = self._db.execute("SELECT doc, revision FROM quotas WHERE id = 1").fetchone()
        if row is None or row["doc"] is None:
            return None, 0 if row is None else row["revision"]
        return Quotas.model_validate_json(row["doc"]), row["revision"]

    def snapshot(self) -> Membership:
        """Everything at one revision (read in one transaction, so the parts agree with each other)."""
        self._db.execute("BEGIN")
        try:
            quotas, quotas_revision = self.quotas()
            return Membership(
                revision=self.revision, regions=self.regions(),
                balancers=self.list_balancers(), replicas=self.list_replicas(), assignments=self.assignments(),
                quotas=quotas, quotas_revision=quotas_revision, owners=self.owners(),
            )
        finally:
            self._db.execute("COMMIT")

    def owners(self) -> list[Ownership]:
        """The owner of every replica that has one, sorted by replica id (rows of removed replicas left out)."""
        rows = self._db.execute("SELECT o.* FROM owners o JOIN replicas r ON r.id = o.replica_id "
                                "ORDER BY o.replica_id")
        return [Ownership(row["replica_id"], row["balancer_url"], row["epoch"], row["handover_to"]) for row in rows]

    # --- writes (each one transaction that bumps the revision) --------------------------------------------------

    def add_replica(self, region: str, url: str, engine: str = "vllm", replica_id: str | None = None,
                    *, max_concurrency: int | None = None, now: float | None = None, **kv: Any) -> Replica:
        """Add a replica; the region is created on first use; the id defaults to ``<region>-<n>``.

        ``max_concurrency`` is the replica's parallel slots (int >= 1) or None. ``kv``: ``kv_events``,
        ``kv_events_replay``, ``kv_block_size`` (Replica). ``now`` is unix time in seconds (default: the clock).
        Raises InvalidInput for a bad region, URL, engine, id, max_concurrency or KV-cache event field, and
        Conflict when the URL or the id already exists.
        """
        spec = _parse(_ReplicaInput, region=region, url=url, engine=engine, max_concurrency=max_concurrency,
                      id=replica_id, **kv)
        region, url, engine, max_concurrency, replica_id = (
            spec.region, spec.url, spec.engine, spec.max_concurrency, spec.id)
        created_at = time.time() if now is None else now
        with self._write():
            clash = self._db.execute("SELECT id FROM replicas WHERE url = ?", (url,)).fetchone()
            if clash:
                raise Conflict.url_taken(url, clash[0])
            if replica_id is not None and self.get_replica(replica_id):
                raise Conflict.id_taken(replica_id)
            self._db.execute("INSERT OR IGNORE INTO regions (name) VALUES (?)", (region,))
            if replica_id is None:
                replica_id = self._next_id(region)
            self._db.execute(
                "INSERT INTO replicas (id, region, url, engine, created_at, max_concurrency, kv_events, "
                "kv_events_replay, kv_block_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (replica_id, region, url, engine, created_at, max_concurrency, spec.kv_events,
                 spec.kv_events_replay, spec.kv_block_size),
            )
            self._bump()
        return Replica(id=replica_id, region=region, url=url, engine=engine, created_at=created_at,
                       max_concurrency=max_concurrency, kv_events=spec.kv_events,
                       kv_events_replay=spec.kv_events_replay, kv_block_size=spec.kv_block_size)

    def remove_replica(self, replica_id: str) -> Replica:
        """Remove a replica by id and return it; NotFound if no replica has that id."""
        with self._write():
            replica = self.get_replica(replica_id)
            if replica is None:
                raise NotFound.replica(replica_id)
            self._db.execute("DELETE FROM replicas WHERE id = ?", (replica_id,))
            self._bump()
        return replica

    def register_balancer(self, region: str, url: str, *, balancer_id: str | None = None,
                          now: float | None = None) -> tuple[Balancer, bool]:
        """Register or refresh (heartbeat) the balancer at ``url``; returns (balancer, changed).

        A balancer is identified by its URL; ``balancer_id`` (default: the URL's host:port) names it within its
        region, and another URL holding the same id in the region is removed (the balancer moved; the server
        decides before whether that is allowed). ``changed`` is True, and the revision bumped, only when the
        balancer is new, moved or changed its id; a plain heartbeat updates ``last_seen`` (unix s) and nothing
        else, so heartbeats do not wake every watcher. InvalidInput for a bad region, URL or id.
        """
        spec = _parse(_BalancerInput, region=region, url=url)
        region, url = spec.region, spec.url
        balancer_id = validate_balancer_id(balancer_id) or default_balancer_id(url)
        last_seen = time.time() if now is None else now
        with self._write():
            row = self._db.execute("SELECT region, id FROM balancers WHERE url = ?", (url,)).fetchone()
            moved = self._db.execute("DELETE FROM balancers WHERE region = ? AND id = ? AND url != ?",
                                     (region, balancer_id, url)).rowcount
            changed = row is None or row[0] != region or row[1] != balancer_id or moved > 0
            self._db.execute("INSERT OR IGNORE INTO regions (name) VALUES (?)", (region,))
            self._db.execute(
                "INSERT INTO balancers (url, region, last_seen, id) VALUES (?, ?, ?, ?) ON CONFLICT(url) DO UPDATE "
                "SET region = excluded.region, last_seen = excluded.last_seen, id = excluded.id",
                (url, region, last_seen, balancer_id),
            )
            if changed:
                self._bump()
            row = self._db.execute("SELECT * FROM balancers WHERE url = ?", (url,)).fetchone()
        return _balancer(row), changed

    def set_replica_health(self, replica_id: str, healthy: bool) -> Replica | None:
        """Record the health check's verdict for a replica; bumps the revision only when it changed. Returns the
        replica when its health changed, None when it did not or the replica is gone."""
        with self._write():
            row = self._db.execute("SELECT healthy FROM replicas WHERE id = ?", (replica_id,)).fetchone()
            if row is None or bool(row["healthy"]) == healthy:
                return None
            self._db.execute("UPDATE replicas SET healthy = ? WHERE id = ?", (int(healthy), replica_id))
            self._bump()
        return self.get_replica(replica_id)

    def set_replica_draining(self, replica_id: str, draining: bool) -> tuple[Replica, bool]:
        """Start (or cancel) draining a replica; returns (replica, changed). NotFound for an unknown id.

        A draining replica gets no new request from any balancer; the ones in flight finish. The revision moves only
        when the flag changed.
        """
        with self._write():
            replica = self.get_replica(replica_id)
            if replica is None:
                raise NotFound.replica(replica_id)
            if replica.draining == draining:
                return replica, False
            self._db.execute("UPDATE replicas SET draining = ? WHERE id = ?", (int(draining), replica_id))
            self._bump()
        return self.get_replica(replica_id), True

    def remove_balancer(self, url: str) -> Balancer:
        """Unregister the balancer at ``url`` and return it; NotFound if none has that URL. A balancer still running
        registers again at its next heartbeat."""
        url = normalize_url(url)
        with self._write():
            row = self._db.execute("SELECT * FROM balancers WHERE url = ?", (url,)).fetchone()
            if row is None:
                raise NotFound.balancer(url)
            self._db.execute("DELETE FROM balancers WHERE url = ?", (url,))
            self._bump()
        return _balancer(row)

    def set_balancer_health(self, url: str, healthy: bool) -> Balancer | None:
        """Record the health check's verdict for a balancer; bumps the revision only when it changed. Returns the
        balancer when its health changed, None when it did not or the balancer is gone."""
        return self._set_balancer_flag("healthy", url, healthy)

    def set_balancer_draining(self, region: str, draining: bool) -> list[Balancer]:
        """Start (or cancel) draining every balancer of ``region``; returns those whose flag changed (the revision
        moves once if any did). NotFound when the region has no balancer."""
        region = validate_region(region)
        with self._write():
            rows = self._db.execute("SELECT * FROM balancers WHERE region = ? ORDER BY url", (region,)).fetchall()
            if not rows:
                raise NotFound.region_balancers(region)
            changed = [row["url"] for row in rows if bool(row["draining"]) != draining]
            if changed:
                self._db.execute("UPDATE balancers SET draining = ? WHERE region = ?", (int(draining), region))
                self._bump()
        return [b for b in self.list_balancers() if b.url in changed]

    def assign(self, region: str, balancer_region: str) -> Assignment | None:
        """Make ``balancer_region``'s balancer serve ``region``'s replicas; returns the new assignment (epoch + 1,
        revision + 1), or None when it already did. NotFound for a region never seen."""
        with self._write():
            known = set(self.regions())
            for name in (region, balancer_region):
                if name not in known:
                    raise NotFound.region(name)
            current = next(a for a in self.assignments() if a.region == region)
            if current.balancer_region == balancer_region:
                return None
            new = Assignment(region, balancer_region, current.epoch + 1)
            self._db.execute("INSERT INTO assignments (region, balancer_region, epoch) VALUES (?, ?, ?) "
                             "ON CONFLICT(region) DO UPDATE SET balancer_region = excluded.balancer_region, "
                             "epoch = excluded.epoch", (region, balancer_region, new.epoch))
            self._bump()
        return new

    def set_owners(self, plan: dict[str, str], handovers: dict[str, str | None] | None = None) -> list[Ownership]:
        """Give each replica of ``plan`` ({replica id: balancer URL}) to that balancer, and set or clear (None) the
        ``handover_to`` of each replica of ``handovers``, in one transaction; returns the ownerships that changed
        (a new owner: epoch + 1 and no handover; a handover set or cleared: same epoch). The revision moves once
        when any did. Replicas that no longer exist are skipped."""
        with self._write():
            current = {o.replica: o for o in self.owners()}
            known = {r.id for r in self.list_replicas()}
            epochs = dict(self._db.execute("SELECT replica_id, epoch FROM owners"))
            changed = [Ownership(rid, url, epochs.get(rid, 0) + 1) for rid, url in sorted(plan.items())
                       if rid in known and (rid not in current or current[rid].balancer != url)]
            moved = {o.replica for o in changed}
            changed += [Ownership(rid, current[rid].balancer, current[rid].epoch, to)
                        for rid, to in sorted((handovers or {}).items())
                        if rid in current and rid not in moved and current[rid].handover_to != to]
            self._db.executemany("INSERT INTO owners (replica_id, balancer_url, epoch, handover_to) "
                                 "VALUES (?, ?, ?, ?) ON CONFLICT(replica_id) DO UPDATE SET balancer_url = "
                                 "excluded.balancer_url, epoch = excluded.epoch, handover_to = excluded.handover_to",
                                 [(o.replica, o.balancer, o.epoch, o.handover_to) for o in changed])
            if changed:
                self._bump()
        return changed

    def change_quotas(self, change: Callable[[Quotas | None], Quotas | None]) -> tuple[Quotas | None, bool]:
        """Replace the quota document by ``change(current)`` in one transaction; returns (new document, changed).
        The revision moves (and balancers' watches wake) only when the document changed; an exception raised by
        ``change`` (InvalidInput, NotFound) changes nothing. None clears it (balancers go back to their config's)."""
        with self._write():
            current, _ = self.quotas()
            new = change(current)
            if quotas_json(new) == quotas_json(current):
                return current, False
            self._bump()
            doc = None if new is None else json.dumps(quotas_json(new), sort_keys=True)
            self._db.execute("INSERT INTO quotas (id, doc, revision) VALUES (1, ?, ?) ON CONFLICT(id) DO UPDATE "
                             "SET doc = excluded.doc, revision = excluded.revision", (doc, self.revision))
        return new, True

    # --- helpers ------------------------------------------------------------------------------------------------

    def _set_balancer_flag(self, column: str, url: str, value: bool) -> Balancer | None:
        with self._write():
            row = self._db.execute("SELECT * FROM balancers WHERE url = ?", (url,)).fetchone()
            if row is None or bool(row[column]) == value:
                return None
            self._db.execute(f"UPDATE balancers SET {column} = ? WHERE url = ?", (int(value), url))
            self._bump()
            row = self._db.execute("SELECT * FROM balancers WHERE url = ?", (url,)).fetchone()
        return _balancer(row)

    def _migrate(self) -> None:
        """Bring a file written by an older controller up to this schema (adding a column keeps every row)."""
        columns = {row["name"] for row in self._db.execute("PRAGMA table_info(replicas)")}
        if "max_concurrency" not in columns:
            self._db.execute("ALTER TABLE replicas ADD COLUMN max_concurrency INTEGER")
        if "healthy" not in columns:
            self._db.execute("ALTER TABLE replicas ADD COLUMN healthy INTEGER NOT NULL DEFAULT 1")
        if "draining" not in columns:
            self._db.execute("ALTER TABLE replicas ADD COLUMN draining INTEGER NOT NULL DEFAULT 0")
        for column, kind in (("kv_events", "TEXT"), ("kv_events_replay", "TEXT"), ("kv_block_size", "INTEGER")):
            if column not in columns:
                self._db.execute(f"ALTER TABLE replicas ADD COLUMN {column} {kind}")
        balancer_columns = {row["name"] for row in self._db.execute("PRAGMA table_info(balancers)")}
        for column, default in (("healthy", 1), ("draining", 0)):
            if column not in balancer_columns:
                self._db.execute(f"ALTER TABLE balancers ADD COLUMN {column} INTEGER NOT NULL DEFAULT {default}")
        if "id" not in balancer_columns:  # an older controller's rows get their default id when read (_balancer)
            self._db.execute("ALTER TABLE balancers ADD COLUMN id TEXT")
        if "handover_to" not in {row["name"] for row in self._db.execute("PRAGMA table_info(owners)")}:
            self._db.execute("ALTER TABLE owners ADD COLUMN handover_to TEXT")

    def _write(self) -> "_Transaction":
        return _Transaction(self._db)

    def _bump(self) -> None:
        self._db.execute("UPDATE meta SET value = value + 1 WHERE key = 'revision'")

    def _next_id(self, region: str) -> str:
        # Skip ids an operator already chose by hand (e.g. "us-3" given explicitly before the counter got there).
        n = self._db.execute("SELECT next_replica_n FROM regions WHERE name = ?", (region,)).fetchone()[0]
        while self._db.execute("SELECT 1 FROM replicas WHERE id = ?", (f"{region}-{n}",)).fetchone():
            n += 1
        self._db.execute("UPDATE regions SET next_replica_n = ? WHERE name = ?", (n + 1, region))
        return f"{region}-{n}"


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK when the body raises (so a refused write changes nothing)."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _replica(row: sqlite3.Row) -> Replica:
    return Replica(id=row["id"], region=row["region"], url=row["url"], engine=row["engine"],
                   created_at=row["created_at"], max_concurrency=row["max_concurrency"], healthy=bool(row["healthy"]),
                   draining=bool(row["draining"]), kv_events=row["kv_events"], kv_events_replay=row["kv_events_replay"],
                   kv_block_size=row["kv_block_size"])


def _balancer(row: sqlite3.Row) -> Balancer:
    return Balancer(region=row["region"], url=row["url"], last_seen=row["last_seen"], healthy=bool(row["healthy"]),
                    draining=bool(row["draining"]), id=row["id"] or "")
