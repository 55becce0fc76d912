"""Routing by the prefix trie vs by KV-cache events, live: real processes on loopback, emulated vLLM replicas that
publish their KV-cache events in vLLM's wire format.

``python -m bench.live.kv_live [--rates 4,5] [--seeds 0] [--duration-s 60] [--out-md bench/results/kv_live.md]`` replays
the multi-tenant shared-prefix workload of bench/sim/kv_routing.py (bench/sim/workloads_extra.py ``multi_tenant``:
750-token prefixes and 150-token questions, llm-d's 6k/1.2k at x1/8; ``--tenants``, 50 here, one region's share of
llm-d's 150; Poisson arrivals, open loop) against 4 emulated vLLM replicas (one ``skylb emulator`` process, each
replica's KV cache cut to ``--kv-cache-tokens``, 8,192: 32,768 tokens for 37,500 tokens of prefixes;
``--time-scale``, 0.5: twice an L4's speed) through each system, restarting the replicas before each so every
system starts with cold caches:

* ``skylb``: one static SkyLB balancer (``skylb balancer --replica URL ...``), the default policy, the prefix trie;
* ``skylb-kv``: the same, each replica given with its event endpoints (``--replica URL#kv=tcp://...,replay=...``),
  so it routes by the engines' KV-cache events (README "KV-cache events");
* ``sglang-cache_aware``: the SGLang router's cache-aware policy (defaults); ``haproxy-leastconn``: HAProxy.

Per system and rate: requests completed, TTFT p50 / p90 (ms, at the client, to the first streamed text), throughput
(requests and output tokens per second of the replay), prefix hit rate (cached / prompt tokens, as the replicas
report them in ``usage``). Runs are paired: at each rate and seed every system replays the same requests. Writes
the report (commit, date, command, machine) and its JSON beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from bench.live.harness import summarize, write_result
from bench.launch.launchers import MODEL, Unavailable, start_haproxy, start_sglang, unavailable_reason, warm_up
from bench.launch.procs import ProcGroup, free_port_block, free_ports
from bench.reporting.provenance import provenance_line
from bench.replay.run import replay
from bench.sim.workloads_extra import multi_tenant
from bench.replay.workload import Request

__all__ = ["SYSTEMS", "workload", "run_system", "run", "format_markdown", "main"]

SYSTEMS = ("skylb", "skylb-kv", "sglang-cache_aware", "haproxy-leastconn")
REPLICAS = 4


def workload(*, seed: int, rate_rps: float, duration_s: float, tenants: int) -> list[Request]:
    """The multi-tenant requests (one region, ``us``) as the replayer sends them."""
    sim = multi_tenant(seed=seed, rate_rps=rate_rps, duration_s=duration_s, regions=("us",), tenants=tenants)
    return [Request(id=r.id, arrival_s=r.arrival_s, region="us", session_id=r.session_key,
                    prompt_tokens=len(r.tokens), output_tokens=r.output_tokens, text=r.text)
            for r in sim.arrivals]


def _start_replicas(procs: ProcGroup, *, time_scale: float, kv_cache_tokens: int) -> tuple[list[str], list[str]]:
    """The emulator's replicas: (base URLs, ``--replica`` flags naming their event endpoints)."""
    ports = free_ports(REPLICAS)
    pub, replay_port = free_port_block(REPLICAS), free_port_block(REPLICAS)
    # "*" binds the emulator's host, as vLLM binds a wildcard endpoint (another host name it would connect to).
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"}
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs.skylb("emulator", "--engine", "vllm", "--model", MODEL, "--time-scale", repr(time_scale),
                "--kv-cache-tokens", str(kv_cache_tokens), "--no-request-log", "--kv-events-config",
                json.dumps(config), *(a for p in ports for a in ("--port", str(p))), name="emulator",
                wait_url=f"{urls[0]}/health")
    flags = [f"{u}#kv=tcp://127.0.0.1:{pub + i},replay=tcp://127.0.0.1:{replay_port + i}"
             for i, u in enumerate(urls)]
    return urls, flags


