"""Build small SkyLB deployments from real processes for end-to-end tests.

Each helper starts one real process (`python -m skylb ...`) through the test's ProcGroup, so every process is
stopped when the test ends, also on failure.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from tests.procs import ProcGroup, free_port, free_ports, wait_http

__all__ = ["Cluster", "get_json", "post_json", "emulator_gauge"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def get_json(url: str, timeout: float = 5.0, *, headers: dict | None = None) -> dict:
    """GET ``url`` (with ``headers``) and decode its JSON body."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: dict, *, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, dict, dict]:
    """POST JSON; returns (status, body, headers) also for error statuses."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def emulator_gauge(url: str, name: str) -> float:
    """Sum of the samples of metric ``name`` on a replica's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Cluster:
    """A deployment under test: controller, emulated replicas, latency proxy, balancers.

    With ``peer_token`` and ``admin_token`` the controller and balancers get them in their environment (as the
    deployment files do) and the helpers send them; without, every process runs open (with its warning), except
    that a deployment of several regions gets a generated peer token (balancers with peers need one).
    """

    def __init__(self, procs: ProcGroup, tmp_path: Path, *, balancer: dict | None = None,
                 controller: dict | None = None, peer_token: str | None = None, admin_token: str | None = None):
        self.peer_token = peer_token
        self.admin_token = admin_token
        # "" unsets a token the test runner's own environment may hold (the processes inherit it).
        self.env = {"SKYLB_PEER_TOKEN": peer_token or "", "SKYLB_ADMIN_TOKEN": admin_token or ""}
        self.procs = procs
        self.tmp = tmp_path
        self.balancer_cfg = {"probe_interval_ms": 50, **(balancer or {})}
        self.controller_cfg = dict(controller or {})
        self.controller_url: str | None = None
        self.balancers: dict[str, str] = {}
        self.toxiproxy_url: str | None = None
        if hasattr(procs, "teardown_checks"):  # the procs fixture (tests/conftest.py)
            procs.teardown_checks.append(self.assert_counters_return_to_zero)

    def config(self, regions: list[str]) -> Path:
        """Write the deployment YAML the processes read; returns its path. Several regions without a peer token
        given: one is generated now (before the first process starts) and used by every process and helper."""
        if len(regions) > 1 and not self.peer_token:
            self.peer_token = secrets.token_urlsafe(24)
            self.env["SKYLB_PEER_TOKEN"] = self.peer_token
        data = {
            "controller": {"db": str(self.tmp / "controller.sqlite"), **self.controller_cfg},
            "balancer": {**self.balancer_cfg, "state_dir": str(self.tmp / "state")},
            "regions": {r: {"replicas": 0} for r in regions},
        }
        path = self.tmp / "deployment.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def start_controller(self, regions: list[str], *, port: int | None = None, wait: bool = True) -> str:
        """Start the controller; returns its URL. ``wait`` False returns at once (the caller waits for its
        /healthz, starting others meanwhile)."""
        port = port or free_port()
        self.controller_url = f"http://127.0.0.1:{port}"
        self.procs.skylb("controller", "--config", str(self.config(regions)), "--port", str(port),
                         name=f"controller-{port}", wait_url=f"{self.controller_url}/healthz" if wait else None,
                         env=self.env)
        return self.controller_url

    def start_emulator(self, n: int, *args: str, name: str = "emulator", wait: bool = True) -> list[str]:
        """Start one emulator process serving ``n`` replicas (vLLM serving MODEL unless ``args`` say otherwise).
        ``wait`` False returns at once (the caller waits for each URL's /health, starting others meanwhile)."""
        ports = free_ports(n)
        port_args = [a for p in ports for a in ("--port", str(p))]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        defaults = [*(() if "--engine" in args else ("--engine", "vllm")),
                    *(() if "--model" in args else ("--model", MODEL))]
        # A generic OpenAI server has no /health: it is up when it lists its models.
        ready = "/v1/models" if "openai" in args and args[list(args).index("openai") - 1] == "--engine" else "/health"
        self.procs.skylb("emulator", *defaults, *port_args, *args, name=name,
                         wait_url=f"{urls[0]}{ready}" if wait else None)
        for url in urls[1:] if wait else ():
            wait_http(f"{url}{ready}", timeout_s=10)
        return urls

    def start_toxiproxy(self) -> str:
        """Start the latency proxy (Toxiproxy API); returns its API URL."""
        port = free_port()
        self.toxiproxy_url = f"http://127.0.0.1:{port}"
        self.procs.skylb("toxiproxy", "--port", str(port), name="toxiproxy", wait_url=f"{self.toxiproxy_url}/version")
        return self.toxiproxy_url

    def start_balancer(self, region: str, regions: list[str], *, port: int | None = None,
                       peer_urls: dict[str, str] | None = None, policy: str | None = None,
                       name: str | None = None, host: str = "127.0.0.1", wait: bool = True,
                       balancer_id: str | None = None) -> str:
        """Start ``region``'s balancer against the controller, listening on ``host``; returns its URL. ``wait``
        False returns at once (the caller waits for its /healthz, starting others meanwhile). ``balancer_id``: one
        of several balancers of the region (`--balancer-id`), kept in ``balancers`` under that id."""
        port = port or free_port()
        url = f"http://{host}:{port}"
        args = ["balancer", "--config", str(self.config(regions)), "--region", region, "--port", str(port),
                "--host", host, "--controller", self.controller_url or "http://127.0.0.1:1"]
        for peer, peer_url in (peer_urls or {}).items():
            args += ["--peer-url", f"{peer}={peer_url}"]
        if policy:
            args += ["--policy", policy]
        if balancer_id:
            args += ["--balancer-id", balancer_id]
        self.procs.skylb(*args, name=name or f"balancer-{balancer_id or region}",
                         wait_url=f"{url}/healthz" if wait else None, env=self.env)
        self.balancers[balancer_id or region] = url
        return url

    def start_static_balancer(self, replicas: list[str], *, region: str = "local", engine: str = "auto",
                              name: str | None = None):
        """Start a balancer with no controller in front of ``replicas`` (static mode: `--replica URL` each, probed as
        ``engine``), with this cluster's balancer settings and tokens, and wait until it has read every replica's
        models; returns its Proc (its URL is ``balancers[region]``)."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = self.tmp / f"static-{region}.yaml"
        config.write_text(yaml.safe_dump({"balancer": {**self.balancer_cfg, "state_dir": str(self.tmp / "state")}}))
        args = ["balancer", "--config", str(config), "--region", region, "--port", str(port), "--engine", engine,
                *(a for r in replicas for a in ("--replica", r))]
        proc = self.procs.skylb(*args, name=name or f"balancer-{region}", wait_url=f"{url}/healthz", env=self.env)
        self.balancers[region] = url
        self.wait_until(lambda: sum(bool(r["models"]) for r in self.status(region)["replicas"]) == len(replicas),
                        timeout_s=20, what="every replica's models")
        return proc

    def ctl(self, *args: str, check: bool = True, in_process: bool = False) -> subprocess.CompletedProcess:
        """Run `skylb-ctl --controller URL ARGS` as a real subprocess, or with ``in_process`` by its ``main`` here
        (ctl_in_process)."""
        if in_process:
            result = ctl_in_process(self.controller_url, *args, env=self.env)
            if check:
                result.check_returncode()
            return result
        return subprocess.run([sys.executable, "-m", "controller.ctl", "--controller", self.controller_url, *args],
                              capture_output=True, text=True, timeout=30, check=check,
                              env={**os.environ, **self.env})

    def add_replica(self, region: str, url: str, *, replica_id: str | None = None, engine: str = "vllm") -> None:
        """Register a replica (``engine``: the adapter that probes it) with the REST call `skylb-ctl replica add`
        makes. Not through the CLI: a Python process per replica cost the suite minutes, and the CLI itself is
        tested in tests/test_controller.py."""
        body = {"region": region, "url": url, "engine": engine, **({"id": replica_id} if replica_id else {})}
        headers = {"Content-Type": "application/json"}
        if self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        request = urllib.request.Request(f"{self.controller_url}/v1/replicas", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status in (200, 201), resp.status

    def status(self, region: str) -> dict:
        """The balancer's operator status (JSON)."""
        headers = {"X-SkyLB-Token": self.peer_token} if self.peer_token else None
        return get_json(f"{self.balancers[region]}/skylb/v1/status?format=json", headers=headers)

    def first_replica(self, region: str) -> dict:
        """The first replica of ``region``'s balancer status, or {} while its membership view has none yet (a
        balancer gets its view just after it registers)."""
        replicas = self.status(region)["replicas"]
        return replicas[0] if replicas else {}

    def wait_until(self, predicate, *, timeout_s: float = 10.0, what: str = "condition"):
        """Poll ``predicate()`` every 50 ms until it returns a truthy value; raise AssertionError after timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.05)

    def assert_counters_return_to_zero(self, timeout_s: float = 10.0) -> None:
        """Every balancer of this cluster still running gets back to holding nothing within ``timeout_s``: queue
        length 0, in_flight 0 and every replica's and peer's outstanding count 0 (counters never leak; issue 10).
        A balancer that no longer answers is skipped. Raises AssertionError with the last status seen."""
        for region, url in self.balancers.items():
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    status = get_json(f"{url}/skylb/v1/status?format=json", timeout=2.0,
                                      headers={"X-SkyLB-Token": self.peer_token} if self.peer_token else None)
                except OSError:  # stopped (or never started): nothing to check
                    break
                held = {"queue_len": status["queue_len"], "in_flight": status["in_flight"],
                        **{f"replica {r['id']}": r["outstanding"] for r in status["replicas"]},
                        **{f"peer {p['region']}": p["outstanding"] for p in status["peers"]}}
                if not any(held.values()):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"balancer {region} still holds {held} {timeout_s} s after the test")
                time.sleep(0.1)

    def wait_replicas_healthy(self, region: str, n: int, timeout_s: float = 10.0) -> None:
        """Wait until ``region``'s balancer has probed ``n`` healthy replicas."""
        self.wait_until(lambda: sum(r["healthy"] for r in self.status(region)["replicas"]) >= n,
                        timeout_s=timeout_s, what=f"{n} healthy replicas in {region}")

    def wait_peers_probed(self, region: str, n: int, timeout_s: float = 10.0) -> None:
        """Wait until ``region``'s balancer has a fresh status from ``n`` peers."""
        self.wait_until(lambda: sum(p["healthy"] for p in self.status(region)["peers"]) >= n,
                        timeout_s=timeout_s, what=f"{n} peers probed by {region}")


def ctl_in_process(controller_url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`skylb-ctl --controller URL ARGS` run by its own ``main`` in this process, with ``env`` set meanwhile: the same
    parser and code as the command without a Python start per call (about 0.5 s each, which tests of many commands
    paid for every one); exit status, stdout and stderr as the command gives them (a usage error's exit 2
    included). Tests that it starts as a command keep a subprocess call (tests/test_controller.py)."""
    import contextlib
    import io
    from controller.ctl import main
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["--controller", controller_url, *args])
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["skylb-ctl", *args], code, out.getvalue(), err.getvalue())
