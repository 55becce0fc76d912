"""Several balancers per region (siblings) in the controller: replica ownership planned by count with epochs, kept in
both stores, served to each balancer as its own view, and the registration rules by balancer id."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.ownership import confirm_released, plan_owners, rebalance, stale_owned, view_for
from controller.server import create_app
from controller.store import Assignment, Balancer, MembershipStore, Ownership, Replica

NOW = 1_000_000.0
LIVE_S = 30.0


def _replicas(region: str, n: int) -> list[Replica]:
    return [Replica(f"{region}-{i}", region, f"http://{region}{i}:8000", "vllm", float(i)) for i in range(1, n + 1)]


def _balancer(region: str, port: int, **flags) -> Balancer:
    return Balancer(region, f"http://127.0.0.1:{port}", NOW - 1, **flags)


def _plan(replicas, balancers, owners=(), assignments=None) -> dict[str, str]:
    regions = sorted({r.region for r in replicas} | {b.region for b in balancers})
    return plan_owners(replicas, balancers, assignments or [Assignment(r, r) for r in regions],
                       list(owners), now=NOW, live_s=LIVE_S)


def _counts(plan: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for url in plan.values():
        counts[url] = counts.get(url, 0) + 1
    return counts


def test_replicas_are_split_by_count_one_owner_each():
    """Five replicas, two live siblings: 3 and 2, every replica owned once; another region's keep to theirs."""
    a, b, eu = _balancer("us", 1), _balancer("us", 2), _balancer("eu", 3)
    plan = _plan(_replicas("us", 5) + _replicas("eu", 2), [a, b, eu])
    assert len(plan) == 7 and _counts(plan) == {a.url: 3, b.url: 2, eu.url: 2}


def test_a_joining_sibling_takes_only_its_share():
    """A sibling joins a balancer holding four replicas: two move, the two the first keeps stay put."""
    a, b = _balancer("us", 1), _balancer("us", 2)
    owners = [Ownership(r.id, a.url, 1) for r in _replicas("us", 4)]
    plan = _plan(_replicas("us", 4), [a, b], owners)
    assert _counts(plan) == {a.url: 2, b.url: 2}
    assert [rid for rid, url in sorted(plan.items()) if url == a.url] == ["us-1", "us-2"]


@pytest.mark.parametrize("flags", [{"healthy": False}, {"draining": True}, {"last_seen": NOW - 31}])
def test_a_dead_draining_or_silent_sibling_gives_its_replicas_to_the_survivors(flags):
    """Unhealthy, draining, or no heartbeat within 30 s: its replicas go to the live siblings, theirs stay."""
    a, b, c = _balancer("us", 1), _balancer("us", 2), _balancer("us", 3)
    owners = [Ownership("us-1", a.url, 1), Ownership("us-2", a.url, 1), Ownership("us-3", b.url, 1),
              Ownership("us-4", b.url, 1), Ownership("us-5", c.url, 1), Ownership("us-6", c.url, 1)]
    dead = Balancer(b.region, b.url, flags.get("last_seen", b.last_seen), flags.get("healthy", True),
                    flags.get("draining", False))
    plan = _plan(_replicas("us", 6), [a, dead, c], owners)
    assert _counts(plan) == {a.url: 3, c.url: 3}
    assert {rid: plan[rid] for rid in ("us-1", "us-2", "us-5", "us-6")} == {
        "us-1": a.url, "us-2": a.url, "us-5": c.url, "us-6": c.url}


def test_the_last_siblings_death_keeps_owners_until_failover_moves_the_region():
    """Every us balancer down: us's replicas keep their owner (nobody to take them); once us is assigned to eu,
    eu's balancers share them."""
    a, eu1, eu2 = _balancer("us", 1, healthy=False), _balancer("eu", 3), _balancer("eu", 4)
    owners = [Ownership(r.id, a.url, 1) for r in _replicas("us", 2)]
    replicas = _replicas("us", 2) + _replicas("eu", 2)
    kept = _plan(replicas, [a, eu1, eu2], owners)
    assert kept["us-1"] == kept["us-2"] == a.url
    moved = _plan(replicas, [a, eu1, eu2], owners, [Assignment("us", "eu", 1), Assignment("eu", "eu")])
    assert _counts(moved) == {eu1.url: 2, eu2.url: 2}


