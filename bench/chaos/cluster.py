"""The deployment a chaos run breaks: three regions as production runs them, every cuttable path through a link.

:class:`ChaosCluster` starts, as real processes on loopback:

- a three-member etcd cluster and three controllers on it (``controller.store: etcd``, leader election, health
  checks, failover, DNS updates), each controller reaching each etcd member through its own link;
- redis-server for the balancers' quotas (a concurrency cap on the model), each balancer reaching it through its
  own link;
- BIND 9 with a view per region (bench/dns/bind.py), updated by the controllers (RFC 2136);
- one emulated vLLM replica per process (``--fault-control``, so a replica can be slowed down or made to answer
  500s), ``replicas`` per region;
- one balancer per region (or ``siblings`` per region, each with its ``--balancer-id``: ``us-a``, ``us-b``, ...;
  the controllers give each replica to one of them), reaching each other balancer through a link per direction (with
  the configured round trip between regions; none between siblings) and each controller through a link of its own.

A balancer's name here is its region with one balancer per region, and its id with siblings; :attr:`balancers` maps
each name to its region. The controllers reach a balancer through one more link, ``ctl-to-<name>``, listening on the
balancer's *advertised* address 127.0.k.(21+i) (region i, sibling k, 0-based) on the balancers' shared port, which
is what the balancer registers and what the controllers health-check. The controllers write that address into DNS
(every live sibling's), so a client of region i resolves 127.0.k.(21+i); the chaos clients (bench/chaos/client.py)
dial the balancer itself at 127.0.k.(11+i) for that answer (:meth:`ChaosCluster.client_address_for`): the
controllers' path and the clients' path to one balancer are two paths, as in production, and cutting the first
leaves the second.

What cannot be cut here: a controller's health checks of the replicas (a replica's one URL is used by the
controllers and its balancer alike, so a link in front of it would cut both) and etcd's member-to-member traffic.

Every process goes into one :class:`bench.launch.procs.ProcGroup`; :meth:`stop` stops them all, also after a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from bench.dns.bind import BindServer, balancer_address, client_address
from bench.latency.links import LatencyLinks
from bench.launch.procs import Proc, ProcGroup, free_ports, wait_http

__all__ = ["ClusterSettings", "ChaosCluster", "MODEL", "REGIONS", "advertised_address", "balancer_name"]

REGIONS = ("us", "eu", "asia")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
RTT_MS = {"us-eu": 80.0, "us-asia": 150.0, "eu-asia": 200.0}


def advertised_address(index: int, sibling: int = 0) -> str:
    """The address the ``index``-th region's balancer (its ``sibling``-th, 0-based) registers (the controllers' link
    to it): 127.0.(sibling).(21+i)."""
    return f"127.0.{sibling}.{21 + index}"


def balancer_name(region: str, sibling: int, siblings: int) -> str:
    """A balancer's name in the cluster: its region alone, or ``<region>-a``, ``-b``, ... with siblings."""
    return region if siblings == 1 else f"{region}-{'abcdefghij'[sibling]}"


@dataclass
class ClusterSettings:
    """Sizes and timings of a chaos deployment (units in the names)."""

    replicas_per_region: int = 4
    time_scale: float = 0.1
    max_num_seqs: int = 4
    #: The model's concurrency cap in the quota (requests in flight over all balancers).
    quota_max_concurrent: int = 8
    #: Balancers per region (siblings, 1-10); each replica is owned by one of them at a time.
    siblings: int = 1
    rtt_ms: dict[str, float] = field(default_factory=lambda: dict(RTT_MS))
    dns_ttl_s: int = 1
    balancer: dict[str, Any] = field(default_factory=lambda: {
        "probe_interval_ms": 100, "heartbeat_s": 2.0, "idle_timeout_s": 10.0, "first_byte_timeout_s": 15.0,
        "connect_timeout_s": 2.0})

    def rtt(self, a: str, b: str) -> float:
        """The round trip between two regions (ms)."""
        return self.rtt_ms.get(f"{a}-{b}", self.rtt_ms.get(f"{b}-{a}", 100.0))


def _binary(name: str) -> str:
    path = shutil.which(name) or next((p for d in ("/usr/sbin", "/usr/bin")
                                       if os.access(p := os.path.join(d, name), os.X_OK)), None)
    if path is None:
        raise RuntimeError(f"{name} not installed (deploy/system/install-packages.sh installs it)")
    return path


