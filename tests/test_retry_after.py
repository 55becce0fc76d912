"""Every 503 and 429 carries a Retry-After jittered uniformly in [base, 1.5 x base], rounded up to whole seconds
(RFC 9110 §10.2.3), from a real balancer process: each kind of refusal answered a dozen times."""

from __future__ import annotations

import math
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.cluster import MODEL, Cluster

LIMITED = "limited-model"  # served by its own emulator process, killed half-way
RETRY_AFTER_S = 10  # the balancer's configured base: answers in [10, 15]
ANSWERS = 12  # per kind: the chance that 12 jittered answers are all equal is below 1e-4


def _retry_afters(answers: list[requests.Response], status: int) -> list[int]:
    assert all(r.status_code == status for r in answers), [(r.status_code, r.text[:200]) for r in answers]
    return [int(r.headers["Retry-After"]) for r in answers]


def _check(kind: str, values: list[int], low: float, high: float) -> None:
    """All of ``values`` are whole seconds in [low, ceil(1.5 x high)] and not all equal (jitter)."""
    assert all(math.floor(low) <= v <= math.ceil(1.5 * high) for v in values), (kind, values)
    assert len(set(values)) > 1, (kind, values)


def _replica(cluster: Cluster, replica_id: str) -> dict:
    return next(r for r in cluster.status("us")["replicas"] if r["id"] == replica_id)


def _post_many(url: str, body: dict, n: int = ANSWERS) -> list[requests.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: requests.post(url, json=body, timeout=30), range(n)))


