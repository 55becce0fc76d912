"""Slow and greedy clients against a real balancer (balancer.client_connections, skylb/listener.py): a head
or a body sent a byte at a time is cut at its deadline with 408, an idle keep-alive connection is closed, and
connections past the cap are refused with 503, while ordinary clients are served throughout. The controller's server
(controller.client_connections) is the same listener: a head dribbled to it is cut as well."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time

import pytest
import requests

from controller.auth import ControllerCredentials
from controller.server import serve
from skylb.config import ControllerConfig
from tests.cluster import MODEL, Cluster
from tests.procs import ProcGroup, wait_for

#: header_timeout_s 1.5, not 1: under a full suite on 2 cores a balancer stalled for more than 1 s between accepting
#: a connection and reading its head sent whole, and cut it at the head deadline (the body test got 408 for its head).
LIMITS = {"header_timeout_s": 1.5, "body_timeout_s": 1.0, "body_min_rate_bytes_s": 500,
          "keepalive_timeout_s": 3.0, "max_connections": 6}
#: The controller's: a head deadline between two bytes of a client sending one a second, and a keep-alive timeout
#: past it (aiohttp's keep-alive timer also closes a connection whose head is incomplete).
CONTROLLER_LIMITS = {"header_timeout_s": 2.5, "keepalive_timeout_s": 10.0}
#: Longest a test waits for a cut that should come after about 1 s (the machine may be loaded).
CUT_BY_S = 6.0


@pytest.fixture(scope="module")
def balancer(tmp_path_factory):
    """A static balancer with deadlines on reading requests (LIMITS), 3-s idle keep-alive and a cap of 6 connections, in
    front of one emulated replica; yields its (host, port)."""
    tmp = tmp_path_factory.mktemp("client-limits")
    with ProcGroup(tmp / "logs") as procs:  # every process stopped at the end, also on failure
        cluster = Cluster(procs, tmp, balancer={"client_connections": LIMITS})
        [replica] = cluster.start_emulator(1, "--time-scale", "0.1", name="emu")
        cluster.start_static_balancer([replica], engine="vllm")
        host, port = cluster.balancers["local"].removeprefix("http://").split(":")
        yield host, int(port)


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    """A controller in this process (its own event loop in a thread) with LIMITS overridden by CONTROLLER_LIMITS,
    and no health checks; yields its (host, port)."""
    with socket.socket() as probe:  # a free port: serve() does not say which port 0 became
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = ControllerConfig(port=port, db=str(tmp_path_factory.mktemp("controller") / "c.sqlite"),
                              health={"enabled": False}, client_connections=LIMITS | CONTROLLER_LIMITS)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(serve(config, stop=stop, credentials=ControllerCredentials()),), daemon=True)
    thread.start()
    wait_for(lambda: _connects(("127.0.0.1", port)), "the controller listening", timeout_s=10)
    yield "127.0.0.1", port
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=10)
    loop.close()


def _connects(address) -> bool:
    try:
        socket.create_connection(address, timeout=1).close()
        return True
    except OSError:
        return False


def _dribble(address, head: bytes, body: bytes = b"", *, every_s: float = 0.2) -> tuple[float, bytes]:
    """Send ``head`` at once when ``body`` is given (else a byte every ``every_s``, the first at once), then ``body``
    a byte every ``every_s``, until the server answers or closes (at most CUT_BY_S); returns (seconds until then,
    what it answered). Raises AssertionError when the connection is still open after CUT_BY_S."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=CUT_BY_S) as sock:
        sock.settimeout(every_s)
        slow = body if body else head
        if body:
            sock.sendall(head)
        for i in range(int(CUT_BY_S / every_s)):
            try:  # the first byte at once: a deadline no longer than every_s still sees a byte before it
                sock.sendall(slow[i % len(slow):i % len(slow) + 1])
            except OSError:  # reset: closed without (or after) an answer we could read
                return time.monotonic() - started, b""
            try:
                answer = sock.recv(65536)
                return time.monotonic() - started, answer + _rest(sock)
            except TimeoutError:
                pass
    raise AssertionError(f"still connected after {CUT_BY_S} s")


