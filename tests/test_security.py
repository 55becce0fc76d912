"""Security (issue 10 item 6): client API keys, the peer token on peer endpoints and forwarded requests, the metrics
token, the controller's admin token and balancer heartbeats, region take-over, URL validation, TLS, and secrets never
in logs. Real processes throughout (tests/cluster.py), each refusal proven."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPConnection
from pathlib import Path

import msgpack
import openai
import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from skylb.balancer.relay import Relay
from skylb.core import Decision
from tests.system import require_binary
from tests.cluster import MODEL, Cluster, post_json
from tests.procs import free_port

pytestmark = pytest.mark.timeout(60)

PEER = "peer-secret-3f9a1c-d82b57e40c6a9f13"
ADMIN = "admin-secret-7b2e94-15c3f0a8e6d24b97"
KEY = "client-key-51d0aa"
METRICS = "metrics-secret-c8e613"
SECRETS = (PEER, ADMIN, KEY, METRICS)


def http(method: str, url: str, *, headers: dict | None = None, body: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """One request; (status, body) also for error statuses."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _from(address: str, method: str, url: str, headers: dict | None = None,
          body: dict | None = None) -> tuple[int, dict, dict]:
    """One request to ``url`` (with the JSON ``body``, if any) sent from the loopback ``address`` (any of
    127.0.0.0/8, so that one test has several client addresses); returns (status, headers, JSON body)."""
    parts = urllib.parse.urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=10, source_address=(address, 0))
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                     body=None if body is None else json.dumps(body).encode(),
                     headers={**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})})
        response = conn.getresponse()
        body = response.read()
        return response.status, dict(response.headers), json.loads(body) if body else {}
    finally:
        conn.close()


def chat(text: str = "hi") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


@pytest.fixture
def secured(procs, tmp_path, monkeypatch) -> Cluster:
    """Controller and one balancer (us) with every credential set, two replicas registered with the admin token."""
    monkeypatch.setenv("SKYLB_API_KEYS", KEY)  # the processes inherit it: the balancer's client keys
    monkeypatch.setenv("SKYLB_METRICS_TOKEN", METRICS)
    cluster = Cluster(procs, tmp_path, peer_token=PEER, admin_token=ADMIN,
                      controller={"health": {"enabled": False}})
    cluster.start_controller(["us"])
    replicas = cluster.start_emulator(2, "--time-scale", "0.01")
    cluster.start_balancer("us", ["us"])
    for url in replicas:
        cluster.add_replica("us", url)
    cluster.wait_replicas_healthy("us", 2)
    return cluster


# --- client API keys ------------------------------------------------------------------------------------------------

def test_client_api_key_required_on_openai_api(secured):
    """Without a key, or with a wrong one, /v1/* answers 401 in OpenAI's shape (the official client raises
    AuthenticationError); the right key is served."""
    base = secured.balancers["us"]
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        status, body = http("POST", f"{base}/v1/chat/completions", headers=headers, body=chat())
        error = json.loads(body)["error"]
        assert status == 401 and error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert http("GET", f"{base}/v1/models", headers=headers)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0).chat.completions.create(**chat())
    answer = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0).chat.completions.create(**chat())
    assert answer.choices[0].message.content


