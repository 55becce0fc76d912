"""Two balancers of one region (siblings) as real processes: they split the region's replicas, one owner each; a
SIGKILLed sibling's replicas serve again through the other within 3 s under closed-loop load, with no request
lost and no cross-region failover; the region's DNS name answers both siblings, then the survivor."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.dns.bind import BindServer
from controller.dns import DnsUpdater
from tests.cluster import MODEL, Cluster, get_json
from tests.procs import free_port, wait_http
from tests.system import require_binary

pytestmark = pytest.mark.timeout(90)

HEALTH = {"interval_s": 0.5, "fastinter_s": 0.2, "timeout_s": 0.3, "rise": 2, "fall": 2}
REGIONS = ["us", "eu"]
#: Replicas of us, split between its two balancers.
US_REPLICAS = 4
#: The acceptance bound: a dead sibling's replicas serve again through the survivor within this (s).
FAILOVER_BOUND_S = 3.0


def _owned(cluster: Cluster, balancer: str) -> set[str]:
    """The replicas ``balancer``'s own status lists as local and not draining."""
    return {r["id"] for r in cluster.status(balancer)["replicas"] if not r["draining"]}


def _healthy(cluster: Cluster, balancer: str) -> set[str]:
    return {r["id"] for r in cluster.status(balancer)["replicas"] if not r["draining"] and r["healthy"]}


class _ClosedLoop:
    """``clients`` threads, each sending one request at a time to ``url`` until stopped (at most ``limit`` each,
    and 30 s each); every answer's status and serving replica is recorded."""

    def __init__(self, url: str, *, clients: int = 4, limit: int = 400):
        self.url, self.limit = url, limit
        self.results: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "_ClosedLoop":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)

    def _run(self, client: int) -> None:
        deadline = time.monotonic() + 30
        for i in range(self.limit):
            if self._stop.is_set() or time.monotonic() > deadline:
                return
            try:
                resp = requests.post(f"{self.url}/v1/completions", timeout=30,
                                     json={"model": MODEL, "prompt": f"{uuid.uuid4().hex} load {client} {i}",
                                           "max_tokens": 4})
                self.results.append((resp.status_code, resp.headers.get("X-SkyLB-Served-By", "")))
            except requests.RequestException as exc:
                self.results.append((0, type(exc).__name__))


def _served_by_each(url: str, replica_ids: set[str], *, rounds: int = 6, parallel: int = 8) -> set[str]:
    """Bursts of ``parallel`` requests (random prompts, so no prefix pulls them together) until each of
    ``replica_ids`` served one, at most ``rounds`` bursts; returns those seen."""
    def one(i: int) -> str:
        resp = requests.post(f"{url}/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": f"{uuid.uuid4().hex} probe {i}", "max_tokens": 16})
        assert resp.status_code == 200, resp.text
        return resp.headers["X-SkyLB-Served-By"].split("/", 1)[1]

    seen: set[str] = set()
    with ThreadPoolExecutor(parallel) as pool:
        for _ in range(rounds):
            seen |= set(pool.map(one, range(parallel), timeout=60))
            if replica_ids <= seen:
                break
    return seen & replica_ids


def test_siblings_split_replicas_and_a_killed_one_fails_over_inside_the_region(procs, tmp_path):
    """us runs balancers us-a and us-b: each owns 2 of us's 4 replicas, none both (the later one's share handed
    over by the first), and each lists the other as peer ``us@<id>``, marked sibling. SIGKILL us-a under
    closed-loop load on us-b: us-a's replicas are probed healthy in us-b and serve requests within 3 s; every
    request answers 200; us stays assigned to itself (epoch 0) and eu's balancer never gets a us replica."""
    cluster = Cluster(procs, tmp_path, controller={"health": HEALTH, "failover": {"rtt_ms": {"us-eu": 80}}})
    cluster.start_controller(REGIONS)
    us_urls = cluster.start_emulator(US_REPLICAS, "--time-scale", "0.05", name="emulator-us")
    (eu_url,) = cluster.start_emulator(1, "--time-scale", "0.05", name="emulator-eu")
    for i, url in enumerate(us_urls, 1):
        cluster.add_replica("us", url, replica_id=f"us-{i}")
    cluster.add_replica("eu", eu_url, replica_id="eu-1")
    for bid in ("us-a", "us-b"):
        cluster.start_balancer("us", REGIONS, balancer_id=bid, wait=False)
    cluster.start_balancer("eu", REGIONS)
    for bid in ("us-a", "us-b"):
        wait_http(f"{cluster.balancers[bid]}/healthz", timeout_s=20)
    everything = {f"us-{i}" for i in range(1, US_REPLICAS + 1)}
    cluster.wait_until(lambda: all(len(_healthy(cluster, b)) == 2 for b in ("us-a", "us-b")), timeout_s=20,
                       what="2 healthy replicas in each us sibling")
    a, b = _owned(cluster, "us-a"), _owned(cluster, "us-b")
    assert not a & b and a | b == everything
    owners = get_json(f"{cluster.controller_url}/v1/owners")["owners"]
    assert sorted(o["replica"] for o in owners if o["replica"].startswith("us")) == sorted(everything)
    cluster.wait_until(lambda: {(p["region"], p["sibling"]) for p in cluster.status("us-b")["peers"]}
                       == {("us@us-a", True), ("eu", False)}, what="us-a (a sibling) and eu among us-b's peers")
    assert requests.get(f"{cluster.balancers['us-b']}/readyz", timeout=5).json()["status"] == "ready"

    with _ClosedLoop(cluster.balancers["us-b"]) as load:
        time.sleep(0.5)  # the load is running before the kill
        killed = time.monotonic()
        next(p for p in procs.procs if p.name == "balancer-us-a").kill()
        cluster.wait_until(lambda: _healthy(cluster, "us-b") == everything, timeout_s=10,
                           what="us-a's replicas probed healthy in us-b")
        probed_s = time.monotonic() - killed
        assert _served_by_each(cluster.balancers["us-b"], a) == a
        served_s = time.monotonic() - killed
        time.sleep(0.5)
    print(f"\nsibling failover: us-a's replicas probed in us-b {probed_s:.2f} s and each served a request "
          f"{served_s:.2f} s after the kill; {len(load.results)} requests under load")
    assert served_s <= FAILOVER_BOUND_S, f"sibling failover took {served_s:.2f} s"
    assert load.results and all(status == 200 for status, _ in load.results), \
        [r for r in load.results if r[0] != 200][:5]
    assignments = {x["region"]: (x["balancer_region"], x["epoch"])
                   for x in get_json(f"{cluster.controller_url}/v1/assignments")["assignments"]}
    assert assignments == {"us": ("us", 0), "eu": ("eu", 0)}
    assert _owned(cluster, "eu") == {"eu-1"}


