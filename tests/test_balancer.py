"""The balancer end to end, with real processes: controller, emulated vLLM replicas, latency proxy, balancers."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.cluster import MODEL, Cluster, emulator_gauge, get_json, post_json
from tests.procs import ProcGroup, free_ports

# Emulated durations x 0.2: a 60-token generation lasts about 0.7 s.
FAST = ("--time-scale", "0.2")


def _complete(url: str, prompt: str, *, max_tokens: int = 8, headers: dict | None = None, timeout: float = 30):
    """A streamed /v1/completions call; returns (status, route, served_by, ttft_s, text, done, rule)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with requests.post(f"{url}/v1/completions", json=body, headers=headers or {}, stream=True,
                       timeout=timeout) as resp:
        ttft, text, done = None, "", False
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.monotonic() - start
            payload = line[6:]
            if payload == b"[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                break
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        return (resp.status_code, resp.headers.get("X-SkyLB-Route"), resp.headers.get("X-SkyLB-Served-By"),
                ttft, text, done, resp.headers.get("X-SkyLB-Rule"))


@pytest.fixture
def one_region(procs, tmp_path):
    """A controller, one balancer (us) and two emulated replicas."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    replicas = cluster.start_emulator(2, *FAST)
    url = cluster.start_balancer("us", ["us"])
    for i, r in enumerate(replicas):
        cluster.add_replica("us", r, replica_id=f"us-{i}")
    cluster.wait_replicas_healthy("us", 2)
    return cluster, url, replicas


def test_openai_client_streaming_and_non_streaming(one_region):
    """The official openai client gets chat and completions, streamed and not, through a balancer."""
    cluster, url, _ = one_region
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=5, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 6 and text and chunks[-1].usage.completion_tokens == 6
    comp = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4,
                                     extra_body={"ignore_eos": True})
    assert comp.choices[0].text and comp.usage.prompt_tokens == 4
    streamed = list(client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert raw.headers["X-SkyLB-Route"] == "local" and raw.headers["X-SkyLB-Served-By"].startswith("us/us-")
    assert raw.headers["X-SkyLB-Rule"] == "estimated_ttft"  # the default profile's local pick


def test_bad_input_gets_openai_errors_never_500(one_region):
    """Invalid JSON, missing fields and unknown paths get 4xx errors in OpenAI's shape."""
    _, url, _ = one_region
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "JSON" in json.loads(err.value.read())["error"]["message"]
    status, body, _ = post_json(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["param"] == "model"
    status, body, _ = post_json(f"{url}/v1/chat/completions", {"model": MODEL})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body, _ = post_json(f"{url}/v1/completions", {"model": MODEL, "prompt": 5})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body, _ = post_json(f"{url}/v1/nothing", {"model": MODEL})
    assert status in (404, 405) and "message" in body["error"]


def test_metrics_and_status_describe_replicas(one_region):
    """/metrics exposes queue length, per-replica pending and availability, routed counts and TTFT."""
    cluster, url, _ = one_region
    _complete(url, "metrics please")
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    for name in ("skylb_queue_length", "skylb_replica_pending_requests", "skylb_replica_available",
                 "skylb_requests_routed_total", "skylb_ttft_seconds_bucket", "skylb_peer_available"):
        assert name in text
    # The TTFT is observed at the first byte, so it is counted before the client can read the stream's end.
    [count] = [line for line in text.splitlines() if line.startswith("skylb_ttft_seconds_count{")
               and 'route="local"' in line]
    assert float(count.rsplit(" ", 1)[1]) >= 1
    assert any(line.startswith("skylb_requests_routed_total{") and 'rule="estimated_ttft"' in line
               for line in text.splitlines())
    status = cluster.status("us")
    assert {r["id"] for r in status["replicas"]} == {"us-0", "us-1"}
    assert status["controller_reachable"] is True
    assert status["placed_by_rule"]["estimated_ttft"] >= 1


def _peak_waiting_under_load(cluster, url, replicas, n_requests=16, max_tokens=40):
    """Send n concurrent long requests; sample replicas' vllm:num_requests_waiting and the balancer queue.

    The requests leave together (a barrier): on a loaded machine, threads that each start their request when they
    get to run spread 16 short requests over as long as the first ones last, and less piles up."""
    peak_waiting, peak_queue, stop = [0.0], [0], threading.Event()
    together = threading.Barrier(n_requests)

    def one(i: int):
        together.wait(timeout=30)
        return _complete(url, f"request {i} " * 20, max_tokens=max_tokens)

    def sample():
        while not stop.is_set():
            peak_waiting[0] = max([peak_waiting[0]] + [emulator_gauge(r, "vllm:num_requests_waiting")
                                                       for r in replicas])
            peak_queue[0] = max(peak_queue[0], cluster.status("us")["queue_len"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(n_requests) as pool:
            results = list(pool.map(one, range(n_requests)))
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert all(r[0] == 200 and r[5] for r in results)
    return peak_waiting[0], peak_queue[0]


def test_selective_pushing_keeps_engines_free_of_pending(procs, tmp_path):
    """With selective pushing, requests wait at the balancer and replicas never build a pending queue."""
    cluster = Cluster(procs, tmp_path, balancer={"max_dispatch_per_probe": 1, "probe_interval_ms": 50})
    cluster.start_controller(["us"])
    replicas = cluster.start_emulator(2, *FAST, "--max-num-seqs", "2")
    url = cluster.start_balancer("us", ["us"])
    for r in replicas:
        cluster.add_replica("us", r)
    cluster.wait_replicas_healthy("us", 2)
    peak_waiting, peak_queue = _peak_waiting_under_load(cluster, url, replicas)
    assert peak_queue >= 4  # the excess waited at the balancer ...
    assert peak_waiting <= 2  # ... not in the engines (at most a probe-interval race)


def test_blind_pushing_builds_pending_in_engines(procs, tmp_path):
    """The round-robin baseline (blind pushing) piles requests up as pending inside the engines."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    replicas = cluster.start_emulator(2, *FAST, "--max-num-seqs", "2")
    url = cluster.start_balancer("us", ["us"], policy="round-robin")
    for r in replicas:
        cluster.add_replica("us", r)
    cluster.wait_replicas_healthy("us", 2)
    # Longer answers than the selective test's: all 16 are in the engines at once even when the machine is slow
    # (4 running, 6 waiting per replica).
    peak_waiting, _ = _peak_waiting_under_load(cluster, url, replicas, max_tokens=120)
    assert peak_waiting >= 4


def _saturate(replica_url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    """Fill a replica directly (not through a balancer) with n long requests, in background threads."""
    def call():
        try:
            post_json(f"{replica_url}/v1/completions",
                      {"model": MODEL, "prompt": "busy", "max_tokens": max_tokens, "ignore_eos": True}, timeout=60)
        except OSError:  # the replica is stopped at teardown while this filler may still run
            pass
    threads = [threading.Thread(target=call, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def _three_regions_once(tmp_path_factory):
    """us, eu, asia with one max-num-seqs=1 replica each in us and eu, two in asia; latency links from us. Started
    once for the tests below (about 6 s of start-up each on an idle machine, 12 s under the full suite)."""
    tmp = tmp_path_factory.mktemp("three-regions")
    with ProcGroup(tmp / "logs") as procs:
        yield from _start_three_regions(procs, tmp)


@pytest.fixture
def three_regions(_three_regions_once):
    """The three regions, idle: every replica free (a test's saturating requests, sent straight to the replicas,
    ended) and no balancer queueing; after the test, every balancer's counters return to zero."""
    cluster, replicas = _three_regions_once
    counts = {region: len(urls) for region, urls in replicas.items()}
    cluster.wait_until(lambda: all(cluster.status(region)["available_replicas"] == n and
                                   cluster.status(region)["queue_len"] == 0 for region, n in counts.items()),
                       timeout_s=20, what="every replica idle")
    yield cluster, replicas
    cluster.assert_counters_return_to_zero()


def _start_three_regions(procs, tmp_path):
    cluster = Cluster(procs, tmp_path)
    regions = ["us", "eu", "asia"]
    cluster.start_controller(regions)
    us_r = cluster.start_emulator(1, *FAST, "--max-num-seqs", "1", name="emu-us")
    eu_r = cluster.start_emulator(1, *FAST, "--max-num-seqs", "1", name="emu-eu")
    asia_r = cluster.start_emulator(2, *FAST, name="emu-asia")
    api = cluster.start_toxiproxy()
    from bench.latency.links import LatencyLinks
    links = LatencyLinks(api)
    # One reservation for the balancers' and the links' ports: a link on port 0 once took asia's before it bound it.
    *reserved, eu_link, asia_link = free_ports(5)
    ports = dict(zip(regions, reserved))
    to_eu = links.link("us-to-eu", f"127.0.0.1:{ports['eu']}", rtt_ms=80, listen_port=eu_link)
    to_asia = links.link("us-to-asia", f"127.0.0.1:{ports['asia']}", rtt_ms=150, listen_port=asia_link)
    cluster.start_balancer("eu", regions, port=ports["eu"])
    cluster.start_balancer("asia", regions, port=ports["asia"])
    cluster.start_balancer("us", regions, port=ports["us"],
                           peer_urls={"eu": f"http://{to_eu}", "asia": f"http://{to_asia}"})
    for region, urls in (("us", us_r), ("eu", eu_r), ("asia", asia_r)):
        for u in urls:
            cluster.add_replica(region, u)
    for region, n in (("us", 1), ("eu", 1), ("asia", 2)):
        cluster.wait_replicas_healthy(region, n)
        cluster.wait_peers_probed(region, 2)
    yield cluster, {"us": us_r, "eu": eu_r, "asia": asia_r}
    links.close()


def test_forwarding_to_the_only_available_peer_pays_the_round_trip(three_regions):
    """With us and eu full, us forwards to asia, the only available peer, and TTFT includes the 150 ms RTT."""
    cluster, replicas = three_regions
    for region in ("us", "eu"):
        _saturate(replicas[region][0], 2, max_tokens=400)  # one running, one pending, for about 5 s
    cluster.wait_until(lambda: cluster.status("us")["available_replicas"] == 0, what="us full")
    cluster.wait_until(lambda: {p["region"]: p["available"] for p in cluster.status("us")["peers"]}
                       == {"eu": False, "asia": True}, what="only asia available to us")
    results = [_complete(cluster.balancers["us"], f"overflow {i}", max_tokens=4) for i in range(3)]
    for status, route, served_by, ttft, _, done, rule in results:
        assert status == 200 and done
        assert route == "peer:asia" and served_by.startswith("asia/")
        # no local room: the peer picker (the snapshot match, else the most room); then asia's local pick
        assert rule == "prefix_match, estimated_ttft"
        assert ttft >= 0.150
    # the status counts each forward once, where it was answered (at the stream's last event, also when the client
    # closes right after reading it); polled (bounded) as the status is read over HTTP while the relays end
    seen = []
    def forwarded():
        seen.append({p["region"]: p["forwarded"] for p in cluster.status("us")["peers"]})
        return seen[-1] == {"eu": 0, "asia": 3}
    try:
        cluster.wait_until(forwarded, timeout_s=5.0, what="3 forwards counted at asia")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the status' last count: {seen[-1]}") from None
    local = _complete(cluster.balancers["asia"], "served in asia", max_tokens=4)
    assert local[1] == "local" and local[3] < 0.150


def test_a_forwarded_request_is_never_forwarded_again(three_regions):
    """A request marked as forwarded waits for a local replica even while a peer is available."""
    cluster, replicas = three_regions
    _saturate(replicas["eu"][0], 2, max_tokens=150)  # busy for about 2 s
    cluster.wait_until(lambda: cluster.status("eu")["available_replicas"] == 0, what="eu full")
    assert any(p["available"] for p in cluster.status("eu")["peers"])
    status, route, served_by, _, _, done, rule = _complete(cluster.balancers["eu"], "from us", max_tokens=2,
                                                           headers={"X-SkyLB-Forwarded-From": "us",
                                                                    "X-SkyLB-Token": cluster.peer_token})
    assert status == 200 and done and route == "local" and served_by.startswith("eu/")
    assert rule == "estimated_ttft"  # waited here for room, then the local pick


def test_a_forwarded_request_keeps_its_age_in_the_peers_queue(three_regions):
    """A forwarded request that says it waited 5 s at its first balancer (``X-SkyLB-Queue-Ms``) queues ahead of one
    that arrived here before it without such a wait: first come, first served across regions; the status reports
    the oldest queued request's age, that wait included. (Both are marked forwarded so neither leaves for asia.)"""
    cluster, replicas = three_regions
    _saturate(replicas["eu"][0], 2, max_tokens=150)  # busy for about 2 s
    cluster.wait_until(lambda: cluster.status("eu")["available_replicas"] == 0, what="eu full")
    finished: dict[str, float] = {}

    def send(name, headers):
        result = _complete(cluster.balancers["eu"], name, max_tokens=2, headers=headers)
        finished[name] = time.monotonic()
        return result

    with ThreadPoolExecutor(2) as pool:
        fresh = pool.submit(send, "fresh", {"X-SkyLB-Forwarded-From": "asia", "X-SkyLB-Token": cluster.peer_token})
        cluster.wait_until(lambda: cluster.status("eu")["queue_len"] == 1, what="fresh request queued")
        forwarded = pool.submit(send, "forwarded", {"X-SkyLB-Forwarded-From": "us", "X-SkyLB-Queue-Ms": "5000",
                                                    "X-SkyLB-Token": cluster.peer_token})
        cluster.wait_until(lambda: cluster.status("eu")["queue_len"] == 2, what="forwarded request queued")
        assert cluster.status("eu")["queue_age_ms"] >= 5000
        results = [fresh.result(timeout=30), forwarded.result(timeout=30)]
    assert all(r[0] == 200 and r[5] and r[1] == "local" for r in results)
    assert finished["forwarded"] < finished["fresh"]


def test_replica_add_and_remove_while_traffic_flows(procs, tmp_path):
    """An added replica takes requests within 2 s; a removed one gets no new requests and its stream finishes."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    a, b = cluster.start_emulator(2, *FAST)
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", a, replica_id="a")
    cluster.wait_replicas_healthy("us", 1)
    long_result = {}
    long_stream = threading.Thread(target=lambda: long_result.update(r=_complete(url, "long", max_tokens=250)))
    long_stream.start()  # only replica a exists: this stream runs on a for about 3 s
    time.sleep(0.3)
    log, stop = [], threading.Event()

    def traffic():
        for i in range(400):  # bounded: at most 400 requests or until stopped
            if stop.is_set():
                return
            sent = time.monotonic()
            log.append((sent, _complete(url, f"short {i}", max_tokens=2)))

    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        time.sleep(0.5)
        # The clocks start once skylb-ctl (a Python subprocess: seconds to start on a busy machine) has returned,
        # i.e. when the controller holds the change: from then on it is the balancer's watch that is measured.
        cluster.add_replica("us", b, replica_id="b")
        added = time.monotonic()
        cluster.wait_until(lambda: any(r[2] == "us/b" for _, r in log), timeout_s=5, what="b serving")
        first_b = min(t for t, r in log if r[2] == "us/b")
        assert first_b - added <= 2.0
        cluster.ctl("replica", "remove", "a")
        removed = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        sender.join(timeout=30)
        long_stream.join(timeout=30)
    assert all(r[0] == 200 and r[5] for _, r in log)
    assert not [r for t, r in log if t > removed + 0.5 and r[2] == "us/a"]
    status, _, served_by, _, text, done, _ = long_result["r"]
    assert status == 200 and done and served_by == "us/a" and len(text.split()) == 250


def test_balancer_keeps_serving_on_last_membership_without_controller(procs, tmp_path):
    """With the controller gone, the balancer serves on its last membership, also after a restart."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, *FAST)
    url = cluster.start_balancer("us", ["us"], name="balancer-1")
    cluster.add_replica("us", replica)
    cluster.wait_replicas_healthy("us", 1)
    procs.procs[0].stop()  # the controller
    cluster.wait_until(lambda: not cluster.status("us")["controller_reachable"], timeout_s=30,
                       what="controller seen as unreachable")
    assert _complete(url, "still here")[0] == 200
    procs.procs[-1].stop()  # the balancer
    url = cluster.start_balancer("us", ["us"], name="balancer-2")
    cluster.wait_replicas_healthy("us", 1)
    status, route, _, _, _, done, _ = _complete(url, "after restart")
    assert status == 200 and done and route == "local"
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    assert 'skylb_controller_reachable{region="us"} 0.0' in text


def test_client_disconnect_removes_a_queued_request(procs, tmp_path):
    """A client that gives up while its request is queued leaves the queue (nothing is sent for it later)."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, *FAST, "--max-num-seqs", "1")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", replica)
    cluster.wait_replicas_healthy("us", 1)
    _saturate(replica, 2, max_tokens=200)
    cluster.wait_until(lambda: cluster.status("us")["available_replicas"] == 0, what="us full")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "impatient", "max_tokens": 1},
                      timeout=0.5)
    cluster.wait_until(lambda: cluster.status("us")["queue_len"] == 0, timeout_s=5, what="queue emptied")


@pytest.mark.parametrize("policy, reused", [("skylb", True), ("skylb-paper", False)])
def test_finished_request_slot_is_reused_before_the_next_probe(procs, tmp_path, policy, reused):
    """A llama.cpp replica with one slot, probed every 8 s: the second request, queued at the balancer while the
    first runs, is sent the moment the first ends (skylb), not at the next probe (the paper's rule waits)."""
    cluster = Cluster(procs, tmp_path, balancer={"probe_interval_ms": 8_000, "max_dispatch_per_probe": 0})
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, *FAST, "--engine", "llamacpp", "--parallel", "1")
    url = cluster.start_balancer("us", ["us"], policy=policy)
    cluster.add_replica("us", replica, engine="llamacpp")
    cluster.wait_replicas_healthy("us", 1, timeout_s=20)  # the next probe comes 8 s after this one
    cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="models learned")
    body = {"model": MODEL, "prompt": "first", "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post_json, f"{url}/v1/completions", body, timeout=20)
        cluster.wait_until(lambda: emulator_gauge(replica, "llamacpp:requests_processing") == 1, what="first runs")
        started = time.monotonic()
        second = pool.submit(post_json, f"{url}/v1/completions", {**body, "prompt": "second"}, timeout=4)
        assert first.result()[0] == 200
        if reused:
            status, _, headers = second.result()
            assert status == 200
            assert float(headers["X-SkyLB-Queue-Ms"]) / 1000 < time.monotonic() - started  # it did wait ...
            assert time.monotonic() - started < 4  # ... for the first to end, not for a probe 30 s later
        else:
            with pytest.raises((TimeoutError, urllib.error.URLError)):  # still queued when the client gives up at 4 s
                second.result()


def test_peer_token_from_the_environment_overrides_the_config(procs, tmp_path):
    """$SKYLB_PEER_TOKEN (what the systemd EnvironmentFile and the Kubernetes Secret set) is the token peers must
    send, over ``balancer.peer_token`` in the config; without it the config's token holds."""
    cfg = tmp_path / "token.yaml"
    from_config, from_env = "peer-token-from-the-config-5e8a1c07", "peer-token-from-the-env-93b4d6f2a7"
    cfg.write_text(f"balancer:\n  peer_token: {from_config}\nregions:\n  us: {{}}\n")
    ports = free_ports(2)
    for port, env in zip(ports, ({"SKYLB_PEER_TOKEN": from_env}, {"SKYLB_PEER_TOKEN": ""})):
        procs.skylb("balancer", "--config", str(cfg), "--region", "us", "--port", str(port),
                    "--controller", "http://127.0.0.1:1", name=f"balancer-{port}", env=env,
                    wait_url=f"http://127.0.0.1:{port}/healthz")

    def status(port: int, token: str | None) -> int:
        headers = {"X-SkyLB-Token": token} if token else {}
        return requests.get(f"http://127.0.0.1:{port}/skylb/v1/status", headers=headers, timeout=5).status_code

    env_port, config_port = ports
    assert [status(env_port, t) for t in (None, from_config, from_env)] == [403, 403, 200]
    assert [status(config_port, t) for t in (None, from_env, from_config)] == [403, 403, 200]


async def test_model_lists_refresh_on_schedule():
    """A model loaded or deleted on a replica after the balancer first read its list is seen at the next refresh
    (``models_refresh_s``), not never: a real HTTP server whose /v1/models changes, probed by the real probers."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from skylb.balancer.probers import Probers
    from skylb.config import BalancerConfig
    from skylb.core import build_router
    from tests.procs import free_port

    served = ["model-a"]

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in served]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    router = build_router("us", BalancerConfig())
    router.set_replicas([("us-1", f"http://127.0.0.1:{port}", "openai")])
    # The probers' clock moves by hand, so a loaded machine's slow probe cannot pass a refresh; a round waits for
    # its probes up to one interval (10 s of real time), so each round's probe has answered when it returns.
    clock = [1000.0]
    try:
        async with aiohttp.ClientSession() as session:
            probers = Probers(router, session, now=lambda: clock[0], on_round=lambda: None, interval_s=10.0,
                              timeout_s=5.0, peer_token=None, models_refresh_s=30.0, max_backoff=1)
            await probers.probe_replicas()
            assert router.served_models() == {"model-a"}
            served[:] = ["model-b"]  # model-a deleted, model-b pulled
            clock[0] += 6.0  # the next probe is due, the model list not yet
            await probers.probe_replicas()
            assert router.served_models() == {"model-a"}  # not yet: the list is read every 30 s, not every probe
            clock[0] += 25.0
            await probers.probe_replicas()
            assert router.served_models() == {"model-b"}
    finally:
        await runner.cleanup()
