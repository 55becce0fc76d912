"""The membership controller: its REST API (a real subprocess), skylb-ctl and ControllerClient (the store's own
semantics, on SQLite and etcd alike: tests/test_store.py)."""

from __future__ import annotations

import asyncio
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import requests
from aiohttp import web

from skylb.balancer.controller_client import ControllerClient, ControllerError, ControllerUnavailable
from tests.cluster import ctl_in_process
from tests.procs import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent  # skylb-ctl runs from the repository root, like an operator's shell
pytestmark = pytest.mark.timeout(30)


# --- helpers ----------------------------------------------------------------------------------------------------

class Controller:
    """A real controller subprocess on a free port, with its config file and SQLite file under ``tmp_path``."""

    def __init__(self, procs, tmp_path: Path):
        self.procs = procs
        self.db = tmp_path / "state" / "controller.sqlite"  # "state/" does not exist: the store must create it
        self.port = free_port()
        self.config = tmp_path / "skylb.yaml"
        # The API tests register made-up URLs: the health check (tested on its own below) would mark them unhealthy.
        self.config.write_text(f"controller:\n  host: 127.0.0.1\n  port: {self.port}\n  db: {self.db}\n"
                               "  health: {enabled: false}\n")
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *flags: str) -> "Controller":
        args = ("controller", "--config", str(self.config), *flags)
        wait_url = f"{self.url}/healthz"
        self.proc = self.procs.skylb(*args, name=f"controller-{self.port}", wait_url=wait_url)
        return self

    def stop(self) -> int:
        """SIGTERM the controller and return its exit status."""
        self.proc.stop()
        return self.proc.popen.returncode


@pytest.fixture
def controller(procs, tmp_path) -> Controller:
    """A started controller with an empty store."""
    return Controller(procs, tmp_path).start()


def ctl(url: str, *args: str) -> subprocess.CompletedProcess:
    """Run the real `skylb-ctl --controller URL ARGS` as a subprocess."""
    return subprocess.run([sys.executable, "-m", "controller.ctl", "--controller", url, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=20)


def revision(url: str) -> int:
    return requests.get(f"{url}/healthz", timeout=5).json()["revision"]


# --- REST API and skylb-ctl against a real controller -----------------------------------------------------------

def test_cli_add_list_remove(controller):
    """skylb-ctl adds, lists (table and JSON, by region) and removes replicas by id and URL; each write bumps the
    revision and logs one JSON membership_change line."""
    url = controller.url
    r = ctl(url, "replica", "add", "--region", "us", "--url", "http://10.0.0.1:8000", "--engine", "vllm")
    assert r.returncode == 0 and "us-1" in r.stdout, r.stderr
    r = ctl(url, "replica", "add", "--region", "eu", "--url", "http://10.0.0.2:8000/", "--engine", "sglang",
            "--id", "eu-gpu")
    assert r.returncode == 0, r.stderr
    assert revision(url) == 2

    table = ctl(url, "replica", "list").stdout
    assert "us-1" in table and "eu-gpu" in table and "sglang" in table and "ENGINE" in table
    listed = json.loads(ctl(url, "replica", "list", "--region", "eu", "--json").stdout)
    assert listed == [{"id": "eu-gpu", "region": "eu", "url": "http://10.0.0.2:8000", "engine": "sglang",
                       "created_at": listed[0]["created_at"], "max_concurrency": None, "healthy": True,
                       "draining": False, "kv_events": None, "kv_events_replay": None, "kv_block_size": None}]
    membership = json.loads(ctl(url, "membership", "--json").stdout)
    assert membership["revision"] == 2 and membership["regions"] == ["eu", "us"]
    assert "revision: 2" in ctl(url, "membership").stdout

    assert ctl(url, "replica", "remove", "us-1").returncode == 0
    r = ctl(url, "replica", "remove", "--url", "http://10.0.0.2:8000")
    assert r.returncode == 0 and "eu-gpu" in r.stdout, r.stderr
    assert revision(url) == 4
    assert json.loads(ctl(url, "replica", "list", "--json").stdout) == []

    changes = [json.loads(line) for line in controller.proc.log().splitlines() if "membership_change" in line]
    assert [(c["action"], c["revision"]) for c in changes] == [
        ("replica_added", 1), ("replica_added", 2), ("replica_removed", 3), ("replica_removed", 4)]


def test_duplicate_url_is_409_and_cli_fails(controller):
    """A second add of the same URL (or id) is 409 in the API's error shape; skylb-ctl prints it and exits 1."""
    body = {"region": "us", "url": "http://10.0.0.1:8000"}
    assert requests.post(f"{controller.url}/v1/replicas", json=body, timeout=5).status_code == 201
    resp = requests.post(f"{controller.url}/v1/replicas", json=body | {"region": "eu"}, timeout=5)
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["code"] == 409 and error["type"] == "conflict" and "already registered" in error["message"]
    resp = requests.post(f"{controller.url}/v1/replicas", json={"region": "us", "url": "http://b:1", "id": "us-1"},
                         timeout=5)
    assert resp.status_code == 409

    r = ctl(controller.url, "replica", "add", "--region", "us", "--url", "http://10.0.0.1:8000")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "skylb-ctl: error: url: http://10.0.0.1:8000 is already registered as replica us-1"]
    assert revision(controller.url) == 1