def test_client_api_key_required_on_ollama_api(secured):
    """/api/* answers 401 in Ollama's shape {"error": "..."} without a key; with it, the request is routed."""
    base = secured.balancers["us"]
    status, body = http("POST", f"{base}/api/chat", body={**chat(), "stream": False})
    assert status == 401 and isinstance(json.loads(body)["error"], str)
    assert http("GET", f"{base}/api/tags")[0] == 401
    status, body = http("POST", f"{base}/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                        body={**chat(), "stream": False})
    # Past the key check: the vLLM emulator speaks no Ollama, so the balancer translates to its OpenAI API.
    assert status == 200 and json.loads(body)["done"] is True


def test_health_and_ollama_root_stay_open(secured):
    """/healthz (probes, the controller's health check), /health (the engines' own, which load generators check)
    and Ollama's GET / need no credential."""
    base = secured.balancers["us"]
    assert http("GET", f"{base}/healthz")[0] == 200 and http("GET", f"{base}/")[0] == 200
    assert http("GET", f"{base}/health")[0] == 200


def test_client_key_not_relayed_to_replicas_and_replica_key_sent():
    """With client keys on, the client's Authorization never reaches a replica or a peer; replica_api_key goes to
    local replicas only, and the peer token to peers only."""
    request = make_mocked_request("POST", "/v1/chat/completions",
                                  headers={"Authorization": f"Bearer {KEY}", "X-Session-ID": "s"})
    relay = Relay(None, region="us", peer_token=PEER, session_header="X-Session-ID", forward_client_auth=False,
                  replica_api_key="replica-key")
    local = relay._upstream_headers(request, Decision(None, "local", "us-1", "http://r", 0.0), "id")
    peer = relay._upstream_headers(request, Decision(None, "peer", "eu", "http://p", 0.0), "id")
    assert local["Authorization"] == "Bearer replica-key" and "X-SkyLB-Token" not in local
    assert "Authorization" not in peer and peer["X-SkyLB-Token"] == PEER and local["X-Session-ID"] == "s"
    open_relay = Relay(None, region="us", peer_token=None, session_header="X-Session-ID")
    assert open_relay._upstream_headers(request, Decision(None, "local", "us-1", "http://r", 0.0),
                                        "id")["Authorization"] == f"Bearer {KEY}"  # keys off: the client's own


def test_api_keys_without_peer_token_refuse_to_start(tmp_path):
    """Client keys without a peer token would let a client pose as a peer: the balancer exits 2 and says so."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("balancer:\n  api_keys: [k1]\nregions:\n  us: {}\n")
    env = {**os.environ, "SKYLB_PEER_TOKEN": ""}
    done = subprocess.run([sys.executable, "-m", "skylb", "balancer", "--config", str(cfg), "--region", "us",
                           "--controller", "http://127.0.0.1:1"], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2 and "peer token" in done.stderr


# --- peer endpoints, the forwarded marker, /metrics ------------------------------------------------------------------

def test_peer_status_needs_peer_token_msgpack_and_json(secured):
    """/skylb/v1/status answers 403 without the peer token or with a wrong one (or with a client key), for msgpack
    and for ?format=json alike; with it, both answer."""
    base = secured.balancers["us"]
    for query in ("", "?format=json"):
        for headers in ({}, {"X-SkyLB-Token": "wrong"}, {"Authorization": f"Bearer {KEY}"},
                        {"X-SkyLB-Token": ADMIN}):
            assert http("GET", f"{base}/skylb/v1/status{query}", headers=headers)[0] == 403, (query, headers)
    status, body = http("GET", f"{base}/skylb/v1/status", headers={"X-SkyLB-Token": PEER})
    assert status == 200 and msgpack.unpackb(body)["region"] == "us"
    status, body = http("GET", f"{base}/skylb/v1/status?format=json", headers={"X-SkyLB-Token": PEER})
    assert status == 200 and json.loads(body)["region"] == "us"


def test_forwarded_marker_without_peer_token_is_refused(secured):
    """A client that marks its request forwarded (to skip the one-hop rule, or claim queue time) gets 403, even with
    a valid client key; a peer's forwarded request (peer token) is served without a client key."""
    base = secured.balancers["us"]
    for headers in ({"Authorization": f"Bearer {KEY}", "X-SkyLB-Forwarded-From": "eu", "X-SkyLB-Queue-Ms": "600000"},
                    {"X-SkyLB-Forwarded-From": "eu", "X-SkyLB-Token": "wrong"}):
        status, body = http("POST", f"{base}/v1/chat/completions", headers=headers, body=chat())
        assert status == 403 and json.loads(body)["error"]["type"] == "permission_error"
    status, body = http("POST", f"{base}/api/generate", headers={"X-SkyLB-Forwarded-From": "eu"},
                        body={"model": MODEL, "prompt": "x", "stream": False})
    assert status == 403 and isinstance(json.loads(body)["error"], str)  # Ollama's shape
    status, _ = http("POST", f"{base}/v1/chat/completions",
                     headers={"X-SkyLB-Forwarded-From": "eu", "X-SkyLB-Token": PEER}, body=chat())
    assert status == 200


def test_metrics_needs_metrics_or_peer_token(secured):
    """/metrics answers 403 without a token, with a wrong one or a client key; the metrics token or the peer token
    (Bearer, as Prometheus sends it, or X-SkyLB-Token) open it."""
    base = secured.balancers["us"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}"},
                    {"Authorization": f"Bearer {ADMIN}"}):
        assert http("GET", f"{base}/metrics", headers=headers)[0] == 403, headers
    for headers in ({"Authorization": f"Bearer {METRICS}"}, {"Authorization": f"Bearer {PEER}"},
                    {"X-SkyLB-Token": PEER}):
        status, body = http("GET", f"{base}/metrics", headers=headers)
        assert status == 200 and b"skylb_" in body, headers


# --- the controller ---------------------------------------------------------------------------------------------------

