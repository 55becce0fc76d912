"""Membership in etcd, for several controllers at once: the interface and semantics of MembershipStore.

Keys under ``prefix`` (default /skylb):

- ``<prefix>/membership``: the whole membership as one JSON document (``_State``): {"format": 1, "revision": N,
  "regions": {name: next replica number}, "replicas": {id: replica}, "balancers": {url: {"region", "healthy",
  "draining", "id"}}, "assignments": {region: {"balancer_region", "epoch"}}, "owners": {replica id: {"balancer",
  "epoch", "handover_to"}}, "quotas": the quota document or null, "quotas_revision": the revision of its last change}.
- ``<prefix>/last_seen/<balancer url>``: that balancer's latest heartbeat (unix s, as text). Heartbeats live apart
  so that they neither rewrite the document nor collide with membership writes.

Every write is a read-modify-write: read the document and its etcd ``mod_revision``, apply the change in memory,
then commit it in one etcd transaction that succeeds only if the document's ``mod_revision`` is still the one read
(compare-and-swap). When another controller wrote in between, the transaction answers the new state and the change
is applied again to that (at most ``_CAS_ATTEMPTS`` times, then StoreUnavailable; after a few, with a short
jittered wait between tries). So, as with SQLite's BEGIN IMMEDIATE, a write and its revision bump are one atomic
step, writes through any controller are serialised, and a refused write (InvalidInput, Conflict, NotFound) changes
nothing. Reads are etcd's linearizable reads: a write acknowledged by one controller is seen by the next read
through any other.

Client library: etcd3gw (OpenStack's, maintained), which speaks etcd's JSON gateway (``/v3/...``, on by default
since etcd 3.4) over ``requests``. It needs neither grpcio nor generated protobuf code, which is what breaks the
gRPC clients: python-etcd3 0.12 (its last release, 2020) no longer imports with current protobuf ("Descriptors
cannot be created directly"). etcd3gw talks to one endpoint per client, hence ``EtcdConnection`` below, which moves
to the next endpoint when one does not answer.

Calls are synchronous, like MembershipStore's, and the server makes them from its event loop: each is one HTTP round
trip to etcd (about 2 ms on loopback; a write about 3 ms, etcd's fsync included), bounded by ``timeout_s`` when
etcd does not answer (StoreUnavailable, HTTP 503). The document is read whole at every call, which suits hundreds
of replicas (tens of KB); etcd refuses a value over 1.5 MiB.
"""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from controller.store import (Assignment, Balancer, Conflict, Membership, NotFound, Ownership, Replica,
                              StoreUnavailable, _BalancerInput, _parse, _ReplicaInput, default_balancer_id,
                              normalize_url, quotas_json, validate_balancer_id, validate_region)
from skylb.quota.limits import Quotas

__all__ = ["EtcdConnection", "EtcdMembershipStore", "REQUEST_TIMEOUT_S"]

#: Longest wait for one answer from etcd (s) before the call fails with StoreUnavailable.
REQUEST_TIMEOUT_S = 2.0
#: Compare-and-swap tries of one write before it gives up (each retry follows a write by another controller).
_CAS_ATTEMPTS = 20
#: After this many lost compare-and-swaps in a row, each retry waits a jittered, doubling moment (2 ms, at most
#: ``_CAS_BACKOFF_MAX_S``) first, as client-go's ``retry.RetryOnConflict`` backs off: four writers retrying at once
#: without it starved one of them 20 times in a row on a loaded machine.
_CAS_BACKOFF_AFTER = 3
_CAS_BACKOFF_MAX_S = 0.05
#: Version of the document's shape, for a later migration.
_FORMAT = 1

T = TypeVar("T")