BAD_REPLICA_BODIES = [  # (request body: a dict is sent as JSON, a str as raw bytes; the field the error names)
    ({"region": "us", "url": "localhost:8000"}, "url"),
    ({"region": "us", "url": "http://a:1", "engine": "nim"}, "engine"),
    ({"url": "http://a:1"}, "region"),
    ({"region": "us", "url": 8000}, "url"),
    ({"region": "us", "url": "http://a:1", "id": 7}, "id"),
    ({"region": "us", "url": "http://a:1", "max_concurrency": True}, "max_concurrency"),
    ({"region": "us", "url": "http://a:1", "replicas": 3}, "replicas"),
    ("{not json", "body"),
    ("[1, 2]", "body"),
    ("", "body"),
    ("[" * 100_000 + "]" * 100_000, "body"),  # deeper than Python's decoder recurses
    ('{"region": ' + "9" * 5000 + "}", "body"),  # an integer longer than Python converts
]


def test_bad_replica_input_is_400(controller):
    """Bad fields, unknown fields and invalid JSON (nested too deeply, an integer too long, a body that does not
    decompress among them) are 400 with a message naming the field; nothing changes."""
    for data, field in BAD_REPLICA_BODIES:
        kwargs = {"json": data} if isinstance(data, dict) else {"data": data}
        resp = requests.post(f"{controller.url}/v1/replicas", timeout=5, **kwargs)
        assert resp.status_code == 400, data
        error = resp.json()["error"]
        assert error["code"] == 400 and error["message"].startswith(f"{field}: "), (data, error)
    resp = requests.post(f"{controller.url}/v1/replicas", data=b"not gzip", timeout=5,
                         headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("body: could not be read")
    assert revision(controller.url) == 0


def test_unknown_id_and_bad_queries(controller):
    """Removing an unknown id is 404 (CLI exit 1); a bad long-poll query is 400; an unknown path is a JSON 404."""
    resp = requests.delete(f"{controller.url}/v1/replicas/nope", timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found"
    r = ctl(controller.url, "replica", "remove", "nope")
    assert r.returncode == 1 and "no replica 'nope'" in r.stderr
    for query in ("revision=x&wait=1", "revision=1&wait=-1", "revision=-2"):
        resp = requests.get(f"{controller.url}/v1/membership?{query}", timeout=5)
        assert resp.status_code == 400, query
    resp = requests.get(f"{controller.url}/v2/nothing", timeout=5)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == 404


def test_membership_persists_across_restart(procs, tmp_path):
    """After SIGTERM and a restart on the same SQLite file (with --port overriding the config), membership and
    revision are unchanged and the next write continues from them."""
    c = Controller(procs, tmp_path).start()
    requests.post(f"{c.url}/v1/replicas", json={"region": "us", "url": "http://a:1"}, timeout=5)
    requests.post(f"{c.url}/v1/balancers", json={"region": "us", "url": "http://lb:9000"}, timeout=5)
    before = requests.get(f"{c.url}/v1/membership", timeout=5).json()
    assert c.stop() == 0
    assert c.db.exists()

    c.port = free_port()  # the config file still names the old port: the flag must win
    c.start("--port", str(c.port))
    assert requests.get(f"{c.url}/v1/membership", timeout=5).json() == before
    assert before["owners"] == [{"replica": "us-1", "balancer": "http://lb:9000", "epoch": 1, "handover_to": None}]
    resp = requests.post(f"{c.url}/v1/replicas", json={"region": "us", "url": "http://a:2"}, timeout=5)
    # Two writes: the replica, then its owner (the region's only balancer, registered and heard from just now).
    assert resp.json()["id"] == "us-2" and revision(c.url) == before["revision"] + 2


async def test_long_poll_wakes_on_change_and_times_out(controller):
    """A watch from revision N answers within ~1 s of a change with revision > N, and otherwise answers after its
    wait with the same revision."""
    async with aiohttp.ClientSession() as session:
        client = ControllerClient(controller.url, session=session)
        first = await client.get_membership()
        start = time.monotonic()
        quiet = await client.get_membership(first["revision"], wait_s=0.5)
        assert quiet["revision"] == first["revision"]
        assert 0.45 <= time.monotonic() - start < 2.0

        watch = asyncio.create_task(client.get_membership(first["revision"], wait_s=20))
        await asyncio.sleep(0.3)
        assert not watch.done()
        changed_at = time.monotonic()
        async with session.post(f"{controller.url}/v1/replicas", json={"region": "asia", "url": "http://c:1"}) as r:
            assert r.status == 201
        woke = await asyncio.wait_for(watch, timeout=5)
        assert time.monotonic() - changed_at < 1.0
        assert woke["revision"] == first["revision"] + 1 and woke["replicas"][0]["region"] == "asia"

        # A client ahead of the controller (its store was replaced) gets the snapshot at once, to re-list.
        start = time.monotonic()
        ahead = await client.get_membership(woke["revision"] + 100, wait_s=20)
        assert ahead["revision"] == woke["revision"] and time.monotonic() - start < 1.0


async def test_balancer_registration(controller):
    """register_balancer registers then heartbeats (last_seen moves, revision does not); skylb-ctl lists it."""
    async with aiohttp.ClientSession() as session:
        client = ControllerClient(controller.url, session=session)
        await client.register_balancer("eu", "http://127.0.0.1:9001")
        rev = (await client.get_membership())["revision"]
        first_seen = (await client.get_membership())["balancers"][0]["last_seen"]
        await asyncio.sleep(0.05)
        await client.register_balancer("eu", "http://127.0.0.1:9001")
        m = await client.get_membership()
        assert m["revision"] == rev == 1 and m["regions"] == ["eu"]
        assert m["balancers"][0]["last_seen"] > first_seen
        with pytest.raises(ControllerError) as info:
            await client.register_balancer("eu", "not-a-url")
        assert info.value.status == 400 and info.value.args[0].startswith("url: ")

    r = ctl(controller.url, "balancer", "list", "--json")
    assert r.returncode == 0 and [b["url"] for b in json.loads(r.stdout)] == ["http://127.0.0.1:9001"]
    assert "http://127.0.0.1:9001" in ctl(controller.url, "balancer", "list").stdout


def test_sigterm_stops_promptly_during_a_watch(controller):
    """SIGTERM ends the controller with status 0 within a few seconds even while a 60 s long poll is waiting."""
    watcher = subprocess.Popen([sys.executable, "-c", (
        "import sys, urllib.request; "
        f"urllib.request.urlopen('{controller.url}/v1/membership?revision=0&wait=60', timeout=30).read()")])
    try:
        # A Python start takes seconds on a loaded machine: wait until the long poll is in, not a fixed time.
        wait_for(lambda: requests.get(f"{controller.url}/healthz", timeout=5).json()["watchers"] == 1,
                 "the watcher's long poll waiting", timeout_s=20)
        start = time.monotonic()
        os.kill(controller.proc.popen.pid, signal.SIGTERM)
        assert controller.proc.popen.wait(timeout=10) == 0
        assert time.monotonic() - start < 5.0
        assert watcher.wait(timeout=10) == 0  # it got an answer, not a reset connection
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert "controller_stopped" in controller.proc.log()


# --- failures without a controller ------------------------------------------------------------------------------

async def test_client_unavailable_when_nothing_listens():
    """ControllerClient raises ControllerUnavailable (not an aiohttp error) when no controller listens."""
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        client = ControllerClient(url, session=session, timeout_s=2)
        with pytest.raises(ControllerUnavailable):
            await client.get_membership()
        with pytest.raises(ControllerUnavailable):
            await client.register_balancer("us", "http://127.0.0.1:9000")


async def test_client_unavailable_on_5xx_and_non_json():
    """A 5xx answer or a 200 that is not a membership snapshot raises ControllerUnavailable."""
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>")

    app = web.Application()
    app.router.add_get("/v1/membership", fail)
    app.router.add_post("/v1/balancers", garbage)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            client = ControllerClient(f"http://127.0.0.1:{port}", session=session, timeout_s=2)
            with pytest.raises(ControllerUnavailable, match="503"):
                await client.get_membership()
            with pytest.raises(ControllerUnavailable, match="not JSON"):
                await client.register_balancer("us", "http://127.0.0.1:9000")
    finally:
        await runner.cleanup()


def test_cli_unreachable_and_usage_errors():
    """skylb-ctl exits 1 with one "cannot reach" line when no controller listens, and 2 for usage errors."""
    url = f"http://127.0.0.1:{free_port()}"
    r = ctl(url, "replica", "list")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"skylb-ctl: error: cannot reach the controller at {url}: "
                                             "connection refused"]
    assert ctl(url, "replica", "add", "--region", "us").returncode == 2  # --url missing
    assert ctl(url, "replica", "remove").returncode == 2  # neither id nor --url
    r = ctl("not-a-url", "membership")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "controller.ctl", "membership"], cwd=ROOT, capture_output=True,
                       text=True, timeout=20, env={**os.environ, "SKYLB_CONTROLLER": url})
    assert r.returncode == 1 and url in r.stderr  # the URL came from the environment


