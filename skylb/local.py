"""`skylb local`: a whole multi-region SkyLB deployment on this machine, a workload replay, and the report.

It starts, as real processes talking real HTTP: the controller; one emulator process per region serving that
region's replicas (or, with ``emulator.engine: llamacpp`` or ``--llamacpp``, one real llama.cpp ``llama-server``
per replica, see skylb/llamacpp.py); the latency proxy (Toxiproxy API; a real Toxiproxy when TOXIPROXY_URL is set)
with one link per ordered pair of regions carrying the configured round trip; one balancer per region, reaching
each peer through its link. It registers the replicas through the controller's API, waits until every balancer sees them, replays the
workload with each region's clients calling their own region's balancer (the launcher plays DNS), prints the report
and writes it as JSON. Every process it started is stopped at the end, also on Ctrl-C, SIGTERM or failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench.replay import replay_and_report
from bench.report import format_table
from skylb.config import ConfigError, DeploymentConfig, load_config
from skylb.core import policy_names
from skylb.llamacpp import (LlamaCppUnavailable, gemma_model_path, llama_server_binary, llama_server_command,
                            model_alias)
from skylb.latency.links import LatencyLinks
from skylb.procs import ProcGroup, free_ports, wait_http

__all__ = ["add_arguments", "main", "Deployment", "LLAMACPP_REPLICAS", "LLAMACPP_MAX_TOKEN_SCALE"]

#: With --llamacpp: llama-server replicas per region (unless --replicas says otherwise); each runs on the CPU.
LLAMACPP_REPLICAS = 1
#: With --llamacpp: the workload's token_scale is capped at this, so that prompts (a Mooncake request has up to
#: ~120k tokens; at 0.01 about 1.2k) fit one slot's context (2048 tokens by default) and a replay on real CPU
#: inference (~80 tokens/s decode, ~350 tokens/s prefill on 2 cores, shared/reference/engines.md) ends in minutes.
LLAMACPP_MAX_TOKEN_SCALE = 0.01
#: How long one llama-server may take to load its model before /health answers 200 (s).
LLAMACPP_START_TIMEOUT_S = 120.0


def _say(msg: str) -> None:
    print(f"[skylb local] {msg}", flush=True)


class Deployment:
    """The processes of one local deployment.

    Args:
        cfg: the deployment config; run_dir: where logs, the controller's DB and balancer state go.
    """

    #: Wait, before the replay, until every balancer has a status from every peer (False: region-local runs).
    expects_peers = True

    def __init__(self, cfg: DeploymentConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs = ProcGroup(run_dir / "logs", pid_file=run_dir / "pids")
        self.links: LatencyLinks | None = None
        self.controller_url = ""
        self.balancer_urls: dict[str, str] = {}
        self.replica_urls: dict[str, list[str]] = {}

    def start(self) -> None:
        """Start every process and register the replicas; raises RuntimeError naming the part that failed."""
        cfg, regions = self.cfg, list(self.cfg.regions)
        n_replicas = sum(r.replicas for r in cfg.regions.values())
        ports = iter(free_ports(2 + len(regions) + n_replicas))
        controller_port, proxy_port = next(ports), next(ports)
        balancer_ports = {r: next(ports) for r in regions}
        self.replica_urls = {r: [f"http://127.0.0.1:{next(ports)}" for _ in range(cfg.regions[r].replicas)]
                             for r in regions}
        config_path = self._write_config()

        self.controller_url = f"http://127.0.0.1:{controller_port}"
        _say(f"controller on {self.controller_url}")
        self.procs.skylb("controller", "--config", str(config_path), "--port", str(controller_port),
                         "--db", str(self.run_dir / "controller.sqlite"), name="controller",
                         wait_url=f"{self.controller_url}/healthz")

        if cfg.emulator.engine == "llamacpp":
            self._start_llama_servers()
        for region, urls in self.replica_urls.items():
            if not urls or cfg.emulator.engine == "llamacpp":
                continue
            port_args = [a for u in urls for a in ("--port", u.rsplit(":", 1)[1])]
            _say(f"{region}: {len(urls)} emulated {cfg.emulator.engine} replicas on ports "
                 f"{', '.join(u.rsplit(':', 1)[1] for u in urls)}")
            self.procs.skylb("emulator", "--engine", cfg.emulator.engine, "--model", cfg.emulator.model,
                             "--time-scale", str(cfg.emulator.time_scale), *port_args, *cfg.emulator.extra_args,
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
                rtt = cfg.latency.rtt(a, b)
                listen = self.links.link(f"skylb-{a}-to-{b}", f"127.0.0.1:{balancer_ports[b]}", rtt_ms=rtt,
                                         jitter_ms=cfg.latency.jitter_ms)
                peer_args[a] += ["--peer-url", f"{b}=http://{listen}"]
                _say(f"link {a} -> {b}: round trip {rtt:g} ms via {listen}")

        for region in regions:
            url = f"http://127.0.0.1:{balancer_ports[region]}"
            self.balancer_urls[region] = url
            self.procs.skylb("balancer", "--config", str(config_path), "--region", region,
                             "--port", str(balancer_ports[region]), "--controller", self.controller_url,
                             *peer_args[region], name=f"balancer-{region}", wait_url=f"{url}/healthz")
            _say(f"{region}: balancer on {url}")

        for region, urls in self.replica_urls.items():
            for url in urls:
                _post_json(f"{self.controller_url}/v1/replicas",
                           {"region": region, "url": url, "engine": cfg.emulator.engine})
        _say(f"registered {n_replicas} replicas through the controller")
        self._wait_ready()

    def _start_llama_servers(self) -> None:
        """Start one real llama-server per replica (all loading at once), wait until each answers /health with 200,
        and check that each reports the expected model id on /v1/models.

        Raises RuntimeError when llama-server or the model cannot be had, or a server does not come up.
        """
        emu = self.cfg.emulator
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
        path = self.run_dir / "config.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def _wait_ready(self, timeout_s: float = 20.0) -> None:
        """Wait until every balancer sees all its replicas and (``expects_peers``) every peer answered a status."""
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = []
            for region, url in self.balancer_urls.items():
                status = _get_json(f"{url}/skylb/v1/status?format=json")
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


def _post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def deployment_checks(doc: dict, cfg: DeploymentConfig) -> list[tuple[str, bool, str]]:
    """What a local run must show, from the replay's records: (check, passed, evidence) triples.

    Every region served requests (its replicas completed some: its own clients' or forwarded ones, so a region
    without clients in a short replay still counts when it took overflow); some requests were forwarded across
    regions (the balancer forwards only when no local replica is available); no request was lost (completed +
    failed = sent, failed = 0); each forwarded request's TTFT is at least the injected round trip between its
    region and the peer that served it.
    """
    records, total = doc["records"], doc["report"]["total"]
    ok = [x for x in records if x["error"] is None]
    forwarded = [x for x in ok if (x["route"] or "").startswith("peer:")]
    served_in = dict.fromkeys(cfg.regions, 0)
    for x in ok:  # a forwarded request was served in the peer's region ("peer:eu"), any other in the client's
        route = x["route"] or ""
        where = route[5:] if route.startswith("peer:") else x["region"]
        served_in[where] = served_in.get(where, 0) + 1
    sent_from = {r: sum(1 for x in records if x["region"] == r) for r in cfg.regions}
    short = [x for x in forwarded
             if x["ttft_ms"] is None or x["ttft_ms"] < cfg.latency.rtt(x["region"], x["route"][5:])]
    min_margin = min((x["ttft_ms"] - cfg.latency.rtt(x["region"], x["route"][5:]) for x in forwarded
                      if x["ttft_ms"] is not None), default=None)
    return [
        ("every region served requests", all(served_in.values()),
         "served by each region's replicas: " + ", ".join(f"{r} {n}" for r, n in served_in.items())
         + "; sent from: " + ", ".join(f"{r} {n}" for r, n in sent_from.items())),
        ("requests forwarded across regions", bool(forwarded), f"{len(forwarded)} forwarded"),
        ("no request lost", total["completed"] + total["failed"] == total["sent"] and total["failed"] == 0,
         f"sent {total['sent']}, completed {total['completed']}, failed {total['failed']}"),
        ("forwarded TTFT includes the round trip", bool(forwarded) and not short,
         f"{len(short)} below their RTT" + ("" if min_margin is None else
                                             f"; smallest TTFT - RTT = {min_margin:.0f} ms")),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `skylb local`."""
    parser.add_argument("--config", help="deployment YAML (default: the embedded configs/local-3region.yaml)")
    parser.add_argument("--trace", help="Mooncake trace to replay (default: workload.trace of the config, "
                        "when the file exists)")
    parser.add_argument("--synthetic", action="store_true", help="replay the synthetic multi-turn workload")
    parser.add_argument("--policy", choices=policy_names(), metavar="NAME",
                        help="routing policy of every balancer: " + ", ".join(policy_names()))
    parser.add_argument("--replicas", type=int, help="emulated replicas per region (overrides the config)")
    parser.add_argument("--llamacpp", action="store_true",
                        help=f"real llama.cpp llama-server replicas (gemma-3-270m on the CPU) instead of emulated "
                        f"ones: {LLAMACPP_REPLICAS} per region unless --replicas, workload token_scale at most "
                        f"{LLAMACPP_MAX_TOKEN_SCALE:g}; builds llama-server first when missing (~5 min)")
    parser.add_argument("--window-s", type=float, help="trace window to replay (trace time, s)")
    parser.add_argument("--max-requests", type=int, help="replay at most this many requests")
    parser.add_argument("--out", help="where to write the report JSON (default: in the run directory)")
    parser.add_argument("--run-dir", help="where logs and state go (default: a new directory under .skylb-run/)")
    parser.add_argument("--keep-running", action="store_true",
                        help="after the replay, keep the deployment up until Ctrl-C (to try it by hand)")