def b64(data: bytes) -> str:
    """``data`` as the JSON gateway carries bytes (base64)."""
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (its last byte + 1; prefixes here are ASCII)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdConnection:
    """etcd3gw clients of ``endpoints`` ("http://host:port"); a call goes to one and moves to the next that answers.

    Not thread-safe: one connection per thread (the store's in the event loop, the election's in its worker).
    """

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = REQUEST_TIMEOUT_S):
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self._clients = [_client(url, timeout_s) for url in self.endpoints]
        self._current = 0

    @property
    def endpoint(self) -> str:
        """The endpoint the next call goes to."""
        return self.endpoints[self._current]

    def call(self, op: Callable[[Etcd3Client], T], *, retry: bool = True) -> T:
        """``op(client)``; when the endpoint does not answer, the next one is used from then on and, with ``retry``
        (reads, and writes that are safe to repeat), tried at once. StoreUnavailable when none answered, or etcd
        answered with an error."""
        errors = []
        for _ in range(len(self._clients) if retry else 1):
            endpoint = self.endpoint
            try:
                return op(self._clients[self._current])
            except (ConnectionFailedError, ConnectionTimeoutError) as exc:
                errors.append(f"{endpoint}: {_reason(exc)}")
                self._current = (self._current + 1) % len(self._clients)
            except Etcd3Exception as exc:
                raise StoreUnavailable(f"etcd at {endpoint} answered an error: {_reason(exc)}") from exc
            except (requests.RequestException, ValueError) as exc:  # a broken answer (ValueError: not JSON)
                raise StoreUnavailable(f"etcd at {endpoint}: {type(exc).__name__}: {exc}") from exc
        raise StoreUnavailable(f"cannot reach etcd ({'; '.join(errors)})")

    def close(self) -> None:
        """Close every endpoint's HTTP session; the connection is unusable afterwards."""
        for client in self._clients:
            client.session.close()


def _client(url: str, timeout_s: float) -> Etcd3Client:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"etcd endpoint {url!r} is not a URL such as http://127.0.0.1:2379")
    # api_path: etcd >= 3.4 serves /v3/; naming it skips the client's version probe on first use.
    return Etcd3Client(host=parts.hostname, port=parts.port or 2379, protocol=parts.scheme, timeout=timeout_s,
                       api_path="/v3/")


def _reason(exc: Etcd3Exception) -> str:
    """A short cause for an etcd3gw exception (its own text is a long requests message, or empty)."""
    if isinstance(exc, ConnectionTimeoutError):
        return "timed out"
    text = exc.detail_text or str(exc) or type(exc).__name__
    if "Connection refused" in text:
        return "connection refused"
    return text.strip()[:200]


