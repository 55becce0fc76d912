"""Static mode, peers by flag, the peer token that peers need, reload without restart, and skylb-ctl's status of a
balancer that wants the peer token: real processes (emulated replicas, balancers started with --replica, a
controller, skylb-ctl), one shared deployment for the module.

The deployment: two emulated vLLM replicas (one slot each) and an emulated Ollama; ``plain``, the one-liner
`skylb balancer --replica R1 --replica R2` with nothing else; ``eu`` (the Ollama, engine detected) with the peer
token; ``us`` (R1) with the
peer token, ``--peer eu=...``, and a config file naming a client keys file that is a symlink into a ConfigMap-like
``..data`` directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import structlog

from skylb.balancer.static import parse_replica, static_membership
from skylb.config import ConfigError
from tests.cluster import MODEL, get_json
from tests.procs import ProcGroup, free_ports

TOKEN = "static-test-peer-token-0123456789"
#: Every process starts from this environment: no token or key the test runner's own environment may hold.
CLEAN = {"SKYLB_PEER_TOKEN": "", "SKYLB_API_KEYS": "", "SKYLB_API_KEYS_FILE": "", "SKYLB_ADMIN_TOKEN": "",
         "SKYLB_ADMIN_TOKEN_FILE": "", "SKYLB_METRICS_TOKEN": ""}


class Static:
    """The module's deployment (see the module docstring)."""

    def __init__(self, procs: ProcGroup, tmp: Path):
        self.procs, self.tmp = procs, tmp
        r1, r2, r3, plain, eu, us = free_ports(6)
        self.replicas = [f"http://127.0.0.1:{p}" for p in (r1, r2, r3)]
        procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", "0.2", "--max-num-seqs", "1",
                    "--port", str(r1), "--port", str(r2), name="emulator", wait_url=f"{self.replicas[1]}/health")
        procs.skylb("emulator", "--engine", "ollama", "--model", MODEL, "--time-scale", "0.2", "--port", str(r3),
                    name="ollama", wait_url=f"{self.replicas[2]}/api/version")
        self.plain, self.eu, self.us = (f"http://127.0.0.1:{p}" for p in (plain, eu, us))
        self._configmap("key-old")
        self.config = tmp / "us.yaml"
        self.config.write_text(json.dumps({"balancer": {"probe_interval_ms": 50,
                                                        "api_keys_file": str(tmp / "keys" / "api-keys")}}))
        procs.skylb("balancer", "--replica", self.replicas[0], "--replica", self.replicas[1], "--port", str(plain),
                    name="plain", env=CLEAN, wait_url=f"{self.plain}/healthz")
        procs.skylb("balancer", "--region", "eu", "--replica", self.replicas[2], "--port", str(eu), name="eu",
                    env={**CLEAN, "SKYLB_PEER_TOKEN": TOKEN}, wait_url=f"{self.eu}/healthz")
        self.us_proc = procs.skylb("balancer", "--region", "us", "--replica", self.replicas[0], "--peer",
                                   f"eu={self.eu}", "--config", str(self.config), "--port", str(us), name="us",
                                   env={**CLEAN, "SKYLB_PEER_TOKEN": TOKEN}, wait_url=f"{self.us}/healthz")

    def _configmap(self, keys: str, generation: int = 0) -> None:
        """Write the keys file as Kubernetes mounts a ConfigMap: ``keys/api-keys -> ..data/api-keys``, ``..data ->
        ..<generation>``; a new generation moves the ``..data`` symlink atomically (rename over it)."""
        mount = self.tmp / "keys"
        version = mount / f"..{generation}"
        version.mkdir(parents=True)
        (version / "api-keys").write_text(keys + "\n")
        (mount / "..data_tmp").symlink_to(version.name)
        os.replace(mount / "..data_tmp", mount / "..data")
        if not (mount / "api-keys").is_symlink():
            (mount / "api-keys").symlink_to("..data/api-keys")

    def status(self, url: str) -> dict:
        return get_json(f"{url}/skylb/v1/status?format=json", headers={"X-SkyLB-Token": TOKEN})

    def wait(self, predicate, what: str, timeout_s: float = 15.0):
        deadline = time.monotonic() + timeout_s
        while not (value := predicate()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)
        return value

    def accepted(self, key: str) -> int:
        """The status of ``GET /v1/models`` on ``us`` with client key ``key`` (checked like every client request,
        and answered without waiting for a replica)."""
        return requests.get(f"{self.us}/v1/models", headers={"Authorization": f"Bearer {key}"},
                            timeout=30).status_code


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static")
    procs = ProcGroup(tmp / "logs")
    try:
        deployment = Static(procs, tmp)
        for url, n in ((deployment.plain, 2), (deployment.eu, 1), (deployment.us, 1)):
            deployment.wait(lambda: sum(r["healthy"] for r in deployment.status(url)["replicas"]) >= n,
                            f"{n} healthy replicas behind {url}")
        deployment.wait(lambda: [p["healthy"] for p in deployment.status(deployment.us)["peers"]] == [True],
                        "us to probe its peer eu")
        yield deployment
    finally:
        procs.stop_all()


