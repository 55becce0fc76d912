"""SkyLB beside the balancers people use instead, on the same emulated replicas and the same workload, in one run.

Entry points:

* ``.venv/bin/python -m bench.peers [--systems NAME ...] [--out-md bench/results/peers.md] [--out-json PATH]``
  (``--help`` lists the knobs); :func:`main` ``(argv) -> int`` is the same thing for a ``skylb bench peers``
  subcommand.
* :func:`run_peers` runs the comparison and returns its result dict; :func:`format_markdown` renders it.
* The launchers (:func:`start_emulator`, :func:`start_skylb`, :func:`start_sglang`, :func:`start_haproxy`,
  :func:`start_system`) and :class:`MachineLoad` are reused by bench/overhead.py and bench/live.py.

The systems (:data:`SYSTEMS`): SkyLB (policies ``skylb`` and ``round_robin``, one region, with its controller),
the SGLang router from PyPI (``sglang-router``; ``cache_aware`` and ``round_robin``) and HAProxy from Debian
(``balance roundrobin`` and ``balance leastconn``, HTTP mode). Each runs in front of the same emulated vLLM replicas
(one ``skylb emulator`` process, the same ports, restarted per system so every system starts with cold prefix
caches) and gets the same closed-loop multi-turn workload (bench/workload.py ``synthetic_workload``, fixed seed)
from the same client (bench/replay.py). A replica poller reads every replica's ``vllm:num_requests_waiting`` every
0.1 s to report the replicas' peak pending requests. A system whose binary is missing is reported as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import yaml

from bench.replay import replay
from bench.report import RequestRecord, build_report, emit_markdown, markdown_table, percentile
from bench.workload import describe, synthetic_workload
from skylb.config import WorkloadConfig
from skylb.procs import ProcGroup, free_ports, wait_http

__all__ = [
    "MODEL", "System", "SYSTEMS", "Unavailable", "MachineLoad", "PendingSampler", "PeersSetup",
    "conditions_lines", "now_label", "process_cpu_s", "haproxy_binary", "haproxy_version", "sglang_router_version",
    "unavailable_reason", "summarize", "run_system", "versions", "SETUP_FLAGS", "benchmark_parser", "setup_from_args",
    "report_tail",
    "start_emulator", "start_skylb", "start_sglang", "start_haproxy", "start_system", "warm_up",
    "run_peers", "format_markdown", "main",
]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: How long a launched balancer may take to answer its first request (s).
START_TIMEOUT_S = 30.0


class Unavailable(RuntimeError):
    """A peer system cannot run here (its binary or package is missing); the message says which."""


@dataclass(frozen=True)
class System:
    """One balancer configuration under test.

    Attributes:
        name: the row label ("skylb", "sglang-cache_aware", ...). kind: "skylb", "sglang" or "haproxy".
        policy: the system's own policy name (SkyLB --policy, SGLang --policy, HAProxy ``balance``).
        skylb_overrides: extra ``balancer`` settings for SkyLB (e.g. ``{"max_dispatch_per_probe": 0}``).
    """

    name: str
    kind: str
    policy: str
    skylb_overrides: dict = field(default_factory=dict, hash=False, compare=False)


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("skylb", "skylb", "skylb"),
    # Not the default config: at most 1 request per replica between two probes instead of 4, which matters when
    # a replica's batch is as small as the default cap (--max-num-seqs 4 here).
    System("skylb-cap1", "skylb", "skylb", {"max_dispatch_per_probe": 1}),
    System("skylb-round_robin", "skylb", "round_robin"),
    System("sglang-cache_aware", "sglang", "cache_aware"),
    System("sglang-round_robin", "sglang", "round_robin"),
    System("haproxy-roundrobin", "haproxy", "roundrobin"),
    System("haproxy-leastconn", "haproxy", "leastconn"),
)}


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


# ----------------------------------------------------------------------------------------------------- launchers


def start_emulator(procs: ProcGroup, ports: Sequence[int], *, time_scale: float, max_num_seqs: int,
                   extra_args: Sequence[str] = (), name: str = "emulator") -> list[str]:
    """Start one ``skylb emulator --engine vllm`` process serving a replica on each of ``ports``.

    ``time_scale`` multiplies every emulated duration (1.0 = Llama-3.1-8B on one L4); ``max_num_seqs`` is each
    replica's running-batch size (requests). Returns the replicas' base URLs once all answer /health.
    """
    port_args = [a for p in ports for a in ("--port", str(p))]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", repr(time_scale),
                "--max-num-seqs", str(max_num_seqs), "--no-request-log", *port_args, *extra_args,
                name=name, wait_url=f"{urls[0]}/health")
    for url in urls[1:]:
        wait_http(f"{url}/health", timeout_s=20)
    return urls


def start_skylb(procs: ProcGroup, replica_urls: Sequence[str], *, run_dir: Path, policy: str = "skylb",
                overrides: dict | None = None, region: str = "us", name: str = "skylb",
                profile_to: Path | None = None) -> str:
    """Start a SkyLB controller and one balancer for ``region`` in front of ``replica_urls``; returns its URL.

    The replicas are registered through the controller's REST API (as `skylb-ctl replica add` does) and the call
    returns once the balancer has probed all of them healthy. ``overrides``: extra ``balancer`` settings.
    ``profile_to``: run the balancer under cProfile, which writes this file when the balancer stops (SIGTERM).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    controller_port, balancer_port = free_ports(2)
    config = {
        "controller": {"db": str(run_dir / f"{name}-controller.sqlite")},
        "balancer": {"state_dir": str(run_dir / f"{name}-state"), "policy": policy, **(overrides or {})},
        "regions": {region: {"replicas": 0}},
    }
    config_path = run_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    controller = f"http://127.0.0.1:{controller_port}"
    procs.skylb("controller", "--config", str(config_path), "--port", str(controller_port),
                name=f"{name}-controller", wait_url=f"{controller}/healthz")
    url = f"http://127.0.0.1:{balancer_port}"
    args = ["balancer", "--config", str(config_path), "--region", region, "--port", str(balancer_port),
            "--controller", controller, "--policy", policy]
    command = ([sys.executable, "-c", _PROFILED_MAIN, str(profile_to), *args] if profile_to else
               [sys.executable, "-m", "skylb", *args])
    procs.start(command, name=f"{name}-balancer", wait_url=f"{url}/healthz")
    for replica in replica_urls:
        _post_json(f"{controller}/v1/replicas", {"region": region, "url": replica, "engine": "vllm"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        status = _get_json(f"{url}/skylb/v1/status?format=json")
        if sum(1 for r in status["replicas"] if r["healthy"]) >= len(replica_urls):
            return url
        if time.monotonic() > deadline:
            raise RuntimeError(f"SkyLB balancer did not see {len(replica_urls)} healthy replicas in "
                               f"{START_TIMEOUT_S:g} s: {status['replicas']}")
        time.sleep(0.1)


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
                 name: str = "sglang") -> str:
    """Start the SGLang router (``python -m sglang_router.launch_router``) in front of ``replica_urls``.

    Listens on 127.0.0.1 only; its Prometheus exporter (default 0.0.0.0:29000, which would clash between runs)
    goes to a free port on 127.0.0.1. Everything else is the router's default (worker health checks every 60 s,
    5 retries, circuit breaker, per-request log lines at INFO). Returns its URL.
    """
    reason = unavailable_reason("sglang")
    if reason:
        raise Unavailable(reason)
    port, metrics_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    procs.start([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *replica_urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(metrics_port)],
                name=name, wait_url=f"{url}/health", timeout_s=START_TIMEOUT_S)
    return url


HAPROXY_CONFIG = """\
# Generated by bench/peers.py: HTTP mode, no health checks (the replicas are known up), timeouts long enough for
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
{servers}
"""


def start_haproxy(procs: ProcGroup, replica_urls: Sequence[str], *, balance: str = "roundrobin",
                  run_dir: Path, name: str = "haproxy") -> str:
    """Start HAProxy (foreground, ``-db``) with ``balance`` over ``replica_urls``; returns its URL."""
    binary = haproxy_binary()
    if binary is None:
        raise Unavailable(unavailable_reason("haproxy"))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    servers = "\n".join(f"    server r{i} {u.removeprefix('http://')}" for i, u in enumerate(replica_urls))
    config_path = run_dir / f"{name}.cfg"
    config_path.write_text(HAPROXY_CONFIG.format(port=port, balance=balance, servers=servers))
    url = f"http://127.0.0.1:{port}"
    procs.start([binary, "-db", "-f", str(config_path)], name=name, wait_url=f"{url}/health",
                timeout_s=START_TIMEOUT_S)
    return url


def start_system(procs: ProcGroup, system: System, replica_urls: Sequence[str], *, run_dir: Path) -> str:
    """Start ``system`` in front of ``replica_urls``, wait until it serves a request; returns its base URL.

    Raises Unavailable when its binary is missing, RuntimeError when it does not come up.
    """
    if system.kind == "skylb":
        url = start_skylb(procs, replica_urls, run_dir=run_dir, policy=system.policy,
                          overrides=system.skylb_overrides, name=system.name)
    elif system.kind == "sglang":
        url = start_sglang(procs, replica_urls, policy=system.policy, name=system.name)
    elif system.kind == "haproxy":
        url = start_haproxy(procs, replica_urls, balance=system.policy, run_dir=run_dir, name=system.name)
    else:
        raise ValueError(f"unknown system kind {system.kind!r}")
    warm_up(url)
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


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# ------------------------------------------------------------------------------------------------ measurements


class MachineLoad:
    """What else ran on this machine during a measurement: load averages and other processes' CPU time.

    ``start()`` snapshots every process's CPU time; ``stop()`` returns ``{"loadavg_start", "loadavg_end",
    "wall_s", "others_cpu_s", "others_cpu_frac", "top_others", "steal_frac"}`` where ``others_cpu_s`` is the CPU
    time (s) used during the window by processes that existed at both snapshots, other than this one (so not by
    the processes the benchmark started, which are gone by then), ``others_cpu_frac`` that time / (wall time x CPU
    cores), ``top_others`` the three largest as "command: seconds", and ``steal_frac`` the share of the machine's
    CPU time the hypervisor gave to others (/proc/stat "steal").
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._cpu0: dict[int, tuple[str, float]] = {}
        self._load0 = ""
        self._stat0: list[int] = []

    def start(self) -> "MachineLoad":
        """Take the first snapshot; returns self."""
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_times()
        self._load0 = _loadavg()
        self._stat0 = _proc_stat()
        return self

    def stop(self) -> dict[str, Any]:
        """Take the second snapshot and return the summary (see the class docstring)."""
        wall = time.monotonic() - self._t0
        cpu1 = _cpu_times()
        me = os.getpid()
        used = {}
        for pid, (cmd, t1) in cpu1.items():
            if pid == me or pid not in self._cpu0 or self._cpu0[pid][0] != cmd:
                continue
            delta = t1 - self._cpu0[pid][1]
            if delta > 0:
                used[f"{cmd}[{pid}]"] = delta
        total = sum(used.values())
        top = sorted(used.items(), key=lambda kv: -kv[1])[:3]
        stat1 = _proc_stat()
        ticks = [b - a for a, b in zip(self._stat0, stat1)]
        steal = ticks[7] / sum(ticks) if len(ticks) > 7 and sum(ticks) > 0 else 0.0
        return {
            "loadavg_start": self._load0, "loadavg_end": _loadavg(), "wall_s": wall,
            "others_cpu_s": total, "others_cpu_frac": total / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0,
            "top_others": [f"{k}: {v:.1f} s" for k, v in top], "steal_frac": steal,
        }


def _proc_stat() -> list[int]:
    """The machine's CPU time counters (ticks: user nice system idle iowait irq softirq steal ...)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def conditions_lines(whole: dict[str, Any], windows: list[tuple[str, dict[str, Any]]], sharing: str) -> list[str]:
    """The "Conditions" section of a report: the machine, load averages, other processes' CPU use.

    ``whole``: the MachineLoad summary of the whole run; ``windows``: (label, summary) of each measurement window.
    Other processes' CPU is summed over the windows (a process that ended mid-run counts in its window only).
    """
    others = sum(w["others_cpu_s"] for _, w in windows) if windows else whole["others_cpu_s"]
    wall = sum(w["wall_s"] for _, w in windows) if windows else whole["wall_s"]
    frac = others / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
    lines = ["## Conditions", "",
             f"- Machine: {os.cpu_count()} CPU cores, no GPU; {sharing}.",
             f"- Load average (1/5/15 min) at start / end: {whole['loadavg_start']} / {whole['loadavg_end']}. "
             f"Other processes (other engineers' tests, the system) used {others:.0f} CPU-s during the "
             f"measurement windows ({100 * frac:.0f}% of the machine)."]
    if windows:
        lines.append("- Per window: " + "; ".join(
            f"{label}: load {w['loadavg_start']} -> {w['loadavg_end']}, others {100 * w['others_cpu_frac']:.0f}%"
            + (f" ({', '.join(w['top_others'][:2])})" if w["others_cpu_frac"] > BUSY_FRACTION else "")
            + (f", steal {100 * w['steal_frac']:.0f}%" if w.get("steal_frac", 0) >= 0.01 else "")
            for label, w in windows) + ".")
    return [*lines, ""]


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (command name, user + system CPU seconds) of every process readable in /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # comm is in parentheses and may hold spaces; the fields after it are space-separated.
        cmd = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(entry.name)] = (cmd, (int(fields[11]) + int(fields[12])) / tick)
    return out


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (all its threads); 0.0 when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PendingSampler:
    """Polls every replica's /metrics for ``vllm:num_requests_waiting`` while a replay runs.

    Args:
        replica_urls: the replicas' base URLs. interval_s: time between two polls of all replicas, s.

    After ``stop()``: ``peak`` = per replica the largest pending count seen; ``mean_total`` = the pending
    requests summed over replicas, averaged over the polls (requests).
    """

    def __init__(self, replica_urls: Sequence[str], *, interval_s: float = 0.1):
        self.replica_urls = list(replica_urls)
        self.interval_s = interval_s
        self.peak = [0] * len(self.replica_urls)
        self._sums: list[int] = []
        self._task: asyncio.Task | None = None

    @property
    def mean_total(self) -> float:
        """Mean over polls of the summed pending requests (0.0 before any poll)."""
        return sum(self._sums) / len(self._sums) if self._sums else 0.0

    def start(self) -> None:
        """Start polling in the running event loop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                values = await asyncio.gather(*(self._one(session, u) for u in self.replica_urls))
                if all(v is not None for v in values):
                    self._sums.append(sum(values))
                for i, v in enumerate(values):
                    if v is not None:
                        self.peak[i] = max(self.peak[i], v)
                await asyncio.sleep(self.interval_s)

    @staticmethod
    async def _one(session: aiohttp.ClientSession, url: str) -> int | None:
        try:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class PeersSetup:
    """The shared setup of a peers run (every system gets exactly this).

    Attributes:
        replicas: emulated vLLM replicas. max_num_seqs: running-batch slots per replica (requests); small, so
            requests queue and where they queue matters. time_scale: emulated durations x this (1 = an L4).
        conversations: closed-loop multi-turn conversations (clients), all in one region. turns: per conversation.
        token_scale: prompt and answer lengths x this. seed: workload seed. request_timeout_s: per request, s.
        deadline_s: bound of one system's replay, s.
    """

    replicas: int = 4
    max_num_seqs: int = 4
    time_scale: float = 1.0
    conversations: int = 32
    turns: int = 5
    token_scale: float = 0.25
    seed: int = 0
    request_timeout_s: float = 120.0
    deadline_s: float = 150.0

    def workload_config(self) -> WorkloadConfig:
        """The WorkloadConfig of the synthetic workload (one region, "us")."""
        return WorkloadConfig(trace=None, synthetic_conversations=self.conversations,
                              synthetic_turns=self.turns, token_scale=self.token_scale,
                              region_weights={"us": 1.0}, seed=self.seed, request_timeout_s=self.request_timeout_s)


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The figures of one system's replay: build_report's totals plus the TTFT mean (ms)."""
    total = build_report(records, wall_s)["total"]
    ttft = [r.ttft_ms for r in records if r.ok and r.ttft_ms is not None]
    total["ttft_mean_ms"] = sum(ttft) / len(ttft) if ttft else None
    total["ttft_p99_ms"] = percentile(ttft, 99)
    total["wall_s"] = wall_s
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:160]] = errors.get(r.error[:160], 0) + 1
    total["errors"] = errors
    return total


