"""Ollama fleets end to end (issue 12): emulated Ollama replicas with load times and a real balancer process.

Hot preference, pre-warm exactly once, the fallback chain, a pulled model routable without restart, num_ctx
pinning, model management through the balancer, and the embedding slot.
"""

from __future__ import annotations

import json
import threading

import ollama
import pytest
import requests

from tests.cluster import Cluster, post_json
from tests.procs import log_events

pytestmark = pytest.mark.timeout(120)

MODEL = "m:latest"
FAST = ("--time-scale", "0.05")


def _fleet(procs, tmp_path, fleet: dict, *, n: int = 2, load_s: float = 1.5, extra: tuple = (),
           balancer: dict | None = None, models: tuple = (MODEL,)):
    """A controller, one emulator process with ``n`` Ollama replicas (each model takes ``load_s`` to load) and
    the us balancer with ``ollama_fleet: fleet``; returns (cluster, balancer URL, replica URLs, replica ids)."""
    cluster = Cluster(procs, tmp_path, balancer={"ollama_fleet": fleet, **(balancer or {})})
    cluster.start_controller(["us"])
    urls = cluster.start_emulator(n, "--engine", "ollama", *[a for m in models for a in ("--model", m)],
                                  "--ollama-load-s", str(load_s), *FAST, *extra, name="emu-ollama")
    url = cluster.start_balancer("us", ["us"])
    ids = [f"r{i}" for i in range(n)]
    for rid, replica in zip(ids, urls):
        cluster.add_replica("us", replica, engine="ollama", replica_id=rid)
    cluster.wait_replicas_healthy("us", n)
    cluster.wait_until(lambda: all(r["thermal"] is not None and r["models"] for r in cluster.status("us")["replicas"]),
                       what="thermal state of every replica")
    return cluster, url, urls, ids


def _thermal(cluster: Cluster, rid: str, model: str = MODEL) -> str | None:
    replica = next(r for r in cluster.status("us")["replicas"] if r["id"] == rid)
    return (replica["thermal"] or {}).get(model)


def _load_lines(procs, replica_url: str) -> list[dict]:
    """The emulator's model_load log lines of the replica at ``replica_url``."""
    text = (procs.log_dir / "emu-ollama.log").read_text(errors="replace")
    name = replica_url.removeprefix("http://")
    return [obj for obj in log_events(text, "model_load") if obj.get("replica") == name]