def test_controller_changes_need_admin_token(secured):
    """Every change of membership (add, remove, drain replicas; drain regions; remove balancers; set and delete
    quotas) answers 401 without the admin token, with a wrong one or with the peer token; reads stay open."""
    c = secured.controller_url
    changes = [("POST", "/v1/replicas", {"region": "us", "url": "http://10.9.9.9:8000"}),
               ("DELETE", "/v1/replicas/us-1", None), ("POST", "/v1/replicas/us-1/drain", {}),
               ("POST", "/v1/replicas/us-1/undrain", {}), ("POST", "/v1/regions/us/drain", {}),
               ("POST", "/v1/regions/us/undrain", {}), ("DELETE", f"/v1/balancers?url={secured.balancers['us']}", None),
               ("POST", "/v1/quotas", {"model": "m", "max_concurrent": 1}), ("DELETE", "/v1/quotas?all=true", None)]
    for i, (method, path, body) in enumerate(changes):  # each change from its own address: 2 wrong tokens each,
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {PEER}"},  # under the
                        {"X-SkyLB-Token": PEER}):  # throttle's 5 free ones
            status, _, answer = _from(f"127.0.3.{i + 1}", method, c + path, headers, body)
            assert status == 401 and answer["error"]["type"] == "authentication_error", (path, headers)
    for path in ("/v1/membership", "/v1/replicas", "/v1/balancers", "/v1/assignments", "/v1/quotas", "/healthz"):
        assert http("GET", c + path)[0] == 200
    assert len(requests.get(f"{c}/v1/replicas", timeout=5).json()["replicas"]) == 2  # nothing changed
    status, _ = http("POST", f"{c}/v1/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                     body={"region": "us", "url": "http://10.9.9.9:8000"})
    assert status == 201


def test_skylb_ctl_sends_the_admin_token(secured, tmp_path):
    """skylb-ctl without the token is refused with the controller's reason (exit 1); with $SKYLB_ADMIN_TOKEN,
    --admin-token-file or $SKYLB_ADMIN_TOKEN_FILE it changes membership; an unreadable file is a usage error."""
    base = [sys.executable, "-m", "controller.ctl", "--controller", secured.controller_url]
    bare = {**os.environ, "SKYLB_ADMIN_TOKEN": ""}
    add = ["replica", "add", "--region", "us", "--url"]
    done = subprocess.run([*base, *add, "http://10.9.9.1:8000"], capture_output=True, text=True, env=bare, timeout=30)
    assert done.returncode == 1 and "admin token" in done.stderr
    done = subprocess.run([*base, *add, "http://10.9.9.1:8000"], capture_output=True, text=True, timeout=30,
                          env={**bare, "SKYLB_ADMIN_TOKEN": ADMIN})
    assert done.returncode == 0, done.stderr
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN + "\n")
    done = subprocess.run([*base, "--admin-token-file", str(token_file), *add, "http://10.9.9.2:8000"],
                          capture_output=True, text=True, env=bare, timeout=30)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*base, *add, "http://10.9.9.4:8000"], capture_output=True, text=True, timeout=30,
                          env={**bare, "SKYLB_ADMIN_TOKEN_FILE": str(token_file)})
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*base, "--admin-token-file", str(tmp_path / "missing"), *add, "http://10.9.9.3:8000"],
                          capture_output=True, text=True, env=bare, timeout=30)
    assert done.returncode == 2 and "cannot read the token file" in done.stderr


def test_balancer_heartbeat_needs_peer_token(secured):
    """POST /v1/balancers answers 401 without the peer token or with a wrong one; the peer token or the admin token
    register; the real balancer (holding the token) is registered."""
    c = secured.controller_url
    body = {"region": "eu", "url": "http://10.8.8.8:8080"}
    for headers in ({}, {"X-SkyLB-Token": "wrong"}, {"Authorization": "Bearer wrong"}):
        assert http("POST", f"{c}/v1/balancers", headers=headers, body=body)[0] == 401
    assert http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER}, body=body)[0] == 200
    assert http("POST", f"{c}/v1/balancers", headers={"Authorization": f"Bearer {ADMIN}"},
                body={"region": "asia", "url": "http://10.8.8.9:8080"})[0] == 200
    urls = {b["url"] for b in requests.get(f"{c}/v1/balancers", timeout=5).json()["balancers"]}
    assert secured.balancers["us"] in urls


def test_live_balancer_id_cannot_be_taken_over(secured):
    """Registering another URL under a live balancer's id is 409 balancer_id_taken, even with the peer token;
    "replace": true without the admin token is 401; with it, the new one replaces the old, and the old one's next
    heartbeat is refused. Another id joins the region as a sibling."""
    c = secured.controller_url
    old = secured.balancers["us"]
    old_id = old.split("://", 1)[1]
    intruder = {"region": "us", "url": "http://10.7.7.7:8080", "id": old_id}
    status, body = http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER}, body=intruder)
    assert status == 409 and json.loads(body)["error"]["type"] == "balancer_id_taken"
    status, _ = http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER}, body={**intruder, "replace": True})
    assert status == 401
    assert [b["url"] for b in requests.get(f"{c}/v1/balancers", timeout=5).json()["balancers"]] == [old]
    status, _ = http("POST", f"{c}/v1/balancers", headers={"Authorization": f"Bearer {ADMIN}"},
                     body={**intruder, "replace": True})
    assert status == 200
    assert [b["url"] for b in requests.get(f"{c}/v1/balancers", timeout=5).json()["balancers"]] == [intruder["url"]]
    status, body = http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER}, body={"region": "us", "url": old})
    assert status == 409 and json.loads(body)["error"]["type"] == "balancer_id_taken"
    status, _ = http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER},
                     body={"region": "us", "url": "http://10.7.7.8:8080", "id": "us-2"})
    assert status == 200
    assert len(requests.get(f"{c}/v1/balancers", timeout=5).json()["balancers"]) == 2