async def _replay_with_sampler(requests, url: str, replica_urls: Sequence[str], setup: PeersSetup,
                               progress: bool | None):
    sampler = PendingSampler(replica_urls)
    sampler.start()
    try:
        result = await replay(requests, {"us": url}, model=MODEL, request_timeout_s=setup.request_timeout_s,
                              deadline_s=setup.deadline_s, progress=progress)
    finally:
        await sampler.stop()
    return result, sampler


def run_system(system: System, setup: PeersSetup, *, ports: Sequence[int], run_dir: Path,
               progress: bool | None = None) -> dict[str, Any]:
    """Run the workload of ``setup`` through ``system`` on fresh replicas at ``ports``; returns its row.

    Row: ``{"system", "status": "ok"|"skipped"|"failed", "reason", "figures": summarize(...) + "pending_peak"
    (per replica), "pending_peak_max", "pending_mean_total", "load": MachineLoad summary}``.
    """
    reason = unavailable_reason(system.kind)
    if reason:
        return {"system": system.name, "status": "skipped", "reason": reason}
    requests = synthetic_workload(setup.workload_config(), ["us"])
    load = MachineLoad().start()
    try:
        with ProcGroup(run_dir / system.name / "logs") as procs:
            replica_urls = start_emulator(procs, ports, time_scale=setup.time_scale,
                                          max_num_seqs=setup.max_num_seqs, name=f"{system.name}-emulator")
            url = start_system(procs, system, replica_urls, run_dir=run_dir / system.name)
            result, sampler = asyncio.run(_replay_with_sampler(requests, url, replica_urls, setup, progress))
    except (RuntimeError, Unavailable, OSError) as exc:
        return {"system": system.name, "status": "failed", "reason": str(exc)[:2000], "load": load.stop()}
    figures = summarize(result.records, result.wall_s)
    figures["pending_peak"] = sampler.peak
    figures["pending_peak_max"] = max(sampler.peak, default=0)
    figures["pending_mean_total"] = sampler.mean_total
    return {"system": system.name, "status": "ok", "figures": figures, "load": load.stop()}


