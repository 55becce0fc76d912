"""Faults injected into real processes (issue 10): a replica killed or hung (a Toxiproxy ``timeout`` toxic through
`skylb toxiproxy`), a peer region partitioned, a balancer stopped with SIGTERM, clients that disconnect. Each test
prints what it measured (``pytest -s`` shows it).

Every process is started through the ``procs`` fixture, so it is stopped also when a test fails, and a Cluster
checks at teardown that its balancers' queue and in-flight counters went back to zero.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import requests
from toxiproxy import Toxiproxy
from toxiproxy.api import APIConsumer

from tests.cluster import MODEL, Cluster, emulator_gauge, get_json
from tests.procs import free_port

# Emulated durations x 0.2: a 60-token generation lasts about 0.7 s.
FAST = ("--time-scale", "0.2")
RUNNING = "vllm:num_requests_running"


def _point_toxiproxy_client(url: str) -> None:
    """The toxiproxy-python client keeps its server as class attributes: point them at ``url``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    APIConsumer.host, APIConsumer.port = host, int(port)


def _stream(url: str, prompt: str, *, max_tokens: int = 8, timeout: float = 30, on_chunk=None) -> dict:
    """A streamed /v1/completions call; returns status, served_by, text, the error event if any, whether it ended
    with [DONE], and the seconds it took. ``on_chunk(i)`` is called after the i-th data chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    out = {"text": "", "error": None, "done": False, "chunks": 0, "after_done": 0}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as resp:
        out.update(status=resp.status_code, served_by=resp.headers.get("X-SkyLB-Served-By"))
        if resp.status_code != 200:
            out["error"] = resp.json()
            out["seconds"] = time.monotonic() - start
            return out
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if out["done"]:
                out["after_done"] += 1
            elif payload == b"[DONE]":
                out["done"] = True
            else:
                chunk = json.loads(payload)
                if "error" in chunk:
                    out["error"] = chunk["error"]
                else:
                    out["text"] += "".join(c.get("text", "") for c in chunk.get("choices", []))
                    out["chunks"] += 1
                    if on_chunk is not None:
                        on_chunk(out["chunks"])
    out["seconds"] = time.monotonic() - start
    return out


def _counter(url: str, name: str) -> float:
    """The sum of a balancer's Prometheus samples of ``name`` (a counter: its ``_total`` samples)."""
    return emulator_gauge(url, name)


def _region(procs, tmp_path, *, replicas: int, balancer: dict, policy: str | None = None,
            proxied: tuple[int, ...] = (), emulator_args: tuple[str, ...] = FAST):
    """A controller, ``replicas`` emulated vLLM replicas (one process each, so one can be killed), the latency proxy
    in front of the replicas in ``proxied`` (by index), and the us balancer, which knows the replicas before it
    starts (its first probe round sees them). The controller's health checks are off, so that membership does not
    change under the balancer's own detection (what these tests measure). Returns (cluster, balancer URL, replica URLs, emulator procs,
    proxies by index)."""
    cluster = Cluster(procs, tmp_path, balancer=balancer, controller={"health": {"enabled": False}})
    cluster.start_controller(["us"])
    urls, emulators = [], []
    for i in range(replicas):
        [url] = cluster.start_emulator(1, *emulator_args, name=f"emulator-{i}")
        urls.append(url)
        emulators.append(procs.procs[-1])
    proxies = {}
    if proxied:
        _point_toxiproxy_client(cluster.start_toxiproxy())
        for i in proxied:
            proxies[i] = Toxiproxy().create(upstream=urls[i].removeprefix("http://"), name=f"replica-{i}",
                                            listen=f"127.0.0.1:{free_port()}")
    for i, url in enumerate(urls):
        cluster.add_replica("us", f"http://{proxies[i].listen}" if i in proxies else url, replica_id=f"r{i}")
    balancer_url = cluster.start_balancer("us", ["us"], policy=policy)
    cluster.wait_replicas_healthy("us", replicas)
    # Healthy is not yet routable: the balancer reads a replica's model list just after its first probe answer, and
    # a test that kills a replica at once must not race that read (under load it lost it: no request went there).
    cluster.wait_until(lambda: all(r["models"] for r in cluster.status("us")["replicas"]), timeout_s=10.0,
                       what="every replica's model list read")
    return cluster, balancer_url, urls, emulators, proxies


