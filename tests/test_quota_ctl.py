"""Quotas through the controller (issue 11, item 4): the stores keep the quota document (SQLite and a real etcd),
`skylb-ctl quota set/list/delete` round-trips through a real controller with clear errors, and every balancer applies
a change within one watch round trip, without restart."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import pytest
import requests

from controller.quotas import remove_entry, set_entry
from controller.store import InvalidInput, NotFound
from skylb.quota.limits import Quotas
from tests.cluster import Cluster, get_json

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-secret-for-quota-tests-5b1d"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


# --- the stores ---------------------------------------------------------------------------------------------------

def test_store_keeps_quotas_bumps_revision_and_survives_reopen(reopen):
    """A quota change is a membership revision (the snapshot carries it); an edit that changes nothing is not; a
    refused edit changes nothing; the document survives reopening the store."""
    store = reopen()
    assert store.quotas() == (None, 0)
    assert store.snapshot().to_dict()["quotas"] is None
    store.add_replica("us", "http://10.0.0.1:8000")
    new, changed = store.change_quotas(lambda q: set_entry(q, {"tenant": "acme", "tokens_per_minute": 1000,
                                                               "weight": 2, "priority": "high"}))
    assert changed and store.revision == 2
    assert store.quotas() == (new, 2)
    assert new.tenants["acme"].limits["*"].tokens_per_minute == 1000
    # The same value again: no revision, so watchers do not wake for nothing.
    _, changed = store.change_quotas(lambda q: set_entry(q, {"tenant": "acme", "tokens_per_minute": 1000}))
    assert not changed and store.revision == 2
    with pytest.raises(InvalidInput):
        store.change_quotas(lambda q: set_entry(q, {"group": "fast", "members": {"fast": 1}}))
    with pytest.raises(NotFound):
        store.change_quotas(lambda q: remove_entry(q, group="nope"))
    assert store.revision == 2
    store.change_quotas(lambda q: set_entry(q, {"model": MODEL, "max_concurrent": 4}))
    store.change_quotas(lambda q: set_entry(q, {"group": "fast", "members": {"a": 2, "b": 1}}))
    snap = store.snapshot().to_dict()
    assert snap["revision"] == snap["quotas_revision"] == 4
    assert snap["quotas"]["models"] == {MODEL: {"max_concurrent": 4}}
    assert snap["quotas"]["groups"] == {"fast": {"a": 2.0, "b": 1.0}}
    store.close()
    again = reopen()
    assert again.revision == 4
    assert again.quotas()[0] == Quotas.model_validate(snap["quotas"])
    # Clearing the document is a change too: the balancers go back to their config's quotas.
    assert again.change_quotas(lambda q: None) == (None, True)
    assert again.quotas() == (None, 5)


def test_set_entry_merges_and_none_removes_a_limit():
    """Setting merges into the entry; a limit field given as null removes that limit, and a limit with no field
    left goes away."""
    q = set_entry(None, {"tenant": "acme", "model": "m", "tokens_per_minute": 10, "max_concurrent": 2})
    q = set_entry(q, {"tenant": "acme", "model": "m", "max_concurrent": None, "requests_per_minute": 5})
    assert q.tenants["acme"].limits["m"].model_dump(exclude_none=True) == {"tokens_per_minute": 10,
                                                                           "requests_per_minute": 5}
    q = set_entry(q, {"tenant": "acme", "model": "m", "tokens_per_minute": None, "requests_per_minute": None})
    assert "m" not in q.tenants["acme"].limits
    assert q.limits_for("acme", "m") == []


@pytest.mark.parametrize("entry, field", [
    ({"tenant": "acme", "tokens_per_minute": -1}, "tokens_per_minute"),
    ({"tenant": "acme", "max_concurrent": 1.5}, "max_concurrent"),
    ({"tenant": "acme", "weight": 0}, "weight"),
    ({"tenant": "acme", "priority": "urgent"}, "priority"),
    ({"tenant": "a/b", "weight": 1}, "tenant"),
    ({"model": "m"}, "model"),
    ({"group": "fast", "members": {}}, "members"),
    ({"group": "fast", "members": {"fast": 1}}, "members"),
    ({"group": "fast", "members": {"a": -2}}, "members"),
    ({"tenant": "acme", "colour": "blue"}, "colour"),
    ({}, "body"),
])
def test_set_entry_rejects_bad_input_naming_the_field(entry, field):
    """Each bad entry is InvalidInput naming its field."""
    with pytest.raises(InvalidInput) as info:
        set_entry(None, entry)
    assert info.value.field == field


# --- skylb-ctl against a real controller ------------------------------------------------------------------------

def _ctl_json(cluster: Cluster, *args: str) -> dict:
    """`skylb-ctl ARGS -o json`, run in this process (the command's own subprocess start is in the round trip)."""
    return json.loads(cluster.ctl(*args, "-o", "json", in_process=True).stdout)


def test_ctl_quota_set_list_delete_round_trip(procs, tmp_path):
    """`skylb-ctl quota set/list/delete -o json` against a real controller with an admin token: tenant, tenant on a
    model, model, group; list shows them as a table too; delete removes each; changes without the token are
    refused (401)."""
    cluster = Cluster(procs, tmp_path, admin_token=ADMIN)
    url = cluster.start_controller(["us"])
    assert json.loads(cluster.ctl("quota", "list", "-o", "json").stdout) == {"quotas": None, "revision": 0}
    assert "(none" in cluster.ctl("quota", "list").stdout

    body = _ctl_json(cluster, "quota", "set", "--tenant", "acme", "--tokens-per-minute", "6000",
                     "--requests-per-minute", "60", "--max-concurrent", "4", "--weight", "2", "--priority", "high")
    assert body["changed"] is True
    assert body["quotas"]["tenants"]["acme"] == {
        "weight": 2.0, "priority": "high",
        "limits": {"*": {"tokens_per_minute": 6000, "requests_per_minute": 60, "max_concurrent": 4}}}
    _ctl_json(cluster, "quota", "set", "--tenant", "acme", "--model", MODEL, "--tokens-per-minute", "1000")
    _ctl_json(cluster, "quota", "set", "--model", MODEL, "--tokens-per-minute", "90000", "--max-concurrent", "16")
    _ctl_json(cluster, "quota", "set", "--group", "fast", "--member", "a=2", "--member", "b=1")
    listed = _ctl_json(cluster, "quota", "list")
    assert listed["quotas"]["tenants"]["acme"]["limits"][MODEL] == {"tokens_per_minute": 1000}
    assert listed["quotas"]["models"] == {MODEL: {"tokens_per_minute": 90000, "max_concurrent": 16}}
    assert listed["quotas"]["groups"] == {"fast": {"a": 2.0, "b": 1.0}}
    assert listed["revision"] == get_json(f"{url}/v1/membership")["quotas_revision"] > 0
    table = cluster.ctl("quota", "list", in_process=True).stdout
    for text in ("TENANT", "acme", "high", "6000", "90000", "fast", "a=2, b=1"):
        assert text in table
    unchanged = cluster.ctl("quota", "set", "--model", MODEL, "--max-concurrent", "16", in_process=True)
    assert "unchanged" in unchanged.stdout

    # The REST API refuses a change without the admin token, as every other change.
    resp = requests.post(f"{url}/v1/quotas", json={"model": "x", "max_concurrent": 1}, timeout=5)
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    resp = requests.delete(f"{url}/v1/quotas", params={"group": "fast"}, timeout=5)
    assert resp.status_code == 401

    _ctl_json(cluster, "quota", "delete", "--tenant", "acme", "--model", MODEL)
    _ctl_json(cluster, "quota", "delete", "--group", "fast")
    body = _ctl_json(cluster, "quota", "delete", "--model", MODEL)
    assert body["quotas"]["groups"] == {} and body["quotas"]["models"] == {}
    assert list(body["quotas"]["tenants"]["acme"]["limits"]) == ["*"]
    body = _ctl_json(cluster, "quota", "delete", "--tenant", "acme")
    assert body["quotas"] == {"tenants": {}, "models": {}, "groups": {}}
    assert _ctl_json(cluster, "quota", "delete", "--all")["quotas"] is None


BAD_CTL_INPUT = [
    (["set", "--tenant", "acme", "--tokens-per-minute", "-5"], 2, "-5 must be above 0"),
    (["set", "--tenant", "acme", "--max-concurrent", "many"], 2, "not a whole number"),
    (["set", "--group", "fast", "--member", "fast=1"], 2, "cannot list itself"),
    (["set", "--group", "fast"], 2, "needs at least one --member"),
    (["set", "--group", "fast", "--member", "a"], 2, "is not MODEL=WEIGHT"),
    (["set", "--group", "fast", "--member", "a=0"], 2, "must be a number above 0"),
    (["set", "--model", "m", "--weight", "2"], 2, "--weight and --priority are a tenant's"),
    (["set", "--model", "m"], 2, "--model needs a limit"),
    (["set", "--tenant", "acme"], 2, "nothing to set"),
    (["set", "--tokens-per-minute", "5"], 2, "say what to set"),
    (["set", "--tenant", "acme", "--priority", "urgent"], 2, "invalid choice"),
    (["set", "--tenant", "a b", "--weight", "2"], 1, "tenant: 'a b' must be"),
    (["delete"], 2, "say what to delete"),
    (["delete", "--tenant", "ghost"], 1, "no quota for tenant 'ghost'"),
    (["delete", "--group", "nope"], 1, "no group 'nope'"),
]


def test_ctl_quota_bad_input_gets_a_clear_error(procs, tmp_path):
    """Bad input: usage errors exit 2 before anything is sent, the controller's refusals exit 1; each says why in
    one line on stderr, and nothing changes."""
    cluster = Cluster(procs, tmp_path, admin_token=ADMIN)
    cluster.start_controller(["us"])
    for i, (args, status, message) in enumerate(BAD_CTL_INPUT):
        result = cluster.ctl("quota", *args, check=False, in_process=i > 0)  # the first as the real command
        assert (result.returncode, message in result.stderr) == (status, True), (args, result.stderr)
    assert _ctl_json(cluster, "quota", "list")["quotas"] is None


# --- balancers apply changes without restart ---------------------------------------------------------------------

#: Quotas in the balancers' config file: in force until the controller holds quotas of its own.
CONFIG_QUOTAS = {"tenants": {"cfg-tenant": {"weight": 3, "limits": {"*": {"tokens_per_minute": 777}}}}}


def _quotas_in_force(cluster: Cluster, region: str) -> dict:
    return cluster.status(region)["quotas"]


def test_ctl_change_reaches_every_balancer_without_restart(procs, tmp_path):
    """Three regions' balancers (real processes): each starts on its config's quotas; a `skylb-ctl quota set` is in
    force on every one within one watch round trip (well inside the long poll's 20 s: the change wakes the watch),
    with the controller's revision; the pids never change (no restart); a second change replaces the first; `quota
    delete --all` brings the config's quotas back; a balancer restarted while the controller is down serves the
    controller's quotas it kept on disk."""
    regions = ["us", "eu", "ap"]
    cluster = Cluster(procs, tmp_path, admin_token=ADMIN, balancer={"quotas": CONFIG_QUOTAS})
    cluster.start_controller(regions)
    for region in regions:
        cluster.start_balancer(region, regions)
    balancers = {p.name: p.popen for p in procs.procs if p.name.startswith("balancer-")}
    for region in regions:
        q = _quotas_in_force(cluster, region)
        assert q["source"] == "config" and q["revision"] is None
        assert q["quotas"]["tenants"]["cfg-tenant"]["limits"]["*"] == {"tokens_per_minute": 777}

    def in_force_everywhere(revision: int) -> bool:
        return all(_quotas_in_force(cluster, r)["revision"] == revision for r in regions)

    body = _ctl_json(cluster, "quota", "set", "--tenant", "acme", "--tokens-per-minute", "5000", "--max-concurrent",
                     "3", "--priority", "high")
    cluster.wait_until(lambda: in_force_everywhere(body["revision"]), timeout_s=5.0,
                       what="the first change in force on every balancer")
    for region in regions:
        q = _quotas_in_force(cluster, region)
        assert q["source"] == "controller"
        assert q["quotas"]["tenants"] == {"acme": {"weight": 1.0, "priority": "high", "limits": {
            "*": {"tokens_per_minute": 5000, "max_concurrent": 3}}}}  # the controller's replace the config's

    body = _ctl_json(cluster, "quota", "set", "--tenant", "acme", "--tokens-per-minute", "9000")
    cluster.wait_until(lambda: in_force_everywhere(body["revision"]), timeout_s=5.0,
                       what="the second change in force on every balancer")
    for region in regions:
        limits = _quotas_in_force(cluster, region)["quotas"]["tenants"]["acme"]["limits"]["*"]
        assert limits == {"tokens_per_minute": 9000, "max_concurrent": 3}
    assert all(popen.poll() is None for popen in balancers.values())  # the same processes: no restart

    # The controller drops its quotas: the config's are in force again everywhere; then a new change.
    _ctl_json(cluster, "quota", "delete", "--all")
    cluster.wait_until(lambda: all(_quotas_in_force(cluster, r)["source"] == "config" for r in regions),
                       timeout_s=5.0, what="the config's quotas back on every balancer")
    assert _quotas_in_force(cluster, "us")["quotas"]["tenants"]["cfg-tenant"]["weight"] == 3
    body = _ctl_json(cluster, "quota", "set", "--tenant", "acme", "--tokens-per-minute", "9000")
    cluster.wait_until(lambda: in_force_everywhere(body["revision"]), timeout_s=5.0,
                       what="the third change in force on every balancer")

    # Static stability: stop the controller, restart one balancer: the controller's quotas come back from disk.
    for proc in procs.procs:
        if proc.name.startswith("controller") or proc.name == "balancer-eu":
            proc.stop()
    cluster.start_balancer("eu", regions, name="balancer-eu-again")
    q = _quotas_in_force(cluster, "eu")
    assert q["source"] == "controller" and q["revision"] == body["revision"]
    assert q["quotas"]["tenants"]["acme"]["limits"]["*"]["tokens_per_minute"] == 9000


def test_apply_quotas_sets_them_then_calls_every_listener():
    """Balancer.apply_quotas sets ``quotas`` and calls each listener with them, in order; one that raises is logged
    and the next still runs."""
    from skylb.balancer.balancer import Balancer
    from skylb.config import BalancerConfig

    balancer = Balancer(BalancerConfig(), region="us", advertise_url="http://127.0.0.1:9")
    seen = []

    def broken(quotas):
        raise RuntimeError("listener bug")

    balancer.quota_listeners += [lambda q: seen.append(("first", balancer.quotas is q)), broken,
                                 lambda q: seen.append(("last", q.tenant("acme").weight))]
    quotas = Quotas.model_validate({"tenants": {"acme": {"weight": 4}}})
    balancer.apply_quotas(quotas)
    assert balancer.quotas is quotas
    assert seen == [("first", True), ("last", 4.0)]


# --- each region's share of every limit (no Redis) -----------------------------------------------------------------

def _bucket(*, tokens=0.0, requests=0, refused=0, peak=0, limit=None):
    return {"asked_tokens": tokens, "admitted_tokens": tokens, "admitted_requests": requests, "refused": refused,
            "peak_in_flight": peak, "limit": limit or {"tokens_per_minute": 6000}}


def test_share_rule_water_fills_with_a_floor():
    """controller/shares.py: busy regions (refusals) split what idle ones leave, max-min fair; every region keeps
    the floor; when every want fits, the rest is split evenly; shares always sum to 1."""
    from controller.shares import FLOOR, HEADROOM, allocate, want

    assert allocate([], 0.1) == []
    # One busy region, one idle: the idle one keeps the floor (0.2 / 2), the busy one gets the rest.
    assert allocate([math.inf, 0.0], FLOOR / 2) == pytest.approx([0.9, 0.1])
    # Two busy, one using 0.1 (wants 0.125 with headroom): the busy ones split the rest evenly.
    shares = allocate([math.inf, math.inf, 0.125], FLOOR / 3)
    assert shares == pytest.approx([0.4375, 0.4375, 0.125])
    # Nobody refused: each gets its want (at least the floor), plus an even part of what is left.
    shares = allocate([0.5, 0.0, 0.2], FLOOR / 3)
    assert shares == pytest.approx([0.5 + 0.2333 / 3, 0.0667 + 0.2333 / 3, 0.2 + 0.2333 / 3], abs=1e-3)
    for wants in ([math.inf] * 4, [0.0] * 3, [1.0, 1.0], [math.inf, 0.3, 0.0, 0.9]):
        assert sum(allocate(wants, FLOOR / len(wants))) == pytest.approx(1.0)
    # Wants from reports: use of the global limit over the window (per minute), times the headroom; any refusal
    # means "as much as it can get"; the tightest of tokens, requests and concurrency decides.
    assert want(_bucket(tokens=3000), 60.0) == pytest.approx(0.5 * HEADROOM)
    assert want(_bucket(tokens=1000), 20.0) == pytest.approx(0.5 * HEADROOM)  # 1000 in 20 s = 3000 a minute
    assert want(_bucket(tokens=10, refused=1), 60.0) == math.inf
    assert want(_bucket(requests=3, peak=4, limit={"requests_per_minute": 60, "max_concurrent": 8}), 60.0) == \
        pytest.approx(0.5 * HEADROOM)
    assert want(None, 60.0) == 0.0
    assert want(_bucket(tokens=60000), 60.0) == 1.0


def test_share_book_moves_unused_share_to_the_busy_region():
    """ShareBook: without reports every region gets 1 / N; a busy region (refusals) grows to 1 - floor while the
    idle one shrinks to the floor; a region with no fresh report counts as wanting the even split; when the busy
    region stops refusing, its share follows its use."""
    from controller.shares import STALE_S, ShareBook

    book, live, key = ShareBook(), ["http://us", "http://eu"], "tenant/acme/*"
    assert book.shares_for("http://us", live, 0.0) == {"default": 0.5, "buckets": {}}
    book.report("http://us", {"window_s": 60, "buckets": {key: _bucket(tokens=3000, refused=5)}}, 0.0)
    book.report("http://eu", {"window_s": 60, "buckets": {}}, 0.0)
    assert book.shares_for("http://us", live, 1.0)["buckets"][key] == pytest.approx(0.9)
    assert book.shares_for("http://eu", live, 1.0)["buckets"][key] == pytest.approx(0.1)
    # eu's report goes stale: unknown demand keeps its even split.
    assert book.shares_for("http://us", live, STALE_S + 1)["buckets"] == {}
    book.report("http://us", {"window_s": 60, "buckets": {key: _bucket(tokens=3000, refused=5)}}, STALE_S + 1)
    assert book.shares_for("http://us", live, STALE_S + 2)["buckets"][key] == pytest.approx(0.5)
    # Back to normal: us no longer refuses and used 0.5 of the limit: it wants 0.625, eu gets the rest.
    book.report("http://us", {"window_s": 60, "buckets": {key: _bucket(tokens=3000)}}, 100.0)
    book.report("http://eu", {"window_s": 60, "buckets": {}}, 100.0)
    us = book.shares_for("http://us", live, 100.0)["buckets"][key]
    eu = book.shares_for("http://eu", live, 100.0)["buckets"][key]
    assert us == pytest.approx(0.625 + 0.275 / 2) and us + eu == pytest.approx(1.0)
    # A third live balancer: the default becomes 1/3.
    assert book.shares_for("http://ap", [*live, "http://ap"], 100.0)["default"] == pytest.approx(1 / 3)


def test_local_limits_per_key_shares_and_demand():
    """LocalLimits.set_shares: each listed bucket enforces its own share, the others the default; ``demand``
    counts what each bucket was asked, admitted and refused over the window."""
    from skylb.quota.buckets import LocalLimits
    from skylb.quota.limits import Limit

    limits = LocalLimits()
    small, big = ("tenant/a/*", Limit(tokens_per_minute=600)), ("tenant/b/*", Limit(tokens_per_minute=600))
    limits.set_shares({"tenant/a/*": 0.1}, 0.5)
    assert (limits.share_for("tenant/a/*"), limits.share_for("tenant/b/*")) == (0.1, 0.5)
    assert limits.acquire_now([small], 60, 0.0).ok  # a's bucket holds 60 tokens (0.1 of 600)
    refused = limits.acquire_now([small], 60, 0.0)
    assert not refused.ok and refused.reason == "tokens_per_minute"
    assert refused.wait_s == pytest.approx(60.0)  # refills at 60 tokens a minute
    for _ in range(5):
        assert limits.acquire_now([big], 60, 0.0).ok  # b's holds 300
    assert not limits.acquire_now([big], 60, 0.0).ok
    report = limits.demand.report(10.0)
    assert report["buckets"]["tenant/a/*"] == {"asked_tokens": 120, "admitted_tokens": 60, "admitted_requests": 1,
                                               "refused": 1, "peak_in_flight": 1,
                                               "limit": {"tokens_per_minute": 600}}
    assert report["buckets"]["tenant/b/*"]["admitted_tokens"] == 300
    assert report["window_s"] == 60.0
    assert limits.demand.report(61.0)["buckets"] == {}  # out of the window
    # A larger share refills faster at once; a smaller one cuts the level at the next use.
    limits.set_shares({"tenant/a/*": 1.0}, 0.5)
    assert limits.acquire_now([small], 100, 10.0).ok  # 10 s at 600 a minute: 100 tokens


def test_busy_region_share_grows_while_the_idle_one_shrinks(procs, tmp_path):
    """Two regions, no Redis, all real processes: a limit set with skylb-ctl (6000 tokens a minute for the tenant
    ``default``) is in force on both balancers, each enforcing its half; us's clients ask for more than its half:
    us answers 429 (OpenAI's shape, Retry-After) once its half is spent, never admitting more than the whole limit;
    its heartbeats report the refused demand, and the controller moves the unused share: us's share of the bucket
    grows to 1 - floor (0.9) while eu's shrinks to the floor (0.1), as both statuses show."""
    from tests.quota_http import http_post

    regions, key = ["us", "eu"], "tenant/default/*"
    cluster = Cluster(procs, tmp_path, admin_token=ADMIN,
                      balancer={"heartbeat_s": 0.3, "quota": {"wait_s": 0.2}})
    cluster.start_controller(regions)
    urls = cluster.start_emulator(2, "--decode-base-ms", "1", "--eos-max-tokens", "4")
    for region, url in zip(regions, urls):
        cluster.start_balancer(region, regions)
        cluster.add_replica(region, url)
    for region in regions:
        cluster.wait_replicas_healthy(region, 1)
    body = _ctl_json(cluster, "quota", "set", "--tenant", "default", "--tokens-per-minute", "6000")
    cluster.wait_until(lambda: all(_quotas_in_force(cluster, r)["revision"] == body["revision"] for r in regions),
                       timeout_s=5.0, what="the limit in force on both balancers")

    def shares(region: str) -> dict:
        return _quotas_in_force(cluster, region)["shares"]
    # The even split once the controller has heard both balancers' heartbeats since the change (until then the
    # first to report may hold the whole share).
    cluster.wait_until(lambda: shares("us")["default"] == shares("eu")["default"] == pytest.approx(0.5),
                       timeout_s=5.0, what="the limit split evenly between the two balancers")
    # ~500 tokens a request (prompt + max_tokens): 6 fit us's half of 6000.
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 496}
    admitted = 0
    refused = None
    for _ in range(40):  # bounded: 40 requests
        status, answer, headers = http_post(f"{cluster.balancers['us']}/v1/chat/completions", request)
        if status == 429:
            refused = (answer, headers)
            break
        assert status == 200, answer
        admitted += 1
    assert refused is not None, "us never refused a request over its share"
    answer, headers = refused
    assert answer["error"]["type"] == "rate_limit_exceeded" and int(headers["Retry-After"]) >= 1
    assert 1 <= admitted <= 12  # its half first (6), never more than the whole limit
    cluster.wait_until(lambda: shares("us")["buckets"].get(key) == pytest.approx(0.9), timeout_s=10.0,
                       what="us's share of the bucket up to 1 - floor")
    cluster.wait_until(lambda: shares("eu")["buckets"].get(key) == pytest.approx(0.1), timeout_s=10.0,
                       what="eu's share of the bucket down to the floor")
    assert shares("eu")["default"] == pytest.approx(0.5)  # buckets nobody asked more of keep the even split


