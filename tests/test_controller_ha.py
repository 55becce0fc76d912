"""A highly available controller (issue 9, item 5): controllers sharing membership in a real etcd elect one leader,
which alone runs the health checks; kill it and another leads within 10 s with membership intact, while a balancer
that knows every controller keeps its membership and heartbeat. Also the election itself in-process, and
ControllerClient moving between controllers."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid

import aiohttp
import pytest
import requests
import yaml
from aiohttp import web
from etcd3gw.lease import Lease

from skylb.balancer.controller_client import ControllerClient, ControllerUnavailable
from controller.etcd_store import EtcdConnection
from controller import leader
from controller.leader import POLL_S, EtcdElection, SoleLeader
from controller.store import StoreUnavailable
from tests.cluster import MODEL, Cluster, get_json
from tests.procs import free_port, free_ports, log_events

pytestmark = pytest.mark.timeout(120)

#: The replica health check, fast: one failed probe marks a replica unhealthy.
HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "rise": 1, "fall": 1}


def _leader_flags(urls: list[str]) -> dict[str, bool]:
    """{url: leads?} of every controller that answers /healthz."""
    flags = {}
    for url in urls:
        try:
            flags[url] = requests.get(f"{url}/healthz", timeout=1).json()["leader"]
        except requests.RequestException:
            pass
    return flags


def _one_leader(urls: list[str]) -> str | None:
    """The URL of the one controller among ``urls`` that says it leads; None while none or several do."""
    leaders = [url for url, leads in _leader_flags(urls).items() if leads]
    return leaders[0] if len(leaders) == 1 else None


def _wait(predicate, *, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return value


def _membership(url: str) -> dict:
    """The membership as `url` serves it, without the balancers' last_seen (heartbeats move it)."""
    snapshot = get_json(f"{url}/v1/membership")
    for balancer in snapshot["balancers"]:
        del balancer["last_seen"]
    return snapshot


def _replica(url: str, replica_id: str) -> dict:
    return next(r for r in get_json(f"{url}/v1/replicas")["replicas"] if r["id"] == replica_id)


def _add(url: str, replica_id: str, replica_url: str) -> dict:
    resp = requests.post(f"{url}/v1/replicas", json={"region": "us", "url": replica_url, "id": replica_id}, timeout=5)
    assert resp.status_code == 201, resp.text
    return resp.json()