def _start_system(procs: ProcGroup, name: str, urls: list[str], flags: list[str], run_dir: Path) -> str:
    if name in ("skylb", "skylb-kv"):
        port = free_ports(1)[0]
        url = f"http://127.0.0.1:{port}"
        replicas = flags if name == "skylb-kv" else urls
        procs.skylb("balancer", "--engine", "vllm", "--port", str(port), "--region", "us",
                    *(a for r in replicas for a in ("--replica", r)), name=name, wait_url=f"{url}/healthz")
    elif name == "sglang-cache_aware":
        url = start_sglang(procs, urls, policy="cache_aware", name=name)
    elif name == "haproxy-leastconn":
        url = start_haproxy(procs, urls, balance="leastconn", run_dir=run_dir, name=name)
    else:
        raise ValueError(f"unknown system {name!r}")
    warm_up(url)
    return url


def run_system(name: str, requests: list[Request], *, run_dir: Path, time_scale: float,
               kv_cache_tokens: int) -> dict[str, Any]:
    """One replay of ``requests`` through system ``name`` on fresh replicas; its row."""
    kind = name.split("-")[0]
    reason = unavailable_reason(kind) if kind in ("sglang", "haproxy") else None
    if reason:
        return {"system": name, "status": "skipped", "reason": reason}
    try:
        with ProcGroup(run_dir / name / "logs") as procs:
            urls, flags = _start_replicas(procs, time_scale=time_scale, kv_cache_tokens=kv_cache_tokens)
            url = _start_system(procs, name, urls, flags, run_dir / name)
            result = asyncio.run(replay(requests, {"us": url}, model=MODEL, progress=False))
            events = _events_followed(url) if name.startswith("skylb") else None
    except (RuntimeError, Unavailable, OSError) as exc:
        return {"system": name, "status": "failed", "reason": str(exc)[:2000]}
    return {"system": name, "status": "ok", "figures": summarize(result.records, result.wall_s), "kv_events": events}


def _events_followed(url: str) -> dict[str, Any]:
    """What a SkyLB balancer made of its replicas' KV-cache events by the end of a run: replicas whose stream is
    live, blocks in its index, sequence gaps, and requests hashed before queueing (its /tokenize calls that
    answered), so a report shows that the events were followed, or were not."""
    status = json.loads(urllib.request.urlopen(f"{url}/skylb/v1/status?format=json", timeout=10).read())
    kv = status.get("kv_events") or {"replicas": {}, "blocks": 0}
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    hashed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("skylb_kv_tokenize_seconds_count") and 'outcome="ok"' in line)
    return {"live": sum(r["live"] for r in kv["replicas"].values()), "replicas": len(kv["replicas"]),
            "blocks": kv["blocks"], "gaps": sum(r["gaps"] for r in kv["replicas"].values()), "hashed": int(hashed)}


def run(*, systems: Sequence[str], rates: Sequence[float], seeds: Sequence[int], duration_s: float,
        time_scale: float, kv_cache_tokens: int, tenants: int, run_dir: Path) -> dict[str, Any]:
    """Every (rate, seed, system) run, paired; the result (rows and setup)."""
    rows = []
    for rate in rates:
        for seed in seeds:
            requests = workload(seed=seed, rate_rps=rate, duration_s=duration_s, tenants=tenants)
            for name in systems:
                row = run_system(name, requests, run_dir=run_dir / f"rate{rate:g}-seed{seed}",
                                 time_scale=time_scale, kv_cache_tokens=kv_cache_tokens)
                row.update(rate_rps=rate, seed=seed, requests=len(requests))
                figures = row.get("figures") or {}
                print(f"{rate:g} req/s seed {seed} {name}: {row['status']} TTFT p90 "
                      f"{figures.get('ttft_p90_ms')} ms, hit {figures.get('prefix_hit_rate')}", file=sys.stderr,
                      flush=True)
                rows.append(row)
    return {"rows": rows, "setup": {"replicas": REPLICAS, "time_scale": time_scale,
                                    "kv_cache_tokens": kv_cache_tokens, "duration_s": duration_s, "tenants": tenants,
                                    "systems": list(systems), "rates": list(rates), "seeds": list(seeds)}}