def test_a_region_fails_over_only_when_its_last_sibling_is_down():
    """plan_assignments: us keeps itself while one of its two balancers lives; with both down it goes to eu."""
    from controller.failover import plan_assignments
    from skylb.config import Failover

    config = Failover(rtt_ms={"us-eu": 80})
    current = [Assignment("eu", "eu"), Assignment("us", "us")]
    eu, a, b = _balancer("eu", 3), _balancer("us", 1), _balancer("us", 2)
    one_dead = [eu, a, Balancer(b.region, b.url, b.last_seen, healthy=False)]
    assert plan_assignments(current, one_dead, config) == {"eu": "eu", "us": "us"}
    both_dead = [eu, *(Balancer(x.region, x.url, x.last_seen, healthy=False) for x in (a, b))]
    assert plan_assignments(current, both_dead, config) == {"eu": "eu", "us": "eu"}


def test_stale_owned_names_replicas_given_away():
    """A balancer claiming epoch 1 of a replica now at epoch 2 elsewhere is stale; its current ones are not."""
    owners = [Ownership("us-1", "http://b", 2), Ownership("us-2", "http://a", 1)]
    assert stale_owned({"us-1": 1, "us-2": 1}, "http://a", owners) == [owners[0]]
    assert stale_owned({"us-1": 2}, "http://a", owners) == []


def test_store_epochs_grow_per_change_and_never_go_back(reopen):
    """set_owners bumps a replica's epoch only when its owner changes, one revision per call; a replica removed
    and added again under its id continues from its epoch (SQLite and etcd alike)."""
    store = reopen()
    store.add_replica("us", "http://r1:8000", replica_id="us-1")
    revision = store.revision
    assert store.set_owners({"us-1": "http://a:1"}) == [Ownership("us-1", "http://a:1", 1)]
    assert store.set_owners({"us-1": "http://a:1"}) == [] and store.revision == revision + 1
    assert store.set_owners({"us-1": "http://b:1", "gone": "http://b:1"}) == [Ownership("us-1", "http://b:1", 2)]
    store.remove_replica("us-1")
    assert store.owners() == []
    store.add_replica("us", "http://r1:8000", replica_id="us-1")
    assert store.set_owners({"us-1": "http://a:1"}) == [Ownership("us-1", "http://a:1", 3)]
    assert store.snapshot().owners == [Ownership("us-1", "http://a:1", 3)]


def test_store_registration_by_id_moves_a_balancer(reopen):
    """Two URLs with their own ids are two balancers of a region; a third URL registering an id already held
    replaces that one (a restart elsewhere); a heartbeat changes nothing."""
    store = reopen()
    a, changed = store.register_balancer("us", "http://10.0.0.1:8080")
    assert changed and a.id == "10.0.0.1:8080"
    store.register_balancer("us", "http://10.0.0.2:8080", balancer_id="us-2")
    revision = store.revision
    assert store.register_balancer("us", "http://10.0.0.2:8080", balancer_id="us-2")[1] is False
    assert store.revision == revision
    moved, changed = store.register_balancer("us", "http://10.0.0.9:8080", balancer_id="us-2")
    assert changed and [b.url for b in store.list_balancers()] == ["http://10.0.0.1:8080", "http://10.0.0.9:8080"]


def test_view_carries_only_owned_replicas_and_the_siblings():
    """view_for: the replicas this balancer owns (with their epoch) and its region's other balancers."""
    store = MembershipStore(":memory:")
    for i in (1, 2, 3):
        store.add_replica("us", f"http://r{i}:8000", replica_id=f"us-{i}")
    store.register_balancer("us", "http://127.0.0.1:1", balancer_id="b1")
    store.register_balancer("us", "http://127.0.0.1:2", balancer_id="b2")
    store.register_balancer("eu", "http://127.0.0.1:3")
    store.set_owners({"us-1": "http://127.0.0.1:1", "us-2": "http://127.0.0.1:2", "us-3": "http://127.0.0.1:1"})
    view = view_for(store.snapshot(), "http://127.0.0.1:1")
    assert [(r["id"], r["owner_epoch"]) for r in view["replicas"]] == [("us-1", 1), ("us-3", 1)]
    assert view["view"]["id"] == "b1" and [b["id"] for b in view["view"]["siblings"]] == ["b2"]
    store.close()


