"""The membership store's semantics: ids, revisions, validation, conflicts, heartbeats, reopening, failover and
drain state. Every test takes the ``store`` fixture (or ``reopen``), so each backend, SQLite and etcd, runs the same
checks; the SQLite file's migrations are checked at the end."""

from __future__ import annotations

import inspect
import sqlite3
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from controller.etcd_store import EtcdMembershipStore
from controller.store import Assignment, Conflict, InvalidInput, MembershipStore, NotFound, StoreUnavailable
from tests.procs import free_port


@pytest.fixture
def store(reopen):
    """An empty store of each backend."""
    return reopen()


def test_both_stores_have_one_interface():
    """EtcdMembershipStore has exactly MembershipStore's public methods, with the same signatures."""
    def interface(cls):
        return {name: (str(inspect.signature(member)) if callable(member) else type(member).__name__)
                for name, member in vars(cls).items() if not name.startswith("_") and name != "kind"}

    assert interface(EtcdMembershipStore) == interface(MembershipStore)
    assert (MembershipStore.kind, EtcdMembershipStore.kind) == ("sqlite", "etcd")


def test_assigns_region_ids_and_bumps_revision(store):
    """add_replica creates the region, numbers ids <region>-<n> per region, and bumps the revision once per write."""
    assert store.revision == 0
    a = store.add_replica("us", "http://10.0.0.1:8000")
    b = store.add_replica("us", "http://10.0.0.2:8000", "sglang")
    c = store.add_replica("eu", "http://10.0.0.3:8000", replica_id="eu-custom")
    d = store.add_replica("eu", "http://10.0.0.4:8000")
    assert [r.id for r in (a, b, c, d)] == ["us-1", "us-2", "eu-custom", "eu-1"]
    assert store.revision == 4
    assert store.regions() == ["eu", "us"]
    assert [r.id for r in store.list_replicas("us")] == ["us-1", "us-2"]
    assert store.get_replica("us-2") == b and store.get_replica("us-9") is None
    snap = store.snapshot().to_dict()
    assert snap["revision"] == 4 and len(snap["replicas"]) == 4
    assert set(snap["replicas"][0]) >= {"id", "region", "url", "engine"}


def test_ids_chosen_by_hand_are_skipped(store):
    """An id given by hand that the counter later reaches is skipped, not reused."""
    store.add_replica("us", "http://a:1", replica_id="us-2")
    assert [store.add_replica("us", f"http://b:{n}").id for n in (1, 2)] == ["us-1", "us-3"]


def test_conflicts_change_nothing(store):
    """A duplicate URL (also in another spelling) or id raises Conflict and leaves the revision unchanged."""
    store.add_replica("us", "http://host-a:8000")
    for url in ("http://host-a:8000", "HTTP://Host-A:8000/"):
        with pytest.raises(Conflict, match="already registered as replica us-1"):
            store.add_replica("eu", url)
    with pytest.raises(Conflict, match="us-1 already exists"):
        store.add_replica("us", "http://host-b:8000", replica_id="us-1")
    assert store.revision == 1
    assert store.regions() == ["us"]  # the refused add in "eu" rolled back the region it created