def test_replica_flags_alone_serve_the_official_openai_client(static):
    """`skylb balancer --replica R1 --replica R2` (no controller, no YAML, no token, engine detected) serves the
    openai client: the model list, a completion, a stream; its region defaults to "local"."""
    client = openai.OpenAI(base_url=f"{static.plain}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL]
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    status = static.status(static.plain)
    assert status["region"] == "local" and {r["engine"] for r in status["replicas"]} == {"vllm"}
    assert sorted(r["url"] for r in status["replicas"]) == sorted(static.replicas[:2])
    assert status["peers"] == []
    # An Ollama behind `--replica URL` alone (eu: its token is for peers only) is detected and serves both APIs.
    assert [r["engine"] for r in static.status(static.eu)["replicas"]] == ["ollama"]
    tags = requests.get(f"{static.eu}/api/tags", timeout=10).json()
    assert [m["name"] for m in tags["models"]] == [MODEL]
    reply = requests.post(f"{static.eu}/api/chat", json={"model": MODEL, "stream": False,
                                                         "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert reply.status_code == 200 and reply.json()["done"] is True


def test_overflow_is_forwarded_to_a_peer_given_by_flag(static):
    """With us's one replica full (one running, one waiting, sent to it directly), a request to us goes to its peer
    eu (--peer eu=URL, both with the peer token) and is served there."""
    fillers = [threading.Thread(target=requests.post, daemon=True, args=(f"{static.replicas[0]}/v1/completions",),
                                kwargs={"json": {"model": MODEL, "prompt": "busy", "max_tokens": 150,
                                                 "ignore_eos": True}, "timeout": 60}) for _ in range(2)]
    for t in fillers:
        t.start()
    static.wait(lambda: static.status(static.us)["available_replicas"] == 0, "us's replica to be full")
    resp = requests.post(f"{static.us}/v1/completions", json={"model": MODEL, "prompt": "over", "max_tokens": 2},
                         headers={"Authorization": "Bearer key-old"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-SkyLB-Route"] == "peer:eu" and resp.headers["X-SkyLB-Served-By"].startswith("eu/")
    for t in fillers:
        t.join(timeout=30)


def test_idle_targets_are_probed_less_and_foreign_load_brings_the_interval_back(static):
    """Adaptive probing on us (probe interval 50 ms, up to 8 intervals): its idle replica and its peer, whose
    answers it foresees, reach 400 ms and stay available (not "probe stale" at 5 intervals); requests sent to the
    replica directly (not by us) bring it back to 50 ms."""
    def intervals():
        status = static.status(static.us)
        replica = status["replicas"][0]
        return replica, status["peers"][0]
    def backed_off():
        replica, peer = intervals()
        return (replica, peer) if replica["probe_interval_ms"] == peer["probe_interval_ms"] == 400 else None

    replica, peer = static.wait(backed_off, "us to back off its idle targets")
    assert replica["available"] and peer["healthy"], (replica, peer)
    # Past the 5 intervals (250 ms) a probe would be stale without backoff: sample its age while it is.
    static.wait(lambda: (r := intervals()[0])["probe_age_ms"] > 300 and r["available"],
                "a backed-off replica probed over 300 ms ago to stay available")
    filler = threading.Thread(target=requests.post, daemon=True, args=(f"{static.replicas[0]}/v1/completions",),
                              kwargs={"json": {"model": MODEL, "prompt": "foreign", "max_tokens": 150,
                                               "ignore_eos": True}, "timeout": 60})
    filler.start()
    static.wait(lambda: intervals()[0]["probe_interval_ms"] == 50, "foreign load to bring the interval back")
    filler.join(timeout=30)


def test_sighup_and_a_configmap_swap_reload_keys_without_dropping_a_stream(static):
    """SIGHUP after the keys file changed admits the new key and refuses the removed one while a stream admitted
    with the old key runs on to its end; a ConfigMap-style swap (the ``..data`` symlink moved) is picked up with no
    signal; an invalid config file then changes nothing (the keys in force stay)."""
    assert (static.accepted("key-old"), static.accepted("key-new")) == (200, 401)
    client = openai.OpenAI(base_url=f"{static.us}/v1", api_key="key-old", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    (static.tmp / "keys" / "..0" / "api-keys").write_text("key-new\n")  # edited in place, then SIGHUP
    static.us_proc.popen.send_signal(signal.SIGHUP)
    static.wait(lambda: static.accepted("key-new") == 200, "the new key to be admitted", timeout_s=10)
    assert static.accepted("key-old") == 401
    assert static.status(static.us)["in_flight"] >= 1  # the stream still runs across the reload
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    assert len([c for c in [first, *rest] if c.choices and c.choices[0].text]) == 300

    static._configmap("key-swapped", generation=1)  # no signal: the poll sees the ..data symlink move
    static.wait(lambda: static.accepted("key-swapped") == 200, "the swapped ConfigMap's key", timeout_s=10)
    assert static.accepted("key-new") == 401

    static.config.write_text("balancer: [not, a, mapping\n")
    static.us_proc.popen.send_signal(signal.SIGHUP)
    static.wait(lambda: "reload_failed" in (static.tmp / "logs" / "us.log").read_text(), "reload_failed logged")
    assert (static.accepted("key-swapped"), static.accepted("key-new")) == (200, 401)


def test_peers_without_a_peer_token_refuse_to_start(tmp_path, monkeypatch, capsys):
    """A balancer given peers (by flag: a real process; or other regions in its deployment file) and no peer token
    exits 2 with a message naming the peers and the variable to set; a single region without peers starts without
    one (``plain`` above)."""
    done = subprocess.run([sys.executable, "-m", "skylb", "balancer", "--replica", "http://127.0.0.1:9", "--peer",
                           "eu=http://127.0.0.1:8"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **CLEAN})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "peers are configured (eu) but no peer token" in done.stderr and "$SKYLB_PEER_TOKEN" in done.stderr
    from skylb.cli import main
    for name, value in CLEAN.items():
        monkeypatch.setenv(name, value)
    deployment = tmp_path / "two.yaml"
    deployment.write_text("regions: {us: {}, eu: {}, asia: {}}\n")
    try:
        assert main(["balancer", "--config", str(deployment), "--region", "us", "--controller",
                     "http://127.0.0.1:1"]) == 2
    finally:
        # main() pointed structlog at this test's captured stderr, which pytest closes: later tests on this worker
        # would log into a closed file.
        structlog.reset_defaults()
    assert "peers are configured (asia, eu) but no peer token" in capsys.readouterr().err


def test_ctl_status_says_a_balancer_refused_for_want_of_the_peer_token(static, tmp_path):
    """`skylb-ctl status` shows a balancer that answered 403 as REFUSED, saying how to give the token, never DOWN;
    with --peer-token-file it reads that balancer; a balancer without a token answers this machine (up). The
    controller reloads its admin token file on SIGHUP: the new token is accepted, the old one refused."""
    procs = ProcGroup(tmp_path / "logs")
    try:
        port = free_ports(1)[0]
        controller = f"http://127.0.0.1:{port}"
        admin_file = tmp_path / "admin-token"
        admin_one, admin_two = "admin-token-one-5c9e2b7d4a1f0836", "admin-token-two-8f3a6d0b2e7c9154"
        admin_file.write_text(admin_one + "\n")
        proc = procs.skylb("controller", "--port", str(port), "--db", str(tmp_path / "c.sqlite"), name="controller",
                           env={**CLEAN, "SKYLB_ADMIN_TOKEN_FILE": str(admin_file)}, wait_url=f"{controller}/healthz")

        def change(token: str) -> int:  # 404 (no such replica) once the token is accepted, else 401
            return requests.delete(f"{controller}/v1/replicas/none", headers={"Authorization": f"Bearer {token}"},
                                   timeout=10).status_code

        assert (change(admin_one), change(admin_two)) == (404, 401)
        admin_file.write_text(admin_two + "\n")
        proc.popen.send_signal(signal.SIGHUP)
        static.wait(lambda: change(admin_two) == 404, "the controller to take the new admin token", timeout_s=10)
        assert change(admin_one) == 401
        for region, url in (("eu", static.eu), ("local", static.plain)):
            requests.post(f"{controller}/v1/balancers", json={"region": region, "url": url},
                          timeout=10).raise_for_status()
        (tmp_path / "peer-token").write_text(TOKEN + "\n")

        def ctl(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "controller.ctl", "--controller", controller, *extra],
                                  capture_output=True, text=True, timeout=30, env={**os.environ, **CLEAN})

        table = ctl("status")
        assert table.returncode == 0, table.stderr
        assert "DOWN" not in table.stdout
        assert "REFUSED (refused: the status needs the peer token (set $SKYLB_PEER_TOKEN or pass " \
               "--peer-token-file FILE))" in table.stdout
        # the balancers table's rows (the region, then its URL); the regions and rules tables also start with a region
        rows = {region: line for line in table.stdout.splitlines() for region, url in (("eu", static.eu),
                                                                                       ("local", static.plain))
                if line.split()[:2] == [region, url]}
        assert "REFUSED" in rows["eu"] and " up " in rows["local"]
        view = json.loads(ctl("--peer-token-file", str(tmp_path / "peer-token"), "status", "-o", "json").stdout)
        assert {b["region"]: b["state"] for b in view["balancers"]} == {"eu": "up", "local": "up"}
    finally:
        procs.stop_all()


@pytest.mark.parametrize("flag,error", [
    ("http://h:1#max_concurrency=64", None),
    ("http://h:1#max_concurrency=0", "positive integer"),
    ("http://h:1#max_concurrency=many", "positive integer"),
    ("http://h:1#max_concurrency=4,max_concurrency=8", "given twice"),
])
def test_replica_flag_states_the_engines_batch_after_a_hash(flag, error):
    """--replica URL#max_concurrency=N: the entry's max_concurrency (no KV endpoint needed), else a ConfigError."""
    if error is None:
        assert parse_replica(flag) == ("http://h:1", {"max_concurrency": 64})
        entries = static_membership("us", [flag, "http://h:2"])["replicas"]
        assert entries[0]["max_concurrency"] == 64 and "max_concurrency" not in entries[1]
    else:
        with pytest.raises(ConfigError, match=error):
            parse_replica(flag)


@pytest.mark.parametrize("url,ok", [
    ("http://h:8000", True), ("http://h", True), ("http://[::1]:8000", True), ("https://u:p@h:443/v1", True),
    ("http://h:99999", False), ("http://h:0", False), ("http://h:port", False), ("http://[::1]:70000", False),
])
def test_a_replica_url_needs_a_port_from_1_to_65535(url, ok):
    """--replica with a port past 65535, 0 or not a number is a ConfigError at start, as the controller refuses it,
    instead of a replica that can never be reached."""
    if ok:
        assert static_membership("us", [url])["replicas"][0]["url"] == url
    else:
        with pytest.raises(ConfigError, match="must be a number from 1 to 65535"):
            static_membership("us", [url])