def test_a_replica_killed_before_the_first_byte_is_retried_elsewhere_ejected_and_returns(procs, tmp_path):
    """A SIGKILLed replica refuses connections: every request sent there is retried on the other replica (never
    the one that failed) and succeeds; after consecutive_gateway_failure failures it is ejected; restarted, it
    serves again once base_ejection_time has passed. Probes are too rare here to notice the death first."""
    cluster, url, (a, b), (proc_a, _), _ = _region(
        procs, tmp_path, replicas=2, policy="round-robin",
        balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100,
                  "outlier_detection": {"consecutive_gateway_failure": 2, "base_ejection_time_s": 2.0}})
    proc_a.kill()
    killed = time.monotonic()
    results, ejected = [], None
    for i in range(8):  # bounded: 8 requests, round robin sends half of them to the dead replica first
        results.append(_stream(url, f"after kill {i}"))
        if ejected is None and _counter(url, "skylb_outlier_ejections_total") >= 1:
            ejected = time.monotonic() - killed
    assert all(r["status"] == 200 and r["done"] and r["served_by"] == "us/r1" and not r["error"] for r in results)
    retries = _counter(url, "skylb_retries_total")
    assert retries == 2  # two attempts reached r0 before it was ejected; none after
    assert _counter(url, "skylb_outlier_ejections_total") == 1
    [r0] = [r for r in cluster.status("us")["replicas"] if r["id"] == "r0"]
    assert r0["reason"] == "ejected (outlier detection)" and r0["ejections"] == 1
    print(f"\nkilled replica: {retries:.0f} retries, ejected {ejected:.3f} s after the kill, "
          f"slowest request {max(r['seconds'] for r in results):.3f} s")
    port = a.rsplit(":", 1)[1]
    procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", port, *FAST, name="emulator-0-again",
                wait_url=f"{a}/health")
    cluster.wait_until(lambda: all(r["ejected_for_s"] is None for r in cluster.status("us")["replicas"]),
                       timeout_s=5, what="ejection over")
    returned = time.monotonic() - killed
    served = {_stream(url, f"back {i}")["served_by"] for i in range(4)}
    assert served == {"us/r0", "us/r1"}
    print(f"ejected replica serving again {returned:.3f} s after the kill (base_ejection_time 2 s)")


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_never_a_retry(procs, tmp_path):
    """SIGKILL of the replica after 5 streamed chunks: the client gets the chunks, one well-formed error event and
    [DONE], nothing after; the other replica never sees the request (no retried, spliced or duplicated text)."""
    cluster, url, (a, b), (proc_a, _), _ = _region(procs, tmp_path, replicas=2, policy="round-robin",
                                                   balancer={"probe_interval_ms": 60_000,
                                                             "stale_after_intervals": 100})

    def kill_at_five(i: int) -> None:
        if i == 5:
            proc_a.kill()

    before_b = emulator_gauge(b, "vllm:request_success_total")
    results = [_stream(url, f"long {i}", max_tokens=200, on_chunk=kill_at_five) for i in range(2)]
    killed = next(r for r in results if r["served_by"] == "us/r0")
    assert killed["status"] == 200 and killed["done"] and killed["after_done"] == 0
    assert killed["error"]["code"] == 502 and "mid-stream" in killed["error"]["message"]
    words = killed["text"].split()
    assert 5 <= len(words) < 200
    other = next(r for r in results if r["served_by"] == "us/r1")
    assert other["done"] and not other["error"] and len(other["text"].split()) == 200
    # Only the request routed there ran on r1: the killed one was not retried.
    assert emulator_gauge(b, "vllm:request_success_total") - before_b == 1
    print(f"\nmid-stream kill: {len(words)} tokens relayed, then one error event and [DONE]")