@pytest.mark.parametrize("kwargs, field", [
    ({"url": "ftp://a:1"}, "url"),
    ({"url": "http://:8000"}, "url"),
    ({"url": "http://a:99999"}, "url"),
    ({"url": "http://a:0"}, "url"),
    ({"url": "http://user:pw@a:1"}, "url"),
    ({"url": "not a url"}, "url"),
    ({"url": None}, "url"),
    ({"engine": "triton"}, "engine"),
    ({"region": "us east"}, "region"),
    ({"region": None}, "region"),
    ({"region": "us\n"}, "region"),
    ({"replica_id": "a/b"}, "id"),
    ({"replica_id": "us-1\n"}, "id"),
    ({"replica_id": 7}, "id"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"max_concurrency": -2}, "max_concurrency"),
    ({"max_concurrency": True}, "max_concurrency"),
    ({"max_concurrency": "4"}, "max_concurrency"),
    ({"max_concurrency": 2.5}, "max_concurrency"),
])
def test_rejects_invalid_fields(store, kwargs, field):
    """Malformed URLs, engines, regions, ids and max_concurrency (an int >= 1, not a bool, string or float) raise
    InvalidInput naming the field, and change nothing."""
    args = {"region": "us", "url": "http://a:1", "engine": "vllm"} | kwargs
    with pytest.raises(InvalidInput) as info:
        store.add_replica(**args)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    assert store.revision == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"region": None}, "region: required, a region name such as us"),
    ({"region": "us east"}, "region: 'us east' must be 1-64 letters, digits, '-' or '_'"),
    ({"url": ""}, "url: required, a URL such as http://10.0.0.5:8000"),
    ({"url": 8000}, "url: 8000 is not a URL such as http://10.0.0.5:8000"),
    ({"url": "ftp://a:1"}, "url: 'ftp://a:1' must start with http:// or https://"),
    ({"url": "http://a:99999"}, "url: 'http://a:99999' is not a valid URL (Port out of range 0-65535)"),
    ({"engine": None}, "engine: None is not a known engine (one of: vllm, sglang, llamacpp, tgi, ollama, openai, "
                       "auto)"),
    ({"replica_id": "a/b"}, "id: 'a/b' must be 1-128 letters, digits, '.', '-' or '_'"),
    ({"max_concurrency": "4"}, "max_concurrency: '4' must be an integer of at least 1 (parallel requests)"),
    ({"url": "bad", "engine": "nim", "replica_id": "a/b"}, "url: 'bad' must start with http:// or https://"),
])
def test_error_messages_say_what_is_expected(store, kwargs, message):
    """InvalidInput names the first bad field, quotes its value and says what a valid one looks like."""
    with pytest.raises(InvalidInput) as info:
        store.add_replica(**({"region": "us", "url": "http://a:1"} | kwargs))
    assert str(info.value) == message


def test_remove_and_ids_are_not_reused(store):
    """remove_replica returns the replica, NotFound for unknown ids, and a later add gets a fresh id."""
    store.add_replica("us", "http://a:1")
    assert store.remove_replica("us-1").url == "http://a:1"
    with pytest.raises(NotFound, match="no replica 'us-1'"):
        store.remove_replica("us-1")
    assert store.add_replica("us", "http://a:1").id == "us-2"
    assert store.revision == 3


def test_survives_reopen(reopen):
    """Replicas, balancers, regions, the revision and the id counter survive closing and reopening the store."""
    store = reopen()
    store.add_replica("us", "http://a:1")
    store.register_balancer("us", "http://lb-us:9000", now=100.0)
    before = store.snapshot()
    store.close()
    store = reopen()
    assert store.snapshot() == before and before.revision == 2
    assert store.add_replica("us", "http://a:2").id == "us-2"


def test_balancer_heartbeat_does_not_bump_revision(store):
    """register_balancer bumps the revision for a new balancer or a region move, not for a heartbeat."""
    assert store.register_balancer("us", "http://lb:9000", now=1.0)[1] is True
    balancer, changed = store.register_balancer("us", "http://lb:9000/", now=2.0)
    assert (changed, balancer.last_seen, store.revision) == (False, 2.0, 1)
    assert store.list_balancers()[0].last_seen == 2.0
    assert store.register_balancer("eu", "http://lb:9000", now=3.0)[1] is True
    assert store.revision == 2
    assert store.list_balancers()[0].region == "eu"


def test_keeps_max_concurrency_and_defaults_to_none(store):
    """add_replica stores an optional max_concurrency (None when unset) and every read returns it."""
    plain = store.add_replica("us", "http://a:1")
    slots = store.add_replica("us", "http://b:11434", "ollama", max_concurrency=4)
    assert plain.max_concurrency is None and slots.max_concurrency == 4
    assert [r.max_concurrency for r in store.list_replicas()] == [None, 4]
    assert store.get_replica(slots.id) == slots
    assert store.snapshot().to_dict()["replicas"][1]["max_concurrency"] == 4