def test_quotas_on_etcd_reach_a_balancer_through_another_controller(procs, tmp_path, etcd):
    """Two controllers sharing a real etcd: `skylb-ctl quota set` through one is listed through the other, and a
    balancer watching the other applies it without restart (the follower's watch wakes on the shared revision)."""
    cluster = Cluster(procs, tmp_path, admin_token=ADMIN, controller={
        "store": "etcd", "etcd": {"endpoints": [etcd], "prefix": f"/test/{uuid.uuid4().hex}"},
        "health": {"enabled": False}})
    first = cluster.start_controller(["us"])
    second = cluster.start_controller(["us"])  # cluster.ctl and the balancer now use the second
    cluster.start_balancer("us", ["us"])
    assert _quotas_in_force(cluster, "us")["source"] == "config"
    body = json.loads(cluster.ctl("--controller", first, "quota", "set", "--model", MODEL, "--max-concurrent", "5",
                                  "-o", "json").stdout)
    assert _ctl_json(cluster, "quota", "list") == {"quotas": body["quotas"], "revision": body["revision"]}
    assert cluster.controller_url == second
    cluster.wait_until(lambda: _quotas_in_force(cluster, "us")["revision"] == body["revision"], timeout_s=5.0,
                       what="the change made through the first controller in force on the balancer")
    assert _quotas_in_force(cluster, "us")["quotas"]["models"] == {MODEL: {"max_concurrent": 5}}


