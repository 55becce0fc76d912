"""The membership store's failover and drain state: balancer health and drain, assignments with epochs, replica
drain. Every test takes the ``store`` fixture, so each store backend runs the same checks."""

from __future__ import annotations

import sqlite3

import pytest

from controller.store import Assignment, MembershipStore, NotFound


@pytest.fixture(params=["sqlite"])
def store(request, tmp_path):
    """An empty store of each backend."""
    s = MembershipStore(tmp_path / "m.sqlite")
    yield s
    s.close()


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


def test_failover_state_survives_reopen(tmp_path):
    path = tmp_path / "m.sqlite"
    store = MembershipStore(path)
    _two_regions(store)
    store.assign("us", "eu")
    store.set_balancer_health("http://lb-us:9000", False)
    store.set_replica_draining("eu-1", True)
    before = store.snapshot()
    store.close()
    assert MembershipStore(path).snapshot() == before


def test_migration_adds_balancer_health_drain_and_assignments(tmp_path):
    """A file from before failover existed (balancers without health, replicas without drain) opens intact."""
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        CREATE TABLE regions (name TEXT PRIMARY KEY, next_replica_n INTEGER NOT NULL DEFAULT 1);
        CREATE TABLE balancers (url TEXT PRIMARY KEY, region TEXT NOT NULL REFERENCES regions(name),
                                last_seen REAL NOT NULL);
        CREATE TABLE replicas (id TEXT PRIMARY KEY, region TEXT NOT NULL REFERENCES regions(name),
                               url TEXT NOT NULL UNIQUE, engine TEXT NOT NULL, created_at REAL NOT NULL,
                               max_concurrency INTEGER, healthy INTEGER NOT NULL DEFAULT 1);
        INSERT INTO meta VALUES ('revision', 2);
        INSERT INTO regions VALUES ('us', 2);
        INSERT INTO balancers VALUES ('http://lb:1', 'us', 3.0);
        INSERT INTO replicas VALUES ('us-1', 'us', 'http://a:1', 'vllm', 5.0, NULL, 1);
    """)
    db.commit()
    db.close()
    store = MembershipStore(path)
    snap = store.snapshot()
    assert snap.revision == 2 and not snap.replicas[0].draining
    assert snap.balancers[0].healthy and not snap.balancers[0].draining
    assert snap.assignments == [Assignment("us", "us", 0)]