def _rest(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def _status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_header_deadline_with_408(balancer):
    """A client dribbling its request line and headers (slowloris) gets 408 and a closed connection about
    header_timeout_s after it opened, not a connection held for ever."""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: {'a' * 200}\r\n\r\n".encode()
    took, answer = _dribble(balancer, head)
    assert 1.3 < took < CUT_BY_S
    status, body = _status_and_json(answer)
    assert status == 408 and body["error"]["code"] == 408 and "header_timeout_s" in body["error"]["message"]


def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_body_deadline_with_408_in_the_apis_shape(balancer):
    """A client whose head is whole but whose body comes a byte at a time (under body_min_rate_bytes_s) gets 408
    in the API's shape (OpenAI's on /v1/*, Ollama's on /api/*) about body_timeout_s after its head, and the
    connection closes."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 50}]}).encode()
    for path, api in (("/v1/chat/completions", "openai"), ("/api/chat", "ollama")):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        took, answer = _dribble(balancer, head, body)
        assert 0.8 < took < CUT_BY_S, path
        status, error = _status_and_json(answer)
        assert status == 408, answer
        message = error["error"] if api == "ollama" else error["error"]["message"]
        assert "body_timeout_s" in message


def test_an_idle_keep_alive_connection_is_closed_and_one_that_never_sends_too(balancer):
    """A connection idle after an answer is closed after keepalive_timeout_s (3 s); one that never sends a byte is
    closed after header_timeout_s (1.5 s), without an answer."""
    for first, limit_s in ((b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", LIMITS["keepalive_timeout_s"]),
                           (b"", LIMITS["header_timeout_s"])):
        started = time.monotonic()
        with socket.create_connection(balancer, timeout=CUT_BY_S) as sock:
            if first:
                sock.sendall(first)
            received = _rest(sock)  # until the balancer closes (or CUT_BY_S: a TimeoutError, an OSError)
            took = time.monotonic() - started
        assert limit_s - 0.2 < took < CUT_BY_S - 0.5, (first, took)
        assert received.startswith(b"HTTP/1.1 200") if first else received == b""


def test_connections_past_the_cap_get_503_and_ordinary_clients_are_served_after(balancer):
    """With max_connections open, one more gets 503 with Retry-After and is closed; once they close, an ordinary
    request (the official client's shape) is served."""
    held = [socket.create_connection(balancer, timeout=5) for _ in range(LIMITS["max_connections"])]
    try:
        time.sleep(0.2)  # all accepted by the balancer
        with socket.create_connection(balancer, timeout=5) as extra:
            answer = _rest(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
        assert "max_connections" in _status_and_json(answer)[1]["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    host, port = balancer
    deadline = time.monotonic() + 5
    while True:  # until the held connections' ends reached the balancer
        try:
            r = requests.post(f"http://{host}:{port}/v1/chat/completions", timeout=10,
                              json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            if r.status_code != 503:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "still refused 5 s after the held connections closed"
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_the_controller_cuts_a_head_sent_a_byte_a_second_and_serves_others(controller):
    """The controller's server has the balancer's head deadline (controller.client_connections): a client sending
    its request line and headers at 1 byte/s gets 408 naming the setting, about header_timeout_s (2.5 s) after it
    connected; an ordinary request is answered after."""
    host, port = controller
    head = b"GET /v1/membership HTTP/1.1\r\nHost: x\r\n\r\n"
    took, answer = _dribble(controller, head, every_s=1.0)
    assert 2.3 < took < CUT_BY_S
    status, body = _status_and_json(answer)
    assert status == 408 and "controller.client_connections.header_timeout_s" in body["error"]["message"]
    assert requests.get(f"http://{host}:{port}/healthz", timeout=5).status_code == 200


def test_bodies_that_do_not_decode_and_heads_aiohttp_rejects_get_errors_in_the_apis_shape(balancer):
    """A gzip body is served; one that does not decompress is a 400 in the API's shape (OpenAI's, Ollama's on /api/),
    counted as unreadable_body, never a 500; a content coding aiohttp cannot decode is 415 with Accept-Encoding, and
    a head line over aiohttp's 8190 bytes a 400, both JSON in OpenAI's shape instead of aiohttp's text/plain."""
    url = "http://{}:{}".format(*balancer)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    gzipped = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    r = requests.post(f"{url}/v1/chat/completions", data=gzip.compress(body), headers=gzipped, timeout=10)
    assert r.status_code == 200 and r.json()["choices"], r.text[:300]
    r = requests.post(f"{url}/v1/chat/completions", data=b"not gzip", headers=gzipped, timeout=10)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and "content-encoding" in error["message"]
    r = requests.post(f"{url}/api/generate", data=b"not gzip", headers=gzipped, timeout=10)
    assert r.status_code == 400 and "content-encoding" in r.json()["error"], r.text[:300]
    r = requests.post(f"{url}/v1/chat/completions", data=b"\x00",
                      headers={"Content-Type": "application/json", "Content-Encoding": "x-none-such, br"}, timeout=10)
    assert r.status_code in (400, 415) and r.headers["Content-Type"].startswith("application/json"), r.text[:300]
    r = requests.post(f"{url}/v1/chat/completions", data=b"\x00",
                      headers={"Content-Type": "application/json", "Content-Encoding": "br"}, timeout=10)
    assert r.status_code == 415 and r.headers["Accept-Encoding"] == "gzip, deflate", r.text[:300]
    assert r.json()["error"]["code"] == 415 and "br" in r.json()["error"]["message"]
    r = requests.post(f"{url}/v1/chat/completions", data=body,
                      headers={"Content-Type": "application/json", "X-Long": "x" * 10_000}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400 and "8190" in r.json()["error"]["message"]
    r = requests.post(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200
    metrics = requests.get(f"{url}/metrics", timeout=5).text
    assert 'skylb_rejected_requests_total{reason="unreadable_body",region="local",status="400"} 2.0' in metrics
    assert 'status="500"' not in "\n".join(line for line in metrics.splitlines() if line.startswith("skylb_responses"))