def _apply_overrides(cfg: DeploymentConfig, args: argparse.Namespace) -> DeploymentConfig:
    data = cfg.model_dump()
    if args.policy:
        data["balancer"]["policy"] = args.policy
    if getattr(args, "llamacpp", False):
        data["emulator"]["engine"] = "llamacpp"
        data["workload"]["token_scale"] = min(data["workload"]["token_scale"], LLAMACPP_MAX_TOKEN_SCALE)
        for region in data["regions"].values():
            region["replicas"] = min(region["replicas"], LLAMACPP_REPLICAS)
    if args.replicas is not None:
        for region in data["regions"].values():
            region["replicas"] = args.replicas
    if args.synthetic:
        data["workload"]["trace"] = None
    elif args.trace:
        data["workload"]["trace"] = args.trace
    if args.window_s is not None:
        data["workload"]["window_s"] = args.window_s
    if args.max_requests is not None:
        data["workload"]["max_requests"] = args.max_requests
    return DeploymentConfig.model_validate(data)


def main(args: argparse.Namespace) -> int:
    """Run the deployment and the replay; 0 when every request completed, 1 otherwise, 2 on a config error."""
    try:
        cfg = _apply_overrides(load_config(args.config), args)
    except (ConfigError, ValueError) as exc:
        print(f"skylb local: {exc}", file=sys.stderr)
        return 2
    Path(".skylb-run").mkdir(exist_ok=True)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="local-", dir=".skylb-run")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else run_dir / "report.json"

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    deployment = Deployment(cfg, run_dir)
    _say(f"run directory {run_dir} (process logs in logs/)")
    try:
        deployment.start()
        doc = asyncio.run(replay_and_report(cfg.workload, deployment.balancer_urls, out=out, base_dir=Path.cwd()))
        print(doc["workload"]["summary"])
        print(format_table(doc["report"]))
        checks = deployment_checks(doc, cfg)
        for name, ok, evidence in checks:
            print(f"  [{'ok' if ok else 'FAILED'}] {name}: {evidence}")
        print(f"report written to {out}")
        if args.keep_running:
            _say("deployment is up; balancers: " + ", ".join(f"{r}={u}" for r, u in
                                                              deployment.balancer_urls.items()) + "; Ctrl-C stops")
            while True:
                time.sleep(3600)
        return 0 if all(ok for _, ok, _ in checks) else 1
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except RuntimeError as exc:
        print(f"skylb local: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("stopping every process")
        deployment.stop()