def test_request_goes_where_its_model_is_hot(procs, tmp_path):
    """The model is hot on r1 only; both replicas idle. With hot_preference every request goes to r1 and none
    waits a load; the thermal state shows hot on r1 and disk on r0."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {"hot_preference": True})
    requests.post(f"{urls[1]}/api/generate", json={"model": MODEL, "prompt": ""}, timeout=30).raise_for_status()
    cluster.wait_until(lambda: _thermal(cluster, "r1") == "hot", what="m hot on r1")
    assert _thermal(cluster, "r0") == "disk"
    served = []
    for i in range(6):
        r = requests.post(f"{url}/api/generate", json={"model": MODEL, "prompt": f"question {i} " * 3,
                                                        "stream": False, "options": {"num_predict": 2}}, timeout=30)
        assert r.status_code == 200, r.text
        served.append(r.headers["X-SkyLB-Served-By"])
        assert r.json()["load_duration"] == 0
    assert set(served) == {"us/r1"}
    assert _load_lines(procs, urls[0]) == []


def test_prewarm_loads_the_model_on_the_runner_up_exactly_once(procs, tmp_path):
    """m is hot on r0 (one slot), on disk on r1. Requests wait for hot r0 (waiting one request's service time is
    cheaper than a 1.5 s load), so the queue passes 3: the balancer pre-warms r1 with one empty generate, exactly
    once although many probe rounds see the deep queue while it loads; once loaded, r1 serves too (each request
    takes about 0.5 s on r0: ten of them outlast the load)."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {"hot_preference": True, "service_s": 0.5, "prewarm": True,
                                                       "prewarm_threshold": 3, "prewarm_keep_alive": "10m"})
    requests.post(f"{urls[0]}/api/generate", json={"model": MODEL, "prompt": ""}, timeout=30).raise_for_status()
    cluster.wait_until(lambda: _thermal(cluster, "r0") == "hot", what="m hot on r0")
    results: list = []

    def one(i: int) -> None:
        r = requests.post(f"{url}/api/generate", json={"model": MODEL, "prompt": f"q{i} words here", "stream": False,
                                                        "options": {"num_predict": 200, "ignore_eos": True}},
                          timeout=60)
        results.append((r.status_code, r.headers.get("X-SkyLB-Served-By")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert [s for s, _ in results] == [200] * 10
    status = cluster.status("us")
    assert status["ollama_fleet"]["prewarms"] == [{"model": MODEL, "replica": "r1", "count": 1}]
    loads = _load_lines(procs, urls[1])
    assert len(loads) == 1, loads  # one load on the runner-up: the pre-warm
    assert _thermal(cluster, "r1") == "hot"
    assert {by for _, by in results} == {"us/r0", "us/r1"}


def test_fallback_chain_serves_when_the_primary_has_no_replica(procs, tmp_path):
    """No replica serves big:latest; its chain names small:latest, which serves it: the response says so."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {"fallbacks": {"big:latest": ["gone:1b", "small:latest"]},
                                                       "fallback_hold_s": 0.5},
                                     n=1, load_s=0.1, models=("small:latest",))
    r = requests.post(f"{url}/api/chat", json={"model": "big:latest", "stream": False,
                                               "messages": [{"role": "user", "content": "hi"}],
                                               "options": {"num_predict": 2}}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["X-SkyLB-Model"] == "small:latest" and r.json()["model"] == "small:latest"
    client = ollama.Client(host=url, timeout=30)
    assert client.generate(model="big:latest", prompt="hello", options={"num_predict": 2}).model == "small:latest"
    with pytest.raises(ollama.ResponseError) as err:  # no chain: still 404
        client.generate(model="other:latest", prompt="x")
    assert err.value.status_code == 404


def test_fallback_after_holding_when_the_primary_is_busy(procs, tmp_path):
    """big:latest is served, by r0 only (one slot, busy with a long generation); after fallback_hold_s in the
    queue the request goes to its fallback small:latest on r1, and says so."""
    cluster = Cluster(procs, tmp_path, balancer={"ollama_fleet": {"fallbacks": {"big:latest": ["small:latest"]},
                                                                  "fallback_hold_s": 0.3}})
    cluster.start_controller(["us"])
    [big] = cluster.start_emulator(1, "--engine", "ollama", "--model", "big:latest", *FAST, name="emu-big")
    [small] = cluster.start_emulator(1, "--engine", "ollama", "--model", "small:latest", *FAST, name="emu-small")
    url = cluster.start_balancer("us", ["us"])
    for rid, replica in (("r0", big), ("r1", small)):
        cluster.ctl("replica", "add", "--region", "us", "--url", replica, "--engine", "ollama", "--id", rid,
                    "--max-concurrency", "1")
    cluster.wait_until(lambda: all(r["models"] for r in cluster.status("us")["replicas"])
                       and len(cluster.status("us")["replicas"]) == 2, what="models")
    results = {}

    def long() -> None:
        r = requests.post(f"{url}/api/generate", json={"model": "big:latest", "prompt": "long", "stream": False,
                                                        "options": {"num_predict": 1000, "ignore_eos": True}},
                          timeout=60)
        results["long"] = (r.status_code, r.headers.get("X-SkyLB-Model"))

    thread = threading.Thread(target=long)
    thread.start()
    try:
        cluster.wait_until(lambda: cluster.first_replica("us").get("outstanding") == 1, what="r0 busy")
        r = requests.post(f"{url}/api/generate", json={"model": "big:latest", "prompt": "short", "stream": False,
                                                        "options": {"num_predict": 2}}, timeout=60)
        results["short"] = (r.status_code, r.headers.get("X-SkyLB-Model"), r.json().get("model"))
    finally:
        thread.join(timeout=60)
    assert results["short"] == (200, "small:latest", "small:latest")
    assert results["long"] == (200, "big:latest")


def test_pulled_model_is_routable_without_restart(procs, tmp_path):
    """A model pulled through the balancer on a named replica is routable at once; one pulled on a replica
    directly is routable after the next model-list refresh; a delete through the balancer removes it."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {}, load_s=0.1, balancer={"models_refresh_s": 0.5})
    client = ollama.Client(host=url, timeout=30, headers={"X-SkyLB-Replica": "r1"})
    progress = list(client.pull("new:7b", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.total and p.completed == p.total for p in progress)
    reply = requests.post(f"{url}/api/generate", json={"model": "new:7b", "prompt": "hi", "stream": False,
                                                        "options": {"num_predict": 2}}, timeout=30)
    assert reply.status_code == 200 and reply.headers["X-SkyLB-Served-By"] == "us/r1"
    # Pulled on r0 directly (not through the balancer): seen within models_refresh_s.
    requests.post(f"{urls[0]}/api/pull", json={"model": "direct:1b", "stream": False}, timeout=30).raise_for_status()
    cluster.wait_until(lambda: "direct:1b" in next(r for r in cluster.status("us")["replicas"]
                                                   if r["id"] == "r0")["models"], what="direct:1b listed")
    status, body, headers = post_json(f"{url}/api/generate", {"model": "direct:1b", "prompt": "x", "stream": False,
                                                              "options": {"num_predict": 1}})
    assert status == 200 and headers["X-SkyLB-Served-By"] == "us/r0"
    # Every replica of the region (no X-SkyLB-Replica): each one's progress lines name it.
    lines = [json.loads(line) for line in requests.post(f"{url}/api/pull", json={"model": "both:1b"},
                                                         timeout=30).text.splitlines()]
    assert {ln["replica"] for ln in lines if ln.get("status") == "success"} == {"r0", "r1"}
    r = requests.delete(f"{url}/api/delete", json={"model": "new:7b"}, headers={"X-SkyLB-Replica": "r1"}, timeout=10)
    assert r.status_code == 200
    status, body, _ = post_json(f"{url}/api/generate", {"model": "new:7b", "prompt": "x", "stream": False})
    assert status in (404, 503) and isinstance(body["error"], str)
    r = requests.post(f"{url}/api/copy", json={"source": "both:1b", "destination": "alias"},
                      headers={"X-SkyLB-Replica": "r0"}, timeout=10)
    assert r.status_code == 200
    created = [json.loads(x) for x in requests.post(f"{url}/api/create", json={"model": "made", "from": "alias"},
                                                     headers={"X-SkyLB-Replica": "r0"}, timeout=30).text.splitlines()]
    assert created[-1] == {"status": "success"}
    assert client.generate(model="made:latest", prompt="x", options={"num_predict": 1}).done
    r = requests.post(f"{url}/api/pull", json={"model": "x"}, headers={"X-SkyLB-Replica": "nope"}, timeout=10)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    # A body nested deeper than Python's decoder recurses: the replica answers it in Ollama's shape, never a 500.
    r = requests.post(f"{url}/api/pull", data=b"[" * 100_000 + b"]" * 100_000, headers={"X-SkyLB-Replica": "r0"},
                      timeout=10)
    assert 400 <= r.status_code < 500 and isinstance(r.json()["error"], str), r.text[:200]


def test_num_ctx_is_pinned(procs, tmp_path):
    """With num_ctx pinned to 8192, clients asking 2048 or nothing never make the replica reload the model (one
    load in all, context_length 8192 in /api/ps); straight to the replica, another num_ctx reloads it."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {"num_ctx": {MODEL: 8192}}, n=1, load_s=0.3)
    client = ollama.Client(host=url, timeout=30)
    for options in ({"num_ctx": 2048}, {}, {"num_ctx": 32768}):
        reply = client.generate(model=MODEL, prompt="hello", options={"num_predict": 1, **options})
        assert reply.done
    assert len(_load_lines(procs, urls[0])) == 1
    assert [m["context_length"] for m in requests.get(f"{urls[0]}/api/ps", timeout=5).json()["models"]] == [8192]
    direct = requests.post(f"{urls[0]}/api/generate", json={"model": MODEL, "prompt": "x", "stream": False,
                                                            "options": {"num_predict": 1, "num_ctx": 2048}},
                           timeout=30).json()
    assert direct["load_duration"] > 0 and len(_load_lines(procs, urls[0])) == 2


@pytest.mark.parametrize("slot", [True, False])
def test_embedding_slot_runs_an_embedding_beside_a_generation(procs, tmp_path, slot):
    """One Ollama replica with one generation slot (max_concurrency 1) busy with a long generation: with the
    embedding slot an embedding is answered while the generation still runs; without, it waits for it."""
    cluster = Cluster(procs, tmp_path, balancer={"ollama_fleet": {"embedding_slot": slot}})
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, "--engine", "ollama", "--model", MODEL, "--parallel", "1", *FAST,
                                       name="emu-ollama")
    url = cluster.start_balancer("us", ["us"])
    cluster.ctl("replica", "add", "--region", "us", "--url", replica, "--engine", "ollama", "--id", "r0",
                "--max-concurrency", "1")
    cluster.wait_until(lambda: cluster.status("us")["replicas"] and cluster.first_replica("us").get("models"),
                       what="models")
    answers: dict[str, int] = {}

    def generate() -> None:
        r = requests.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "long", "stream": False,
                                                        "options": {"num_predict": 60, "ignore_eos": True}},
                          headers={"X-Request-Id": "generate"}, timeout=60)
        answers["generate"] = r.status_code

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        cluster.wait_until(lambda: cluster.first_replica("us").get("outstanding") == 1, what="generation running")
        r = requests.post(f"{url}/api/embed", json={"model": MODEL, "input": "a short text"},
                          headers={"X-Request-Id": "embed"}, timeout=60)
        answers["embed"] = r.status_code
    finally:
        thread.join(timeout=60)
    assert answers == {"generate": 200, "embed": 200}
    # The order the balancer finished them in (its request lines), not the order two client threads woke up in:
    # without the slot the embedding is placed only when the generation's answer has ended.
    balancer = next(p for p in procs.procs if p.name == "balancer-us")

    def finished() -> list[str]:
        return [line["client_request_id"] for line in log_events(balancer.log(), "request")
                if line.get("client_request_id") in answers]

    cluster.wait_until(lambda: len(finished()) == 2, what="both request lines")
    assert finished() == (["embed", "generate"] if slot else ["generate", "embed"])


def test_a_short_model_name_means_its_latest_tag(procs, tmp_path):
    """The replicas list ``m:latest``; a client asking for ``m`` or ``M`` (as `ollama run m` does) is served through
    either API, its body naming the served model, and its route keyed by that name; an unknown tag is still
    a 404 in the API's shape."""
    cluster, url, urls, ids = _fleet(procs, tmp_path, {}, load_s=0.1)
    client = ollama.Client(host=url, timeout=30)
    answer = client.generate(model="m", prompt="hello there", options={"num_predict": 2})
    assert answer["model"] == MODEL and answer["done"]
    status, body, _ = post_json(f"{url}/v1/chat/completions", {"model": "M", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["model"] == MODEL, body
    missing = requests.post(f"{url}/api/generate", json={"model": "m:7b", "prompt": "x", "stream": False}, timeout=30)
    assert missing.status_code == 404 and "m:7b" in missing.json()["error"]