async def test_registration_api_shares_a_region_and_guards_an_id():
    """Over HTTP: b1 registers and owns us's 4 replicas; b2 joins: 2 of them start a handover (in neither view),
    b1's heartbeat without them completes it (b2 owns them at epoch 2); a live id at another URL is 409
    balancer_id_taken; a bad id is 400 naming it; a heartbeat holding a replica's older epoch is 409
    stale_epoch."""
    store = MembershipStore(":memory:")
    for i in (1, 2, 3, 4):
        store.add_replica("us", f"http://r{i}:8000", replica_id=f"us-{i}")
    b1, b2 = "http://127.0.0.1:1", "http://127.0.0.1:2"

    async def view(client, url) -> dict[str, int]:
        answer = await (await client.get("/v1/membership", params={"balancer": url})).json()
        return {r["id"]: r["owner_epoch"] for r in answer["replicas"]}

    async with TestClient(TestServer(create_app(store))) as client:
        for url, bid in ((b1, "b1"), (b2, "b2")):
            resp = await client.post("/v1/balancers", json={"region": "us", "url": url, "id": bid})
            assert resp.status == 200 and (await resp.json())["id"] == bid
        owners = (await (await client.get("/v1/owners")).json())["owners"]
        leaving = sorted(o["replica"] for o in owners if o["handover_to"] == b2)
        assert len(leaving) == 2 and all(o["balancer"] == b1 for o in owners)
        kept = await view(client, b1)
        assert sorted(kept) == sorted(set(f"us-{i}" for i in (1, 2, 3, 4)) - set(leaving))
        assert await view(client, b2) == {}
        resp = await client.post("/v1/balancers", json={"region": "us", "url": b1, "id": "b1", "owned": kept})
        assert resp.status == 200
        assert await view(client, b2) == {rid: 2 for rid in leaving}
        resp = await client.post("/v1/balancers", json={"region": "us", "url": "http://127.0.0.1:9", "id": "b1"})
        assert resp.status == 409 and (await resp.json())["error"]["type"] == "balancer_id_taken"
        resp = await client.post("/v1/balancers", json={"region": "us", "url": "http://127.0.0.1:9", "id": "a b"})
        assert resp.status == 400 and (await resp.json())["error"]["message"].startswith("id: ")
        resp = await client.post("/v1/balancers", json={"region": "us", "url": b1, "id": "b1",
                                                        "owned": {**kept, leaving[0]: 1}})
        assert resp.status == 409 and (await resp.json())["error"]["type"] == "stale_epoch"
    store.close()


def test_a_dead_owner_loses_its_replicas_at_once_a_live_one_hands_them_over(reopen):
    """rebalance: replicas of a dead sibling move now (epoch + 1); those a live sibling must give up to a joining one
    only get handover_to (same epoch) until confirm_released, which moves the ones its heartbeat no longer claims."""
    store = reopen()
    for i in (1, 2, 3, 4):
        store.add_replica("us", f"http://r{i}:8000", replica_id=f"us-{i}")
    store.register_balancer("us", "http://a:1", now=NOW)
    assert len(rebalance(store, now=NOW)) == 4
    store.register_balancer("us", "http://b:1", now=NOW)
    started = rebalance(store, now=NOW)
    assert {(o.balancer, o.epoch, o.handover_to) for o in started} == {("http://a:1", 1, "http://b:1")}
    leaving = {o.replica for o in started}
    assert rebalance(store, now=NOW) == []  # stable while it waits
    done = confirm_released(store, "http://a:1", {r: 1 for r in {"us-1", "us-2", "us-3", "us-4"} - leaving})
    assert {(o.replica, o.balancer, o.epoch, o.handover_to) for o in done} == {
        (r, "http://b:1", 2, None) for r in leaving}
    store.set_balancer_health("http://b:1", False)
    moved = rebalance(store, now=NOW)
    assert {(o.replica, o.balancer, o.epoch) for o in moved} == {(r, "http://a:1", 3) for r in leaving}


def test_a_request_with_no_local_room_goes_to_a_sibling_before_another_region():
    """The router's peer filter: with a sibling (a balancer of this region) that has room, only siblings are offered,
    even when another region reports more room; with no sibling with room, the other region takes it."""
    from skylb.core import AvailabilityRules, PeerStatus, Request, Router, make_policy
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules())
    router.set_replicas([("r1", "sim://r1", "vllm")])
    router.set_peers([("us@b", "sim://us-b"), ("eu", "sim://eu")])
    router.peers["us@b"].sibling = True
    router.observe_replica("r1", now=0.0, healthy=True, pending=3)  # no room here
    for region, free in (("us@b", 1), ("eu", 4)):
        router.observe_peer(region, now=0.0, rtt_s=0.01, status=PeerStatus(region, available_replicas=free,
                                                                           replicas=4, queue_len=0, models=None))
    router.enqueue(Request("a", "hello " * 50, arrived_at=0.0))
    [decision] = router.dispatch(0.01)
    assert (decision.route, decision.target) == ("peer", "us@b")
    router.observe_peer("us@b", now=0.02, rtt_s=0.01, status=PeerStatus("us@b", available_replicas=0, replicas=4,
                                                                        queue_len=0, models=None))
    router.enqueue(Request("b", "other " * 50, arrived_at=0.02))
    [decision] = router.dispatch(0.03)
    assert (decision.route, decision.target) == ("peer", "eu")
