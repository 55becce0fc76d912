"""`skylb local`: a whole multi-region SkyLB deployment on this machine, a workload replay, and the report.

The deployment is bench/launch/local.py's :class:`~bench.launch.local.Deployment` (controller, replicas, latency proxy, one
balancer per region, all real processes talking real HTTP). This module is the demo around it: it reads the
deployment YAML (the ``workload`` section validated by bench/replay/workload.py), applies the command line's overrides,
starts the deployment, replays the workload with each region's clients calling their own region's balancer (the
launcher plays DNS; bench/replay/run.py), prints the report with the deployment checks (:func:`deployment_checks`) and
writes it as JSON. Every process it started is stopped at the end, also on Ctrl-C, SIGTERM or failure.

With ``--dns`` the launcher no longer plays DNS: BIND 9 runs with a view per region, the balancers listen on
127.0.0.11, .12, .13 (one port), and each region's clients call the one service URL (``http://llm.skylb.test:PORT``)
from their region's source address (127.0.11.1, 127.0.12.1, 127.0.13.1), resolving the name against named from
that address (bench/dns/resolver.py; the system resolver can neither ask a given port nor pick the source). The
report then also checks that the name resolved to each region's own balancer (:func:`dns_check`).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.launch import interrupts
from bench.replay.run import replay_and_report
from bench.replay.report import format_table
from bench.launch.settings import emulator_settings, latency_settings
from bench.replay.workload import WorkloadConfig, workload_settings
from skylb.config import ConfigError, DeploymentConfig, default_config_path, load_config
from skylb.core import policy_names
from bench.dns.resolver import SourceResolver, region_connector
from bench.launch.local import Deployment

__all__ = ["add_arguments", "main", "apply_overrides", "deployment_checks", "dns_check", "LLAMACPP_REPLICAS",
           "LLAMACPP_MAX_TOKEN_SCALE"]

#: With --llamacpp: llama-server replicas per region (unless --replicas says otherwise); each runs on the CPU.
LLAMACPP_REPLICAS = 1
#: With --llamacpp: the workload's token_scale is capped at this, so that prompts (a Mooncake request has up to
#: ~120k tokens; at 0.01 about 1.2k) fit one slot's context (2048 tokens by default) and a replay on real CPU
#: inference (~80 tokens/s decode, ~350 tokens/s prefill on 2 cores, shared/reference/engines.md) ends in minutes.
LLAMACPP_MAX_TOKEN_SCALE = 0.01


def _say(msg: str) -> None:
    print(f"[skylb local] {msg}", flush=True)


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
    latency = latency_settings(cfg)
    short = [x for x in forwarded
             if x["ttft_ms"] is None or x["ttft_ms"] < latency.rtt(x["region"], x["route"][5:])]
    min_margin = min((x["ttft_ms"] - latency.rtt(x["region"], x["route"][5:]) for x in forwarded
                      if x["ttft_ms"] is not None), default=None)
    return [
        ("every region served requests", all(served_in.values()),
         "served by each region's replicas: " + ", ".join(f"{r} {n}" for r, n in served_in.items())
         + "; sent from: " + ", ".join(f"{r} {n}" for r, n in sent_from.items())),
        ("requests forwarded across regions", bool(forwarded),
         f"{len(forwarded)} of {len(ok)} forwarded ({len(forwarded) / max(1, len(ok)):.0%}); " + _p90_spread(doc)),
        ("no request lost", total["completed"] + total["failed"] == total["sent"] and total["failed"] == 0,
         f"sent {total['sent']}, completed {total['completed']}, failed {total['failed']}"),
        ("forwarded TTFT includes the round trip", bool(forwarded) and not short,
         f"{len(short)} below their RTT" + ("" if min_margin is None else
                                             f"; smallest TTFT - RTT = {min_margin:.0f} ms")),
    ]


async def dns_check(deployment: Deployment) -> tuple[str, bool, str]:
    """(check, passed, evidence): each region's clients, asking named from their own source address, get their own
    region's balancer for the service name."""
    bind = deployment.bind
    assert bind is not None, "dns_check needs a deployment started with dns=True"
    seen, ok = [], True
    for region, source in deployment.client_addresses.items():
        try:
            answer = await SourceResolver(bind.host, bind.port, source=source).addresses(bind.name)
        except OSError as exc:
            answer = [f"error: {exc}"]
        ok = ok and sorted(answer) == sorted(bind.balancers[region])
        seen.append(f"{region} clients ({source}) -> {', '.join(answer)}")
    return (f"{bind.name} resolves to each region's balancer", ok, "; ".join(seen))


def _p90_spread(doc: dict) -> str:
    """The busiest region's TTFT p90 against the least loaded region's (by requests sent), as the demo's headline:
    with forwarding, the busiest region should not wait much longer than the others (issue 8: at most 2x)."""
    regions = {r: v for r, v in doc["report"].get("regions", {}).items()
               if v.get("ttft_p90_ms") is not None and v.get("sent")}
    if len(regions) < 2:
        return "fewer than two regions with a TTFT p90"
    busiest = max(regions, key=lambda r: regions[r]["sent"])
    least = min(regions, key=lambda r: regions[r]["sent"])
    b, l = regions[busiest]["ttft_p90_ms"], regions[least]["ttft_p90_ms"]
    return (f"TTFT p90 of the busiest region ({busiest}, {regions[busiest]['sent']} sent) {b:.0f} ms, "
            f"{b / l:.2f}x the least loaded's ({least}, {regions[least]['sent']} sent, {l:.0f} ms)")


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
    parser.add_argument("--start-s", type=float, help="start of the trace window (trace time, s; the first minute "
                        "of a trace is cache-cold)")
    parser.add_argument("--window-s", type=float, help="trace window to replay (trace time, s)")
    parser.add_argument("--time-compression", type=float, help="divide trace time by this (2 = twice as fast)")
    parser.add_argument("--max-requests", type=int, help="replay at most this many requests")
    parser.add_argument("--out", help="where to write the report JSON (default: in the run directory)")
    parser.add_argument("--run-dir", help="where logs and state go (default: a new directory under .skylb-run/)")
    parser.add_argument("--dns", action="store_true",
                        help="run behind DNS as users do: BIND 9 with a view per region, balancers on 127.0.0.11, "
                        ".12, ...; each region's clients resolve the service name from their own source address")
    parser.add_argument("--keep-running", action="store_true",
                        help="after the replay, keep the deployment up until Ctrl-C (to try it by hand)")