def _chat(model: str, max_tokens: int = 2, **extra) -> dict:
    return {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello"}], **extra}


def _hold_replica(replica: str, n: int) -> list[requests.Response]:
    """``n`` long streams sent straight to a replica (not through the balancer): its one slot is busy, the rest
    pending, so the balancer sees it unavailable without having placed a request itself."""
    return [requests.post(f"{replica}/v1/chat/completions", json=_chat(MODEL, 4000, stream=True, ignore_eos=True),
                          stream=True, timeout=30) for _ in range(n)]


def test_every_503_and_429_carries_a_jittered_retry_after(procs, tmp_path):
    """Queue 503 before any dispatch rate is known, quota 429, model-group 429 and 503, admission-lease 503, a
    model whose replicas went away, the SIGTERM drain's 503 (requests and /healthz): each answered 12 times, each
    Retry-After a whole number of seconds in [base, 1.5 x base], and not all equal."""
    quotas = {"models": {LIMITED: {"requests_per_minute": 1}},
              "groups": {"grp-limited": {LIMITED: 1.0}, "grp-none": {"absent-model": 1.0}}}
    cluster = Cluster(procs, tmp_path, balancer={
        "retry_after_s": RETRY_AFTER_S, "queue_timeout_s": 0.5, "no_target_timeout_s": 0.5, "drain_timeout_s": 20,
        "quotas": quotas,
        "quota": {"wait_s": 0}})
    cluster.start_controller(["us"])
    [held] = cluster.start_emulator(1, "--max-num-seqs", "1", name="emu-held")
    [limited] = cluster.start_emulator(1, "--model", LIMITED, "--time-scale", "0.1", name="emu-limited")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", held, replica_id="held")
    cluster.add_replica("us", limited, replica_id="limited")
    cluster.wait_until(lambda: sum(bool(r["models"]) for r in cluster.status("us")["replicas"]) == 2,
                       what="both replicas' models")

    # Queue 503 before the balancer placed any request (no dispatch rate): the configured base.
    streams = _hold_replica(held, 2)
    cluster.wait_until(lambda: not _replica(cluster, "held")["available"], what="the held replica unavailable")
    answers = _post_many(f"{url}/v1/chat/completions", _chat(MODEL))
    assert all("had room for 0.5 s" in r.json()["error"]["message"] for r in answers), [r.text[:300] for r in answers]
    _check("queue 503", _retry_afters(answers, 503), RETRY_AFTER_S, RETRY_AFTER_S)
    for s in streams:
        s.close()

    # Quota 429: one request a minute on LIMITED, so the next wait about 60 s for the bucket.
    assert requests.post(f"{url}/v1/chat/completions", json=_chat(LIMITED), timeout=30).status_code == 200
    _check("quota 429", _retry_afters(_post_many(f"{url}/v1/chat/completions", _chat(LIMITED)), 429), 50, 60)
    _check("model group 429", _retry_afters(_post_many(f"{url}/v1/chat/completions", _chat("grp-limited")), 429),
           50, 60)
    _check("model group 503", _retry_afters(_post_many(f"{url}/v1/chat/completions", _chat("grp-none")), 503),
           RETRY_AFTER_S, RETRY_AFTER_S)
    _check("admission lease 503", _retry_afters(_post_many(f"{url}/skylb/v1/schedule",
                                                           {"model": "grp-none", "estimated_tokens": 10}), 503),
           RETRY_AFTER_S, RETRY_AFTER_S)

    # A model whose only replica went away (recently served: it may come back): 503.
    cluster.ctl("replica", "remove", "limited")
    cluster.wait_until(lambda: all(r["id"] != "limited" for r in cluster.status("us")["replicas"]),
                       what="the limited replica removed")
    time.sleep(0.6)  # past no_target_timeout_s: a request no longer waits in the queue for it to come back
    answers = _post_many(f"{url}/v1/chat/completions", _chat(LIMITED))
    assert all("served by no replica" in r.json()["error"]["message"] for r in answers), answers[0].text
    _check("unavailable model 503", _retry_afters(answers, 503), RETRY_AFTER_S, RETRY_AFTER_S)

    # SIGTERM drain: while a stream runs through it, new requests and /healthz get 503.
    balancer = procs.procs[-1]
    stream = requests.post(f"{url}/v1/chat/completions", json=_chat(MODEL, 40, stream=True, ignore_eos=True),
                           stream=True, timeout=30)
    lines = stream.iter_lines()
    next(line for line in lines if line)  # the first event: the stream runs
    balancer.popen.send_signal(signal.SIGTERM)
    cluster.wait_until(lambda: requests.get(f"{url}/healthz", timeout=5).status_code == 503, what="draining")
    drain = _post_many(f"{url}/v1/completions", {"model": MODEL, "prompt": "late", "max_tokens": 2})
    health = [requests.get(f"{url}/healthz", timeout=5) for _ in range(ANSWERS)]
    rest = threading.Thread(target=lambda: [None for _ in lines])  # the held stream runs to its end
    rest.start()
    assert all("shutting down" in r.json()["error"]["message"] for r in drain)
    _check("SIGTERM drain 503", _retry_afters(drain, 503), RETRY_AFTER_S, RETRY_AFTER_S)
    _check("draining /healthz 503", _retry_afters(health, 503), RETRY_AFTER_S, RETRY_AFTER_S)
    assert balancer.popen.wait(timeout=30) == 0
    rest.join(timeout=10)


def test_the_controllers_503_carries_a_jittered_retry_after():
    """The controller's 503 (its store, etcd, unreachable) tells clients when to come back, jittered the same way."""
    from controller.server import STORE_RETRY_AFTER_S, _error

    values = [int(_error(503, "etcd unreachable", "store_unavailable").headers["Retry-After"]) for _ in range(ANSWERS)]
    _check("controller 503", values, STORE_RETRY_AFTER_S, STORE_RETRY_AFTER_S)
    assert "Retry-After" not in _error(404, "no such replica", "not_found").headers


async def test_a_503_or_429_from_elsewhere_gets_one_and_one_of_its_own_is_kept(tmp_path):
    """The balancer app's last resort: a 503 or 429 answered without a Retry-After (a replica's own, passed on)
    leaves with a jittered one from the configured base; one that has its own keeps it; other statuses get none."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from skylb.balancer.process import build_app
    from skylb.config import BalancerConfig

    cfg = BalancerConfig(controller_url="http://127.0.0.1:1", state_dir=str(tmp_path / "state"),
                         retry_after_s=RETRY_AFTER_S)
    app = build_app(cfg, region="us", advertise_url="http://127.0.0.1:1")

    async def passed_on(request: web.Request) -> web.Response:
        status = int(request.query["status"])
        headers = {"Retry-After": request.query["own"]} if "own" in request.query else None
        return web.json_response({"error": "from a replica"}, status=status, headers=headers)

    app.router.add_get("/test/passed-on", passed_on)
    async with TestClient(TestServer(app)) as client:
        for status in (503, 429):
            values = [int((await client.get(f"/test/passed-on?status={status}")).headers["Retry-After"])
                      for _ in range(ANSWERS)]
            _check(f"passed-on {status}", values, RETRY_AFTER_S, RETRY_AFTER_S)
        assert (await client.get("/test/passed-on?status=503&own=3")).headers["Retry-After"] == "3"
        assert "Retry-After" not in (await client.get("/test/passed-on?status=502")).headers