def test_a_hung_replica_times_out_before_the_first_byte_is_retried_and_ejected(procs, tmp_path):
    """A replica that accepts and then says nothing (Toxiproxy ``timeout`` toxic, timeout 0): the request routed
    there waits first_byte_timeout_s, is retried on the other replica and succeeds; the hung one is ejected, so the
    next requests do not wait."""
    cluster, url, _, _, proxies = _region(
        procs, tmp_path, replicas=2, policy="round-robin", proxied=(0,),
        balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100, "first_byte_timeout_s": 1.0,
                  "outlier_detection": {"consecutive_gateway_failure": 1}})
    proxies[0].add_toxic(type="timeout", attributes={"timeout": 0}, name="hang")
    results = [_stream(url, f"after hang {i}") for i in range(4)]
    assert all(r["status"] == 200 and r["done"] and r["served_by"] == "us/r1" for r in results)
    waited = sorted(r["seconds"] for r in results)
    print(f"\nhung replica: request times {', '.join(f'{s:.3f}' for s in waited)} s (first byte timeout 1 s)")
    assert 1.0 <= waited[-1] < 3.0  # the one sent to the hung replica: its first byte timeout, then r1
    assert waited[-2] < 0.9  # the hung replica was ejected: nobody else waited for it
    assert _counter(url, "skylb_outlier_ejections_total") == 1 and _counter(url, "skylb_retries_total") == 1


def test_a_stream_that_hangs_mid_way_ends_after_the_idle_timeout(procs, tmp_path):
    """A replica that stops sending after its first chunks (the toxic added to the open connection): the stream
    ends idle_timeout_s later with a well-formed error event and [DONE]; it is not retried."""
    cluster, url, _, _, proxies = _region(
        procs, tmp_path, replicas=1, proxied=(0,),
        balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100, "idle_timeout_s": 1.0})
    hung_at = {}

    def hang_at_three(i: int) -> None:
        if i == 3:
            proxies[0].add_toxic(type="timeout", attributes={"timeout": 0}, name="hang")
            hung_at["t"] = time.monotonic()

    result = _stream(url, "idle", max_tokens=200, on_chunk=hang_at_three)
    ended = time.monotonic() - hung_at["t"]
    assert result["done"] and result["after_done"] == 0 and "nothing for 1 s" in result["error"]["message"]
    assert 3 <= len(result["text"].split()) < 200 and 0.8 <= ended < 3.0
    assert _counter(url, "skylb_retries_total") == 0
    print(f"\nhung mid-stream: ended {ended:.3f} s after the hang with an error event (idle timeout 1 s)")


def _sigterm(proc) -> float:
    """Send SIGTERM to a started process; returns the monotonic time it was sent."""
    proc.popen.send_signal(signal.SIGTERM)
    return time.monotonic()


def test_sigterm_fails_readiness_finishes_held_streams_and_exits_0(procs, tmp_path):
    """SIGTERM during a stream: /healthz answers 503 "draining", a new request gets 503, the running stream
    completes (every token, [DONE]) and the process exits 0 once it is done, well inside drain_timeout_s."""
    cluster, url, _, _, _ = _region(procs, tmp_path, replicas=1, balancer={"drain_timeout_s": 30})
    balancer = procs.procs[-1]
    sent, result = {}, {}

    def on_chunk(i: int) -> None:
        if i == 1:
            sent["t"] = _sigterm(balancer)

    stream = threading.Thread(target=lambda: result.update(_stream(url, "drain me", max_tokens=150,
                                                                   on_chunk=on_chunk)))
    stream.start()
    cluster.wait_until(lambda: "t" in sent, timeout_s=10, what="SIGTERM sent")
    health = requests.get(f"{url}/healthz", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = requests.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2},
                            timeout=5)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert balancer.popen.wait(timeout=40) == 0
    exited = time.monotonic() - sent["t"]
    stream.join(timeout=10)
    assert result["done"] and not result["error"] and len(result["text"].split()) == 150
    assert exited < 10
    print(f"\nSIGTERM with a stream in flight: the stream finished and the balancer exited 0 {exited:.3f} s later")