def test_replica_and_balancer_urls_are_validated(secured):
    """Replica and balancer URLs need http(s), a real host (no spaces, escapes or credentials), no query: 400."""
    c, admin = secured.controller_url, {"Authorization": f"Bearer {ADMIN}"}
    for url in ("ftp://10.0.0.1:21", "http://", "http://bad host:80", "http://ex%61mple:80", "http://u:p@h:80",
                "http://h:80/?x=1", "file:///etc/passwd", "http://h:80/a b", "10.0.0.1:8000"):
        status, body = http("POST", f"{c}/v1/replicas", headers=admin, body={"region": "us", "url": url})
        assert status == 400 and "url" in json.loads(body)["error"]["message"], url
        status, _ = http("POST", f"{c}/v1/balancers", headers=admin, body={"region": "zz", "url": url})
        assert status == 400, url


def test_open_mode_logs_a_warning(procs, tmp_path):
    """With no token configured, the controller and the balancer start open and each says so loudly."""
    cluster = Cluster(procs, tmp_path)
    cluster.start_controller(["us"])
    cluster.start_balancer("us", ["us"])
    cluster.wait_until(lambda: "peer_endpoints_open" in "".join(p.log() for p in procs.procs),
                       what="the balancer's warning")
    logs = {p.name: p.log() for p in procs.procs}
    assert any("controller_api_open" in text for text in logs.values())
    assert any("peer_endpoints_open" in text for text in logs.values())


# --- secrets in logs, TLS ---------------------------------------------------------------------------------------------