def test_three_controllers_on_etcd_survive_the_leader(procs, tmp_path, etcd):
    """Three `skylb controller --store etcd`: exactly one leads and only it health-checks; a write through one is
    read through another and wakes a long poll on a follower; kill -9 the leader: another leads within 10 s,
    membership is unchanged, writes and health checks go on, and a balancer given all three URLs keeps its
    membership and heartbeat."""
    cluster = Cluster(procs, tmp_path, controller={
        "store": "etcd", "etcd": {"endpoints": [etcd], "prefix": f"/test/{uuid.uuid4().hex}"}, "health": HEALTH})
    config = cluster.config(["us"])
    urls = []
    for i, port in enumerate(free_ports(3)):
        urls.append(f"http://127.0.0.1:{port}")
        procs.skylb("controller", "--config", str(config), "--port", str(port), name=f"controller-{i}",
                    wait_url=f"{urls[-1]}/healthz")
    proc = {url: p for url, p in zip(urls, procs.procs)}
    leader = _wait(lambda: _one_leader(urls), timeout_s=10, what="one leader")
    time.sleep(1.0)  # a few renewals later, still the same one
    assert _one_leader(urls) == leader
    followers = [url for url in urls if url != leader]
    assert all(requests.get(f"{url}/healthz", timeout=5).json()["store"] == "etcd" for url in urls)

    # Writes through any controller, reads through any other; only the leader probes (and marks the dead one).
    live = [f"http://127.0.0.1:{port}" for port in free_ports(2)]
    cluster.procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", live[0].rsplit(":", 1)[1],
                        "--port", live[1].rsplit(":", 1)[1], name="emulator", wait_url=f"{live[0]}/health")
    _add(leader, "us-a", live[0])
    _add(followers[0], "us-dead", f"http://127.0.0.1:{free_port()}")
    replicas = get_json(f"{followers[1]}/v1/replicas")["replicas"]
    assert [r["id"] for r in replicas] == ["us-a", "us-dead"]
    _wait(lambda: not _replica(followers[1], "us-dead")["healthy"], timeout_s=5, what="us-dead marked unhealthy")
    # The leader logs the change just after its etcd write, which a follower may serve first.
    _wait(lambda: log_events(proc[leader].log(), "health_change"), timeout_s=5, what="the leader's health_change")
    for url in urls:
        log = proc[url].log()
        assert bool(log_events(log, "leader_elected")) == (url == leader), url
        assert bool(log_events(log, "health_change")) == (url == leader), url

    # A long poll on a follower answers as soon as the leader takes a write.
    revision = get_json(f"{followers[0]}/healthz")["revision"]
    answer: dict = {}
    poll = threading.Thread(target=lambda: answer.update(
        get_json(f"{followers[0]}/v1/membership?revision={revision}&wait=20", timeout=30)))
    poll.start()
    _wait(lambda: get_json(f"{followers[0]}/healthz")["watchers"] == 1, timeout_s=5, what="the long poll waiting")
    assert not answer
    written = time.monotonic()
    requests.delete(f"{leader}/v1/replicas/us-dead", timeout=5).raise_for_status()
    poll.join(timeout=5)
    assert answer["revision"] == revision + 1 and time.monotonic() - written < 1.5  # 0.2 s revision poll

    # A balancer that knows all three controllers, the leader first.
    cluster.controller_url = ",".join([leader, *followers])
    cluster.start_balancer("us", ["us"])
    cluster.wait_replicas_healthy("us", 1)
    # Its first heartbeat registers it (one more revision): snapshot only after that, or the kill races it.
    before = _wait(lambda: (m := _membership(followers[0]))["balancers"] and m, timeout_s=10,
                   what="the balancer registered by its heartbeat")
    _wait(lambda: cluster.status("us")["membership_revision"] == before["revision"], timeout_s=5,
          what="the balancer at the current revision")

    killed, killed_at = time.monotonic(), time.time()
    os.kill(proc[leader].popen.pid, signal.SIGKILL)
    new_leader = _wait(lambda: _one_leader(followers), timeout_s=10, what="a new leader", interval_s=0.02)
    elected_s = time.monotonic() - killed
    print(f"\nleader election after kill -9: {elected_s:.2f} s")
    assert elected_s < 10
    assert _membership(new_leader) == _membership(followers[0]) == before

    # Writes and health checks go on under the new leader; the balancer follows through a surviving controller.
    _add(new_leader, "us-b", live[1])
    _add(new_leader, "us-dead-2", f"http://127.0.0.1:{free_port()}")
    _wait(lambda: not _replica(new_leader, "us-dead-2")["healthy"], timeout_s=5,
          what="us-dead-2 marked unhealthy by the new leader")
    _wait(lambda: log_events(proc[new_leader].log(), "health_change"), timeout_s=5, what="the new leader's health_change")
    _wait(lambda: sorted(r["id"] for r in cluster.status("us")["replicas"]) == ["us-a", "us-b"], timeout_s=5,
          what="the balancer on us-a and us-b (us-dead-2 dropped as unhealthy)")
    cluster.wait_replicas_healthy("us", 2)
    _wait(lambda: get_json(f"{new_leader}/v1/balancers")["balancers"][0]["last_seen"] > killed_at, timeout_s=15,
          what="a balancer heartbeat after the kill", interval_s=0.5)
    assert cluster.status("us")["controller_reachable"]


# --- the election, in-process -------------------------------------------------------------------------------------

class _Leads:
    """Which elections run their leader's task now, and when each one started and stopped."""

    def __init__(self):
        self.active: set[int] = set()
        self.history: list[tuple[float, int, str]] = []

    def task(self, n: int):
        async def lead() -> None:
            self.active.add(n)
            self.history.append((time.monotonic(), n, "start"))
            try:
                await asyncio.Event().wait()
            finally:
                self.active.discard(n)
                self.history.append((time.monotonic(), n, "stop"))
        return lead


