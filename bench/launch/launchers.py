"""Start the systems the live benchmarks measure, as real processes on this machine.

The emulated vLLM replicas (:func:`start_emulator`), SkyLB with its controller (:func:`start_skylb`), the SGLang
router from PyPI (:func:`start_sglang`) and HAProxy from Debian (:func:`start_haproxy`); :func:`start_system` starts
one :class:`System` and waits until it serves a completion. Every process goes into the caller's
:class:`bench.launch.procs.ProcGroup`, which stops it. A system whose binary or package is missing raises
:class:`Unavailable` (:func:`unavailable_reason` says why beforehand, so a benchmark can skip it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from bench.launch.procs import ProcGroup, free_ports, wait_http

__all__ = [
    "MODEL", "START_TIMEOUT_S", "System", "Unavailable", "haproxy_binary", "haproxy_version",
    "sglang_router_version", "unavailable_reason", "versions", "start_emulator", "start_skylb", "start_sglang",
    "start_haproxy", "start_system", "warm_up",
]

#: The model every emulated replica serves and every benchmark client asks for.
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: How long a launched balancer may take to answer its first request (s).
START_TIMEOUT_S = 30.0


class Unavailable(RuntimeError):
    """A system cannot run here (its binary or package is missing); the message says which."""


@dataclass(frozen=True)
class System:
    """One balancer configuration under test.

    Attributes:
        name: the row label ("skylb", "sglang-cache_aware", ...). kind: "skylb", "sglang" or "haproxy".
        policy: the system's own policy name (SkyLB --policy, SGLang --policy, HAProxy ``balance``).
        skylb_overrides: extra ``balancer`` settings for SkyLB (e.g. ``{"max_dispatch_per_probe": 0}``).
        options: keyword arguments for the system's launcher (:func:`start_sglang`: ``cache_threshold``,
            ``balance_abs_threshold``, ``balance_rel_threshold``; :func:`start_haproxy`: ``maxconn``,
            ``timeout_queue_s``, ``hash_header``, ``hash_balance_factor``).
    """

    name: str
    kind: str
    policy: str
    skylb_overrides: dict = field(default_factory=dict, hash=False, compare=False)
    options: dict = field(default_factory=dict, hash=False, compare=False)


# ------------------------------------------------------------------------------------------------ availability


def haproxy_binary() -> str | None:
    """Path of the ``haproxy`` binary (PATH, then /usr/sbin), or None."""
    found = shutil.which("haproxy")
    if found:
        return found
    return "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None


def haproxy_version() -> str | None:
    """The first line of ``haproxy -v`` ("HAProxy version 2.6.12-1+deb12u4 ..."), or None when absent."""
    binary = haproxy_binary()
    if binary is None:
        return None
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10).stdout
    return out.splitlines()[0].strip() if out else None


def sglang_router_version() -> str | None:
    """The installed ``sglang-router`` version, or None when it is not installed."""
    if importlib.util.find_spec("sglang_router") is None:
        return None
    try:
        return importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def unavailable_reason(kind: str) -> str | None:
    """None when systems of ``kind`` can run here, else why not (used to skip a row or a test)."""
    if kind == "haproxy" and haproxy_binary() is None:
        return "haproxy binary not found (apt-get install haproxy)"
    if kind == "sglang" and sglang_router_version() is None:
        return "sglang-router not installed (pip install 'skylb[bench]')"
    return None


def versions() -> dict[str, str | None]:
    """Versions of the systems compared (None: not installed) and of Python."""
    return {"sglang-router": sglang_router_version(), "haproxy": haproxy_version(),
            "python": sys.version.split()[0]}


# ----------------------------------------------------------------------------------------------------- launchers


def start_emulator(procs: ProcGroup, ports: Sequence[int], *, time_scale: float, max_num_seqs: int,
                   extra_args: Sequence[str] = (), name: str = "emulator", request_log: bool = False) -> list[str]:
    """Start one ``skylb emulator --engine vllm`` process serving a replica on each of ``ports``.

    ``time_scale`` multiplies every emulated duration (1.0 = Llama-3.1-8B on one L4); ``max_num_seqs`` is each
    replica's running-batch size (requests). ``request_log``: the emulator logs one ``request_finished`` line per
    request (replica, request id = the completion's ``id``), which tells which replica served a response that
    passed a balancer naming no replica. Returns the replicas' base URLs once all answer /health.
    """
    port_args = [a for p in ports for a in ("--port", str(p))]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", repr(time_scale),
                "--max-num-seqs", str(max_num_seqs), *([] if request_log else ["--no-request-log"]), *port_args,
                *extra_args, name=name, wait_url=f"{urls[0]}/health")
    for url in urls[1:]:
        wait_http(f"{url}/health", timeout_s=20)
    return urls


def start_skylb(procs: ProcGroup, replica_urls: Sequence[str], *, run_dir: Path, policy: str = "skylb",
                overrides: dict | None = None, engine: str = "vllm", region: str = "us", name: str = "skylb",
                profile_to: Path | None = None, checkout: Path | None = None, balancers: int = 1,
                max_concurrency: int | None = None) -> str | list[str]:
    """Start a SkyLB controller and one balancer for ``region`` in front of ``replica_urls``; returns its URL.
    With ``balancers`` > 1, that many siblings of the region (ids b1..bn, sharing a peer token made for the run;
    the controller gives each a share of the replicas), and the list of their URLs.

    The replicas are registered through the controller's REST API (as `skylb-ctl replica add` does) and the call
    returns once the balancer has probed all of them healthy. ``overrides``: extra ``balancer`` settings.
    ``engine``: the replicas' engine adapter ("vllm", "ollama", ...).
    ``profile_to``: run the balancer under cProfile, which writes this file when the balancer stops (SIGTERM).
    ``checkout``: run the balancer from another checkout of SkyLB (an earlier commit, for an A/B comparison); the
    controller is this one's. ``max_concurrency``: registered with every replica (`skylb-ctl replica add
    --max-concurrency`): the engine's batch stated, not learned.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    controller_port, *balancer_ports = free_ports(1 + balancers)
    # Siblings forward to each other: a peer token made for the run (a lone balancer needs none).
    env = {"SKYLB_PEER_TOKEN": secrets.token_hex(16)} if balancers > 1 else None
    headers = {"X-SkyLB-Token": env["SKYLB_PEER_TOKEN"]} if env else None
    config = {
        "controller": {"db": str(run_dir / f"{name}-controller.sqlite")},
        "balancer": {"state_dir": str(run_dir / f"{name}-state"), "policy": policy, **(overrides or {})},
        "regions": {region: {"replicas": 0}},
    }
    config_path = run_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    controller = f"http://127.0.0.1:{controller_port}"
    procs.skylb("controller", "--config", str(config_path), "--port", str(controller_port),
                name=f"{name}-controller", wait_url=f"{controller}/healthz", env=env)
    urls = []
    for i, port in enumerate(balancer_ports, 1):
        url = f"http://127.0.0.1:{port}"
        args = ["balancer", "--config", str(config_path), "--region", region, "--port", str(port),
                "--controller", controller, "--policy", policy,
                *(("--balancer-id", f"b{i}") if balancers > 1 else ())]
        command = ([sys.executable, "-c", _PROFILED_MAIN, str(profile_to), *args] if profile_to else
                   [sys.executable, "-c", _CHECKOUT_MAIN, str(checkout), *args] if checkout else
                   [sys.executable, "-m", "skylb", *args])
        procs.start(command, name=f"{name}-balancer" + (f"-{i}" if balancers > 1 else ""), wait_url=f"{url}/healthz",
                    env=env)
        urls.append(url)
    for replica in replica_urls:
        _post_json(f"{controller}/v1/replicas", {"region": region, "url": replica, "engine": engine,
                                                  **({"max_concurrency": max_concurrency} if max_concurrency else {})})
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        # Each sibling probes only the replicas it owns: together they must see every replica healthy.
        seen = [_get_json(f"{u}/skylb/v1/status?format=json", headers=headers)["replicas"] for u in urls]
        if sum(1 for replicas in seen for r in replicas if r["healthy"] and not r.get("draining")) >= len(replica_urls):
            return urls if balancers > 1 else urls[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"SkyLB balancer did not see {len(replica_urls)} healthy replicas in "
                               f"{START_TIMEOUT_S:g} s: {seen}")
        time.sleep(0.1)


#: ``python -c`` program running `python -m skylb ARGS` from the checkout in argv[1] (first on sys.path).
_CHECKOUT_MAIN = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["skylb", *sys.argv[2:]]
runpy.run_module("skylb", run_name="__main__", alter_sys=True)
"""

#: ``python -c`` program running `python -m skylb ARGS` under cProfile with the process's CPU time as the clock
#: (so time spent waiting, in epoll or descheduled, does not count); argv[1] is the output file. Profiling starts
#: on SIGUSR1 (so start-up is left out) and the file is written when the process exits (SIGTERM).
_PROFILED_MAIN = """
import cProfile, runpy, signal, sys, time
out = sys.argv[1]
sys.argv = ["skylb", *sys.argv[2:]]
prof = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
try:
    runpy.run_module("skylb", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def start_sglang(procs: ProcGroup, replica_urls: Sequence[str], *, policy: str = "cache_aware",
                 name: str = "sglang", cache_threshold: float | None = None,
                 balance_abs_threshold: int | None = None, balance_rel_threshold: float | None = None) -> str:
    """Start the SGLang router (``python -m sglang_router.launch_router``) in front of ``replica_urls``.

    Listens on 127.0.0.1 only; its Prometheus exporter (default 0.0.0.0:29000, which would clash between runs)
    goes to a free port on 127.0.0.1. ``cache_threshold`` (0-1), ``balance_abs_threshold`` (requests) and
    ``balance_rel_threshold`` (a ratio) set cache_aware's ``--cache-threshold``, ``--balance-abs-threshold`` and
    ``--balance-rel-threshold`` (None: the router's defaults 0.3, 64 and 1.5). Everything else is the router's
    default (worker health checks every 60 s, 5 retries, circuit breaker, per-request log lines at INFO).
    Returns its URL.
    """
    reason = unavailable_reason("sglang")
    if reason:
        raise Unavailable(reason)
    port, metrics_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    tuning = [a for flag, v in (("--cache-threshold", cache_threshold), ("--balance-abs-threshold",
                                balance_abs_threshold), ("--balance-rel-threshold", balance_rel_threshold))
              if v is not None for a in (flag, str(v))]
    procs.start([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *replica_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(metrics_port), *tuning],
                name=name, wait_url=f"{url}/health", timeout_s=START_TIMEOUT_S)
    return url


HAPROXY_CONFIG = """\
# Generated by bench/launch/launchers.py: HTTP mode, no health checks (the replicas are known up), timeouts long enough for
# streams of several minutes; no logging (HAProxy logs only when a log target is configured).
global
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
    timeout http-keep-alive 60s
    timeout http-request 30s
    # Without this HAProxy sends with MSG_MORE and the kernel holds small SSE chunks up to 200 ms (measured:
    # TTFT +190 ms); the HAProxy manual recommends it for interactive traffic such as streamed tokens.
    option http-no-delay

frontend bench
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance {balance}
{backend_options}{servers}
"""


def start_haproxy(procs: ProcGroup, replica_urls: Sequence[str], *, balance: str = "roundrobin",
                  run_dir: Path, name: str = "haproxy", maxconn: int | None = None,
                  timeout_queue_s: float | None = None, hash_header: str | None = None,
                  hash_balance_factor: int | None = None) -> str:
    """Start HAProxy (foreground, ``-db``) with ``balance`` over ``replica_urls``; returns its URL.

    ``maxconn``: per-server concurrent requests; beyond it HAProxy holds requests in its own queue (HAProxy
    Configuration Manual, "maxconn" server option), for at most ``timeout_queue_s`` (s; then a 503). ``hash_header``:
    ``balance hdr(NAME)`` with ``hash-type consistent`` (a session sticks to a server), and ``hash_balance_factor``
    (percent, >100) bounds each server's load to that share of the average (consistent hashing with bounded loads,
    the manual's ``hash-balance-factor``). ``balance`` is ignored when ``hash_header`` is set.
    """
    binary = haproxy_binary()
    if binary is None:
        raise Unavailable(unavailable_reason("haproxy"))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    limit = f" maxconn {maxconn}" if maxconn else ""
    servers = "\n".join(f"    server r{i} {u.removeprefix('http://')}{limit}" for i, u in enumerate(replica_urls))
    options = []
    if hash_header:
        balance = f"hdr({hash_header})"
        options.append("    hash-type consistent")
        if hash_balance_factor:
            options.append(f"    hash-balance-factor {int(hash_balance_factor)}")
    if timeout_queue_s is not None:
        options.append(f"    timeout queue {int(timeout_queue_s * 1000)}ms")
    backend_options = "".join(line + "\n" for line in options)
    config_path = run_dir / f"{name}.cfg"
    config_path.write_text(HAPROXY_CONFIG.format(port=port, balance=balance, servers=servers,
                                                 backend_options=backend_options))
    url = f"http://127.0.0.1:{port}"
    procs.start([binary, "-db", "-f", str(config_path)], name=name, wait_url=f"{url}/health",
                timeout_s=START_TIMEOUT_S)
    return url


def start_system(procs: ProcGroup, system: System, replica_urls: Sequence[str], *, run_dir: Path) -> str | list[str]:
    """Start ``system`` in front of ``replica_urls``, wait until it serves a request; returns its base URL (the
    list of them for SkyLB with ``options={"balancers": n}``, n > 1: siblings of one region).

    Raises Unavailable when its binary is missing, RuntimeError when it does not come up.
    """
    if system.kind == "skylb":
        url = start_skylb(procs, replica_urls, run_dir=run_dir, policy=system.policy,
                          overrides=system.skylb_overrides, name=system.name, **system.options)
    elif system.kind == "sglang":
        url = start_sglang(procs, replica_urls, policy=system.policy, name=system.name, **system.options)
    elif system.kind == "haproxy":
        url = start_haproxy(procs, replica_urls, balance=system.policy, run_dir=run_dir, name=system.name,
                            **system.options)
    else:
        raise ValueError(f"unknown system kind {system.kind!r}")
    for one in [url] if isinstance(url, str) else url:
        warm_up(one)
    return url


def warm_up(url: str, *, timeout_s: float = START_TIMEOUT_S) -> None:
    """Send tiny completions to ``url`` until one succeeds (a router may answer /health before its workers are in)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            _post_json(f"{url}/v1/completions", {"model": MODEL, "prompt": "warm up", "max_tokens": 1})
            return
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"; the last one is reported
            last = exc
            time.sleep(0.2)
    raise RuntimeError(f"{url} served no completion within {timeout_s:g} s: {last}")


def _post_json(url: str, body: dict, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def _get_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return json.loads(resp.read())