def test_replica_health_is_a_revision_only_when_it_changes(store):
    """The health check's verdict is stored with the replica; a change bumps the revision, a repeat does not; an
    unknown replica is ignored."""
    store.add_replica("us", "http://10.0.0.1:8000", "vllm", "us-a")
    assert store.get_replica("us-a").healthy and store.revision == 1
    assert store.set_replica_health("us-a", True) is None and store.revision == 1
    changed = store.set_replica_health("us-a", False)
    assert changed is not None and not changed.healthy and store.revision == 2
    assert store.set_replica_health("us-a", False) is None and store.revision == 2
    assert store.set_replica_health("nobody", False) is None
    assert store.snapshot().to_dict()["replicas"][0]["healthy"] is False


def _two_regions(store) -> None:
    store.add_replica("us", "http://10.0.0.1:8000", replica_id="us-1")
    store.add_replica("eu", "http://10.0.0.2:8000", replica_id="eu-1")
    store.register_balancer("us", "http://lb-us:9000", now=1.0)
    store.register_balancer("eu", "http://lb-eu:9000", now=1.0)


def test_every_region_starts_assigned_to_its_own_balancer_at_epoch_0(store):
    _two_regions(store)
    assert store.assignments() == [Assignment("eu", "eu", 0), Assignment("us", "us", 0)]
    assert store.snapshot().to_dict()["assignments"] == [
        {"region": "eu", "balancer_region": "eu", "epoch": 0}, {"region": "us", "balancer_region": "us", "epoch": 0}]


def test_assign_bumps_epoch_and_revision_on_change_only(store):
    """A failover and a failback each bump the epoch; assigning what already holds changes nothing."""
    _two_regions(store)
    revision = store.revision
    assert store.assign("us", "eu") == Assignment("us", "eu", 1)
    assert store.revision == revision + 1
    assert store.assign("us", "eu") is None and store.revision == revision + 1
    assert store.assign("us", "us") == Assignment("us", "us", 2)
    assert [a for a in store.assignments() if a.region == "us"] == [Assignment("us", "us", 2)]
    with pytest.raises(NotFound):
        store.assign("mars", "us")
    with pytest.raises(NotFound):
        store.assign("us", "mars")


def test_balancer_health_and_drain_are_revisions_only_when_they_change(store):
    _two_regions(store)
    revision = store.revision
    changed = store.set_balancer_health("http://lb-us:9000", False)
    assert changed is not None and not changed.healthy and store.revision == revision + 1
    assert store.set_balancer_health("http://lb-us:9000", False) is None and store.revision == revision + 1
    assert store.set_balancer_health("http://nobody:1", False) is None
    # A heartbeat keeps the verdict and the drain flag: only the health check and the operator change them.
    balancer, changed = store.register_balancer("us", "http://lb-us:9000", now=2.0)
    assert not changed and not balancer.healthy
    assert [b.url for b in store.set_balancer_draining("eu", True)] == ["http://lb-eu:9000"]
    assert store.set_balancer_draining("eu", True) == [] and store.revision == revision + 2
    assert {b.region: (b.healthy, b.draining) for b in store.list_balancers()} == {
        "us": (False, False), "eu": (True, True)}
    with pytest.raises(NotFound):
        store.set_balancer_draining("asia", True)


def test_replica_drain_and_balancer_removal(store):
    _two_regions(store)
    revision = store.revision
    replica, changed = store.set_replica_draining("us-1", True)
    assert changed and replica.draining and store.revision == revision + 1
    assert store.set_replica_draining("us-1", True) == (replica, False)
    assert store.snapshot().to_dict()["replicas"][1]["draining"] is True
    with pytest.raises(NotFound):
        store.set_replica_draining("us-9", True)
    assert store.remove_balancer("http://LB-US:9000/").url == "http://lb-us:9000"
    assert [b.region for b in store.list_balancers()] == ["eu"] and store.revision == revision + 2
    with pytest.raises(NotFound):
        store.remove_balancer("http://lb-us:9000")


def test_failover_state_survives_reopen(reopen):
    store = reopen()
    _two_regions(store)
    store.assign("us", "eu")
    store.set_balancer_health("http://lb-us:9000", False)
    store.set_replica_draining("eu-1", True)
    before = store.snapshot()
    store.close()
    assert reopen().snapshot() == before


# --- SQLite only: files written by older controllers ----------------------------------------------------------------