async def _until(predicate, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


async def test_election_runs_the_task_on_one_leader_and_hands_over(etcd):
    """Three elections: one leads and only it runs the task; a stopping leader resigns, so another leads within
    about POLL_S; a leader whose lease is revoked under it stops its task at its next renewal; a leader that can no
    longer reach etcd stops its task before its lease can expire, so before anyone else is elected."""
    prefix, ttl_s = f"/test/{uuid.uuid4().hex}", 2
    leads = _Leads()
    elections = [EtcdElection([etcd], prefix=prefix, ttl_s=ttl_s, name=f"c{n}") for n in range(3)]
    runs = [asyncio.create_task(e.run(leads.task(n))) for n, e in enumerate(elections)]
    try:
        first = await _until(lambda: [n for n, e in enumerate(elections) if e.is_leader], timeout_s=5,
                             what="a leader")
        await asyncio.sleep(2 * ttl_s)  # several renewals
        assert first == [n for n, e in enumerate(elections) if e.is_leader] and leads.active == set(first)

        # A leader that stops resigns: the next one needs no lease expiry.
        stopped = time.monotonic()
        runs[first[0]].cancel()
        await asyncio.gather(runs[first[0]], return_exceptions=True)
        second = await _until(lambda: leads.active - set(first), timeout_s=5, what="a second leader")
        assert time.monotonic() - stopped < POLL_S + 1.0 and len(leads.active) == 1
        (second,) = second

        # The lease revoked under the leader (as etcd expires it): the task stops at the next renewal.
        revoked = time.monotonic()
        admin = EtcdConnection([etcd])
        admin.call(lambda c: Lease(elections[second]._lease_id, c).revoke())
        admin.close()
        await _until(lambda: second not in leads.active, timeout_s=ttl_s, what="the task stopped")
        assert time.monotonic() - revoked <= ttl_s / 3 + 0.5
        third = await _until(lambda: [n for n, e in enumerate(elections) if e.is_leader], timeout_s=5,
                             what="a third leader")

        # etcd unreachable for the leader: it stops leading before its lease expires and another is elected.
        def unreachable(op, *, retry=True):
            raise StoreUnavailable("cannot reach etcd (test)")

        cut = time.monotonic()
        elections[third[0]]._etcd.call = unreachable
        await _until(lambda: third[0] not in leads.active and leads.active, timeout_s=3 * ttl_s,
                     what="a leader after the cut")
        stops = [t for t, n, what in leads.history if n == third[0] and what == "stop" and t > cut]
        starts = [t for t, n, what in leads.history if n != third[0] and what == "start" and t > cut]
        assert stops and starts and stops[0] < starts[0], leads.history
        assert starts[0] - cut >= ttl_s - 1.0  # the new one waited for the old lease to expire
    finally:
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


async def test_a_failing_leader_task_runs_again(monkeypatch):
    """The leader's task is started again after it fails (a health check that met an etcd error), not left dead
    for the rest of the term."""
    monkeypatch.setattr(leader, "RESTART_S", 0.01)
    calls = []

    async def lead() -> None:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise StoreUnavailable("cannot reach etcd (test)")
        await asyncio.Event().wait()

    run = asyncio.create_task(SoleLeader().run(lead))
    try:
        await _until(lambda: len(calls) == 3, timeout_s=2, what="the third start")
        await asyncio.sleep(0.1)
        assert len(calls) == 3 and not run.done()
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


# --- ControllerClient with several controllers -------------------------------------------------------------------

async def test_client_moves_to_the_next_controller_and_stays_there():
    """A dead controller and one answering 503 (its store unreachable) are skipped; the client then keeps using
    the one that answered; ControllerUnavailable names every controller only when none answers."""
    hits: list[str] = []

    def app(status: int) -> web.Application:
        async def membership(request: web.Request) -> web.Response:
            hits.append(f"{status} {request.method}")
            return web.json_response({"revision": 3, "replicas": []} if status == 200 else {}, status=status)

        application = web.Application()
        application.router.add_get("/v1/membership", membership)
        application.router.add_post("/v1/balancers", membership)
        return application

    runners, urls = [], []
    for status in (503, 200):
        runner = web.AppRunner(app(status))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        async with aiohttp.ClientSession() as session:
            client = ControllerClient(f"{dead}, {urls[0]},{urls[1]}/", session=session, timeout_s=2)
            assert (await client.get_membership())["revision"] == 3
            assert client.base_url == urls[1] and hits == ["503 GET", "200 GET"]
            await client.register_balancer("us", "http://127.0.0.1:9000")
            assert hits[2:] == ["200 POST"]  # straight to the one that answered

            client = ControllerClient([dead, urls[0]], session=session, timeout_s=2)
            with pytest.raises(ControllerUnavailable) as info:
                await client.get_membership()
            assert dead in str(info.value) and f"{urls[0]}/v1/membership: HTTP 503" in str(info.value)
    finally:
        for runner in runners:
            await runner.cleanup()


def test_controller_without_etcd_exits_with_one_line(tmp_path):
    """`skylb controller --store etcd` with no etcd listening exits 1 with one line naming the endpoint."""
    import subprocess
    import sys

    endpoint = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "skylb", "controller", "--store", "etcd", "--etcd-endpoints", endpoint,
                        "--port", str(free_port())], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"skylb controller: cannot reach etcd ({endpoint}: connection refused)"]


def test_config_names_the_store(tmp_path):
    """The store and etcd settings come from the config's controller section; a bad endpoint is a config error."""
    from skylb.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"controller": {"store": "etcd", "etcd": {"endpoints": ["http://e1:2379"]}}}))
    config = load_config(path).controller
    assert (config.store, config.etcd.endpoints, config.etcd.prefix, config.etcd.lease_ttl_s) == (
        "etcd", ["http://e1:2379"], "/skylb", 5)
    path.write_text(yaml.safe_dump({"controller": {"etcd": {"endpoints": ["e1:2379"]}}}))
    with pytest.raises(ConfigError, match="etcd endpoint 'e1:2379'"):
        load_config(path)