@dataclass
class _State:
    """The membership as the document holds it, with each balancer's last_seen from its heartbeat key."""

    revision: int = 0
    #: Every region ever used -> its next replica number (ids are never reused, as in MembershipStore).
    next_replica_n: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    balancers: dict[str, Balancer] = field(default_factory=dict)
    #: Only regions that were assigned at least once; the others are their own balancer's at epoch 0.
    assignments: dict[str, Assignment] = field(default_factory=dict)
    #: The quota document (None: never set) and the revision of its last change.
    quotas: Quotas | None = None
    quotas_revision: int = 0
    #: Every replica's owner ever given (kept after the replica goes, so its epoch never goes back).
    owners: dict[str, Ownership] = field(default_factory=dict)

    @classmethod
    def decode(cls, doc: bytes | None, last_seen: dict[str, float]) -> _State:
        if doc is None:
            return cls()
        data = json.loads(doc)
        return cls(
            revision=data["revision"],
            next_replica_n=data["regions"],
            replicas={rid: Replica(**r) for rid, r in data["replicas"].items()},
            balancers={url: Balancer(url=url, last_seen=last_seen.get(url, 0.0), **b)
                       for url, b in data["balancers"].items()},
            assignments={region: Assignment(region=region, **a) for region, a in data["assignments"].items()},
            owners={rid: Ownership(replica=rid, **o) for rid, o in data.get("owners", {}).items()},
            # A document written before quotas existed has neither key.
            quotas=None if data.get("quotas") is None else Quotas.model_validate(data["quotas"]),
            quotas_revision=data.get("quotas_revision", 0),
        )

    def encode(self) -> bytes:
        """The document (without last_seen); equal states encode to equal bytes."""
        return json.dumps({
            "format": _FORMAT,
            "revision": self.revision,
            "regions": self.next_replica_n,
            "replicas": {rid: asdict(r) for rid, r in self.replicas.items()},
            "balancers": {url: {"region": b.region, "healthy": b.healthy, "draining": b.draining, "id": b.id}
                          for url, b in self.balancers.items()},
            "assignments": {region: {"balancer_region": a.balancer_region, "epoch": a.epoch}
                            for region, a in self.assignments.items()},
            "owners": {rid: {"balancer": o.balancer, "epoch": o.epoch, "handover_to": o.handover_to}
                       for rid, o in self.owners.items()},
            "quotas": quotas_json(self.quotas),
            "quotas_revision": self.quotas_revision,
        }, sort_keys=True, separators=(",", ":")).encode()

    def regions(self) -> list[str]:
        return sorted(self.next_replica_n)

    def list_replicas(self, region: str | None = None) -> list[Replica]:
        chosen = [r for r in self.replicas.values() if region is None or r.region == region]
        return sorted(chosen, key=lambda r: (r.region, r.created_at, r.id))

    def list_balancers(self) -> list[Balancer]:
        return sorted(self.balancers.values(), key=lambda b: (b.region, b.url))

    def list_assignments(self) -> list[Assignment]:
        return [self.assignments.get(region, Assignment(region, region, 0)) for region in self.regions()]

    def membership(self) -> Membership:
        return Membership(revision=self.revision, regions=self.regions(), balancers=self.list_balancers(),
                          replicas=self.list_replicas(), assignments=self.list_assignments(), quotas=self.quotas,
                          quotas_revision=self.quotas_revision, owners=self.list_owners())

    def list_owners(self) -> list[Ownership]:
        return [self.owners[rid] for rid in sorted(self.owners) if rid in self.replicas]

    def next_id(self, region: str) -> str:
        # Skip ids an operator already chose by hand (e.g. "us-3" given explicitly before the counter got there).
        n = self.next_replica_n[region]
        while f"{region}-{n}" in self.replicas:
            n += 1
        self.next_replica_n[region] = n + 1
        return f"{region}-{n}"


