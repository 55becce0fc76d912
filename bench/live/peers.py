"""SkyLB beside the balancers deployed instead across regions: one balancer in us for all replicas, or one per region.

Entry points:

* ``.venv/bin/python -m bench.live.peers [--systems NAME ...] [--runs 5] [--trace PATH] [--out-md bench/results/peers.md]
  [--out-json PATH]`` (``--help`` lists the sizes); :func:`main` ``(argv) -> int`` is the same for the ``skylb bench
  peers`` subcommand. The JSON result goes beside the Markdown report (``.json`` for ``.md``) unless ``--out-json``
  says otherwise; both carry the run's provenance (bench/reporting/provenance.py).
* :func:`run_peers` runs every system ``runs`` times and returns the result dict; :func:`format_markdown` renders
  it, with the acceptance lines (:func:`acceptance`) marked MET or MISSED.

Three regions (us, eu, asia), each with ``replicas`` emulated vLLM replicas (one emulator process per region), and
the round trips between regions of the demo's config (bench/launch/settings.py ``latency``: us-eu 80 ms, us-asia 150 ms,
eu-asia 200 ms) injected by the latency proxy (bench/latency). Systems (:data:`SYSTEMS`):

* ``skylb``, ``skylb-ch``: one SkyLB balancer per region (bench/launch/local.py ``Deployment``, as bench/live/regions.py runs it),
  policies ``skylb`` (prefix trie) and ``skylb-ch`` (hash ring); a balancer reaches its peers through the links.
* ``sglang-cache_aware``, ``sglang-round_robin``: one SGLang router in us in front of all replicas. Its connections
  to an eu or asia replica go through a link with that region's round trip to us, as a router in us would reach a
  replica there. cache_aware's thresholds are sized for the cluster (:func:`launch_options`).
* ``haproxy-us``: one HAProxy in us in front of all replicas, through the same links: ``balance leastconn``, each
  server's ``maxconn`` the engine's batch, so further requests wait in HAProxy's queue (``timeout queue``).
* ``haproxy-per-region``: one HAProxy per region in front of its own replicas only (the same settings), the SkyLB
  paper's baseline of a load balancer per region (§5.1, the per-region GKE gateway): nothing crosses regions.

Clients (bench/replay/run.py ``replay_sessions``): closed loop, ``clients`` in all, split us 0.6, eu 0.2, asia 0.2 (the
paper's 120/40/40 clients, §5.2); each has one request in flight and runs its region's sessions of the Mooncake
conversation trace (bench/replay/workload.py ``trace_sessions``, sessions assigned to regions with the same weights) turn by
turn, for a send window of ``duration_s``; throughput counts the requests completed within it. A client calls its
nearest entry point: its region's balancer (SkyLB, per-region HAProxy), or the one in us,
reached from eu and asia through a link with the round trip to us. Every system is started fresh (fresh replicas:
cold prefix caches) for each run; within a run every system gets the same sessions (the run's workload seed), and the
rounds interleave the systems, rotating which goes first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from bench.live.harness import now_label, report_tail, summarize
from bench.latency.links import LatencyLinks
from bench.launch.launchers import MODEL, System, Unavailable, start_emulator, start_system, unavailable_reason, versions
from bench.live.regions import LiveSetup, deployment_config
from bench.launch.local import Deployment
from bench.launch.procs import ProcGroup, free_ports
from bench.reporting.provenance import provenance
from bench.replay.run import replay_sessions
from bench.replay.report import RequestRecord, build_report, emit_markdown, markdown_table, write_json
from bench.replay.sampling import MachineLoad
from bench.launch.settings import LatencyConfig, latency_settings
from bench.sim.workloads import DEFAULT_TRACE
from bench.replay.workload import Request, trace_session_count, trace_sessions
from skylb.config import DeploymentConfig

__all__ = ["REGIONS", "HOME", "WEIGHTS", "PeersSystem", "SYSTEMS", "SINGLE_BALANCERS", "PeersSetup", "launch_options",
           "client_split", "workload", "skylb_config", "RouterDeployment", "served_regions", "figures_of",
           "run_system", "run_peers", "summary", "acceptance", "format_markdown", "build_parser", "main"]

REGIONS = ("us", "eu", "asia")
#: Where the single balancers (SGLang router, haproxy-us) run: the region with most clients.
HOME = "us"
#: Clients and sessions per region (the paper's 120/40/40 clients, §5.2).
WEIGHTS = {"us": 0.6, "eu": 0.2, "asia": 0.2}
#: cache_aware's prefix-match threshold (fraction of the prompt): the router's default, kept because a fraction of
#: the prompt does not depend on the cluster's size.
SGLANG_CACHE_THRESHOLD = 0.3
#: cache_aware's relative imbalance threshold (busiest / least busy replica's requests): the default, a ratio.
SGLANG_BALANCE_REL = 1.5


@dataclass(frozen=True)
class PeersSystem:
    """One row of the comparison.

    Attributes:
        name: the row label. kind: "skylb", "sglang" or "haproxy". policy: SkyLB's ``--policy``, SGLang's
            ``--policy`` or HAProxy's ``balance``. placement: "per-region" (an instance in every region, each
            region's clients call their own) or "us" (one instance in us for every replica and client).
    """

    name: str
    kind: str
    policy: str
    placement: str


SYSTEMS: dict[str, PeersSystem] = {s.name: s for s in (
    PeersSystem("skylb", "skylb", "skylb", "per-region"),
    PeersSystem("skylb-ch", "skylb", "skylb-ch", "per-region"),
    PeersSystem("sglang-cache_aware", "sglang", "cache_aware", HOME),
    PeersSystem("sglang-round_robin", "sglang", "round_robin", HOME),
    PeersSystem("haproxy-us", "haproxy", "leastconn", HOME),
    PeersSystem("haproxy-per-region", "haproxy", "leastconn", "per-region"),
)}
#: The single balancers in us the third acceptance line compares SkyLB with.
SINGLE_BALANCERS = ("sglang-cache_aware", "sglang-round_robin", "haproxy-us")


@dataclass
class PeersSetup:
    """The shared setup of a run (every system gets exactly this).

    Attributes:
        replicas: emulated vLLM replicas per region. max_num_seqs: each replica's running batch (requests).
        time_scale: emulated durations x this (1 = Llama-3.1-8B on an L4).
        clients: closed-loop clients in all (split by :data:`WEIGHTS`). duration_s: the send window of a run, s:
            clients send requests for this long, then let their last request finish. pool_requests: the sessions
            the clients draw from hold at least this many requests (whole sessions; more than any system serves in
            ``duration_s``, so no client runs out). token_scale: the trace's prompt and output lengths x this.
            max_turns: a session keeps its first max_turns requests. trace: the Mooncake-format trace.
        seed: the first run's workload seed; run k uses seed + k - 1: its sessions start at session (seed + k - 1)
            x session_stride of the trace, modulo its sessions (disjoint stretches for seeds 0-4 of the default
            trace), and the seed draws regions and think times. request_timeout_s: bound of one request, s.
            ramp_s: the clients' start is spread over this, s.
            rtt_ms: round trips between regions (None: the config's). balancer_options: SkyLB balancer settings
            over the defaults (``skylb.config.BalancerConfig`` fields, e.g. ``{"probe_interval_ms": 500}``), to
            measure what one setting costs or buys; validated with the rest of the deployment config.
    """

    replicas: int = 4
    max_num_seqs: int = 4
    time_scale: float = 1.0
    clients: int = 72
    duration_s: float = 40.0
    pool_requests: int = 2000
    token_scale: float = 0.05
    max_turns: int = 8
    trace: str = str(DEFAULT_TRACE)
    seed: int = 0
    session_stride: int = 1500
    request_timeout_s: float = 120.0
    ramp_s: float = 2.0
    rtt_ms: dict | None = None
    balancer_options: dict | None = None


# ----------------------------------------------------------------------------------------------- configuration


def launch_options(system: PeersSystem, setup: PeersSetup) -> dict[str, Any]:
    """The launcher options (bench/launch/launchers.py) of a baseline, sized for ``setup``'s replicas.

    SGLang cache_aware: it leaves prefix routing for the least loaded replica only when the busiest replica has more
    than ``balance_abs_threshold`` in-flight requests over the least busy one and more than ``rel`` times as many.
    The defaults (64, 1.5) are sized for GPU engines that run hundreds of requests at once; here a replica runs
    ``max_num_seqs`` (4), so 64 could never be reached and cache_aware would never balance. ``max_num_seqs // 2``
    (2) balances once the busiest replica has queued requests while the least busy has half its batch free (5 vs 2
    in flight), i.e. when a request's placement decides whether it waits. HAProxy: leastconn with ``maxconn`` =
    the batch (HAProxy queues the rest itself instead of the engines), waiting at most the client's request
    timeout (``timeout queue``; HAProxy's default, ``timeout connect``, would fail queued requests after 5 s).
    """
    if system.kind == "sglang" and system.policy == "cache_aware":
        return {"cache_threshold": SGLANG_CACHE_THRESHOLD,
                "balance_abs_threshold": max(1, setup.max_num_seqs // 2),
                "balance_rel_threshold": SGLANG_BALANCE_REL}
    if system.kind == "haproxy":
        return {"maxconn": setup.max_num_seqs, "timeout_queue_s": setup.request_timeout_s}
    return {}


def client_split(clients: int) -> dict[str, int]:
    """``clients`` split over :data:`REGIONS` by :data:`WEIGHTS` (largest remainder, at least 1 each)."""
    if clients < len(REGIONS):
        raise ValueError(f"need at least {len(REGIONS)} clients, got {clients}")
    exact = {g: clients * WEIGHTS[g] / sum(WEIGHTS.values()) for g in REGIONS}
    out = {g: max(1, math.floor(v)) for g, v in exact.items()}
    for g in sorted(REGIONS, key=lambda g: out[g] - exact[g]):
        if sum(out.values()) >= clients:
            break
        out[g] += 1
    return out


def workload(setup: PeersSetup, seed: int) -> list[list[Request]]:
    """The sessions of the run with workload seed ``seed`` (bench/replay/workload.py ``trace_sessions``), from
    session ``seed x session_stride`` of the trace, modulo its sessions (a trace with fewer sessions than the
    seeds' stretches need is read again from its start, so those stretches overlap)."""
    first = seed * setup.session_stride % trace_session_count(setup.trace)
    return trace_sessions(setup.trace, REGIONS, weights=WEIGHTS, seed=seed, token_scale=setup.token_scale,
                          requests=setup.pool_requests, first_session=first, max_turns=setup.max_turns)


def skylb_config(setup: PeersSetup, policy: str) -> DeploymentConfig:
    """The SkyLB deployment of bench/live/regions.py (the default config, ``setup``'s replicas and ``policy``), with the
    emulators' request log on (:func:`served_regions` reads it)."""
    live = LiveSetup(replicas=setup.replicas, max_num_seqs=setup.max_num_seqs, time_scale=setup.time_scale,
                     rtt_ms=setup.rtt_ms)
    data = deployment_config(live, policy=policy, region_local=False).model_dump()
    data["emulator"]["extra_args"] = [a for a in data["emulator"]["extra_args"] if a != "--no-request-log"]
    data["balancer"].update(setup.balancer_options or {})
    return DeploymentConfig.model_validate(data)


def _latency(setup: PeersSetup) -> LatencyConfig:
    """The round trips every system runs with: those of the SkyLB deployment (one source for all)."""
    return latency_settings(skylb_config(setup, "skylb"))


# ---------------------------------------------------------------------------------------------- the baselines


class RouterDeployment:
    """A baseline on this machine: the replicas of every region (one emulator process per region, request log on)
    and in front of them one instance of the system in us, or one per region.

    In us (``placement`` "us"): the latency proxy carries one link per eu or asia replica (the system's connections
    to it pay that region's round trip to us) and one link per eu or asia client region to the system (the clients'
    round trip to us). ``entry_urls``: region -> the URL that region's clients call. ``own``: the name prefix of the
    system's own processes (for their CPU time).
    """

    def __init__(self, system: PeersSystem, setup: PeersSetup, run_dir: Path):
        self.system, self.setup, self.run_dir = system, setup, Path(run_dir)
        self.latency = _latency(setup)
        self.procs = ProcGroup(self.run_dir / "logs", pid_file=self.run_dir / "pids")
        self.links: LatencyLinks | None = None
        self.replica_urls: dict[str, list[str]] = {}
        self.entry_urls: dict[str, str] = {}
        self.own = (system.name,)

    def start(self) -> None:
        """Start the replicas, the proxy and links (in us) and the system; raises RuntimeError or Unavailable."""
        n = self.setup.replicas
        ports = free_ports(n * len(REGIONS))
        for i, region in enumerate(REGIONS):
            self.replica_urls[region] = start_emulator(
                self.procs, ports[i * n:(i + 1) * n], time_scale=self.setup.time_scale,
                max_num_seqs=self.setup.max_num_seqs, name=f"emulator-{region}", request_log=True)
        if self.system.placement == "per-region":
            for region in REGIONS:
                self.entry_urls[region] = self._start(f"{self.system.name}-{region}", self.replica_urls[region])
            return
        proxy_port, *listen = free_ports(1 + n * (len(REGIONS) - 1) + len(REGIONS) - 1)
        api = f"http://127.0.0.1:{proxy_port}"
        self.procs.skylb("toxiproxy", "--port", str(proxy_port), name="toxiproxy", wait_url=f"{api}/version")
        self.links = LatencyLinks(api)
        listen_ports = iter(listen)
        workers = list(self.replica_urls[HOME])
        for region in REGIONS:
            if region != HOME:
                workers += [self._link(f"{HOME}-to-{region}-r{i}", url, HOME, region, next(listen_ports))
                            for i, url in enumerate(self.replica_urls[region])]
        url = self._start(self.system.name, workers)
        self.entry_urls = {region: url if region == HOME else
                           self._link(f"clients-{region}-to-{HOME}", url, region, HOME, next(listen_ports))
                           for region in REGIONS}

    def _link(self, name: str, url: str, a: str, b: str, listen_port: int) -> str:
        """A link to ``url`` with the round trip between regions ``a`` and ``b``; returns its URL."""
        assert self.links is not None
        return "http://" + self.links.link(name, url.removeprefix("http://"), rtt_ms=self.latency.rtt(a, b),
                                           jitter_ms=self.latency.jitter_ms, listen_port=listen_port)

    def _start(self, name: str, replica_urls: list[str]) -> str:
        system = System(name, self.system.kind, self.system.policy, options=launch_options(self.system, self.setup))
        return start_system(self.procs, system, replica_urls, run_dir=self.run_dir)

    def stop(self) -> None:
        """Remove the links and stop every process."""
        if self.links is not None:
            try:
                self.links.close()
            except Exception:  # noqa: BLE001 - the proxy may be gone already; stopping must go on
                pass
        self.procs.stop_all()


class _SkyLBDeployment:
    """bench/launch/local.py's Deployment seen through RouterDeployment's attributes (entry_urls, own)."""

    own = ("balancer-", "controller")

    def __init__(self, system: PeersSystem, setup: PeersSetup, run_dir: Path):
        self.deployment = Deployment(skylb_config(setup, system.policy), Path(run_dir))
        self.procs = self.deployment.procs

    @property
    def replica_urls(self) -> dict[str, list[str]]:
        return self.deployment.replica_urls

    @property
    def entry_urls(self) -> dict[str, str]:
        return self.deployment.balancer_urls

    def start(self) -> None:
        self.deployment.start()

    def stop(self) -> None:
        self.deployment.stop()


# ------------------------------------------------------------------------------------------------------ the run


def served_regions(log_dir: Path, replica_urls: dict[str, list[str]]) -> dict[str, str]:
    """Completion id -> "region/index" of the replica that served it, from the emulators' ``request_finished``
    lines (JSON, one per request) in ``log_dir/emulator-*.log``. A replica is known by its port."""
    replica_of = {u.rsplit(":", 1)[1]: f"{g}/{i}" for g, urls in replica_urls.items() for i, u in enumerate(urls)}
    out: dict[str, str] = {}
    for path in sorted(Path(log_dir).glob("emulator-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"request_finished"' not in line:
                continue
            try:
                event = json.loads(line)
                out[event["request_id"]] = replica_of[str(event["replica"]).rsplit(":", 1)[1]]
            except (ValueError, KeyError, TypeError):
                continue  # not one of this run's replicas, or a line cut by a kill
    return out


def figures_of(records: list[RequestRecord], wall_s: float, *, duration_s: float, served: dict[str, str],
               cpu: dict[str, float]) -> dict[str, Any]:
    """One system's figures of one run: bench/live/harness.py ``summarize`` of every request sent, with

    ``throughput_rps`` and ``output_tokens_per_s`` over the send window: completed requests (their output tokens)
    that ended within ``duration_s`` of the start, per second of it (``completed_in_window``: how many); latencies
    and hit rate count every completed request, those that ended after the window too (cutting them would drop the
    longest). Added: ``cross_region_frac`` (completed requests served by a replica outside the client's region,
    by the engines' logs), ``served_frac`` ({region: share of the completed requests its replicas served}),
    ``served_unknown`` (completed requests no log line names), ``forwarded_frac`` (SkyLB's own count:
    ``X-SkyLB-Route`` peer:*; None when no response carried the header), ``cpu_s`` ({"system", "replicas", "proxy",
    "clients": CPU s over the replay}), ``cpu_ms_per_request`` (the system's own processes, per completed
    request), ``cpu_busy_frac`` (all of them / (wall x cores)), ``region_ttft_p90_ms`` ({client region: ms}) and
    ``rules`` ({``X-SkyLB-Rule``: {"completed", "ttft_p90_ms"}}, bench/replay/report.py; empty for other systems).
    """
    f = summarize(records, wall_s)
    done = [r for r in records if r.ok]
    ended = [r for r in done if r.sent_s is not None and r.sent_s + (r.e2e_ms or 0) / 1000 <= duration_s]
    f.update(completed_in_window=len(ended), throughput_rps=len(ended) / duration_s,
             output_tokens_per_s=sum(r.completion_tokens or 0 for r in ended) / duration_s)
    where = [served.get(r.response_id or "") for r in done]
    known = [(r, w.split("/")[0]) for r, w in zip(done, where) if w]
    f["served_unknown"] = len(done) - len(known)
    f["cross_region_frac"] = sum(g != r.region for r, g in known) / len(known) if known else None
    f["served_frac"] = {g: sum(s == g for _, s in known) / len(known) for g in REGIONS} if known else {}
    routed = [r for r in done if r.route is not None]
    f["forwarded_frac"] = (sum(r.route.startswith("peer:") for r in routed) / len(routed)) if routed else None
    f["cpu_s"] = dict(cpu)
    f["cpu_ms_per_request"] = 1000 * cpu["system"] / len(done) if done else None
    f["cpu_busy_frac"] = sum(cpu.values()) / (wall_s * (os.cpu_count() or 1)) if wall_s > 0 else None
    report = build_report(records, wall_s)
    regions = report["regions"]
    f["region_ttft_p90_ms"] = {g: regions.get(g, {}).get("ttft_p90_ms") for g in REGIONS}
    f["rules"] = report["total"]["rules"]  # by X-SkyLB-Rule (SkyLB only): completed requests, TTFT p90
    return f


def _cpu_s(deployment) -> dict[str, float]:
    """CPU time used so far (s): the system's own processes, the replicas, the latency proxy, and this process
    (the clients)."""
    procs = deployment.procs
    return {"system": sum(procs.cpu_seconds(prefix) for prefix in deployment.own),
            "replicas": procs.cpu_seconds("emulator-"), "proxy": procs.cpu_seconds("toxiproxy"),
            "clients": time.process_time()}


def _dry_regions(sessions: list[list[Request]], records: list[RequestRecord]) -> list[str]:
    """Regions whose clients started every session of their pool (so some may have idled before the window
    ended: the pool was too small)."""
    started = {r.session_id for r in records}
    return [g for g in REGIONS if all(s[0].session_id in started for s in sessions if s[0].region == g)]


def run_system(system: PeersSystem, setup: PeersSetup, sessions: list[list[Request]], *, run_dir: Path,
               progress: bool | None = None) -> dict[str, Any]:
    """Run the clients on ``sessions`` through a fresh deployment of ``system`` for ``setup.duration_s``; returns its
    row.

    Row: ``{"system", "status": "ok"|"skipped"|"failed", "reason", "figures": figures_of(...) + "pool_dry"
    (:func:`_dry_regions`), "entry" (the URLs the clients called), "load"}``. Every process is stopped before it
    returns; the records go to ``run_dir/<system>/records.json``.
    """
    reason = unavailable_reason(system.kind) if system.kind != "skylb" else None
    if reason:
        return {"system": system.name, "status": "skipped", "reason": reason}
    sys_dir = Path(run_dir) / system.name
    sys_dir.mkdir(parents=True, exist_ok=True)
    deployment = (_SkyLBDeployment if system.kind == "skylb" else RouterDeployment)(system, setup, sys_dir)
    load = MachineLoad().start()
    try:
        deployment.start()
        cpu0 = _cpu_s(deployment)
        result = asyncio.run(replay_sessions(sessions, client_split(setup.clients), deployment.entry_urls,
                                             model=MODEL, request_timeout_s=setup.request_timeout_s,
                                             issue_s=setup.duration_s, ramp_s=setup.ramp_s, progress=progress))
        cpu = {k: v - cpu0[k] for k, v in _cpu_s(deployment).items()}
    except (RuntimeError, OSError, Unavailable) as exc:
        return {"system": system.name, "status": "failed", "reason": str(exc)[:2000], "load": load.stop()}
    finally:
        deployment.stop()
    write_json({"records": [r.to_dict() for r in result.records]}, sys_dir / "records.json")
    served = served_regions(sys_dir / "logs", deployment.replica_urls)
    figures = figures_of(result.records, result.wall_s, duration_s=setup.duration_s, served=served, cpu=cpu)
    figures["pool_dry"] = _dry_regions(sessions, result.records)
    return {"system": system.name, "status": "ok", "entry": dict(deployment.entry_urls), "figures": figures,
            "load": load.stop()}


def run_peers(systems: Sequence[str] | None = None, *, setup: PeersSetup | None = None, runs: int = 5,
              run_dir: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Run every system of ``systems`` (default all of :data:`SYSTEMS`) ``runs`` times in interleaved rounds.

    Round k (1-based) uses workload seed ``setup.seed + k - 1`` for every system and starts with the k-th system
    (rotated), so neither a drift of the machine's load nor going first falls on one system. Returns ``{"setup",
    "clients", "runs": [[row per system] per round], "rows" (every row, with "run" and "seed"), "workloads" ({seed:
    one line}), "rtt_ms", "versions", "wall_s", "load", "run_dir", "generated"}``.
    """
    setup = setup or PeersSetup()
    names = list(systems or SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    if runs < 1:
        raise ValueError("runs must be >= 1")
    if not Path(setup.trace).is_file():
        raise FileNotFoundError(f"trace not found: {setup.trace}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="peers-"))
    load = MachineLoad().start()
    t0 = time.monotonic()
    rounds, described = [], {}
    pools = {setup.seed + k: workload(setup, setup.seed + k) for k in range(runs)}  # a bad trace fails before run 1
    for k in range(runs):
        seed = setup.seed + k
        sessions = pools[seed]
        described[seed] = _describe(sessions)
        order = names[k % len(names):] + names[:k % len(names)]
        rows = []
        for name in order:
            print(f"[bench.live.peers] run {k + 1}/{runs} (seed {seed}) {name} ...", file=sys.stderr, flush=True)
            row = run_system(SYSTEMS[name], setup, sessions, run_dir=run_dir / f"run{k + 1}", progress=progress)
            row.update(run=k + 1, seed=seed)
            f = row.get("figures") or {}
            print(f"[bench.live.peers] run {k + 1}/{runs} {name}: {row['status']} {row.get('reason', '')}".rstrip()
                  + (f" {f['completed_in_window']} completed in the window, {f['completed']}/{f['sent']} in all, "
                     f"{f['wall_s']:.0f} s" if f else ""),
                  file=sys.stderr, flush=True)
            rows.append(row)
        rounds.append(sorted(rows, key=lambda r: names.index(r["system"])))
    return {"setup": asdict(setup), "clients": client_split(setup.clients), "systems": names, "runs": rounds,
            "rows": [r for rows in rounds for r in rows], "workloads": described,
            "rtt_ms": _latency(setup).rtt_ms, "versions": versions(), "wall_s": time.monotonic() - t0,
            "load": load.stop(), "run_dir": str(run_dir), "generated": now_label()}


def _describe(sessions: list[list[Request]]) -> str:
    """One line about a run's sessions: requests and sessions per region, turns, mean prompt and output tokens."""
    reqs = [r for s in sessions for r in s]
    per = {g: (sum(len(s) for s in sessions if s[0].region == g), sum(s[0].region == g for s in sessions))
           for g in REGIONS}
    return (f"{len(reqs)} requests in {len(sessions)} sessions ("
            + ", ".join(f"{g} {n} in {m}" for g, (n, m) in per.items())
            + f"), {sum(len(s) > 1 for s in sessions)} sessions of 2-{max(len(s) for s in sessions)} turns; "
            f"prompt {sum(r.prompt_tokens for r in reqs) / len(reqs):.0f} tokens on average (max "
            f"{max(r.prompt_tokens for r in reqs)}), output {sum(r.output_tokens for r in reqs) / len(reqs):.0f}")


# ---------------------------------------------------------------------------------------------------- summary


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


#: The figures (keys of a row's figures) summarized over runs.
#: The most CPU SkyLB's whole deployment may use per completed request, ms (acceptance line 4).
CPU_MS_PER_REQUEST_TARGET = 5.0

_SUMMARY_KEYS = ("throughput_rps", "ttft_p50_ms", "ttft_p90_ms", "cross_region_frac", "forwarded_frac",
                 "prefix_hit_rate", "cpu_ms_per_request", "cpu_busy_frac", "completed_in_window", "wall_s")


def summary(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system over its ok runs: ``{figure: [value per ok run]}`` for :data:`_SUMMARY_KEYS`, the client regions'
    TTFT p90 (``ttft_p90_<region>``), the regions' served shares (``served_<region>``), ``completed``, ``sent``,
    ``ok_runs`` and ``runs``."""
    out: dict[str, dict[str, Any]] = {}
    for name in result["systems"]:
        rows = [r for r in result["rows"] if r["system"] == name]
        ok = [r["figures"] for r in rows if r["status"] == "ok"]
        s: dict[str, Any] = {key: [f[key] for f in ok if f.get(key) is not None] for key in _SUMMARY_KEYS}
        for g in REGIONS:
            s[f"ttft_p90_{g}"] = [f["region_ttft_p90_ms"][g] for f in ok if f["region_ttft_p90_ms"].get(g) is not None]
            s[f"served_{g}"] = [f["served_frac"][g] for f in ok if f["served_frac"]]
        s.update(completed=sum(f["completed"] for f in ok), sent=sum(f["sent"] for f in ok), ok_runs=len(ok),
                 runs=len(rows))
        out[name] = s
    return out


def acceptance(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The acceptance lines for ``skylb``, each ``{"text", "status": "MET"|"MISSED"|"NOT EVALUATED"}``:

    1. its mean TTFT p90 is below every other system's, and lower than each other system's in at least 4 of 5
       paired runs (the same seed; ceil(0.8 x runs) in general);
    2. its mean throughput is at least every other system's;
    3. its mean TTFT p90 is at most half the best (lowest) of the single balancers in us (:data:`SINGLE_BALANCERS`);
    4. the CPU its whole deployment (balancers and controller) uses per completed request is at most
       :data:`CPU_MS_PER_REQUEST_TARGET` on average (what it takes from the machine its replicas share).
    A line whose systems did not all complete a run is NOT EVALUATED.
    """
    s = summary(result)
    mean = {name: {k: _mean(v) for k, v in fig.items() if isinstance(v, list)} for name, fig in s.items()}
    others = [n for n in s if n != "skylb" and s[n]["ok_runs"]]
    if "skylb" not in s or not s["skylb"]["ok_runs"] or not others:
        return [{"text": "skylb and at least one other system must complete a run", "status": "NOT EVALUATED"}]
    me = mean["skylb"]
    need = math.ceil(0.8 * len(result["runs"]))
    wins = {n: _paired_wins(result, n) for n in others}
    lines = []
    below = all(me["ttft_p90_ms"] < mean[n]["ttft_p90_ms"] for n in others)
    paired = all(won >= need for won, _ in wins.values())
    lines.append({"status": "MET" if below and paired else "MISSED", "text": (
        f"SkyLB's mean TTFT p90 ({me['ttft_p90_ms']:.0f} ms) is below every other system's ("
        + ", ".join(f"{n} {mean[n]['ttft_p90_ms']:.0f}" for n in others)
        + f") and lower in >= {need} of {len(result['runs'])} paired runs against each ("
        + ", ".join(f"{n} {won}/{pairs}" for n, (won, pairs) in wins.items()) + ")")})
    top = all(me["throughput_rps"] >= mean[n]["throughput_rps"] for n in others)
    lines.append({"status": "MET" if top else "MISSED", "text": (
        f"SkyLB's mean throughput ({me['throughput_rps']:.2f} req/s) is at least every other system's ("
        + ", ".join(f"{n} {mean[n]['throughput_rps']:.2f}" for n in others) + ")")})
    singles = [n for n in SINGLE_BALANCERS if n in others]
    if not singles:
        lines.append({"status": "NOT EVALUATED", "text": "no single balancer in us completed a run"})
    else:
        best = min(singles, key=lambda n: mean[n]["ttft_p90_ms"])
        ratio = me["ttft_p90_ms"] / mean[best]["ttft_p90_ms"]
        lines.append({"status": "MET" if ratio <= 0.5 else "MISSED", "text": (
            f"SkyLB's mean TTFT p90 is <= 0.5x the best single balancer in us ({best}, "
            f"{mean[best]['ttft_p90_ms']:.0f} ms): {ratio:.2f}x")})
    cpu = me.get("cpu_ms_per_request")
    if cpu is not None:
        lines.append({"status": "MET" if cpu <= CPU_MS_PER_REQUEST_TARGET else "MISSED", "text": (
            f"SkyLB's deployment uses at most {CPU_MS_PER_REQUEST_TARGET:g} ms of CPU per request: {cpu:.1f} ms ("
            + ", ".join(f"{n} {mean[n]['cpu_ms_per_request']:.1f}" for n in others
                        if mean[n].get("cpu_ms_per_request") is not None) + ")")})
    return lines


def _paired_wins(result: dict[str, Any], other: str) -> tuple[int, int]:
    """(runs in which skylb's TTFT p90 was lower than ``other``'s, runs in which both completed)."""
    won = pairs = 0
    for rows in result["runs"]:
        by = {r["system"]: r for r in rows if r["status"] == "ok"}
        if "skylb" in by and other in by:
            pairs += 1
            won += by["skylb"]["figures"]["ttft_p90_ms"] < by[other]["figures"]["ttft_p90_ms"]
    return won, pairs


# ----------------------------------------------------------------------------------------------------- report


def _spread(values: Sequence[float], fmt: str = "{:.0f}", scale: float = 1.0) -> str:
    """``mean [min, max]`` of ``values`` x ``scale``; the value alone for one run; "-" for none."""
    if not values:
        return "-"
    vals = [v * scale for v in values]
    text = fmt.format(sum(vals) / len(vals))
    return text if len(vals) == 1 else f"{text} [{fmt.format(min(vals))}, {fmt.format(max(vals))}]"


def _f(value, fmt: str = "{:.0f}", scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _summary_table(result: dict[str, Any]) -> str:
    s = summary(result)
    body = []
    for name, x in s.items():
        system = SYSTEMS[name]
        entry = "each region's own" if system.placement == "per-region" else f"one in {HOME}"
        if not x["ok_runs"]:
            body.append([name, entry, f"no ok run of {x['runs']}"])
            continue
        across = _spread(x["cross_region_frac"], "{:.1f}%", 100)
        if x["forwarded_frac"]:
            across += f" (fwd {_spread(x['forwarded_frac'], '{:.1f}%', 100)})"
        body.append([name, entry, f"{x['completed']}/{x['sent']}", _spread(x["completed_in_window"]),
                     _spread(x["throughput_rps"], "{:.2f}"),
                     _spread(x["ttft_p50_ms"]), _spread(x["ttft_p90_ms"]),
                     " / ".join(_f(_mean(x[f"ttft_p90_{g}"])) for g in REGIONS), across,
                     " / ".join(_f(_mean(x[f"served_{g}"]), "{:.0f}%", 100) for g in REGIONS),
                     _spread(x["prefix_hit_rate"], "{:.1f}%", 100), _spread(x["cpu_ms_per_request"], "{:.1f}"),
                     _spread(x["cpu_busy_frac"], "{:.0f}%", 100)])
    return markdown_table(["system", "balancers", "ok/sent", "in window", "req/s", "TTFT p50 ms", "TTFT p90 ms",
                           "TTFT p90 us / eu / asia clients (mean)", "served across regions",
                           "served by us / eu / asia replicas (mean)", "prefix hit", "CPU ms/request",
                           "machine busy"], body)


def _run_row(row: dict[str, Any]) -> list[str]:
    head = [str(row["run"]), str(row["seed"]), row["system"]]
    if row["status"] != "ok":
        return head + [f"{row['status']}: {(row.get('reason') or '').splitlines()[0][:160].replace('|', '/')}"]
    f = row["figures"]
    across = _f(f["cross_region_frac"], "{:.1f}%", 100)
    if f["forwarded_frac"] is not None:
        across += f" (fwd {_f(f['forwarded_frac'], '{:.1f}%', 100)})"
    return head + [f"{f['completed']}/{f['sent']}", str(f["completed_in_window"]), _f(f["wall_s"], "{:.1f}"),
                   _f(f["throughput_rps"], "{:.2f}"), _f(f["ttft_p50_ms"]), _f(f["ttft_p90_ms"]),
                   _f(f["e2e_p90_ms"]), across, _f(f["prefix_hit_rate"], "{:.1f}%", 100),
                   _f(f["cpu_ms_per_request"], "{:.1f}"), _f(f["cpu_busy_frac"], "{:.0f}%", 100),
                   str(f["served_unknown"]), ", ".join(f["pool_dry"]) or "-"]


def format_markdown(result: dict[str, Any], notes: str = "") -> str:
    """The result as the Markdown report bench/results/peers.md; ``notes`` (Markdown) is appended as is."""
    runs = len(result["runs"])
    seeds = sorted({r["seed"] for r in result["rows"]})
    lines = ["# SkyLB beside one balancer in us and one balancer per region: three regions, live", "",
             f"Generated on {result.get('generated') or now_label()}; {runs} paired run(s) (workload seeds "
             f"{', '.join(map(str, seeds))}; within a run every system gets the same sessions; systems interleaved, "
             f"the first rotated each run), whole run {result['wall_s']:.0f} s. Versions: sglang-router "
             f"{result['versions'].get('sglang-router')}, {result['versions'].get('haproxy')}, Python "
             f"{result['versions'].get('python')}.", "",
             "## Acceptance", "",
             *(f"- **{a['status']}**: {a['text']}." for a in acceptance(result)), "",
             "## Over the runs", "",
             "Cells: mean [min, max] over the ok runs.", "",
             _summary_table(result), "",
             "## Each run", "",
             markdown_table(["run", "seed", "system", "ok/sent", "in window", "wall s", "req/s", "TTFT p50",
                             "TTFT p90", "E2E p90", "served across regions", "prefix hit", "CPU ms/request",
                             "machine busy", "unattributed", "pool ran dry"], [_run_row(r) for r in result["rows"]]),
             "", *_definitions(result), *_setup_lines(result)]
    windows = {**result, "rows": [{**r, "system": f"{r['system']} #{r['run']}"} for r in result["rows"]]}
    lines += report_tail(windows, f"all {3 * result['setup']['replicas']} replicas (3 emulator processes), the "
                                  "systems, the latency proxy and the clients share them", notes)
    return "\n".join(lines)


def _definitions(result: dict[str, Any]) -> list[str]:
    window = result["setup"]["duration_s"]
    return [f"Throughput: requests completed within the {window:g} s send window of the closed-loop run, per second "
            "of it (\"in window\"; the clients send for that long, then their requests in flight finish: ok/sent "
            "counts all, wall s until the last ended). TTFT (ms at the client to the first SSE chunk with text), "
            "E2E and prefix hit count every completed request (a client in eu or asia of a system in us pays its "
            "round trip to us in its TTFT). Served across regions: "
            "completed requests served by a replica outside the client's region, by the replicas' request logs "
            "(the completion id names the replica; \"unattributed\": completed requests no log line names); for "
            "SkyLB, fwd is the balancers' own count (`X-SkyLB-Route: peer:*`). Prefix hit: cached prompt tokens / "
            "prompt tokens, from the replicas' `usage`. CPU ms/request: CPU time of the system's own processes "
            "during the replay (SkyLB: its balancers and controller; SGLang: the router; HAProxy: its instances; "
            "never the replicas, the proxy or the clients), per completed request. Machine busy: CPU time of every "
            "process of the run (system, replicas, proxy, clients) over the replay / (wall x cores): near 100% the "
            "emulated engines' steps run late and every figure is the machine's as much as the system's. Pool ran "
            "dry: regions whose clients started every session drawn for the run (then some idled; none should).",
            ""]


def _setup_lines(result: dict[str, Any]) -> list[str]:
    s, clients = result["setup"], result["clients"]
    rtt = ", ".join(f"{k} {v:g} ms" for k, v in result["rtt_ms"].items())
    cache = launch_options(SYSTEMS["sglang-cache_aware"], PeersSetup(**s))
    hap = launch_options(SYSTEMS["haproxy-us"], PeersSetup(**s))
    return ["## Setup", "",
            f"- Replicas: {s['replicas']} emulated vLLM replicas per region (`--max-num-seqs {s['max_num_seqs']}`, "
            f"`--time-scale {s['time_scale']:g}`: Llama-3.1-8B on an L4), one emulator process per region, started "
            "fresh for every system and run (cold prefix caches). Round trips between regions: "
            f"{rtt}, injected by the latency proxy (bench/latency, Toxiproxy's API; half each way, per chunk, the "
            "TCP handshake not delayed).",
            "- `skylb`, `skylb-ch`: bench/launch/local.py `Deployment` (as bench/live/regions.py): controller, one balancer per "
            "region with the default config (probe every 100 ms, tau 2, `max_dispatch_per_probe 4`), peers "
            "reached through a link per ordered pair of regions.",
            f"- `sglang-*`: one SGLang router in {HOME} (`python -m sglang_router.launch_router`); its worker URLs "
            f"for the {s['replicas'] * 2} eu and asia replicas are links with that region's round trip to "
            f"{HOME}. cache_aware: `--cache-threshold {cache['cache_threshold']}`, `--balance-abs-threshold "
            f"{cache['balance_abs_threshold']}`, `--balance-rel-threshold {cache['balance_rel_threshold']}`: the "
            "defaults 64 / 1.5 can never trigger on replicas that run "
            f"{s['max_num_seqs']} requests at once, so the absolute threshold is half a batch (balancing starts "
            f"when the busiest replica queues while the least busy has half its batch free); the cache threshold "
            "and the ratio are fractions and keep their defaults. round_robin: defaults.",
            f"- `haproxy-us`: one HAProxy in {HOME} (bench/launch/launchers.py config: `mode http`, `option "
            f"http-no-delay`), `balance leastconn`, per server `maxconn {hap['maxconn']}` (the batch; HAProxy holds "
            f"the rest in its queue, `timeout queue {hap['timeout_queue_s']:g}s`, the client's request timeout), "
            "servers as for the router. `haproxy-per-region`: the same settings, one HAProxy per region in front "
            "of its own replicas (nothing crosses regions).",
            f"- Clients: {sum(clients.values())} closed-loop clients ("
            + ", ".join(f"{g} {n}" for g, n in clients.items())
            + "), one request in flight each (bench/replay/run.py `replay_sessions`, streamed `/v1/completions`, "
            f"`ignore_eos`), started over {s['ramp_s']:g} s. A client runs its region's sessions of "
            f"`{Path(s['trace']).name}` turn by turn (bench/replay/workload.py `trace_sessions`: sessions derived from "
            f"the trace's hash ids, assigned to regions us 0.6 / eu 0.2 / asia 0.2), each turn 0.2-1.0 s (seeded) "
            f"after its previous request ended, at most {s['max_turns']} turns per session, prompts and outputs x "
            f"{s['token_scale']:g}. Run k's sessions start at session {s['session_stride']} x seed of the trace "
            f"(modulo its sessions), "
            f"{s['pool_requests']} requests in all (more than a run sends). The clients send for "
            f"{s['duration_s']:g} s. Entry points: each region's own balancer (SkyLB, haproxy-per-region); "
            f"for the systems in {HOME}, clients in eu and asia call it through a link with their round trip to "
            f"{HOME}.",
            "- Session pools: " + "; ".join(f"seed {k}: {v}" for k, v in result["workloads"].items()) + ".", ""]


# -------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.live.peers` (`skylb bench peers`)."""
    d = PeersSetup()
    p = argparse.ArgumentParser(prog="python -m bench.live.peers", description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), help="systems to run (default: all)")
    p.add_argument("--runs", type=int, default=5, help="paired runs (interleaved rounds; run k uses seed + k - 1)")
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed of the first run")
    p.add_argument("--replicas", type=int, default=d.replicas, help="replicas per region")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running batch per replica")
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="emulated durations x this")
    p.add_argument("--clients", type=int, default=d.clients, help="closed-loop clients in all (us 0.6, eu 0.2, "
                   "asia 0.2)")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="send window of a run, s")
    p.add_argument("--pool-requests", type=int, default=d.pool_requests, help="requests in the sessions a run "
                   "draws from (whole sessions; more than a run sends)")
    p.add_argument("--token-scale", type=float, default=d.token_scale, help="prompt and output lengths x this")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="turns kept per session")
    p.add_argument("--trace", default=d.trace, help="Mooncake-format trace (default: %(default)s)")
    p.add_argument("--out-md", default="bench/results/peers.md", help="Markdown report ('' for none)")
    p.add_argument("--out-json", default=None, help="the raw result (default: beside --out-md, .json)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report (analysis)")
    p.add_argument("--run-dir", default=None, help="logs and state (default: a new temporary directory)")
    p.add_argument("--balancer-option", action="append", default=[], metavar="KEY=VALUE", type=_balancer_option,
                   help="a SkyLB balancer setting over the defaults (a BalancerConfig field; VALUE read as YAML), "
                        "e.g. probe_interval_ms=500; repeat for several")
    p.add_argument("--no-progress", action="store_true")
    return p


def _balancer_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--balancer-option``: (key, VALUE parsed as YAML: 500 is a number, true a boolean)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the report; 0 when every system that could run completed every request."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    setup = PeersSetup(replicas=args.replicas, max_num_seqs=args.max_num_seqs, time_scale=args.time_scale,
                       clients=args.clients, duration_s=args.duration_s, pool_requests=args.pool_requests,
                       token_scale=args.token_scale,
                       max_turns=args.max_turns, trace=args.trace, seed=args.seed,
                       balancer_options=dict(args.balancer_option) or None)
    try:  # a misspelt or invalid --balancer-option fails here, before anything starts
        skylb_config(setup, "skylb")
    except ValidationError as exc:
        parser.error(f"--balancer-option: {exc}")
    prov = provenance(shlex.join(["python", "-m", "bench.live.peers", *argv]))  # the commit the run starts from
    result = run_peers(args.systems, setup=setup, runs=args.runs,
                       run_dir=Path(args.run_dir) if args.run_dir else None,
                       progress=False if args.no_progress else None)
    result["provenance"] = prov
    text = format_markdown(result, Path(args.notes).read_text() if args.notes else "")
    out_json = args.out_json or (str(Path(args.out_md).with_suffix(".json")) if args.out_md else None)
    emit_markdown(text, result, out_md=args.out_md, out_json=out_json)
    bad = [r for r in result["rows"] if r["status"] == "failed" or (r["status"] == "ok" and r["figures"]["failed"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