def test_sigterm_with_a_hung_upstream_ends_it_after_the_drain_timeout(procs, tmp_path):
    """SIGTERM while a request waits on a hung replica (no first byte, first_byte_timeout_s far away): after
    drain_timeout_s the client gets a well-formed 503 in the API's shape and the process exits 0 (it used to take
    122 s and answer nothing)."""
    cluster, url, _, _, proxies = _region(procs, tmp_path, replicas=1, proxied=(0,),
                                          balancer={"drain_timeout_s": 1.0, "probe_interval_ms": 60_000,
                                                    "stale_after_intervals": 100})
    balancer = procs.procs[-1]
    proxies[0].add_toxic(type="timeout", attributes={"timeout": 0}, name="hang")
    result = {}
    client = threading.Thread(target=lambda: result.update(_stream(url, "hung", timeout=60)))
    client.start()
    cluster.wait_until(lambda: cluster.status("us")["in_flight"] == 1, timeout_s=10, what="request in flight")
    sent = _sigterm(balancer)
    assert balancer.popen.wait(timeout=20) == 0
    exited = time.monotonic() - sent
    client.join(timeout=10)
    assert result["status"] == 503 and result["error"]["error"]["type"] == "overloaded_error"
    assert 1.0 <= exited < 5.0
    print(f"\nSIGTERM with a hung upstream: client answered 503, exit 0 after {exited:.3f} s (drain_timeout_s 1)")


def _leave_while_running(cluster: Cluster, url: str, body: dict, replica: str) -> None:
    """A not-streamed completion to ``url`` whose client gives up after 1.5 s, once ``replica`` runs it; returns
    when the client has left (its read timed out)."""
    outcome = {}

    def impatient() -> None:
        try:
            requests.post(f"{url}/v1/completions", json=body, timeout=1.5)
        except requests.exceptions.ReadTimeout as exc:
            outcome["timeout"] = exc

    client = threading.Thread(target=impatient)
    client.start()
    cluster.wait_until(lambda: emulator_gauge(replica, RUNNING) == 1, timeout_s=1.4, what="engine running 1")
    client.join(timeout=10)
    assert "timeout" in outcome


@pytest.mark.parametrize("phase", ["before-first-token", "mid-stream", "not-streamed"])
def test_a_client_disconnect_cancels_the_upstream_request(procs, tmp_path, phase):
    """A client that leaves before its first token, mid-stream, or while waiting for a whole (not streamed) answer:
    the balancer closes the upstream request and the engine's running count drops to 0 (its /metrics), well before
    the generation would have ended. (Leaving while queued: test_balancer.py.)"""
    cluster, url, [replica], _, _ = _region(procs, tmp_path, replicas=1, balancer={},
                                            emulator_args=("--prefill-ms-per-token", "20"))
    prompt = " ".join(f"word{i}" for i in range(400)) if phase == "before-first-token" else "short"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 500, "ignore_eos": True,
            "stream": phase != "not-streamed"}
    if phase == "mid-stream":
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=30) as resp:
            lines = resp.iter_lines()
            for _ in range(6):  # bounded: a few chunks, then the client goes away
                next(lines)
            assert emulator_gauge(replica, RUNNING) == 1
        left = time.monotonic()
    else:
        _leave_while_running(cluster, url, body, replica)
        left = time.monotonic()
    cluster.wait_until(lambda: emulator_gauge(replica, RUNNING) == 0, timeout_s=5, what="engine running 0")
    dropped = time.monotonic() - left
    assert dropped < 2.0
    print(f"\nclient left {phase}: the engine's running count was 0 {dropped:.3f} s later")



def _us_reaching_eu_through_a_link(cluster: Cluster, us_replica: str, eu_replica: str):
    """Balancers us and eu, us reaching eu through a latency-proxy link (to be cut), one replica each; returns
    (us's URL, the link)."""
    eu = cluster.start_balancer("eu", ["us", "eu"])
    _point_toxiproxy_client(cluster.start_toxiproxy())
    link = Toxiproxy().create(upstream=eu.removeprefix("http://"), name="us-eu", listen=f"127.0.0.1:{free_port()}")
    us = cluster.start_balancer("us", ["us", "eu"], peer_urls={"eu": f"http://{link.listen}"})
    cluster.add_replica("us", us_replica, replica_id="us-0")
    cluster.add_replica("eu", eu_replica, replica_id="eu-0")
    cluster.wait_replicas_healthy("us", 1)
    return us, link