class EtcdMembershipStore:
    """Membership in etcd under ``prefix``, shared by every controller given the same endpoints and prefix.

    ``endpoints`` are the etcd cluster's client URLs ("http://host:port"); ``timeout_s`` bounds each call. Raises
    StoreUnavailable at once when no endpoint answers. Every method has MembershipStore's signature, semantics and
    errors (tests/test_store.py runs the same checks on both), plus StoreUnavailable (HTTP 503) when etcd does not
    answer or a write met ``_CAS_ATTEMPTS`` concurrent writes in a row; a write that failed so may or may not have
    been applied, as with any store over a network.

    Not thread-safe: use one store from one thread (the controller's event loop).
    """

    #: The backend's name, as `GET /healthz` reports it.
    kind = "etcd"

    def __init__(self, endpoints: Sequence[str] = ("http://127.0.0.1:2379",), *, prefix: str = "/skylb",
                 timeout_s: float = REQUEST_TIMEOUT_S):
        self.prefix = prefix.rstrip("/")
        self._doc_key = f"{self.prefix}/membership".encode()
        self._seen_prefix = f"{self.prefix}/last_seen/".encode()
        self._etcd = EtcdConnection(endpoints, timeout_s=timeout_s)
        self._read()  # fail now, not at the first request, when etcd is not there

    def close(self) -> None:
        """Close the connections to etcd; the store is unusable afterwards (the data stays in etcd)."""
        self._etcd.close()

    # --- reads (one linearizable etcd read each) ------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The current revision: 0 for a new store, +1 for every write that changed membership."""
        return self._read()[0].revision

    def regions(self) -> list[str]:
        """Every region ever used, sorted by name."""
        return self._read()[0].regions()

    def get_replica(self, replica_id: str) -> Replica | None:
        """The replica with this id, or None."""
        return self._read()[0].replicas.get(replica_id)

    def list_replicas(self, region: str | None = None) -> list[Replica]:
        """Replicas sorted by region, then creation time, then id; only ``region``'s when given."""
        return self._read()[0].list_replicas(region)

    def list_balancers(self) -> list[Balancer]:
        """Registered balancers sorted by region then URL."""
        return self._read()[0].list_balancers()

    def assignments(self) -> list[Assignment]:
        """One assignment per region, sorted by region (a region never failed over: its own balancer, epoch 0)."""
        return self._read()[0].list_assignments()

    def quotas(self) -> tuple[Quotas | None, int]:
        """The quota document (None until the first change) and the revision of its last change (0: never)."""
        state = self._read()[0]
        return state.quotas, state.quotas_revision

    def owners(self) -> list[Ownership]:
        """The owner of every replica that has one, sorted by replica id."""
        return self._read()[0].list_owners()

    def snapshot(self) -> Membership:
        """Everything at one revision (the document and the heartbeats are read in one etcd transaction)."""
        return self._read()[0].membership()

    # --- writes (each one compare-and-swap that bumps the revision when membership changed) -----------------------

    def add_replica(self, region: str, url: str, engine: str = "vllm", replica_id: str | None = None,
                    *, max_concurrency: int | None = None, now: float | None = None, **kv: Any) -> Replica:
        """As MembershipStore.add_replica: InvalidInput for a bad field, Conflict for a URL or id in use."""
        spec = _parse(_ReplicaInput, region=region, url=url, engine=engine, max_concurrency=max_concurrency,
                      id=replica_id, **kv)
        created_at = time.time() if now is None else now

        def change(state: _State) -> Replica:
            clash = next((r for r in state.replicas.values() if r.url == spec.url), None)
            if clash:
                raise Conflict.url_taken(spec.url, clash.id)
            if spec.id is not None and spec.id in state.replicas:
                raise Conflict.id_taken(spec.id)
            state.next_replica_n.setdefault(spec.region, 1)
            replica = Replica(id=spec.id or state.next_id(spec.region), region=spec.region, url=spec.url,
                              engine=spec.engine, created_at=created_at, max_concurrency=spec.max_concurrency,
                              kv_events=spec.kv_events, kv_events_replay=spec.kv_events_replay,
                              kv_block_size=spec.kv_block_size)
            state.replicas[replica.id] = replica
            return replica

        return self._write(change)

    def remove_replica(self, replica_id: str) -> Replica:
        """Remove a replica by id and return it; NotFound if no replica has that id."""
        def change(state: _State) -> Replica:
            if replica_id not in state.replicas:
                raise NotFound.replica(replica_id)
            return state.replicas.pop(replica_id)

        return self._write(change)

    def register_balancer(self, region: str, url: str, *, balancer_id: str | None = None,
                          now: float | None = None) -> tuple[Balancer, bool]:
        """As MembershipStore.register_balancer: (balancer, changed); only a new balancer, a region or id change or
        a move (another URL held the id) bumps the revision, a heartbeat writes its last_seen key alone."""
        spec = _parse(_BalancerInput, region=region, url=url)
        balancer_id = validate_balancer_id(balancer_id) or default_balancer_id(spec.url)
        last_seen = time.time() if now is None else now

        def change(state: _State) -> tuple[Balancer, bool]:
            old = state.balancers.get(spec.url)
            moved = [u for u, b in state.balancers.items()
                     if b.region == spec.region and b.id == balancer_id and u != spec.url]
            for gone in moved:
                del state.balancers[gone]
            state.next_replica_n.setdefault(spec.region, 1)
            new = (Balancer(region=spec.region, url=spec.url, last_seen=last_seen, id=balancer_id) if old is None
                   else replace(old, region=spec.region, last_seen=last_seen, id=balancer_id))
            state.balancers[spec.url] = new
            return new, old is None or old.region != spec.region or old.id != balancer_id or bool(moved)

        return self._write(change)

    def set_replica_health(self, replica_id: str, healthy: bool) -> Replica | None:
        """The health check's verdict; the replica when its health changed, None when not or when it is gone."""
        return self._write(lambda state: _set_flag(state.replicas, replica_id, "healthy", healthy))

    def set_replica_draining(self, replica_id: str, draining: bool) -> tuple[Replica, bool]:
        """Start (or cancel) draining a replica; (replica, changed). NotFound for an unknown id."""
        def change(state: _State) -> tuple[Replica, bool]:
            if replica_id not in state.replicas:
                raise NotFound.replica(replica_id)
            changed = _set_flag(state.replicas, replica_id, "draining", draining)
            return state.replicas[replica_id], changed is not None

        return self._write(change)

    def remove_balancer(self, url: str) -> Balancer:
        """Unregister the balancer at ``url`` and return it; NotFound if none has that URL."""
        url = normalize_url(url)

        def change(state: _State) -> Balancer:
            if url not in state.balancers:
                raise NotFound.balancer(url)
            return state.balancers.pop(url)

        return self._write(change)

    def set_balancer_health(self, url: str, healthy: bool) -> Balancer | None:
        """The health check's verdict; the balancer when its health changed, None when not or when it is gone."""
        return self._write(lambda state: _set_flag(state.balancers, url, "healthy", healthy))

    def set_balancer_draining(self, region: str, draining: bool) -> list[Balancer]:
        """Start (or cancel) draining every balancer of ``region``; those whose flag changed, sorted by URL.
        NotFound when the region has no balancer."""
        region = validate_region(region)

        def change(state: _State) -> list[Balancer]:
            urls = sorted(url for url, b in state.balancers.items() if b.region == region)
            if not urls:
                raise NotFound.region_balancers(region)
            changed = (_set_flag(state.balancers, url, "draining", draining) for url in urls)
            return [b for b in changed if b is not None]

        return self._write(change)

    def assign(self, region: str, balancer_region: str) -> Assignment | None:
        """Make ``balancer_region``'s balancer serve ``region``'s replicas; the new assignment (epoch + 1), or None
        when it already did. NotFound for a region never seen."""
        def change(state: _State) -> Assignment | None:
            for name in (region, balancer_region):
                if name not in state.next_replica_n:
                    raise NotFound.region(name)
            current = state.assignments.get(region, Assignment(region, region, 0))
            if current.balancer_region == balancer_region:
                return None
            state.assignments[region] = Assignment(region, balancer_region, current.epoch + 1)
            return state.assignments[region]

        return self._write(change)

    def set_owners(self, plan: dict[str, str], handovers: dict[str, str | None] | None = None) -> list[Ownership]:
        """As MembershipStore.set_owners: the ownerships that changed (new owners at epoch + 1, handovers set or
        cleared at the same epoch), in one compare-and-swap."""
        def change(state: _State) -> list[Ownership]:
            current = {rid: o for rid, o in state.owners.items() if rid in state.replicas}
            changed = [Ownership(rid, url, state.owners[rid].epoch + 1 if rid in state.owners else 1)
                       for rid, url in sorted(plan.items()) if rid in state.replicas
                       and (rid not in current or current[rid].balancer != url)]
            moved = {o.replica for o in changed}
            changed += [replace(current[rid], handover_to=to) for rid, to in sorted((handovers or {}).items())
                        if rid in current and rid not in moved and current[rid].handover_to != to]
            state.owners.update((o.replica, o) for o in changed)
            return changed

        return self._write(change)

    def change_quotas(self, change: Callable[[Quotas | None], Quotas | None]) -> tuple[Quotas | None, bool]:
        """As MembershipStore.change_quotas: (new document, changed), by compare-and-swap (``change`` may run again
        on another controller's newer document, so it must be a pure function of its argument)."""
        def apply(state: _State) -> tuple[Quotas | None, bool]:
            new = change(state.quotas)
            if quotas_json(new) == quotas_json(state.quotas):
                return state.quotas, False
            state.quotas, state.quotas_revision = new, state.revision + 1  # _write bumps the revision to this
            return new, True

        return self._write(apply)

    # --- helpers ------------------------------------------------------------------------------------------------

    def _reads(self) -> list[dict[str, Any]]:
        """The transaction operations that read the document and every heartbeat."""
        return [{"request_range": {"key": b64(self._doc_key)}},
                {"request_range": {"key": b64(self._seen_prefix), "range_end": b64(prefix_end(self._seen_prefix))}}]

    def _read(self) -> tuple[_State, int]:
        """The state and the document's etcd mod_revision (0 when it does not exist yet), read at one revision."""
        answer = self._etcd.call(lambda c: c.transaction({"compare": [], "success": self._reads(), "failure": []}))
        return self._decode(answer["responses"])

    def _decode(self, responses: list[dict]) -> tuple[_State, int]:
        docs = responses[0]["response_range"].get("kvs", [])
        seen = {unb64(kv["key"])[len(self._seen_prefix):].decode(): float(unb64(kv.get("value", "")))
                for kv in responses[1]["response_range"].get("kvs", [])}
        if not docs:
            return _State.decode(None, seen), 0
        return _State.decode(unb64(docs[0].get("value", "")), seen), int(docs[0]["mod_revision"])

    def _write(self, change: Callable[[_State], T]) -> T:
        """Apply ``change`` (which mutates the state it is given and returns the method's result) by
        compare-and-swap; bump the revision when the document changed; write changed heartbeats alongside."""
        state, mod_revision = self._read()
        for attempt in range(_CAS_ATTEMPTS):
            before, seen_before = state.encode(), {url: b.last_seen for url, b in state.balancers.items()}
            result = change(state)  # a refusal raises here, before anything is written
            ops = []
            if state.encode() != before:
                state.revision += 1
                ops.append({"request_put": {"key": b64(self._doc_key), "value": b64(state.encode())}})
            for url, balancer in state.balancers.items():
                if seen_before.get(url) != balancer.last_seen:
                    ops.append({"request_put": {"key": b64(self._seen_key(url)),
                                                "value": b64(repr(balancer.last_seen).encode())}})
            ops += [{"request_delete_range": {"key": b64(self._seen_key(url))}}
                    for url in seen_before.keys() - state.balancers.keys()]
            if not ops:
                return result
            # Not retried on another endpoint: a lost answer may hide a committed write (the operator retries).
            txn = {"compare": [{"key": b64(self._doc_key), "target": "MOD", "result": "EQUAL",
                                "mod_revision": mod_revision}],
                   "success": ops, "failure": self._reads()}
            answer = self._etcd.call(lambda c: c.transaction(txn), retry=False)
            if answer.get("succeeded"):
                return result
            if attempt < _CAS_BACKOFF_AFTER:
                state, mod_revision = self._decode(answer["responses"])  # another controller wrote: apply to that
            else:  # still contended: wait a jittered, growing moment, then read afresh (the answer is stale by then)
                backoff_s = min(_CAS_BACKOFF_MAX_S, 0.002 * 2 ** (attempt - _CAS_BACKOFF_AFTER))
                time.sleep(random.uniform(0.5, 1.0) * backoff_s)
                state, mod_revision = self._read()
        raise StoreUnavailable(f"membership in etcd changed under this write {_CAS_ATTEMPTS} times in a row; "
                               "try again")

    def _seen_key(self, url: str) -> bytes:
        return self._seen_prefix + url.encode()


def _set_flag(items: dict[str, Any], key: str, flag: str, value: bool) -> Any:
    """Set ``items[key].<flag>`` to ``value``; the updated item when it changed, None when not or when it is gone."""
    item = items.get(key)
    if item is None or getattr(item, flag) == value:
        return None
    items[key] = replace(item, **{flag: value})
    return items[key]