def test_heartbeat_drops_demand_for_a_controller_older_than_shares(tmp_path):
    """A controller from before quota shares refuses the unknown ``demand`` field (400 naming it, as its
    register_balancer does): the balancer registers without it from then on instead of failing every heartbeat.
    The old controller is an aiohttp app answering as the old handler did."""
    import aiohttp
    from aiohttp import web

    from skylb.balancer.membership import MembershipWatcher
    from tests.procs import free_port

    bodies = []

    async def register(request):
        body = await request.json()
        bodies.append(body)
        if "demand" in body:
            return web.json_response({"error": {"message": "demand: unknown field (expected region, url, epochs, "
                                                           "replace)", "type": "invalid_request_error",
                                                "code": 400}}, status=400)
        return web.json_response({"region": body["region"], "url": body["url"], "last_seen": 0.0})

    async def run():
        app = web.Application()
        app.router.add_post("/v1/balancers", register)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        async with aiohttp.ClientSession() as session:
            watcher = MembershipWatcher(region="us", advertise_url="http://127.0.0.1:9",
                                        controller_url=f"http://127.0.0.1:{port}", state_dir=str(tmp_path),
                                        apply=lambda snapshot: None, session=session, heartbeat_s=0.05,
                                        demand=lambda: {"window_s": 60.0, "buckets": {}})
            task = asyncio.create_task(watcher._heartbeat())
            try:
                for _ in range(100):  # bounded: 5 s
                    if len(bodies) >= 3:
                        break
                    await asyncio.sleep(0.05)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()

    asyncio.run(run())
    assert "demand" in bodies[0]
    assert len(bodies) >= 3 and all("demand" not in body for body in bodies[1:])


def test_balancer_applies_well_formed_shares_only():
    """skylb/quota/regional.py: a heartbeat answer's shares go to in-process buckets; a malformed answer (a share
    of 0, above 1, not a number) or buckets that are not in-process change nothing."""
    from skylb.quota.buckets import LocalLimits
    from skylb.quota.regional import apply_shares, demand_report

    limits = LocalLimits()
    assert apply_shares(limits, {"default": 0.5, "buckets": {"model/m": 0.9}})
    assert (limits.share, limits.shares) == (0.5, {"model/m": 0.9})
    for bad in ({"default": 0, "buckets": {}}, {"default": 0.5, "buckets": {"model/m": 1.5}},
                {"default": 0.5, "buckets": {"model/m": "most"}}, {"default": True, "buckets": {}}, {"default": 0.5}):
        assert not apply_shares(limits, bad)
    assert (limits.share, limits.shares) == (0.5, {"model/m": 0.9})
    assert demand_report(limits, 0.0) == {"window_s": 60.0, "buckets": {}}
    assert demand_report(object(), 0.0) is None and not apply_shares(object(), {"default": 1, "buckets": {}})
