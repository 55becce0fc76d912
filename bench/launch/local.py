"""A whole multi-region SkyLB deployment on this machine, as real processes talking real HTTP.

:class:`Deployment` starts the controller; one emulator process per region serving that region's replicas (or, with
``emulator.engine: llamacpp``, one real llama.cpp ``llama-server`` per replica, see bench/launch/llamacpp.py); the latency
proxy (Toxiproxy API; a real Toxiproxy when TOXIPROXY_URL is set) with one link per ordered pair of regions carrying
the configured round trip; one balancer per region, reaching each peer through its link. It registers the replicas
through the controller's API, waits until every balancer sees them, and stops every process it started.

With ``dns=True`` (``skylb local --dns``) it runs the deployment as users do, behind DNS: the balancers listen on
distinct loopback addresses (region i on 127.0.0.(11+i)) on one port, and BIND 9 (bench/dns/bind.py, started
first) answers the service name with a view per region, so region i's clients, resolving from 127.0.(11+i).1, get
their own region's balancer; the controller's config carries the views' TSIG keys (``controller.dns``).

Secure by default (README, "Security"): each run generates a random admin token and peer token, passes them to the
controller and the balancers in their environment (never on a command line, never in a log), and keeps them in
``<run_dir>/admin-token`` and ``<run_dir>/peer-token`` (mode 0600) for `skylb-ctl --admin-token-file` and
`skylb-ctl --peer-token-file` (the run prints the command line, ``ctl_command``). A region whose config sets its own
``peer_token`` (the region-local benchmark) keeps it; then
the controller has no peer token and balancer heartbeats are open (it warns).

Used by `skylb local` (bench/launch/demo.py: the deployment, a workload replay and the report) and by the live benchmark
(bench/live/regions.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from skylb.balancer.auth import load_api_keys
from skylb.config import DeploymentConfig
from bench.dns.bind import BindServer, balancer_address, client_address
from bench.launch.llamacpp import (LlamaCppUnavailable, gemma_model_path, llama_server_binary, llama_server_command,
                            model_alias)
from bench.latency.links import LatencyLinks
from bench.launch.procs import ProcGroup, free_port_block, free_ports, wait_http
from bench.launch.settings import emulator_settings, failover_rtt_ms, latency_settings

__all__ = ["Deployment", "LLAMACPP_START_TIMEOUT_S", "ctl_program"]

#: How long one llama-server may take to load its model before /health answers 200 (s).
LLAMACPP_START_TIMEOUT_S = 120.0


def ctl_program() -> str:
    """How a shell runs this installation's `skylb-ctl` as pasted: ``skylb-ctl`` when PATH finds it (the venv is
    activated), else the absolute path of the script beside this Python (``.venv/bin/skylb-ctl``), else this Python
    with ``-m controller.ctl`` (a checkout without the console scripts installed)."""
    beside = Path(sys.executable).parent / "skylb-ctl"
    if not beside.is_file():
        return f"{shlex.quote(sys.executable)} -m controller.ctl"
    found = shutil.which("skylb-ctl")
    return "skylb-ctl" if found and Path(found).resolve() == beside.resolve() else shlex.quote(str(beside))


def _say(msg: str) -> None:
    print(f"[skylb local] {msg}", flush=True)


class Deployment:
    """The processes of one local deployment.

    Args:
        cfg: the deployment config; run_dir: where logs, the controller's DB and balancer state go.
        dns: run BIND 9 with a view per region and put each region's balancer on its own loopback address.
        kv_events: the emulated replicas publish their KV-cache events in vLLM's wire format (``--kv-events-config``,
            a PUB and a replay socket per replica) and are registered with those endpoints, so the balancers route
            by them (README "KV-cache events"); ``kv_endpoints`` then lists them per region. Emulated vLLM only.
    """

    #: Wait, before the replay, until every balancer has a status from every peer (False: region-local runs).
    expects_peers = True

    def __init__(self, cfg: DeploymentConfig, run_dir: Path, *, dns: bool = False, kv_events: bool = False):
        self.cfg = cfg
        #: The demo's own sections, checked before anything starts (ConfigError naming a bad key).
        self.emulator = emulator_settings(cfg)
        self.latency = latency_settings(cfg)
        self.run_dir = run_dir
        self.procs = ProcGroup(run_dir / "logs", pid_file=run_dir / "pids")
        self.links: LatencyLinks | None = None
        self.controller_url = ""
        self.balancer_urls: dict[str, str] = {}
        self.replica_urls: dict[str, list[str]] = {}
        self.dns = dns
        if kv_events and self.emulator.engine != "vllm":
            raise ValueError(f"kv_events needs emulated vLLM replicas, not {self.emulator.engine!r}")
        self.kv_events = kv_events
        #: With kv_events: region -> each replica's (event endpoint, replay endpoint), in ``replica_urls`` order.
        self.kv_endpoints: dict[str, list[tuple[str, str]]] = {}
        #: With dns: the running BIND server, the one URL every region's clients call (the service name and the
        #: balancers' port), and region -> the source address its clients resolve and connect from.
        self.bind: BindServer | None = None
        self.service_url = ""
        self.client_addresses: dict[str, str] = {}
        #: This run's admin token (the controller's API) and each region's peer token (see the module docstring).
        self.admin_token = secrets.token_urlsafe(32)
        shared = secrets.token_urlsafe(32)
        self.peer_tokens = {r: cfg.balancer_for(r).peer_token or shared for r in cfg.regions}
        self._controller_peer_token = shared if set(self.peer_tokens.values()) == {shared} else ""
        #: A client API key the demo's clients send, when the config turns keys on (else None).
        keys = load_api_keys(cfg.balancer.api_keys, cfg.balancer.api_keys_file)
        self.client_api_key = min(keys) if keys else None

    def _write_tokens(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name, token in (("admin-token", self.admin_token), ("peer-token", self._controller_peer_token)):
            path = self.run_dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")

    def start(self) -> None:
        """Start every process and register the replicas; raises RuntimeError naming the part that failed."""
        cfg, regions = self.cfg, list(self.cfg.regions)
        self._write_tokens()
        n_replicas = sum(r.replicas for r in cfg.regions.values())
        # One reservation for every port, the latency links' too: a link given port 0 once got a balancer's port
        # before that balancer had bound it.
        n_links = len(regions) * (len(regions) - 1)
        ports = iter(free_ports(3 + len(regions) + n_replicas + n_links))
        controller_port, proxy_port, dns_port = next(ports), next(ports), next(ports)
        if self.dns:
            hosts = {r: balancer_address(i) for i, r in enumerate(regions)}
            balancer_ports = dict.fromkeys(regions, _free_port_on(list(hosts.values())))
        else:
            hosts = dict.fromkeys(regions, "127.0.0.1")
            balancer_ports = {r: next(ports) for r in regions}
        self.replica_urls = {r: [f"http://127.0.0.1:{next(ports)}" for _ in range(cfg.regions[r].replicas)]
                             for r in regions}
        if self.dns:  # first: the controller's config carries the views' keys
            self._start_dns(hosts, dns_port, balancer_ports[regions[0]])
        config_path = self._write_config()

        self.controller_url = f"http://127.0.0.1:{controller_port}"
        _say(f"controller on {self.controller_url}")
        self.procs.skylb("controller", "--config", str(config_path), "--port", str(controller_port),
                         "--db", str(self.run_dir / "controller.sqlite"), name="controller",
                         wait_url=f"{self.controller_url}/healthz",
                         env={"SKYLB_ADMIN_TOKEN": self.admin_token, "SKYLB_ADMIN_TOKEN_FILE": "",
                              "SKYLB_PEER_TOKEN": self._controller_peer_token})
        _say(f"controller admin token in {self.run_dir / 'admin-token'} (skylb-ctl --admin-token-file)")

        if self.emulator.engine == "llamacpp":
            self._start_llama_servers()
        for region, urls in self.replica_urls.items():
            if not urls or self.emulator.engine == "llamacpp":
                continue
            port_args = [a for u in urls for a in ("--port", u.rsplit(":", 1)[1])]
            _say(f"{region}: {len(urls)} emulated {self.emulator.engine} replicas on ports "
                 f"{', '.join(u.rsplit(':', 1)[1] for u in urls)}")
            if self.kv_events:
                port_args += self._kv_events_args(region, len(urls))
            self.procs.skylb("emulator", "--engine", self.emulator.engine, "--model", self.emulator.model,
                             "--time-scale", str(self.emulator.time_scale), *port_args, *self.emulator.extra_args,
                             name=f"emulator-{region}", wait_url=f"{urls[0]}/health")
            for url in urls[1:]:
                wait_http(f"{url}/health", timeout_s=20)

        api_url = os.environ.get("TOXIPROXY_URL")
        if not api_url:
            api_url = f"http://127.0.0.1:{proxy_port}"
            self.procs.skylb("toxiproxy", "--port", str(proxy_port), name="toxiproxy",
                             wait_url=f"{api_url}/version")
        _say(f"latency proxy (Toxiproxy API) at {api_url}")
        self.links = LatencyLinks(api_url)
        peer_args: dict[str, list[str]] = {r: [] for r in regions}
        for a in regions:
            for b in regions:
                if a == b:
                    continue
                rtt = self.latency.rtt(a, b)
                listen = self.links.link(f"skylb-{a}-to-{b}", f"{hosts[b]}:{balancer_ports[b]}", rtt_ms=rtt,
                                         jitter_ms=self.latency.jitter_ms,
                                         listen_port=0 if os.environ.get("TOXIPROXY_URL") else next(ports))
                peer_args[a] += ["--peer-url", f"{b}=http://{listen}"]
                _say(f"link {a} -> {b}: round trip {rtt:g} ms via {listen}")

        for region in regions:
            url = f"http://{hosts[region]}:{balancer_ports[region]}"
            self.balancer_urls[region] = url
            self.procs.skylb("balancer", "--config", str(config_path), "--region", region,
                             "--host", hosts[region], "--port", str(balancer_ports[region]),
                             "--controller", self.controller_url,
                             *peer_args[region], name=f"balancer-{region}", wait_url=f"{url}/healthz",
                             env={"SKYLB_PEER_TOKEN": self.peer_tokens[region]})
            _say(f"{region}: balancer on {url}")

        for region, urls in self.replica_urls.items():
            for i, url in enumerate(urls):
                entry = {"region": region, "url": url, "engine": self.emulator.engine}
                if self.kv_events:
                    entry["kv_events"], entry["kv_events_replay"] = self.kv_endpoints[region][i]
                _post_json(f"{self.controller_url}/v1/replicas", entry,
                           headers={"Authorization": f"Bearer {self.admin_token}"})
        _say(f"registered {n_replicas} replicas through the controller")
        self._wait_ready()
        for line in self.page_lines():
            _say(line)
        _say(f"skylb-ctl for this deployment (paste it): {self.ctl_command()}")

    def _kv_events_args(self, region: str, n: int) -> list[str]:
        """The emulator's ``--kv-events-config`` for ``n`` replicas of ``region`` (it offsets each replica's ports
        from the configured ones), their endpoints kept in ``kv_endpoints``."""
        pub, replay = free_port_block(n), free_port_block(n)
        self.kv_endpoints[region] = [(f"tcp://127.0.0.1:{pub + i}", f"tcp://127.0.0.1:{replay + i}") for i in range(n)]
        # "*" binds the emulator's host, as vLLM binds a wildcard endpoint.
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
        return ["--kv-events-config", json.dumps(config)]

    def page_lines(self) -> list[str]:
        """Where each status page is and what its login form wants: the controller's (the admin token) and each
        balancer's (the peer token), as the content of this run's token files."""
        lines = [f"status page of the controller: {self.controller_url}/ in a browser; its token is the content of "
                 f"{self.run_dir / 'admin-token'}"]
        pages = ", ".join(f"{r}={u}/" for r, u in self.balancer_urls.items())
        where = (f"the content of {self.run_dir / 'peer-token'}" if self._controller_peer_token
                 else "each region's balancer.peer_token in the config")
        return [*lines, f"status pages of the balancers: {pages}; their token is {where}"]

    def ctl_command(self, command: str = "status") -> str:
        """A ready-to-paste `skylb-ctl` command line for this deployment: its controller, the admin token file and,
        when the balancers share one peer token, the peer token file (so that ``status`` can read the balancers)."""
        parts = [ctl_program(), "--controller", self.controller_url or "",
                 "--admin-token-file", shlex.quote(str(self.run_dir / "admin-token"))]
        if self._controller_peer_token:
            parts += ["--peer-token-file", shlex.quote(str(self.run_dir / "peer-token"))]
        return " ".join([*parts, command])

    def _start_dns(self, hosts: dict[str, str], dns_port: int, balancer_port: int) -> None:
        """Start named on 127.0.0.1:``dns_port`` with a view per region answering with ``hosts`` (region ->
        balancer address); raises RuntimeError with named's log when it does not answer."""
        self.bind = BindServer(self.run_dir / "dns", hosts, port=dns_port)
        try:
            self.bind.start(procs=self.procs)
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"named: {exc}") from exc
        self.client_addresses = {r: client_address(i) for i, r in enumerate(hosts)}
        self.service_url = f"http://{self.bind.name.rstrip('.')}:{balancer_port}"
        _say(f"DNS: named on 127.0.0.1:{dns_port}, {self.bind.name} in a view per region: "
             + ", ".join(f"{r} clients ({self.client_addresses[r]}) -> {h}" for r, h in hosts.items()))

    def _start_llama_servers(self) -> None:
        """Start one real llama-server per replica (all loading at once), wait until each answers /health with 200,
        and check that each reports the expected model id on /v1/models.

        Raises RuntimeError when llama-server or the model cannot be had, or a server does not come up.
        """
        emu = self.emulator
        try:
            binary = Path(emu.llamacpp_binary) if emu.llamacpp_binary else llama_server_binary(build=True)
            model = Path(emu.llamacpp_model) if emu.llamacpp_model else gemma_model_path()
        except (LlamaCppUnavailable, ValueError, OSError) as exc:
            raise RuntimeError(f"cannot start llama-server replicas: {exc}") from exc
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise RuntimeError(f"llama-server binary {binary} is not an executable file")
        if not model.is_file():
            raise RuntimeError(f"model file {model} does not exist")
        alias = model_alias(model)
        _say(f"llama-server {binary}, model {model} (id {alias})")
        started = []
        for region, urls in self.replica_urls.items():
            if urls:
                _say(f"{region}: {len(urls)} llama-server replicas ({emu.llamacpp_parallel} slots, "
                     f"{emu.llamacpp_threads} threads each) on ports {', '.join(u.rsplit(':', 1)[1] for u in urls)}")
            for i, url in enumerate(urls):
                argv = llama_server_command(int(url.rsplit(":", 1)[1]), model_path=model, binary=binary,
                                            parallel=emu.llamacpp_parallel, ctx_size=emu.llamacpp_ctx_size,
                                            threads=emu.llamacpp_threads, alias=alias, extra_args=emu.extra_args)
                started.append((self.procs.start(argv, name=f"llama-server-{region}-{i}"), url))
        for proc, url in started:
            try:  # /health answers 503 "Loading model" until the model is loaded
                wait_http(f"{url}/health", timeout_s=LLAMACPP_START_TIMEOUT_S, proc=proc.popen)
            except (TimeoutError, RuntimeError) as exc:
                raise RuntimeError(f"{proc.name}: {exc}\n--- log ---\n{proc.log()[-4000:]}") from exc
            served = [m.get("id") for m in _get_json(f"{url}/v1/models").get("data", [])]
            if alias not in served:
                raise RuntimeError(f"llama-server at {url} reports models {served}, expected {alias}")

    def _write_config(self) -> Path:
        data = self.cfg.model_dump()
        data["balancer"]["state_dir"] = str(self.run_dir / "state")
        # The controller fails regions over by the round trips this run injects (unless the file sets its own).
        data["controller"]["failover"]["rtt_ms"] = failover_rtt_ms(self.cfg)
        if self.bind is not None:
            data["controller"]["dns"] = self.bind.dns_config().model_dump()
        path = self.run_dir / "config.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def _wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until every balancer sees all its replicas and (``expects_peers``) every peer answered a status."""
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = []
            for region, url in self.balancer_urls.items():
                status = _get_json(f"{url}/skylb/v1/status?format=json",
                                   headers={"X-SkyLB-Token": self.peer_tokens[region]})
                healthy = sum(1 for r in status["replicas"] if r["healthy"])
                peers_needed = len(self.balancer_urls) - 1 if self.expects_peers else 0
                peers_seen = sum(1 for p in status["peers"] if p["healthy"])
                if healthy < len(self.replica_urls[region]) or peers_seen < peers_needed:
                    waiting.append(region)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"balancers not ready after {timeout_s:g} s: {', '.join(waiting)}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Remove the latency links and stop every process (newest first)."""
        if self.links is not None:
            try:
                self.links.close()
            except Exception as exc:  # the proxy may already be gone; stopping must go on
                _say(f"could not remove latency links: {exc}")
        self.procs.stop_all()


def _free_port_on(hosts: list[str], attempts: int = 20) -> int:
    """A TCP port that was free a moment ago on every one of ``hosts`` (the balancers share one port)."""
    for _ in range(attempts):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            try:
                for host in hosts[1:]:
                    with socket.socket() as s:
                        s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port free on all of {', '.join(hosts)} after {attempts} tries")


def _post_json(url: str, body: dict, *, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _get_json(url: str, *, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        return json.loads(resp.read())