def _f(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _events(row: dict[str, Any]) -> str:
    e = row.get("kv_events")
    if not e:
        return "-"
    return f"{e['live']}/{e['replicas']} live, {e['blocks']} blocks, {e['hashed']} hashed"


def format_markdown(result: dict[str, Any]) -> str:
    """The report: provenance, setup, one table row per run."""
    setup, prov = result["setup"], result["provenance"]
    lines = ["# Routing by the trie vs by KV-cache events, live (emulated vLLM replicas publishing events)", "",
             provenance_line(prov) + f" Whole run {result.get('wall_s')} s.", "",
             f"{setup['replicas']} emulated vLLM replicas in one region (`skylb emulator`, time scale "
             f"{setup['time_scale']:g}, KV cache {setup['kv_cache_tokens']} tokens each), restarted before each "
             f"system; the multi-tenant workload ({setup['tenants']} tenants, 750-token prefixes, 150-token questions, Poisson "
             f"arrivals for {setup['duration_s']:g} s, open loop, streamed `/v1/completions`); paired runs (every "
             f"system replays the same requests at a rate and seed). Method: bench/live/kv_live.py.", "",
             "KV events (SkyLB rows, at the end of the run): replicas whose event stream was live / given, blocks "
             "in the balancer's index, requests hashed before queueing.", "",
             "| rate req/s | seed | system | ok/sent | TTFT p50 ms | TTFT p90 ms | req/s | out tok/s | prefix hit "
             "| KV events |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        f = row.get("figures")
        if not f:
            lines.append(f"| {row['rate_rps']:g} | {row['seed']} | {row['system']} | {row['status']}: "
                         f"{row.get('reason', '')[:80]} | | | | | | |")
            continue
        lines.append(f"| {row['rate_rps']:g} | {row['seed']} | {row['system']} | {f['completed']}/{f['sent']} | "
                     f"{_f(f['ttft_p50_ms'], '{:.0f}')} | {_f(f['ttft_p90_ms'], '{:.0f}')} | "
                     f"{_f(f['throughput_rps'], '{:.2f}')} | {_f(f['output_tokens_per_s'], '{:.0f}')} | "
                     f"{_f(f['prefix_hit_rate'] and 100 * f['prefix_hit_rate'], '{:.1f}%')} | {_events(row)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.live.kv_live", description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rates", default="4,5", help="comma-separated arrival rates, requests/s")
    p.add_argument("--seeds", default="0", help="comma-separated workload seeds")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrivals over this long, s")
    p.add_argument("--time-scale", type=float, default=0.5, help="the emulator's time scale (1: an L4)")
    p.add_argument("--kv-cache-tokens", type=int, default=8192, help="each replica's KV cache, tokens")
    p.add_argument("--tenants", type=int, default=50,
                   help="tenants (50 x 750 prefix tokens = 37,500: more than 4 replicas' 32,768 of KV cache)")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/skylb-kv-live"), help="logs of every process")
    p.add_argument("--out-md", type=Path, default=Path("bench/results/kv_live.md"))
    args = p.parse_args(argv)
    started = time.time()
    result = run(systems=args.systems, rates=[float(x) for x in args.rates.split(",")],
                 seeds=[int(x) for x in args.seeds.split(",")], duration_s=args.duration_s,
                 time_scale=args.time_scale, kv_cache_tokens=args.kv_cache_tokens, tenants=args.tenants,
                 run_dir=args.run_dir)
    write_result(result, args.out_md, module="bench.live.kv_live", argv=argv, started=started, render=format_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