class ChaosCluster:
    """The processes of one chaos deployment under ``work`` (see the module docstring); ``start`` then ``stop``."""

    def __init__(self, work: Path, settings: ClusterSettings | None = None, *, regions: tuple[str, ...] = REGIONS):
        self.work = Path(work)
        self.s = settings or ClusterSettings()
        self.regions = regions
        self.procs = ProcGroup(self.work / "logs")
        self.admin_token = secrets.token_urlsafe(24)
        self.peer_token = secrets.token_urlsafe(24)
        #: name -> the running Proc of each restartable part ("replica:us-1", "balancer:us", "controller:0",
        #: "etcd:0", "redis"), and how often each was started.
        self.running: dict[str, Proc] = {}
        self.starts: dict[str, int] = {}
        self.links: LatencyLinks | None = None
        self.ctl_links: dict[str, LatencyLinks] = {}
        self.replica_urls: dict[str, str] = {}  # replica id -> URL
        #: balancer name -> its region (see the module docstring), in region order, siblings together.
        self.balancers = {balancer_name(r, k, self.s.siblings): r for r in regions for k in range(self.s.siblings)}
        self.balancer_urls: dict[str, str] = {}  # balancer name -> its own URL (clients, the bench)
        self.controller_urls: list[str] = []
        self.etcd_client_urls: list[str] = []
        self.bind: BindServer | None = None
        self._argv: dict[str, tuple[list[str], str | None, dict[str, str]]] = {}

    # ------------------------------------------------------------------------------------------------ start

    def start(self) -> None:
        """Start everything and wait until every balancer serves its replicas and sees its peers; RuntimeError
        naming the part that failed."""
        n = len(self.balancers)
        replicas = [f"{r}-{k + 1}" for r in self.regions for k in range(self.s.replicas_per_region)]
        ports = iter(free_ports(32 + len(replicas) + n * (n + 4)))
        hosts, advertised = {}, {}
        for i, r in enumerate(self.regions):
            for k in range(self.s.siblings):
                name = balancer_name(r, k, self.s.siblings)
                hosts[name], advertised[name] = balancer_address(i, k), advertised_address(i, k)
        self._dial = {advertised[b]: hosts[b] for b in self.balancers}
        self._proxy(next(ports), advertised)
        self._etcd(ports)
        self._redis(next(ports), ports)
        self.balancer_port = _free_port_on([*hosts.values(), *advertised.values()])
        self.bind = BindServer(self.work / "dns", {r: [advertised[b] for b, br in self.balancers.items() if br == r]
                                                   for r in self.regions},
                               port=next(ports), ttl_s=self.s.dns_ttl_s)
        self.bind.start(procs=self.procs)
        self._controllers(ports)
        for rid in replicas:
            self.replica_urls[rid] = f"http://127.0.0.1:{next(ports)}"
            self._define(f"replica:{rid}", ["emulator", "--engine", "vllm", "--model", MODEL, "--port",
                                            self.replica_urls[rid].rsplit(":", 1)[1], "--time-scale",
                                            repr(self.s.time_scale), "--max-num-seqs", str(self.s.max_num_seqs),
                                            "--fault-control"], f"{self.replica_urls[rid]}/health")
            self.launch(f"replica:{rid}", wait=False)
        for rid in replicas:
            wait_http(f"{self.replica_urls[rid]}/health", timeout_s=30)
        self._balancers(hosts, advertised, ports)
        for rid in replicas:
            self.admin("POST", "/v1/replicas", {"region": rid.rsplit("-", 1)[0], "url": self.replica_urls[rid],
                                                "id": rid, "engine": "vllm"})
        self.wait_ready()

    def _define(self, name: str, args: list[str], wait_url: str | None, env: dict[str, str] | None = None,
                *, skylb: bool = True) -> None:
        self._argv[name] = (["python", "-m", "skylb", *args] if skylb else args, wait_url, env or {})

    def launch(self, name: str, *, wait: bool = True, timeout_s: float = 30.0) -> Proc:
        """Start (or restart) the part ``name`` with its original command line; waits until it answers."""
        import sys
        argv, wait_url, env = self._argv[name]
        skylb_args = None
        if argv[0] == "python":  # ["python", "-m", "skylb", ...]: forked when bench.launch.forkstart is enabled (tests)
            argv, skylb_args = [sys.executable, *argv[1:]], argv[3:]
        self.starts[name] = self.starts.get(name, 0) + 1
        proc = self.procs.start(argv, name=f"{name.replace(':', '-')}-{self.starts[name]}",
                                wait_url=wait_url if wait else None, timeout_s=timeout_s, env=env,
                                skylb_args=skylb_args)
        self.running[name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL the part ``name`` (a crash)."""
        proc = self.running.pop(name, None)
        if proc is not None:
            proc.kill()

    def _proxy(self, port: int, advertised: dict[str, str]) -> None:
        api = f"http://127.0.0.1:{port}"
        self.procs.skylb("toxiproxy", "--port", str(port), name="toxiproxy", wait_url=f"{api}/version")
        self.links = LatencyLinks(api)
        self.ctl_links = {b: LatencyLinks(api, listen_host=advertised[b]) for b in self.balancers}

    def _etcd(self, ports) -> None:
        etcd = _binary("etcd")
        members = [(f"http://127.0.0.1:{next(ports)}", f"http://127.0.0.1:{next(ports)}") for _ in range(3)]
        cluster = ",".join(f"m{j}={peer}" for j, (_, peer) in enumerate(members))
        self.etcd_client_urls = [client for client, _ in members]
        for j, (client, peer) in enumerate(members):
            self._define(f"etcd:{j}", [etcd, "--name", f"m{j}", "--data-dir", str(self.work / f"etcd-{j}"),
                                       "--listen-client-urls", client, "--advertise-client-urls", client,
                                       "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                       "--initial-cluster", cluster, "--initial-cluster-token", "skylb-chaos"],
                         f"{client}/health", skylb=False)
            self.launch(f"etcd:{j}", wait=False)  # a member waits for a quorum: start all, then wait
        for client in self.etcd_client_urls:
            wait_http(f"{client}/health", timeout_s=30)

    def _redis(self, port: int, ports) -> None:
        self.redis_port = port
        self._define("redis", [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(self.work)], None, skylb=False)
        self.launch("redis")
        _wait_redis(port)
        self.redis_urls = {}
        for b in self.balancers:
            listen = self.links.link(f"{b}-to-redis", f"127.0.0.1:{port}", rtt_ms=0, listen_port=next(ports),
                                     spare_ports=ports)
            self.redis_urls[b] = f"redis://{listen}/0"

    def _controllers(self, ports) -> None:
        env = {"SKYLB_ADMIN_TOKEN": self.admin_token, "SKYLB_ADMIN_TOKEN_FILE": "",
               "SKYLB_PEER_TOKEN": self.peer_token}
        for i in range(3):
            endpoints = []
            for j, client in enumerate(self.etcd_client_urls):
                listen = self.links.link(f"ctl{i}-to-etcd{j}", client.removeprefix("http://"), rtt_ms=0,
                                         listen_port=next(ports), spare_ports=ports)
                endpoints.append(f"http://{listen}")
            rtt = {f"{a}-{b}": self.s.rtt(a, b) for a in self.regions for b in self.regions if a < b}
            config = {"controller": {"store": "etcd", "etcd": {"endpoints": endpoints, "prefix": "/chaos"},
                                     "failover": {"rtt_ms": rtt},
                                     "dns": self.bind.dns_config().model_dump(mode="json")},
                      "regions": {r: {"replicas": 0} for r in self.regions}}
            path = self.work / f"controller-{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            port = next(ports)
            self.controller_urls.append(f"http://127.0.0.1:{port}")
            self._define(f"controller:{i}", ["controller", "--config", str(path), "--port", str(port)],
                         f"{self.controller_urls[i]}/healthz", env)
            self.launch(f"controller:{i}")

    def _balancers(self, hosts: dict[str, str], advertised: dict[str, str], ports) -> None:
        port = self.balancer_port
        config = {"balancer": {**self.s.balancer, "state_dir": str(self.work / "state"),
                               "quota": {"redis_retry_s": 2.0, "key_prefix": "chaos:"},
                               "quotas": {"models": {MODEL: {"max_concurrent": self.s.quota_max_concurrent}}}},
                  "regions": {r: {"replicas": 0} for r in self.regions}}
        path = self.work / "balancers.yaml"
        path.write_text(yaml.safe_dump(config))
        for a in self.balancers:
            self.ctl_links[a].link(f"ctl-to-{a}", f"{hosts[a]}:{port}", rtt_ms=0, listen_port=port)
        for a, region in self.balancers.items():
            args = ["balancer", "--config", str(path), "--region", region, "--host", hosts[a], "--port", str(port),
                    "--advertise-url", f"http://{advertised[a]}:{port}"]
            if self.s.siblings > 1:
                args += ["--balancer-id", a]
            for b, other in self.balancers.items():
                if b != a:  # siblings reach each other at no added round trip
                    listen = self.links.link(f"{a}-to-{b}", f"{hosts[b]}:{port}", listen_port=next(ports),
                                             spare_ports=ports,
                                             rtt_ms=self.s.rtt(region, other) if other != region else 0)
                    args += ["--peer-url", f"{other}=http://{listen}" if self.s.siblings == 1
                             else f"{other}@{b}=http://{listen}"]
            controllers = [self.links.link(f"{a}-to-ctl{i}", url.removeprefix("http://"), rtt_ms=0,
                                           listen_port=next(ports), spare_ports=ports)
                           for i, url in enumerate(self.controller_urls)]
            controllers = [f"http://{listen}" for listen in controllers]
            args += ["--controller", ",".join(controllers)]
            self.balancer_urls[a] = f"http://{hosts[a]}:{port}"
            self._define(f"balancer:{a}", args, f"{self.balancer_urls[a]}/healthz",
                         {"SKYLB_PEER_TOKEN": self.peer_token, "SKYLB_REDIS_URL": self.redis_urls[a]})
            self.launch(f"balancer:{a}")

    # ------------------------------------------------------------------------------------------------ views

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        """One admin call to the first controller that answers; RuntimeError when none does."""
        last: Exception | None = None
        for url in self.controller_urls:
            try:
                resp = requests.request(method, url + path, json=body, timeout=5,
                                        headers={"Authorization": f"Bearer {self.admin_token}"})
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
                last = RuntimeError(f"{url}{path}: HTTP {resp.status_code}")
            except (requests.RequestException, ValueError) as exc:
                last = exc
        raise RuntimeError(f"no controller answered {method} {path}: {last}")

    def siblings_of(self, region: str) -> list[str]:
        """The names of ``region``'s balancers."""
        return [b for b, r in self.balancers.items() if r == region]

    def name_of(self, entry: dict) -> str:
        """The balancer name of an entry of the controllers' ``GET /v1/balancers`` (``region``, ``id``)."""
        return entry["region"] if self.s.siblings == 1 else entry["id"]

    def status(self, balancer: str, timeout_s: float = 2.0) -> dict:
        """A balancer's detailed status (JSON); raises requests' exceptions when it does not answer."""
        resp = requests.get(f"{self.balancer_urls[balancer]}/skylb/v1/status?format=json", timeout=timeout_s,
                            headers={"X-SkyLB-Token": self.peer_token})
        resp.raise_for_status()
        return resp.json()

    def leader(self) -> int | None:
        """The index of the controller that says it leads, or None."""
        for i, url in enumerate(self.controller_urls):
            if f"controller:{i}" not in self.running:
                continue
            try:
                if requests.get(f"{url}/healthz", timeout=1).json().get("leader"):
                    return i
            except (requests.RequestException, ValueError):
                continue
        return None

    def client_address_for(self, answer: str) -> str:
        """The address a client dials for a DNS answer: a balancer's advertised address maps to the balancer."""
        return self._dial.get(answer, answer)

    def client_source(self, region: str) -> str:
        """The source address a region's clients resolve and connect from (their BIND view)."""
        return client_address(self.regions.index(region))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until each region's replicas are healthy at its balancers (each at one of its siblings) and every
        balancer sees every other one healthy; RuntimeError after."""
        deadline = time.monotonic() + timeout_s
        waiting: list[str] = []
        while time.monotonic() < deadline:
            waiting = []
            for r in self.regions:
                own: set[str] = set()
                for b in self.siblings_of(r):
                    try:
                        st = self.status(b)
                    except requests.RequestException:
                        waiting.append(b)
                        continue
                    own |= {x["id"] for x in st["replicas"] if x["id"].startswith(f"{r}-") and x["healthy"]}
                    if sum(1 for p in st["peers"] if p["healthy"]) < len(self.balancers) - 1:
                        waiting.append(b)
                if len(own) < self.s.replicas_per_region:
                    waiting.append(r)
            if not waiting and self.leader() is not None:
                return
            time.sleep(0.3)
        raise RuntimeError(f"chaos deployment not ready after {timeout_s:g} s: {waiting or 'no leader'}")

    def logs(self, prefix: str) -> list[Path]:
        """The log files of every process whose name starts with ``prefix`` (all its generations)."""
        return sorted(self.procs.log_dir.glob(f"{prefix}*.log"))

    def stop(self) -> None:
        """Stop every process (newest first)."""
        self.procs.stop_all()


def _wait_redis(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port}")


def _free_port_on(hosts: list[str], attempts: int = 50) -> int:
    """A TCP port free a moment ago on every one of ``hosts``."""
    for _ in range(attempts):
        (port,) = free_ports(1)
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {', '.join(hosts)}")


def get_json(url: str, timeout_s: float = 2.0) -> Any:
    """GET ``url`` as JSON (urllib; raises OSError/ValueError)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())