def test_a_partitioned_peer_is_unavailable_within_3_probe_intervals_and_rejoins(procs, tmp_path):
    """us reaches eu through the latency proxy. A hang on the link (``timeout`` toxic) and then the link disabled:
    each time us marks eu unavailable within 3 probe intervals, serves its requests without waiting on eu, and
    takes eu back once the link heals."""
    interval_s = 0.1
    cluster = Cluster(procs, tmp_path, balancer={"probe_interval_ms": interval_s * 1000})
    cluster.start_controller(["us", "eu"])
    us_replica, eu_replica = cluster.start_emulator(2, *FAST)
    us, link = _us_reaching_eu_through_a_link(cluster, us_replica, eu_replica)

    def eu_available() -> bool:
        return any(p["region"] == "eu" and p["available"] for p in cluster.status("us")["peers"])

    def measure(available: bool, what: str) -> float:
        start = time.monotonic()
        cluster.wait_until(lambda: eu_available() == available, timeout_s=10, what=what)
        return time.monotonic() - start

    cluster.wait_until(eu_available, timeout_s=10, what="eu available at us")
    for fault in ("timeout toxic", "link disabled"):
        if fault == "timeout toxic":
            link.add_toxic(type="timeout", attributes={"timeout": 0}, name="partition")
        else:
            link.disable()
        detected = measure(False, f"eu unavailable ({fault})")
        results = [_stream(us, f"during partition {i}", timeout=10) for i in range(3)]
        assert all(r["status"] == 200 and r["done"] and r["served_by"] == "us/us-0" for r in results)
        slowest = max(r["seconds"] for r in results)
        if fault == "timeout toxic":
            link.destroy_toxic("partition")
        else:
            link.enable()
        rejoined = measure(True, f"eu available again ({fault})")
        print(f"\npartition ({fault}): eu unavailable at us after {detected:.3f} s "
              f"({detected / interval_s:.1f} probe intervals), slowest request meanwhile {slowest:.3f} s, "
              f"rejoined {rejoined:.3f} s after the link healed")
        assert detected <= 3 * interval_s + 0.15  # 3 intervals, and the status poll's own latency
        assert slowest < 1.0 and rejoined < 3.0


def test_with_the_retry_budget_spent_a_failed_request_gets_an_error_not_a_retry(procs, tmp_path):
    """A zero retry budget: a request whose replica refuses it is not retried; the client gets a 502 in the API's
    shape and skylb_retry_budget_exhausted counts it."""
    cluster, url, _, (proc_a, _), _ = _region(
        procs, tmp_path, replicas=2, policy="round-robin",
        balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100,
                  "retry_policy": {"budget_percent": 0, "min_retry_concurrency": 0}})
    proc_a.kill()
    results = [_stream(url, f"no budget {i}") for i in range(2)]  # round robin: one of them goes to r0
    failed = [r for r in results if r["status"] != 200]
    assert len(failed) == 1 and failed[0]["status"] == 502 and "retry budget" in failed[0]["error"]["error"]["message"]
    assert _counter(url, "skylb_retry_budget_exhausted_total") == 1 and _counter(url, "skylb_retries_total") == 0


def test_a_request_forwarded_to_a_peer_that_gets_partitioned_is_retried_without_waiting(procs, tmp_path):
    """A request forwarded to eu (us's only replica is full) is waiting for its first byte when the link hangs:
    us gives it up as soon as eu's status goes stale (not after first_byte_timeout_s, 30 s here) and serves it on
    its own replica once that has room."""
    interval_s = 0.1
    cluster = Cluster(procs, tmp_path, balancer={"probe_interval_ms": interval_s * 1000, "first_byte_timeout_s": 30})
    cluster.start_controller(["us", "eu"])
    [us_replica] = cluster.start_emulator(1, *FAST, "--max-num-seqs", "1", name="emulator-us")
    [eu_replica] = cluster.start_emulator(1, "--prefill-ms-per-token", "20", name="emulator-eu")
    us, link = _us_reaching_eu_through_a_link(cluster, us_replica, eu_replica)
    cluster.wait_until(lambda: any(p["available"] for p in cluster.status("us")["peers"]), what="eu available")
    busy = [threading.Thread(target=lambda: _stream(us_replica, "fill", max_tokens=100), daemon=True)
            for _ in range(2)]
    for t in busy:  # straight to the replica: one runs, one is pending, us has no room for about 2.5 s
        t.start()
    cluster.wait_until(lambda: cluster.status("us")["available_replicas"] == 0, what="us full")
    result = {}
    client = threading.Thread(target=lambda: result.update(
        _stream(us, " ".join(f"word{i}" for i in range(400)), timeout=60)))
    sent = time.monotonic()
    client.start()
    cluster.wait_until(lambda: cluster.status("eu")["in_flight"] == 1, timeout_s=5, what="forwarded to eu")
    link.add_toxic(type="timeout", attributes={"timeout": 0}, name="partition")
    partitioned = time.monotonic()
    client.join(timeout=40)
    link.destroy_toxic("partition")
    assert result["status"] == 200 and result["done"] and result["served_by"] == "us/us-0"
    # the forward given up is not a forward of the status' count: the request was answered here
    assert [p["forwarded"] for p in cluster.status("us")["peers"]] == [0]
    took = time.monotonic() - partitioned
    assert took < 10
    print(f"\nforwarded request caught by a partition: served locally {took:.3f} s after the partition "
          f"({time.monotonic() - sent:.3f} s in all; first_byte_timeout_s 30)")
    for t in busy:
        t.join(timeout=10)