def test_secrets_never_appear_in_logs(secured, procs, tmp_path):
    """After good and bad calls on every protected route, a balancer whose peer token the controller refuses, and
    skylb-ctl errors, no process log holds any token or key."""
    base, c = secured.balancers["us"], secured.controller_url
    http("POST", f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, body=chat())
    http("POST", f"{base}/v1/chat/completions", headers={"Authorization": "Bearer nope"}, body=chat())
    http("POST", f"{base}/v1/chat/completions", headers={"X-SkyLB-Forwarded-From": "eu", "X-SkyLB-Token": PEER},
         body={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    http("GET", f"{base}/skylb/v1/status", headers={"X-SkyLB-Token": PEER})
    http("GET", f"{base}/metrics", headers={"Authorization": f"Bearer {METRICS}"})
    http("POST", f"{c}/v1/replicas", headers={"Authorization": f"Bearer {ADMIN}"}, body={"region": "us", "url": "x"})
    http("POST", f"{c}/v1/balancers", headers={"X-SkyLB-Token": PEER}, body={"region": "us", "url": "http://1.2.3.4:1"})
    secured.ctl("replica", "remove", "no-such-replica", check=False)
    # A balancer holding another peer token: the controller refuses its heartbeats, it logs why (not the token).
    impostor = Cluster(procs, tmp_path, peer_token=PEER + "-other", admin_token=None)
    impostor.controller_url = c
    impostor.start_balancer("eu", ["us", "eu"], name="balancer-impostor")
    deadline = time.monotonic() + 10
    while "balancer_registration_failed" not in procs.procs[-1].log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "balancer_registration_failed" in procs.procs[-1].log()
    for proc in list(procs.procs):
        proc.stop()
    logs = {path.name: path.read_text() for path in Path(procs.log_dir).glob("*.log")}
    assert len(logs) >= 4
    for name, text in logs.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret[:6]}... in {name}"


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([require_binary("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_listener_with_a_self_signed_certificate(procs, tmp_path):
    """With tls_cert_file and tls_key_file the balancer speaks HTTPS: a client trusting the certificate is served,
    one that does not is refused at the handshake, and plain HTTP gets no answer."""
    cert, key = _self_signed(tmp_path)
    port = free_port()
    cfg = tmp_path / "tls.yaml"
    cfg.write_text(f"balancer:\n  tls_cert_file: {cert}\n  tls_key_file: {key}\n  state_dir: {tmp_path / 'state'}\n"
                   "regions:\n  us: {}\n")
    procs.skylb("balancer", "--config", str(cfg), "--region", "us", "--port", str(port),
                "--controller", "http://127.0.0.1:1", name="balancer-tls", env={"SKYLB_PEER_TOKEN": ""})
    trusted = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}/healthz"
    deadline = time.monotonic() + 20
    while True:
        try:
            status, body = http("GET", url, context=trusted)
            break
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert status == 200 and json.loads(body)["status"] == "ok"
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        http("GET", url, context=ssl.create_default_context())
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
        http("GET", f"http://127.0.0.1:{port}/healthz")


def http_client_errors():
    import http.client
    return http.client.HTTPException


def test_tls_needs_both_files(tmp_path):
    """tls_cert_file without tls_key_file is a config error (exit 2), not a silent plain-HTTP listener."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("balancer:\n  tls_cert_file: /x/cert.pem\nregions:\n  us: {}\n")
    done = subprocess.run([sys.executable, "-m", "skylb", "balancer", "--config", str(cfg), "--region", "us"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "tls_key_file" in done.stderr


# --- skylb local ------------------------------------------------------------------------------------------------

def test_skylb_local_generates_tokens_per_run(tmp_path):
    """`skylb local` (Deployment) makes fresh random admin and peer tokens per run, one peer token for every region
    unless the config gives a region its own (the region-local benchmark), and keeps them in 0600 files."""
    from skylb.config import DeploymentConfig
    from bench.launch.local import Deployment

    a, b = Deployment(DeploymentConfig(), tmp_path / "a"), Deployment(DeploymentConfig(), tmp_path / "b")
    assert a.admin_token != b.admin_token and len(a.admin_token) >= 32
    assert len(set(a.peer_tokens.values())) == 1 and a.peer_tokens != b.peer_tokens
    a._write_tokens()
    assert (tmp_path / "a" / "admin-token").read_text().strip() == a.admin_token
    assert (tmp_path / "a" / "admin-token").stat().st_mode & 0o077 == 0
    own = DeploymentConfig.model_validate({"regions": {"us": {"balancer": {"peer_token": "mine"}}, "eu": {}}})
    local = Deployment(own, tmp_path / "c")
    assert local.peer_tokens["us"] == "mine" and local.peer_tokens["eu"] != "mine"


def test_api_keys_come_from_the_config_a_file_and_the_environment(tmp_path, monkeypatch):
    """Keys are the union of balancer.api_keys, the keys file (comments and blank lines skipped;
    $SKYLB_API_KEYS_FILE over the config's path) and $SKYLB_API_KEYS; an unreadable file names its path only."""
    from skylb.balancer.auth import load_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team a\nk-file-1\n\n  k-file-2  # rotated 2026-11\n")
    monkeypatch.setenv("SKYLB_API_KEYS", "k-env-1, k-env-2,")
    monkeypatch.delenv("SKYLB_API_KEYS_FILE", raising=False)
    assert load_api_keys(["k-cfg"], str(keys)) == {"k-cfg", "k-file-1", "k-file-2", "k-env-1", "k-env-2"}
    monkeypatch.setenv("SKYLB_API_KEYS_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing"):
        load_api_keys([], str(keys))


async def test_a_key_names_its_tenant(tmp_path, monkeypatch):
    """balancer.tenants and the keys file's ``<key> <tenant>`` lines map keys to tenants; the middleware gives a
    request its key's tenant, ``default`` for a key of no tenant; one key for two tenants is a config error."""
    from aiohttp.test_utils import TestClient, TestServer

    from skylb.balancer.auth import Credentials, auth_middleware, load_api_keys, load_tenants, tenant_of

    keys = tmp_path / "keys"
    keys.write_text("k-b tenant-b  # from the file\nk-plain\n")
    monkeypatch.delenv("SKYLB_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("SKYLB_API_KEYS", raising=False)
    tenants = load_tenants({"tenant-a": ["k-a1", "k-a2"]}, str(keys))
    assert tenants == {"k-a1": "tenant-a", "k-a2": "tenant-a", "k-b": "tenant-b"}
    api_keys = load_api_keys(["k-a1", "k-a2"], str(keys))
    assert api_keys == {"k-a1", "k-a2", "k-b", "k-plain"}
    with pytest.raises(ValueError, match="two tenants"):
        load_tenants({"x": ["k-b"]}, str(keys))

    async def whoami(request):
        return web.json_response({"tenant": tenant_of(request)})
    app = web.Application(middlewares=[auth_middleware(Credentials(api_keys=api_keys, peer_token="p",
                                                                   tenants=tenants))])
    app.router.add_post("/v1/chat/completions", whoami)
    async with TestClient(TestServer(app)) as client:
        for key, tenant in (("k-a2", "tenant-a"), ("k-b", "tenant-b"), ("k-plain", "default")):
            response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
            assert (await response.json())["tenant"] == tenant
        response = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer nope"})
        assert response.status == 401


async def test_a_silent_balancer_no_longer_holds_its_id():
    """A balancer not heard from for LIVE_HEARTBEAT_S (where the health check is off and never marks it unhealthy)
    does not block a new registration under its id, which replaces it; a fresh one does (409)."""
    from aiohttp.test_utils import TestClient, TestServer

    from controller.auth import ControllerCredentials
    from controller.ownership import LIVE_HEARTBEAT_S
    from controller.server import create_app
    from controller.store import MembershipStore

    store = MembershipStore(":memory:")
    store.register_balancer("us", "http://10.0.0.1:8080", balancer_id="lb-1", now=time.time() - LIVE_HEARTBEAT_S - 1)
    store.register_balancer("eu", "http://10.0.0.2:8080", balancer_id="lb-1")
    app = create_app(store, credentials=ControllerCredentials(admin_token=ADMIN, peer_token=PEER))
    async with TestClient(TestServer(app)) as client:
        peer = {"X-SkyLB-Token": PEER}
        resp = await client.post("/v1/balancers", json={"region": "us", "url": "http://10.0.0.3:8080", "id": "lb-1"},
                                 headers=peer)
        assert resp.status == 200
        assert [b.url for b in store.list_balancers() if b.region == "us"] == ["http://10.0.0.3:8080"]
        resp = await client.post("/v1/balancers", json={"region": "eu", "url": "http://10.0.0.4:8080", "id": "lb-1"},
                                 headers=peer)
        assert resp.status == 409 and (await resp.json())["error"]["type"] == "balancer_id_taken"
    store.close()


def test_skylb_local_runs_secured_and_its_clients_send_the_api_key(tmp_path):
    """A real `skylb local` run with client keys on: the replicas are registered with the generated admin token, the
    balancers read each other's status with the generated peer token (the run waits for that before replaying), the
    demo's clients send a key and are all served, nothing runs open, and no output or log holds a token or the key."""
    cfg = {
        "balancer": {"probe_interval_ms": 50, "api_keys": [KEY]},
        "regions": {"us": {"replicas": 1}, "eu": {"replicas": 1}},
        "emulator": {"time_scale": 0.05, "extra_args": ["--max-num-seqs", "2"]},
        "latency": {"rtt_ms": {"us-eu": 20}},
        "workload": {"trace": None, "region_weights": {"us": 0.9, "eu": 0.1}, "synthetic_conversations": 6,
                     "synthetic_turns": 2, "request_timeout_s": 60},
    }
    config, run_dir, out = tmp_path / "local.yaml", tmp_path / "run", tmp_path / "report.json"
    config.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYLB_")}
    done = subprocess.run([sys.executable, "-m", "skylb", "local", "--config", str(config), "--run-dir", str(run_dir),
                           "--out", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    total = json.loads(out.read_text())["report"]["total"]
    assert total["sent"] == total["completed"] > 0 and total["failed"] == 0
    tokens = [(run_dir / name).read_text().strip() for name in ("admin-token", "peer-token")]
    assert all(len(t) >= 32 for t in tokens)
    # A ready-to-paste skylb-ctl command names both token files (never the tokens).
    assert (f"--admin-token-file {run_dir / 'admin-token'} --peer-token-file {run_dir / 'peer-token'} status"
            in done.stdout)
    texts = [done.stdout, done.stderr, *(p.read_text() for p in (run_dir / "logs").glob("*.log"))]
    assert not [t for t in texts for secret in (*tokens, KEY) if secret in t]
    assert not [t for t in texts if "controller_api_open" in t or "peer_endpoints_open" in t]


def test_without_tokens_peer_and_admin_endpoints_answer_this_machine_only():
    """Protected mode (the default when no token is configured): the controller's changes and registrations, and a
    balancer's peer status and /metrics, are refused to a non-loopback client with a message saying which token to
    set; loopback clients (this machine, the tests) pass. The client API stays open. The forwarded marker without a
    peer token is refused to every client, loopback included."""
    from unittest import mock

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from controller import auth as controller_auth
    from skylb.tokens import from_this_machine
    from skylb.balancer import auth as balancer_auth

    assert from_this_machine("127.0.0.1") and from_this_machine("127.0.0.13") and from_this_machine("::1")
    assert from_this_machine(None) and not from_this_machine("10.0.0.5") and not from_this_machine("garbage")

    def request(method: str, path: str, remote: str, headers: dict | None = None, app=None):
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: (remote, 5000) if name == "peername" \
            else default
        return make_mocked_request(method, path, headers=headers or {}, transport=transport, app=app)

    async def ok(_request):
        return web.Response(text="passed")

    async def run(middleware, req):
        return await middleware(req, ok)

    import asyncio

    app = web.Application()
    app[controller_auth.CREDENTIALS] = controller_auth.ControllerCredentials()
    for path in ("/v1/replicas", "/v1/balancers"):
        far = asyncio.run(run(controller_auth.auth_middleware, request("POST", path, "10.0.0.5", app=app)))
        assert far.status == 401 and "this machine only" in json.loads(far.body)["error"]["message"]
        near = asyncio.run(run(controller_auth.auth_middleware, request("POST", path, "127.0.0.1", app=app)))
        assert near.status == 200
    assert asyncio.run(run(controller_auth.auth_middleware, request("GET", "/v1/membership", "10.0.0.5",
                                                                    app=app))).status == 200

    check = balancer_auth.auth_middleware(balancer_auth.Credentials())
    for path, headers in (("/skylb/v1/status", {}), ("/metrics", {})):
        far = asyncio.run(run(check, request("GET", path, "10.0.0.5", headers)))
        assert far.status == 403 and "this machine only" in json.loads(far.body)["error"]["message"], path
        near = asyncio.run(run(check, request("GET", path, "127.0.0.1", headers)))
        assert near.status == 200, path
    assert asyncio.run(run(check, request("POST", "/v1/completions", "10.0.0.5"))).status == 200
    # The forwarded marker needs the peer token, from this machine too (a local reverse proxy passes its clients'
    # headers on): without a token there are no peers to send it.
    for remote in ("10.0.0.5", "127.0.0.1"):
        marked = asyncio.run(run(check, request("POST", "/v1/completions", remote, {"X-SkyLB-Forwarded-From": "eu"})))
        assert marked.status == 403 and "peer token" in json.loads(marked.body)["error"]["message"], remote


# --- guessing: the status page's login, weak tokens ------------------------------------------------------------------

def test_status_page_login_is_throttled_per_address_with_429_and_a_growing_retry_after(procs, tmp_path):
    """Five wrong tokens from one address get the form again (401); the sixth locks the address out: 429 with
    Retry-After 1, and while locked out even the right token is not checked (429); the next wrong token once the
    lockout ended doubles it (Retry-After 2). 300 guesses no longer run in a second."""
    cluster = Cluster(procs, tmp_path, peer_token=PEER)
    [replica] = cluster.start_emulator(1, "--time-scale", "0.01", name="emu")
    cluster.start_static_balancer([replica], engine="vllm")
    login = f"{cluster.balancers['local']}/skylb/login"

    def attempt(token: str) -> requests.Response:
        return requests.post(login, data={"token": token}, allow_redirects=False, timeout=10)

    assert [attempt(f"wrong-{i}").status_code for i in range(5)] == [401] * 5
    sixth = attempt("wrong-5")
    assert sixth.status_code == 429 and sixth.headers["Retry-After"] == "1" and "try again" in sixth.text
    assert attempt(PEER).status_code == 429 and "Set-Cookie" not in attempt(PEER).headers
    time.sleep(1.1)
    again = attempt("wrong-6")
    assert again.status_code == 429 and again.headers["Retry-After"] == "2"


def test_wrong_api_keys_and_peer_tokens_are_throttled_per_address_as_the_login_is(procs, tmp_path, monkeypatch):
    """Five wrong client keys from one address get 401; the sixth gets 429 with Retry-After 1 in the API's shape,
    and while it is locked out a right key from it is not compared (429), while right keys and the peer token from
    another address are served; a request with no credential is no guess (401, not counted); one count covers every
    credential: a wrong peer token (X-SkyLB-Token) after the lockout doubles it (Retry-After 2), on Ollama's API in
    Ollama's shape."""
    monkeypatch.setenv("SKYLB_API_KEYS", KEY)
    cluster = Cluster(procs, tmp_path, peer_token=PEER)
    [replica] = cluster.start_emulator(1, "--time-scale", "0.01", name="emu")
    cluster.start_static_balancer([replica], engine="vllm")
    url = cluster.balancers["local"]
    guesser, other = "127.0.0.2", "127.0.0.1"

    def models(address: str, key: str) -> tuple[int, dict, dict]:
        return _from(address, "GET", f"{url}/v1/models", {"Authorization": f"Bearer {key}"})

    assert [models(guesser, f"wrong-{i}")[0] for i in range(5)] == [401] * 5
    status, headers, body = models(guesser, "wrong-5")
    assert status == 429 and headers["Retry-After"] == "1", body
    assert body["error"]["type"] == "rate_limit_exceeded" and "try again" in body["error"]["message"]
    assert models(guesser, KEY)[0] == 429  # locked out: not compared
    assert models(other, KEY)[0] == 200
    assert _from(other, "GET", f"{url}/skylb/v1/status?format=json", {"X-SkyLB-Token": PEER})[0] == 200
    assert _from(guesser, "GET", f"{url}/v1/models")[0] == 401  # no credential: no guess, neither refused nor counted
    time.sleep(1.1)
    status, headers, body = _from(guesser, "GET", f"{url}/api/tags", {"X-SkyLB-Token": "wrong-peer"})
    assert status == 429 and headers["Retry-After"] == "2" and "try again" in body["error"], body
    assert models(other, KEY)[0] == 200


def test_wrong_admin_and_peer_tokens_at_the_controller_are_throttled_per_address(procs, tmp_path):
    """At the controller, five wrong admin tokens on a change from one address get 401, the sixth 429 with
    Retry-After 1; while locked out the right admin token from it gets 429, and from another address it is
    served; once the lockout ended, the right token from it is served and starts its count again (a wrong peer
    token on a heartbeat is then a plain 401)."""
    cluster = Cluster(procs, tmp_path, peer_token=PEER, admin_token=ADMIN, controller={"health": {"enabled": False}})
    url = cluster.start_controller(["us"])
    guesser, other = "127.0.0.2", "127.0.0.1"

    def remove(address: str, token: str) -> tuple[int, dict, dict]:
        return _from(address, "DELETE", f"{url}/v1/replicas/nothing-here", {"Authorization": f"Bearer {token}"})

    assert [remove(guesser, f"wrong-{i}")[0] for i in range(5)] == [401] * 5
    status, headers, body = remove(guesser, "wrong-5")
    assert status == 429 and headers["Retry-After"] == "1" and "try again" in body["error"]["message"], body
    assert remove(guesser, ADMIN)[0] == 429
    assert remove(other, ADMIN)[0] == 404  # compared, right: the change runs (no such replica)
    time.sleep(1.1)
    assert remove(guesser, ADMIN)[0] == 404
    assert _from(guesser, "POST", f"{url}/v1/balancers", {"X-SkyLB-Token": "wrong-peer"})[0] == 401


def test_guess_throttle_forgets_after_a_success_or_an_hour_and_stays_bounded():
    """A right token forgets the address's failures; so does an hour without one; lockouts double up to 15 min;
    at most GUESS_MAX_ADDRESSES addresses are tracked, the oldest failure forgotten first."""
    from skylb import tokens
    from skylb.tokens import GUESS_FREE_FAILURES, GUESS_LOCK_MAX_S, GuessThrottle

    now = [1000.0]
    throttle = GuessThrottle(clock=lambda: now[0])
    assert [throttle.failed("a") for _ in range(GUESS_FREE_FAILURES)] == [0.0] * GUESS_FREE_FAILURES
    locks = []
    for _ in range(12):
        locks.append(throttle.failed("a"))
        now[0] += locks[-1]
    assert locks[:4] == [1.0, 2.0, 4.0, 8.0] and locks[-1] == GUESS_LOCK_MAX_S
    assert throttle.locked_for_s("b") == 0.0
    throttle.succeeded("a")
    assert throttle.locked_for_s("a") == 0.0 and throttle.failed("a") == 0.0
    for _ in range(GUESS_FREE_FAILURES):
        throttle.failed("c")
    now[0] += 3601
    assert throttle.failed("c") == 0.0  # an hour later: a first failure again
    small = GuessThrottle(clock=lambda: now[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokens, "GUESS_MAX_ADDRESSES", 3)
        for address in ("1", "2", "3", "4"):
            small.failed(address)
    assert list(small._failures) == ["2", "3", "4"]


def test_weak_peer_or_admin_tokens_stop_the_process_naming_the_rule(tmp_path):
    """A balancer or controller whose peer or admin token is short, a run of few characters, or holds a space exits 2
    with the rule and how to generate a token on stderr (never the token); a generated one starts."""
    from skylb.tokens import check_token

    weak = ("abc", "peer-" + "p" * 40, "a long enough token with spaces 0123456789")
    for token in weak:
        with pytest.raises(ValueError, match="at least 32 characters.*secrets.token_urlsafe"):
            check_token("the peer token", token)
    assert check_token("the metrics token", "short", strong=False) == "short"
    # cwd: the controller's default database lies there (never reached); PYTHONPATH: this checkout's skylb from there
    base = {**{k: v for k, v in os.environ.items() if not k.startswith("SKYLB_")},
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = [(["balancer", "--replica", "http://127.0.0.1:9", "--port", str(free_port())],
             {"SKYLB_PEER_TOKEN": "abc"}, "the peer token"),
            (["controller", "--port", str(free_port())], {"SKYLB_ADMIN_TOKEN": "admin-" + "a" * 40},
             "the admin token")]
    for args, env, name in runs:
        done = subprocess.run([sys.executable, "-m", "skylb", *args], capture_output=True, text=True, timeout=20,
                              env={**base, **env}, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert f"{name} is too weak" in done.stderr and "token_urlsafe" in done.stderr
        assert list(env.values())[0] not in done.stderr