# --- max_concurrency (engines without a pending metric) -----------------------------------------------------------

def test_max_concurrency_over_rest_and_cli(controller):
    """POST /v1/replicas and `skylb-ctl replica add --max-concurrency N` set it; membership shows it or null."""
    url = controller.url
    r = ctl(url, "replica", "add", "--region", "us", "--url", "http://10.0.0.9:11434", "--engine", "ollama",
            "--max-concurrency", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["max_concurrency"] == 4
    resp = requests.post(f"{url}/v1/replicas", json={"region": "us", "url": "http://10.0.0.8:8000",
                                                     "engine": "auto"}, timeout=5)
    assert resp.status_code == 201 and resp.json()["max_concurrency"] is None
    membership = requests.get(f"{url}/v1/membership", timeout=5).json()
    assert {r["url"]: r["max_concurrency"] for r in membership["replicas"]} == {
        "http://10.0.0.9:11434": 4, "http://10.0.0.8:8000": None}
    assert "MAX CONCURRENCY" in ctl(url, "replica", "list").stdout
    resp = requests.post(f"{url}/v1/replicas", json={"region": "us", "url": "http://c:1", "max_concurrency": 0},
                         timeout=5)
    assert resp.status_code == 400 and "max_concurrency" in resp.json()["error"]["message"]
    r = ctl(url, "replica", "add", "--region", "us", "--url", "http://d:1", "--max-concurrency", "-1")
    assert r.returncode == 1 and "max_concurrency" in r.stderr


def test_kv_event_endpoints_over_cli_and_their_validation(controller):
    """`skylb-ctl replica add --kv-events E --kv-events-replay R` stores both in membership (what balancers follow);
    a malformed endpoint or a replay without events is refused (exit 1, the field named), nothing added."""
    url = controller.url
    r = ctl(url, "replica", "add", "--region", "us", "--url", "http://10.0.0.6:8000", "--kv-events",
            "tcp://10.0.0.6:5557", "--kv-events-replay", "tcp://10.0.0.6:5558", "--json")
    assert r.returncode == 0, r.stderr
    entry = requests.get(f"{url}/v1/membership", timeout=5).json()["replicas"][0]
    assert (entry["kv_events"], entry["kv_events_replay"]) == ("tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558")
    for flags, field in ((["--kv-events", "10.0.0.7:5557"], "kv_events"),
                         (["--kv-events-replay", "tcp://10.0.0.7:5558"], "kv_events")):
        r = ctl(url, "replica", "add", "--region", "us", "--url", "http://10.0.0.7:8000", *flags)
        assert r.returncode == 1 and f"{field}:" in r.stderr, r.stderr
    assert revision(url) == 1


def test_cli_engine_choices_cover_every_adapter():
    """skylb-ctl's --engine accepts every registered engine adapter (auto included) and refuses others."""
    from controller.store import ENGINES
    from skylb.engines import ADAPTERS

    assert set(ENGINES) == set(ADAPTERS)
    url = f"http://127.0.0.1:{free_port()}"
    r = ctl(url, "replica", "add", "--region", "us", "--url", "http://a:1", "--engine", "triton")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.timeout(90)  # nine skylb-ctl processes, each a Python start-up: slow on a loaded 2-core machine
def test_every_command_prints_json_with_output_json(controller):
    """`-o json` (and `--json`) works on every skylb-ctl command: stdout parses as JSON and the exit status is 0;
    every leaf command of the parser is covered, so a new one without JSON output fails here."""
    from controller.ctl import build_parser

    url = controller.url
    requests.post(f"{url}/v1/balancers", json={"region": "us", "url": "http://127.0.0.1:9"}, timeout=5)
    commands = [
        ("replica", "add", "--region", "us", "--url", "http://10.0.0.1:8000", "--id", "us-1"),
        ("replica", "list"),
        ("replica", "drain", "us-1", "--no-wait"),
        ("replica", "drain", "us-1"),  # its only balancer is unreachable: nothing can be in flight there
        ("replica", "undrain", "us-1"),
        ("replica", "remove", "us-1"),
        ("balancer", "list"),
        ("balancer", "drain", "us", "--no-wait"),
        ("balancer", "drain", "us"),
        ("balancer", "undrain", "us"),
        ("membership",),
        ("status",),
        ("balancer", "remove", "http://127.0.0.1:9"),
        ("quota", "set", "--tenant", "acme", "--tokens-per-minute", "100"),
        ("quota", "list"),
        ("quota", "delete", "--tenant", "acme"),
    ]
    for i, command in enumerate(commands):
        flag = ("-o", "json") if i % 2 == 0 else ("--json",)
        # The first as the real command, the rest by its main in this process (a Python start each cost 0.5 s).
        out = ctl(url, *command, *flag) if i == 0 else ctl_in_process(url, *command, *flag)
        assert out.returncode == 0, (command, out.stderr)
        json.loads(out.stdout)

    def leaves(parser, path=()):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return {path}
        return set().union(*(leaves(p, path + (name,)) for a in subs for name, p in a.choices.items()))

    assert leaves(build_parser()) == {c[:2] if c[0] in ("replica", "balancer", "quota") else c[:1] for c in commands}
    bad = ctl_in_process(url, "replica", "drain", "nobody", "-o", "json")
    assert bad.returncode == 1 and "no replica 'nobody'" in bad.stderr and bad.stdout == ""