def test_an_ollama_replica_killed_mid_stream_ends_with_an_error_line(procs, tmp_path):
    """Ollama's NDJSON stream: SIGKILL of the replica after 5 lines; the client gets those lines, then one
    ``{"error": ...}`` line, and nothing after (no retry on the other replica)."""
    cluster = Cluster(procs, tmp_path, balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100},
                      controller={"health": {"enabled": False}})
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, "--engine", "ollama", "--model", "llama3.1:8b", *FAST, name="emu-ollama")
    emulator = procs.procs[-1]
    cluster.add_replica("us", replica, engine="ollama")
    url = cluster.start_balancer("us", ["us"])
    cluster.wait_until(lambda: cluster.first_replica("us").get("models"), what="models")
    lines = []
    with requests.post(f"{url}/api/generate", json={"model": "llama3.1:8b", "prompt": "hello",
                                                     "options": {"num_predict": 200}}, stream=True, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                lines.append(json.loads(line))
                if len(lines) == 5:
                    emulator.kill()
    assert all("response" in line and not line["done"] for line in lines[:5])
    assert "mid-stream" in lines[-1]["error"] and len(lines) < 200
    assert [i for i, line in enumerate(lines) if "error" in line] == [len(lines) - 1]
    print(f"\nOllama mid-stream kill: {len(lines) - 1} lines relayed, then one error line")


def test_counters_return_to_zero_when_a_replica_is_removed_and_killed_with_streams_in_flight(procs, tmp_path):
    """Two streams on r0; r0 is removed from membership, then killed: both streams end with an error event, r0
    leaves the balancer's view and every counter is 0 (never negative, never stuck)."""
    cluster, url, _, (proc_a, _), _ = _region(procs, tmp_path, replicas=2, policy="round-robin",
                                              balancer={"probe_interval_ms": 60_000, "stale_after_intervals": 100})
    results, started = [], threading.Event()

    def stream(i: int) -> None:
        results.append(_stream(url, f"long {i}", max_tokens=300, on_chunk=lambda n: n == 3 and started.set()))

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(4)]  # round robin: 2 on r0, 2 on r1
    for c in clients:
        c.start()
    started.wait(timeout=10)
    cluster.wait_until(lambda: all(r["outstanding"] == 2 for r in cluster.status("us")["replicas"]),
                       timeout_s=5, what="2 streams per replica")
    cluster.ctl("replica", "remove", "r0")
    cluster.wait_until(lambda: [r["draining"] for r in cluster.status("us")["replicas"] if r["id"] == "r0"] == [True],
                       timeout_s=5, what="r0 draining")
    proc_a.kill()
    for c in clients:
        c.join(timeout=30)
    on_r0 = [r for r in results if r["served_by"] == "us/r0"]
    assert len(on_r0) == 2 and all(r["error"] and r["done"] for r in on_r0)
    cluster.wait_until(lambda: [r["id"] for r in cluster.status("us")["replicas"]] == ["r1"], timeout_s=30,
                       what="r0 dropped")
    cluster.assert_counters_return_to_zero()


