"""A balancer in front of replicas that are down says so: in its log (at start and at each change), in the answer
to a request (503 naming each replica and why, not 404 "does not exist") and in /healthz's readiness; real
processes (a static balancer, then an emulated vLLM started on the dead replica's port). A model whose only replica
left the membership a moment ago makes its requests wait for ``no_target_timeout_s``, not fail at once."""

from __future__ import annotations

import concurrent.futures
import json
import time

import requests

from tests.cluster import MODEL, Cluster
from tests.procs import Proc, ProcGroup, free_ports, wait_for

#: Every process starts from this environment: no token or key the test runner's own environment may hold.
CLEAN = {"SKYLB_PEER_TOKEN": "", "SKYLB_API_KEYS": "", "SKYLB_API_KEYS_FILE": "", "SKYLB_METRICS_TOKEN": ""}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _events(proc: Proc, event: str) -> list[dict]:
    """The JSON log lines of ``proc`` whose event is ``event``."""
    lines = (json.loads(line) for line in proc.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def test_a_replica_that_is_down_is_logged_answered_503_and_not_ready(procs: ProcGroup, tmp_path):
    """`skylb balancer --replica URL` with nothing at URL: a warning names the replica and "connection refused";
    a chat request (OpenAI and Ollama shapes) gets 503 with Retry-After saying no replica is reachable and why;
    /healthz stays 200 with ready false. Once an engine listens there: replica_healthy is logged, ready, served."""
    replica_port, port = free_ports(2)
    replica, url = f"http://127.0.0.1:{replica_port}", f"http://127.0.0.1:{port}"
    config = tmp_path / "b.yaml"
    config.write_text(json.dumps({"balancer": {"probe_interval_ms": 50}}))
    balancer = procs.skylb("balancer", "--replica", replica, "--port", str(port), "--config", str(config),
                           name="balancer", env=CLEAN, wait_url=f"{url}/healthz")
    warning = wait_for(lambda: _events(balancer, "replica_unhealthy"), "the replica_unhealthy warning")[0]
    assert warning["level"] == "warning" and warning["url"] == replica and warning["replica"] == "local-1"
    assert "connection refused" in warning["reason"].lower()

    answer = requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) > 0
    message = answer.json()["error"]["message"]
    assert "no replica is reachable" in message and replica in message and "connection refused" in message.lower()
    ollama = requests.post(f"{url}/api/chat", json={**CHAT, "stream": False}, timeout=10)
    assert ollama.status_code == 503 and replica in ollama.json()["error"]
    health = requests.get(f"{url}/healthz", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["ready"] is False
    assert [(u["url"], "connection refused" in u["reason"].lower()) for u in health.json()["unhealthy"]] == [
        (replica, True)]
    time.sleep(0.3)  # several more failed probes: still one warning (logged at changes only)
    assert len(_events(balancer, "replica_unhealthy")) == 1

    procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--port", str(replica_port), name="emulator",
                wait_url=f"{replica}/health")
    healthy = wait_for(lambda: _events(balancer, "replica_healthy"), "the replica_healthy line")[0]
    assert healthy["url"] == replica and healthy["engine"] == "vllm"
    wait_for(lambda: requests.get(f"{url}/healthz", timeout=5).json()["ready"], "ready")
    wait_for(lambda: requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200,
          "the model served")


def test_a_request_for_a_model_gone_a_moment_ago_waits_for_it_then_gets_503(procs: ProcGroup, tmp_path):
    """The controller drops the only replica (a health check or an operator's remove) and gives it back 1 s later:
    a request sent in between waits in the queue and is answered 200, as the requests queued before it were; one
    sent once the model has been gone longer than ``no_target_timeout_s`` gets 503 at once (not 404)."""
    cluster = Cluster(procs, tmp_path, balancer={"no_target_timeout_s": 3})
    cluster.start_controller(["us"])
    [replica] = cluster.start_emulator(1, "--time-scale", "0.1", name="emu")
    url = cluster.start_balancer("us", ["us"])
    cluster.add_replica("us", replica, replica_id="r1")
    cluster.wait_until(lambda: [bool(r["models"]) for r in cluster.status("us")["replicas"]] == [True],
                       what="the replica's models")
    cluster.ctl("replica", "remove", "r1", in_process=True)
    cluster.wait_until(lambda: not cluster.status("us")["replicas"], what="the replica gone")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(requests.post, f"{url}/v1/chat/completions", json=CHAT, timeout=20)
        time.sleep(1.0)
        assert not waiting.done(), waiting.result().text
        cluster.add_replica("us", replica, replica_id="r1")
        answer = waiting.result(timeout=15)
    assert answer.status_code == 200, answer.text

    cluster.ctl("replica", "remove", "r1", in_process=True)
    cluster.wait_until(lambda: not cluster.status("us")["replicas"], what="the replica gone again")
    time.sleep(3.2)
    started = time.monotonic()
    gone = requests.post(f"{url}/v1/chat/completions", json=CHAT, timeout=20)
    assert gone.status_code == 503 and "served by no replica" in gone.json()["error"]["message"], gone.text
    assert time.monotonic() - started < 1.0 and int(gone.headers["Retry-After"]) > 0