def run_peers(systems: Sequence[str] | None = None, *, setup: PeersSetup | None = None,
              run_dir: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Run every system in ``systems`` (names of :data:`SYSTEMS`; default all) one after the other.

    Returns ``{"setup": asdict(setup), "workload": one-line description, "versions": {...}, "rows": [row...],
    "wall_s", "load": MachineLoad summary of the whole run}`` (rows: :func:`run_system`).
    """
    setup = setup or PeersSetup()
    names = list(systems or SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="peers-"))
    ports = free_ports(setup.replicas)
    load = MachineLoad().start()
    t0 = time.monotonic()
    rows = []
    for name in names:
        print(f"[bench.peers] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_system(SYSTEMS[name], setup, ports=ports, run_dir=run_dir, progress=progress))
        row = rows[-1]
        print(f"[bench.peers] {name}: {row['status']} {row.get('reason', '')}".rstrip(), file=sys.stderr, flush=True)
    requests = synthetic_workload(setup.workload_config(), ["us"])
    return {
        "setup": setup.__dict__.copy(), "workload": describe(requests), "versions": versions(),
        "rows": rows, "wall_s": time.monotonic() - t0, "load": load.stop(), "run_dir": str(run_dir),
        "generated": now_label(),
    }


def now_label() -> str:
    """The local time, for a report's "generated on" line."""
    return time.strftime("%Y-%m-%d %H:%M %Z")


def versions() -> dict[str, str | None]:
    """Versions of the systems compared and of Python."""
    return {"sglang-router": sglang_router_version(), "haproxy": haproxy_version(),
            "python": sys.version.split()[0]}


# ----------------------------------------------------------------------------------------------------- report


def _f(value, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _row(row: dict[str, Any]) -> list[str]:
    """One system's cells of the report table; a row that did not run says why in its second cell."""
    if row["status"] != "ok":
        reason = (row.get("reason") or "").splitlines()[0][:160].replace("|", "/")
        return [row["system"], f"{row['status']}: {reason}"]
    f = row["figures"]
    return [row["system"], f"{f['completed']}/{f['sent']}", _f(f["throughput_rps"], "{:.2f}"),
            _f(f["output_tokens_per_s"]), _f(f["ttft_mean_ms"]), _f(f["ttft_p50_ms"]), _f(f["ttft_p90_ms"]),
            _f(f["e2e_p50_ms"]), _f(f["e2e_p90_ms"]),
            _f(f["prefix_hit_rate"] and 100 * f["prefix_hit_rate"], "{:.1f}%"),
            f"{f['pending_peak_max']} ({'/'.join(map(str, f['pending_peak']))})", f"{f['pending_mean_total']:.1f}"]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The peers result as the Markdown report bench/results/peers.md (table, setup, conditions); ``notes``
    (Markdown written after looking at the figures) is appended as is."""
    s = result["setup"]
    lines = [
        "# SkyLB beside the SGLang router and HAProxy (live, one run)",
        "",
        f"Generated by `python -m bench.peers` on {result.get('generated') or now_label()}; "
        f"whole run {result['wall_s']:.0f} s. Versions: sglang-router {result['versions']['sglang-router']}, "
        f"{result['versions']['haproxy']}, Python {result['versions']['python']}.",
        "",
        markdown_table(["system", "ok/sent", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p90", "E2E p50",
                        "E2E p90", "prefix hit", "peak pending (max; per replica)", "mean pending (sum)"],
                       [_row(row) for row in result["rows"]]),
    ]
    lines += ["", "Latencies in ms, measured at the client (TTFT: to the first SSE chunk with text). "
              "Throughput: completed requests (output tokens) per second of the replay's wall time. "
              "Prefix hit: cached prompt tokens / prompt tokens, as the replicas report them in `usage`. "
              "Pending: `vllm:num_requests_waiting` polled on every replica every 0.1 s.", ""]
    lines += ["## Setup", "",
              f"- Replicas: {s['replicas']} emulated vLLM replicas (`skylb emulator`, one process), "
              f"`--max-num-seqs {s['max_num_seqs']}`, `--time-scale {s['time_scale']:g}` (Llama-3.1-8B on an L4 "
              f"x {s['time_scale']:g}), restarted on the same ports before each system so that every system starts "
              "with cold prefix caches.",
              f"- Workload: {result['workload']}; closed loop (a turn is sent 0.2-1.0 s after the previous turn of "
              f"its conversation completed), `token_scale {s['token_scale']:g}`, seed {s['seed']}; every turn "
              "extends the previous turn's prompt, and all conversations share a system prompt.",
              "- Client: bench/replay.py (aiohttp, streamed `/v1/completions`, `ignore_eos`), one process.",
              "- SkyLB: controller + one balancer (region `us`) with the default config (probe every 100 ms, "
              "selective pushing: a replica is available while its last probe showed 0 pending requests, and gets "
              "at most `max_dispatch_per_probe` = 4 requests between two probes), replicas registered through the "
              "controller. `skylb-cap1` is the same with `max_dispatch_per_probe 1` (not the default).",
              "- SGLang router: `python -m sglang_router.launch_router --host 127.0.0.1 --worker-urls ... "
              "--policy P --prometheus-host 127.0.0.1 --prometheus-port FREE`, defaults otherwise (cache_aware: "
              "route to the worker with the longest prefix match when it covers >= 30% of the prompt, else to the "
              "smallest tree; switch to least load only when max - min load > 64 and max > 1.5 x min).",
              "- HAProxy: generated config, `mode http`, `balance roundrobin|leastconn`, no health checks, "
              "client/server timeouts 600 s, `option http-no-delay` (without it HAProxy sends with MSG_MORE and "
              "the kernel holds small SSE chunks up to 200 ms: TTFT p50 203 ms instead of 13 ms in a trial run).",
              ""]
    lines += _observations(result)
    lines += report_tail(result, "every process of the run (client, emulator, balancer) shares them", notes)
    return "\n".join(lines)


def report_tail(result: dict[str, Any], sharing: str, notes: str) -> list[str]:
    """The end of a live benchmark report: the Conditions section (``sharing``: what shares the machine), the
    errors of rows that ran, then the hand-written ``notes`` (Markdown) as they are."""
    rows = result["rows"]
    lines = conditions_lines(result["load"], [(r["system"], r["load"]) for r in rows if r.get("load")], sharing)
    errors = {r["system"]: r["figures"]["errors"] for r in rows if r["status"] == "ok" and r["figures"]["errors"]}
    if errors:
        lines += ["## Errors", ""] + [f"- {k}: {v}" for k, v in errors.items()] + [""]
    if notes:
        lines += [notes.rstrip(), ""]
    return lines


#: Other processes' share of the machine above which a row is flagged as measured under load.
BUSY_FRACTION = 0.2


def _observations(result: dict[str, Any]) -> list[str]:
    """Automatic remarks on the rows: requests piled on one replica, rows measured while the machine was busy."""
    out = []
    for row in result["rows"]:
        if row["status"] != "ok":
            continue
        peaks = row["figures"]["pending_peak"]
        idle = [i for i, p in enumerate(peaks) if p == 0]
        if idle and max(peaks) > 0:
            out.append(f"- {row['system']}: requests queued on replica(s) "
                       f"{', '.join(str(i) for i, p in enumerate(peaks) if p > 0)} while replica(s) "
                       f"{', '.join(map(str, idle))} never had a pending request (peaks {peaks}).")
        frac = row["load"]["others_cpu_frac"]
        if frac > BUSY_FRACTION:
            out.append(f"- {row['system']}: measured while other processes used {100 * frac:.0f}% of the machine "
                       f"({', '.join(row['load']['top_others'])}); its timings are pessimistic.")
    return (["## Observations (automatic)", "", *out, ""]) if out else []


# -------------------------------------------------------------------------------------------------------- CLI


#: The setup fields the live benchmark CLIs (bench.peers, bench.live) take as flags: PeersSetup and LiveSetup
#: both have them.
SETUP_FLAGS = ("replicas", "max_num_seqs", "time_scale", "conversations", "turns", "token_scale", "seed")


def benchmark_parser(prog: str, description: str, *, systems, defaults, out_md: str,
                     helps: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags shared by the live benchmark CLIs: ``--systems``, one flag per :data:`SETUP_FLAGS` field (its
    default from ``defaults``, a setup dataclass), and the report paths (``--out-md`` defaults to ``out_md``)."""
    helps = helps or {}
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--systems", nargs="+", choices=list(systems), help="systems to run (default: all)")
    for name in SETUP_FLAGS:
        default = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=helps.get(name))
    p.add_argument("--out-md", default=out_md, help="Markdown report ('' for none)")
    p.add_argument("--out-json", default=None, help="also write the raw result as JSON here")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report (analysis)")
    p.add_argument("--run-dir", default=None, help="logs and state (default: a new temporary directory)")
    p.add_argument("--no-progress", action="store_true")
    return p


def setup_from_args(cls, args: argparse.Namespace):
    """A ``cls`` setup (PeersSetup, LiveSetup) from the :data:`SETUP_FLAGS` of parsed ``args``."""
    return cls(**{name: getattr(args, name) for name in SETUP_FLAGS})


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.peers`."""
    return benchmark_parser("python -m bench.peers", __doc__.splitlines()[0], systems=SYSTEMS,
                            defaults=PeersSetup(), out_md="bench/results/peers.md")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the report; 0 when every system that could run completed all requests."""
    args = build_parser().parse_args(argv)
    setup = setup_from_args(PeersSetup, args)
    result = run_peers(args.systems, setup=setup, run_dir=Path(args.run_dir) if args.run_dir else None,
                       progress=False if args.no_progress else None)
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    emit_markdown(text, result, out_md=args.out_md, out_json=args.out_json)
    bad = [r for r in result["rows"] if r["status"] == "failed"
           or (r["status"] == "ok" and r["figures"]["failed"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