def test_dns_answers_every_live_sibling(procs, tmp_path):
    """With controller.dns on a real BIND: us's name answers both siblings' addresses (127.0.0.11 and .21); after
    one is SIGKILLed, only the survivor's."""
    addresses = {"us": "127.0.0.11", "eu": "127.0.0.12"}
    bind = BindServer(tmp_path / "named", addresses, port=free_port(), ttl_s=3, named=require_binary("named"))
    try:
        bind.start(procs=procs)
        cluster = Cluster(procs, tmp_path, controller={"health": HEALTH,
                                                       "dns": bind.dns_config().model_dump(mode="json")})
        cluster.start_controller(REGIONS)
        cluster.start_balancer("us", REGIONS, balancer_id="us-a", host="127.0.0.11", wait=False)
        cluster.start_balancer("us", REGIONS, balancer_id="us-b", host="127.0.0.21", wait=False)
        cluster.start_balancer("eu", REGIONS, host="127.0.0.12")
        for bid in ("us-a", "us-b"):
            wait_http(f"{cluster.balancers[bid]}/healthz", timeout_s=20)
        updater = DnsUpdater(bind.dns_config())

        def answer() -> list[str]:
            return asyncio.run(updater.current_all("us"))

        cluster.wait_until(lambda: answer() == ["127.0.0.11", "127.0.0.21"], timeout_s=15, what="both us siblings")
        next(p for p in procs.procs if p.name == "balancer-us-a").kill()
        killed = time.monotonic()
        cluster.wait_until(lambda: answer() == ["127.0.0.21"], timeout_s=10, what="only the surviving sibling")
        print(f"\nDNS: us answered the survivor alone {time.monotonic() - killed:.2f} s after the kill")
        assert asyncio.run(updater.current_all("eu")) == ["127.0.0.12"]
    finally:
        bind.stop()


def test_a_sessions_next_turn_at_the_other_sibling_reaches_the_replica_that_served_its_first(procs, tmp_path):
    """us runs us-a and us-b, two replicas each. A session's first turn goes to us-a; its second turn (the first
    extended) goes to us-b, which forwards it to us-a (a sibling holds its prefix: skylb/core/held_prefixes.py), and
    the replica that served the first serves it; an unrelated prompt at us-b stays on us-b's replicas."""
    # One region: the cluster makes no peer token itself, and siblings forward only with one.
    cluster = Cluster(procs, tmp_path, controller={"health": HEALTH}, peer_token=uuid.uuid4().hex)
    cluster.start_controller(["us"])
    for i, url in enumerate(cluster.start_emulator(4, "--time-scale", "0.05", name="emulator-us"), 1):
        cluster.add_replica("us", url, replica_id=f"us-{i}")
    for bid in ("us-a", "us-b"):
        cluster.start_balancer("us", ["us"], balancer_id=bid, wait=False)
    for bid in ("us-a", "us-b"):
        wait_http(f"{cluster.balancers[bid]}/healthz", timeout_s=20)
    cluster.wait_until(lambda: all(len(_healthy(cluster, b)) == 2 for b in ("us-a", "us-b"))
                       and all(any(p["sibling"] and p["healthy"] for p in cluster.status(b)["peers"])
                               for b in ("us-a", "us-b")),
                       timeout_s=20, what="2 healthy replicas and a healthy sibling in each us balancer")
    turn_1 = "".join(f"user: tell me about topic {i} in some detail please. " for i in range(120))

    def send(balancer: str, prompt: str) -> tuple[str, str]:
        resp = requests.post(f"{cluster.balancers[balancer]}/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        return resp.headers["X-SkyLB-Route"], resp.headers["X-SkyLB-Served-By"]

    route, first = send("us-a", turn_1)
    assert route == "local" and first.split("/", 1)[1] in _owned(cluster, "us-a")
    # us-b has read a status of us-a's that holds the prefix (the count of hashes it keeps for its sibling).
    cluster.wait_until(lambda: any(p["sibling"] and p["prefixes"] for p in cluster.status("us-b")["peers"]),
                       timeout_s=5, what="us-a's prefixes at us-b")
    route, second = send("us-b", turn_1 + "assistant: a long answer. " * 20 + "user: one more thing? ")
    assert (route, second) == ("peer:us@us-a", first)
    route, other = send("us-b", "".join(f"user: something else entirely, number {i}. " for i in range(120)))
    assert route == "local" and other.split("/", 1)[1] in _owned(cluster, "us-b")