def _old_file(path, replicas_columns: str, rows: str) -> None:
    """A SQLite file as an older controller wrote it: its replicas table had ``replicas_columns`` after created_at
    (and balancers had no health or drain); ``rows`` are its INSERT statements."""
    db = sqlite3.connect(path)
    db.executescript(f"""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        CREATE TABLE regions (name TEXT PRIMARY KEY, next_replica_n INTEGER NOT NULL DEFAULT 1);
        CREATE TABLE balancers (url TEXT PRIMARY KEY, region TEXT NOT NULL REFERENCES regions(name),
                                last_seen REAL NOT NULL);
        CREATE TABLE replicas (id TEXT PRIMARY KEY, region TEXT NOT NULL REFERENCES regions(name),
                               url TEXT NOT NULL UNIQUE, engine TEXT NOT NULL, created_at REAL NOT NULL
                               {replicas_columns});
        {rows}
    """)
    db.commit()
    db.close()


def test_migration_adds_balancer_health_drain_and_assignments(tmp_path):
    """A file from before failover existed (balancers without health, replicas without drain) opens intact."""
    path = tmp_path / "old.sqlite"
    _old_file(path, ", max_concurrency INTEGER, healthy INTEGER NOT NULL DEFAULT 1", """
        INSERT INTO meta VALUES ('revision', 2);
        INSERT INTO regions VALUES ('us', 2);
        INSERT INTO balancers VALUES ('http://lb:1', 'us', 3.0);
        INSERT INTO replicas VALUES ('us-1', 'us', 'http://a:1', 'vllm', 5.0, NULL, 1);
    """)
    store = MembershipStore(path)
    snap = store.snapshot()
    assert snap.revision == 2 and not snap.replicas[0].draining
    assert snap.balancers[0].healthy and not snap.balancers[0].draining
    assert snap.assignments == [Assignment("us", "us", 0)]


def test_store_migrates_a_file_without_max_concurrency(tmp_path):
    """A SQLite file from before the columns existed opens with its rows intact (max_concurrency None, healthy)."""
    path = tmp_path / "old.sqlite"
    _old_file(path, "", """
        INSERT INTO meta VALUES ('revision', 1);
        INSERT INTO regions VALUES ('us', 2);
        INSERT INTO replicas VALUES ('us-1', 'us', 'http://a:1', 'vllm', 5.0);
    """)
    store = MembershipStore(path)
    assert store.get_replica("us-1").max_concurrency is None and store.revision == 1
    assert store.get_replica("us-1").healthy
    assert store.add_replica("us", "http://b:1", "ollama", max_concurrency=2).max_concurrency == 2
    store.close()
    assert MembershipStore(path).get_replica("us-2").max_concurrency == 2  # a second open migrates nothing


# --- etcd only: several controllers writing at once -----------------------------------------------------------------

def test_concurrent_writers_on_etcd_lose_nothing(etcd):
    """Four stores on one etcd prefix (four controllers) each add ten replicas at once from their own threads:
    compare-and-swap serialises them, so all 40 land with distinct ids and the revision is exactly 40."""
    prefix = f"/test/{uuid.uuid4().hex}"
    stores = [EtcdMembershipStore([etcd], prefix=prefix) for _ in range(4)]

    def writer(n: int) -> list[str]:
        return [stores[n].add_replica("us", f"http://10.0.{n}.{i}:8000").id for i in range(10)]

    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            ids = [rid for batch in pool.map(writer, range(len(stores))) for rid in batch]
        assert sorted(ids) == sorted(f"us-{n}" for n in range(1, 41))
        assert stores[0].revision == 40 and len(stores[3].list_replicas()) == 40
    finally:
        for store in stores:
            store.close()


def test_etcd_store_unreachable_is_store_unavailable(etcd):
    """Without an answering endpoint the store does not open (StoreUnavailable, HTTP 503, one line saying so); with
    a dead endpoint listed first it moves on to the live one."""
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailable) as info:
        EtcdMembershipStore([dead])
    assert info.value.code == 503 and str(info.value) == f"cannot reach etcd ({dead}: connection refused)"
    store = EtcdMembershipStore([dead, etcd], prefix=f"/test/{uuid.uuid4().hex}")
    try:
        assert store.add_replica("us", "http://a:1").id == "us-1" and store.revision == 1
    finally:
        store.close()