def apply_overrides(cfg: DeploymentConfig, args: argparse.Namespace, *,
                    source: str | Path | None = None) -> tuple[DeploymentConfig, WorkloadConfig]:
    """The deployment and its workload with the command line's overrides (``args`` of :func:`add_arguments`).

    The returned config carries the overridden workload too, so the run directory's config.yaml records what was
    replayed. Raises ConfigError (naming ``source``) for a bad ``workload`` section, ValueError (pydantic's
    ValidationError) for an override out of range.
    """
    data = cfg.model_dump()
    workload = workload_settings(cfg, source=source).model_dump()
    emulator_settings(cfg, source=source), latency_settings(cfg, source=source)  # their typos, before anything runs
    if args.policy:
        data["balancer"]["policy"] = args.policy
    if getattr(args, "llamacpp", False):
        data["emulator"]["engine"] = "llamacpp"
        workload["token_scale"] = min(workload["token_scale"], LLAMACPP_MAX_TOKEN_SCALE)
        for region in data["regions"].values():
            region["replicas"] = min(region["replicas"], LLAMACPP_REPLICAS)
    if args.replicas is not None:
        for region in data["regions"].values():
            region["replicas"] = args.replicas
    if args.synthetic:
        workload["trace"] = None
    elif args.trace:
        workload["trace"] = args.trace
    for key in ("start_s", "window_s", "time_compression"):
        if getattr(args, key, None) is not None:
            workload[key] = getattr(args, key)
    if args.max_requests is not None:
        workload["max_requests"] = args.max_requests
    settings = WorkloadConfig.model_validate(workload)
    data["workload"] = settings.model_dump()
    return DeploymentConfig.model_validate(data), settings


def _region_connector(server: str, port: int, sources: dict[str, str], region: str):
    """The connector of ``region``'s clients: resolve from and connect from its source address (no pool limit:
    the replay is open loop)."""
    return region_connector(server, port, sources[region], limit=0)


def main(args: argparse.Namespace) -> int:
    """Run the deployment and the replay; 0 when every request completed, 1 otherwise, 2 on a config error."""
    try:
        cfg, workload = apply_overrides(load_config(args.config), args, source=args.config or default_config_path())
    except (ConfigError, ValueError) as exc:
        print(f"skylb local: {exc}", file=sys.stderr)
        return 2
    Path(".skylb-run").mkdir(exist_ok=True)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="local-", dir=".skylb-run")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else run_dir / "report.json"

    # `kill -USR1 PID` prints every thread's stack on stderr: what a run that seems stuck is waiting for.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    deployment = Deployment(cfg, run_dir, dns=args.dns)
    _say(f"run directory {run_dir} (process logs in logs/)")
    try:
        # Ctrl-C or SIGTERM: one KeyboardInterrupt, then the stop runs to its end whatever else arrives (an
        # impatient second Ctrl-C 0.3 s later once printed a traceback and left the deployment's processes running).
        interrupts.stop_on_signals()
        deployment.start()
        balancers, connector_for, pre_checks = deployment.balancer_urls, None, []
        if args.dns:
            bind = deployment.bind
            balancers = dict.fromkeys(deployment.balancer_urls, deployment.service_url)
            connector_for = functools.partial(_region_connector, bind.host, bind.port, deployment.client_addresses)
            pre_checks = [asyncio.run(dns_check(deployment))]
        doc = asyncio.run(replay_and_report(workload, balancers, out=out, base_dir=Path.cwd(),
                                            connector_for=connector_for, api_key=deployment.client_api_key))
        print(doc["workload"]["summary"])
        print(format_table(doc["report"]))
        checks = pre_checks + deployment_checks(doc, cfg)
        for name, ok, evidence in checks:
            print(f"  [{'ok' if ok else 'FAILED'}] {name}: {evidence}")
        print(f"report written to {out}")
        if args.keep_running:
            if args.dns:
                bind = deployment.bind
                _say(f"service {deployment.service_url}; e.g. dig @{bind.host} -p {bind.port} -b "
                     f"{next(iter(deployment.client_addresses.values()))} {bind.name}")
            _say("deployment is up; balancers: " + ", ".join(f"{r}={u}" for r, u in
                                                              deployment.balancer_urls.items()) + "; Ctrl-C stops")
            while True:
                time.sleep(3600)
        return 0 if all(ok for _, ok, _ in checks) else 1
    except KeyboardInterrupt:
        interrupts.stopping()
        _say("interrupted")
        return 130
    except RuntimeError as exc:
        print(f"skylb local: {exc}", file=sys.stderr)
        return 1
    finally:
        interrupts.stopping()
        _say("stopping every process (Ctrl-C is ignored until they are stopped)")
        deployment.stop()
        _say("every process stopped")