def test_a_replica_answering_500_is_retried_before_the_first_byte_and_the_client_gets_the_others_200(procs,
                                                                                                      tmp_path):
    """One of two replicas answers every generation with 500 (the fault schedule's failing engine): each request
    routed there is retried on the other before any byte reached the client, streamed or not, so the client gets
    200 from the healthy one, and the retries are counted."""
    # consecutive_5xx 100: the failing replica is not ejected, so round robin keeps sending it requests to retry
    cluster = Cluster(procs, tmp_path, balancer={"policy": "round-robin",
                                                 "outlier_detection": {"consecutive_5xx": 100}})
    bad, good = cluster.start_emulator(2, "--fault-control", *FAST)
    assert requests.put(f"{bad}/emulator/faults", json={"error_status": 500}, timeout=5).status_code == 200
    cluster.start_static_balancer([bad, good], engine="vllm")
    url = cluster.balancers["local"]
    results = [_stream(url, f"five hundred {i}") for i in range(3)]
    for i in range(3):
        r = requests.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"whole {i}"}]})
        results.append({"status": r.status_code, "served_by": r.headers.get("X-SkyLB-Served-By"),
                        "error": None if r.ok else r.text, "done": r.ok})
    print("500 replica:", results)
    assert all(r["status"] == 200 and r["error"] is None and r["done"] for r in results), results
    good_id = next(r["id"] for r in cluster.status("local")["replicas"] if r["url"] == good)
    assert {r["served_by"] for r in results} == {f"local/{good_id}"}
    assert _counter(url, "skylb_retries_total") >= 2  # round robin: at least 2 of the 6 went to the 500 first


@pytest.mark.parametrize("streamed", [True, False], ids=["mid-stream", "not-streamed"])
def test_a_client_disconnect_on_a_forwarded_request_frees_the_peer_replica(procs, tmp_path, streamed):
    """us has no replica, so its request is forwarded to eu's only replica; the client leaves mid-stream or while
    waiting for a whole answer. us closes its request to eu, eu closes its request to the replica, and the engine's
    running count (its /metrics) drops to 0 long before the 500-token generation would have ended; both balancers'
    counters go back to zero and each logs the request once, as closed by its client (499)."""
    cluster = Cluster(procs, tmp_path, controller={"health": {"enabled": False}})
    cluster.start_controller(["us", "eu"])
    [replica] = cluster.start_emulator(1, "--prefill-ms-per-token", "20")
    cluster.add_replica("eu", replica, replica_id="eu-0")
    eu = cluster.start_balancer("eu", ["us", "eu"])
    us = cluster.start_balancer("us", ["us", "eu"])
    cluster.wait_replicas_healthy("eu", 1)
    cluster.wait_until(lambda: any(p["region"] == "eu" and p["available"] for p in cluster.status("us")["peers"]),
                       timeout_s=10, what="eu available at us")
    body = {"model": MODEL, "prompt": "short", "max_tokens": 500, "ignore_eos": True, "stream": streamed}
    if streamed:
        with requests.post(f"{us}/v1/completions", json=body, stream=True, timeout=30) as resp:
            assert resp.status_code == 200 and resp.headers.get("X-SkyLB-Served-By", "").startswith("eu")
            lines = resp.iter_lines()
            for _ in range(6):  # bounded: a few chunks, then the client goes away
                next(lines)
            assert emulator_gauge(replica, RUNNING) == 1
    else:
        _leave_while_running(cluster, us, body, replica)
    left = time.monotonic()
    cluster.wait_until(lambda: emulator_gauge(replica, RUNNING) == 0, timeout_s=5, what="engine running 0")
    dropped = time.monotonic() - left
    assert dropped < 2.0
    cluster.assert_counters_return_to_zero()
    for region in ("us", "eu"):
        log = next(p for p in procs.procs if p.name == f"balancer-{region}").log

        def lines() -> list[dict]:
            return [line for line in map(json.loads, log().splitlines()) if line["event"] == "request"]

        cluster.wait_until(lambda: lines(), what=f"{region}'s request line")
        assert [(line["status"], line["error"]) for line in lines()] == [(499, "client disconnected")], lines()
    print(f"\nclient left a forwarded request {'mid-stream' if streamed else 'not streamed'}: eu's replica running "
          f"0 {dropped:.3f} s later")
