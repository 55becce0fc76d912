"""Exact cache locality across regions, live: does a region that overflows forward a tenant's request to the region
holding its prefix?

``python -m bench.live.kv_regions [--rates 12,15] [--seeds 0] [--duration-s 60] [--abroad 0.3]
[--out-md bench/results/kv_regions.md]`` runs the local three-region deployment (bench/launch/local.py
``Deployment``: the controller, one ``skylb emulator`` process of ``--replicas`` vLLM replicas per region publishing
their KV-cache events in vLLM's wire format, the latency proxy with the demo's round trips, one balancer per region)
and replays the multi-tenant shared-prefix workload of bench/sim/kv_routing.py (bench/sim/workloads_extra.py
``multi_tenant``: 150 tenants behind 750-token prefixes, 150-token questions; each tenant has a home region, and a
share ``--abroad`` of its requests comes from one of the other two, so a region holds a tenant's prefix through its
own clients, which the snapshot trie of what a balancer forwarded cannot know). Each replica's KV cache is cut to
``--kv-cache-tokens`` (8,192: 98,304 tokens in all for 112,500 of prefixes), so the caches evict. Systems:

* ``skylb-kv``: the default, replicas registered with their event endpoints: each balancer routes its replicas by
  their events and puts a summary of the blocks its region holds in its peer status (README "KV-cache events",
  *Across regions*);
* ``skylb``: the same processes with ``balancer.kv_events: false``: the prefix trie and the regional snapshot trie.

The audit (:class:`Audit`) is the bench's own view, not the balancers': it follows every replica's event stream
with the balancer's subscriber into one block index, tokenizes every prompt with a replica's ``/tokenize`` and
hashes it as vLLM does, and at each request's arrival notes, per region, the largest share of the prompt one of its
replicas holds. A forwarded request (``X-SkyLB-Route: peer:<region>``) counts as *held by a peer's region* when a
region other than its client's held at least half its prompt in one replica at its arrival, and as *to a holding
region* when the region it went to was one of those (the simulator's audit, bench/sim/kv_routing.py, applies the
same rule at the decision; here the state is read at arrival, before any wait in the origin's queue).

Per system, rate and seed: TTFT p50 / p90, throughput, prefix hit rate, forwarded requests and the audit. Runs are
paired (every system replays the same requests at a rate and seed). Writes the report (commit, date, command,
machine) and its JSON beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from bench.launch.launchers import MODEL
from bench.launch.local import Deployment
from bench.live.harness import summarize, write_result
from bench.replay.report import RequestRecord
from bench.replay.run import replay
from bench.replay.workload import Request
from bench.reporting.provenance import provenance_line
from bench.sim.workloads_extra import multi_tenant
from skylb.config import DeploymentConfig, load_config
from skylb.core.kv_endpoint import KVEventsEndpoint
from skylb.core.kv_hash import request_block_hashes
from skylb.core.kv_index import BlockIndex

__all__ = ["SYSTEMS", "REGIONS", "HELD_SHARE", "workload", "deployment_config", "Audit", "forward_audit",
           "run_system", "run", "format_markdown", "main"]

#: System name -> whether its balancers route by the KV-cache events (``balancer.kv_events``).
SYSTEMS = {"skylb-kv": True, "skylb": False}
REGIONS = ("us", "eu", "asia")
#: A region holds a request's prefix when one of its replicas holds at least this share of the prompt's blocks.
HELD_SHARE = 0.5
#: vLLM's block size, which the emulator uses and reports in its events (tokens).
BLOCK_SIZE = 16


def workload(*, seed: int, rate_rps: float, duration_s: float, tenants: int, abroad: float) -> list[Request]:
    """The multi-tenant requests of the three regions, as the replayer sends them (open loop)."""
    sim = multi_tenant(seed=seed, rate_rps=rate_rps, duration_s=duration_s, regions=REGIONS, tenants=tenants,
                       abroad=abroad)
    return [Request(id=r.id, arrival_s=r.arrival_s, region=r.region, session_id=r.session_key,
                    prompt_tokens=len(r.tokens), output_tokens=r.output_tokens, text=r.text) for r in sim.arrivals]


def deployment_config(*, replicas: int, time_scale: float, kv_cache_tokens: int, kv_routing: bool) -> DeploymentConfig:
    """The embedded default config with three regions of ``replicas`` emulated vLLM replicas whose KV caches hold
    ``kv_cache_tokens`` tokens each, routing by the events or not (``balancer.kv_events``)."""
    data = load_config(None).model_dump()
    data["regions"] = {r: {"replicas": replicas} for r in REGIONS}
    data["emulator"].update(engine="vllm", model=MODEL, time_scale=time_scale,
                            extra_args=["--kv-cache-tokens", str(kv_cache_tokens), "--no-request-log"])
    data["balancer"]["policy"] = "skylb"
    data["balancer"]["kv_events"] = kv_routing
    return DeploymentConfig.model_validate(data)


class Audit:
    """What every region's replicas hold, from their own KV-cache events (module docstring).

    Args:
        endpoints: region -> each replica's (event endpoint, replay endpoint), as ``Deployment.kv_endpoints``.
    """

    def __init__(self, endpoints: dict[str, list[tuple[str, str]]]):
        self.index = BlockIndex()
        self.region_of = {f"{region}/{i}": region for region, eps in endpoints.items() for i in range(len(eps))}
        self.endpoints = {f"{region}/{i}": KVEventsEndpoint(pub, replay, "kv-events")
                          for region, eps in endpoints.items() for i, (pub, replay) in enumerate(eps)}
        self._subscribers = None

    async def start(self, timeout_s: float = 20.0) -> None:
        """Follow every stream; returns once each is live. Raises RuntimeError naming those that are not."""
        from skylb.engines.kv_subscriber import KVEventSubscribers
        self._subscribers = KVEventSubscribers(self.index)
        self._subscribers.update(self.endpoints)
        deadline = time.monotonic() + timeout_s
        while not all(self.index.is_live(r) for r in self.endpoints):
            if time.monotonic() > deadline:
                raise RuntimeError("KV event streams not live: "
                                   + ", ".join(r for r in self.endpoints if not self.index.is_live(r)))
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Stop following the streams."""
        if self._subscribers is not None:
            await self._subscribers.close()

    async def hashes(self, replica_url: str, requests: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """Each request's block hashes: its prompt tokenized by ``replica_url``'s ``/tokenize`` (the body a balancer
        sends for a completion) and hashed as vLLM hashes blocks of :data:`BLOCK_SIZE`. RuntimeError when the
        replica does not answer 200."""
        out = {}
        async with aiohttp.ClientSession() as session:
            for r in requests:
                async with session.post(f"{replica_url}/tokenize", json={"model": MODEL, "prompt": r.text}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{replica_url}/tokenize answered {resp.status}: {await resp.text()}")
                    tokens = (await resp.json())["tokens"]
                out[r.id] = request_block_hashes(tokens, BLOCK_SIZE)
        return out

    def held(self, block_hashes: tuple[int, ...]) -> dict[str, float]:
        """Per region, the largest share of the prompt (0-1) one of its replicas holds now."""
        shares = dict.fromkeys(REGIONS, 0.0)
        if block_hashes:
            for replica, n in self.index.matched_blocks(block_hashes).items():
                region = self.region_of[replica]
                shares[region] = max(shares[region], n / len(block_hashes))
        return shares

    async def watch_peers(self, balancers: dict[str, tuple[str, str]], started: float, until_s: float,
                          every_s: float = 0.25) -> dict[str, list[tuple[float, frozenset[str]]]]:
        """Every ``every_s`` until ``until_s`` after ``started`` (loop time): per region, the peers its balancer
        would forward to now (its status page: ``peers[].available``), as (seconds after ``started``, regions).
        ``balancers``: region -> (base URL, peer token)."""
        loop, out = asyncio.get_running_loop(), {region: [] for region in balancers}
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while (now := loop.time() - started) < until_s:
                for region, (url, token) in balancers.items():
                    try:
                        async with session.get(f"{url}/skylb/v1/status?format=json",
                                               headers={"X-SkyLB-Token": token}) as resp:
                            peers = (await resp.json())["peers"]
                    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                        continue  # a missed reading: the previous one stands
                    out[region].append((now, frozenset(p["region"] for p in peers if p["available"])))
                await asyncio.sleep(every_s)
        return out

    async def follow(self, requests: Sequence[Request], hashes: dict[str, tuple[int, ...]],
                     started: float) -> dict[str, dict[str, float]]:
        """At each request's arrival (``arrival_s`` after ``started``, loop time), :meth:`held` of its prompt."""
        loop, out = asyncio.get_running_loop(), {}
        for r in sorted(requests, key=lambda r: r.arrival_s):
            await asyncio.sleep(max(0.0, started + r.arrival_s - loop.time()))
            out[r.id] = self.held(hashes[r.id])
        return out


def forward_audit(records: Sequence[RequestRecord], held: dict[str, dict[str, float]],
                  open_peers: dict[str, list[tuple[float, frozenset[str]]]] | None = None) -> dict[str, int]:
    """Forwarded requests (``X-SkyLB-Route: peer:<region>``), those a peer's region held at arrival (at least
    :data:`HELD_SHARE` of the prompt in one replica), of those the ones sent to a holding region, and to the region
    holding the largest share; with ``open_peers`` (:meth:`Audit.watch_peers`), also those where a holding region
    was one the client's balancer could forward to at the request's send time (its latest reading before), and of
    those the ones sent to a holding region."""
    out = {"forwarded": 0, "held_by_peer": 0, "to_holder": 0, "to_deepest": 0, "held_with_room": 0,
           "to_holder_with_room": 0}
    for r in records:
        if not (r.route or "").startswith("peer:"):
            continue
        out["forwarded"] += 1
        target = r.route.split(":", 1)[1]
        peers = {region: share for region, share in held[r.id].items() if region != r.region}
        best = max(peers.values(), default=0.0)
        if best < HELD_SHARE:
            continue
        out["held_by_peer"] += 1
        to_holder = peers.get(target, 0.0) >= HELD_SHARE
        out["to_holder"] += to_holder
        out["to_deepest"] += peers.get(target, 0.0) == best
        readings = [regions for at, regions in (open_peers or {}).get(r.region, ()) if at <= (r.sent_s or 0.0)]
        if readings and any(peers[p] >= HELD_SHARE for p in readings[-1]):
            out["held_with_room"] += 1
            out["to_holder_with_room"] += to_holder
    return out


async def _replay_audited(deployment: Deployment, requests: list[Request]) -> tuple[Any, dict, dict, dict]:
    audit = Audit(deployment.kv_endpoints)
    try:
        await audit.start()
        hashes = await audit.hashes(deployment.replica_urls[REGIONS[0]][0], requests)
        started = asyncio.get_running_loop().time()
        balancers = {r: (url, deployment.peer_tokens[r]) for r, url in deployment.balancer_urls.items()}
        until_s = max(r.arrival_s for r in requests) + 1.0
        result, held, open_peers = await asyncio.gather(
            replay(requests, deployment.balancer_urls, model=MODEL, progress=False),
            audit.follow(requests, hashes, started), audit.watch_peers(balancers, started, until_s))
        streams = {r: {"live": audit.index.is_live(r), "gaps": s.gaps, "batches": s.batches}
                   for r, s in audit.index.replicas.items()}
    finally:
        await audit.close()
    return result, held, open_peers, streams


def run_system(name: str, requests: list[Request], *, run_dir: Path, replicas: int, time_scale: float,
               kv_cache_tokens: int) -> dict[str, Any]:
    """One replay of ``requests`` through a fresh deployment of system ``name``; its row (every process stopped)."""
    cfg = deployment_config(replicas=replicas, time_scale=time_scale, kv_cache_tokens=kv_cache_tokens,
                            kv_routing=SYSTEMS[name])
    shutil.rmtree(run_dir / name, ignore_errors=True)  # a controller database left by an earlier run refuses these
    deployment = Deployment(cfg, run_dir / name, kv_events=True)
    try:
        deployment.start()
        result, held, open_peers, streams = asyncio.run(_replay_audited(deployment, requests))
        followed = {region: _events_followed(url, deployment.peer_tokens[region])
                    for region, url in deployment.balancer_urls.items()}
    except (RuntimeError, OSError) as exc:
        return {"system": name, "status": "failed", "reason": str(exc)[:2000]}
    finally:
        deployment.stop()
    return {"system": name, "status": "ok", "figures": summarize(result.records, result.wall_s),
            "forwards": forward_audit(result.records, held, open_peers), "audit_streams": streams,
            "kv_events": followed}


def _events_followed(url: str, peer_token: str) -> dict[str, int]:
    """What one balancer made of its replicas' KV-cache events by the end of a run (its status page's JSON):
    replicas whose stream is live, replicas with an event endpoint, blocks in its index."""
    request = urllib.request.Request(f"{url}/skylb/v1/status?format=json", headers={"X-SkyLB-Token": peer_token})
    status = json.loads(urllib.request.urlopen(request, timeout=10).read())
    kv = status.get("kv_events") or {"replicas": {}, "blocks": 0}
    return {"live": sum(r["live"] for r in kv["replicas"].values()), "replicas": len(kv["replicas"]),
            "blocks": kv["blocks"]}


def run(*, systems: Sequence[str], rates: Sequence[float], seeds: Sequence[int], duration_s: float, abroad: float,
        tenants: int, replicas: int, time_scale: float, kv_cache_tokens: int, run_dir: Path) -> dict[str, Any]:
    """Every (rate, seed, system) run, paired; the result (rows and setup)."""
    rows = []
    for rate in rates:
        for seed in seeds:
            requests = workload(seed=seed, rate_rps=rate, duration_s=duration_s, tenants=tenants, abroad=abroad)
            for name in systems:
                row = run_system(name, requests, run_dir=run_dir / f"rate{rate:g}-seed{seed}", replicas=replicas,
                                 time_scale=time_scale, kv_cache_tokens=kv_cache_tokens)
                row.update(rate_rps=rate, seed=seed, requests=len(requests))
                print(f"{rate:g} req/s seed {seed} {name}: {row['status']} {row.get('forwards')} "
                      f"{row.get('reason', '')[:300]}", file=sys.stderr, flush=True)
                rows.append(row)
    return {"rows": rows, "setup": {"replicas": replicas, "time_scale": time_scale, "kv_cache_tokens": kv_cache_tokens,
                                    "duration_s": duration_s, "tenants": tenants, "abroad": abroad,
                                    "systems": list(systems), "rates": list(rates), "seeds": list(seeds)}}


def _pct(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.0f}%)" if whole else str(part)


def format_markdown(result: dict[str, Any]) -> str:
    """The report: provenance, setup, one row per run."""
    setup, prov = result["setup"], result["provenance"]
    lines = ["# Exact cache locality across regions, live: forwards to the region holding the prefix", "",
             provenance_line(prov) + f" Whole run {result.get('wall_s')} s.", "",
             f"Three regions ({', '.join(REGIONS)}) of {setup['replicas']} emulated vLLM replicas each (time scale "
             f"{setup['time_scale']:g}, KV cache {setup['kv_cache_tokens']} tokens each, publishing KV-cache events), "
             f"one SkyLB balancer per region, the demo's round trips; the multi-tenant workload "
             f"({setup['tenants']} tenants, 750-token prefixes, 150-token questions, {100 * setup['abroad']:.0f}% of "
             f"a tenant's requests from another region than its home, Poisson arrivals for {setup['duration_s']:g} "
             f"s, open loop, streamed `/v1/completions`); paired runs. Method: bench/live/kv_regions.py.", "",
             f"Forwards: requests forwarded to a peer; of those, held by a peer's region (one of its replicas held "
             f"at least {HELD_SHARE:.0%} of the prompt at the request's arrival, by the bench's own reading of every "
             f"replica's events); of those, sent to a holding region, and to the one holding the most; then the "
             f"forwards where a holding region was open (the client's balancer listed it as available to forward "
             f"to in its status, read every 0.25 s, at the latest reading before the request was sent), and of "
             f"those the ones sent to a holding region.", "",
             "KV events: the balancers' own streams at the end of the run (live / with an endpoint, summed over the "
             "regions; 0/0 when routing by the trie).", "",
             "| rate req/s | seed | system | ok/sent | TTFT p50 ms | TTFT p90 ms | req/s | prefix hit | KV events "
             "| forwarded | held by a peer's region | to a holding region | to the deepest | held, a holder open "
             "| to a holding region |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        head = f"| {row['rate_rps']:g} | {row['seed']} | {row['system']} |"
        f = row.get("figures")
        if not f:
            lines.append(f"{head} {row['status']}: {row.get('reason', '')[:80]} | | | | | | | | | | | |")
            continue
        fw, kv = row["forwards"], row["kv_events"].values()
        events = f"{sum(e['live'] for e in kv)}/{sum(e['replicas'] for e in kv)}"
        hit = f"{100 * f['prefix_hit_rate']:.1f}%" if f.get("prefix_hit_rate") is not None else "-"
        lines.append(f"{head} {f['completed']}/{f['sent']} | {f['ttft_p50_ms']:.0f} | {f['ttft_p90_ms']:.0f} | "
                     f"{f['throughput_rps']:.2f} | {hit} | {events} | {fw['forwarded']} | {fw['held_by_peer']} | "
                     f"{_pct(fw['to_holder'], fw['held_by_peer'])} | {_pct(fw['to_deepest'], fw['held_by_peer'])} | "
                     f"{fw['held_with_room']} | {_pct(fw['to_holder_with_room'], fw['held_with_room'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.live.kv_regions", description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--rates", default="12,15", help="comma-separated arrival rates of the three regions, requests/s")
    p.add_argument("--seeds", default="0", help="comma-separated workload seeds")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrivals over this long, s")
    p.add_argument("--abroad", type=float, default=0.3, help="share of a tenant's requests from another region (0-1)")
    p.add_argument("--tenants", type=int, default=150, help="tenants (150 x 750 prefix tokens = 112,500)")
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas per region")
    p.add_argument("--time-scale", type=float, default=0.5, help="the emulator's time scale (1: an L4)")
    p.add_argument("--kv-cache-tokens", type=int, default=8192, help="each replica's KV cache, tokens")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="logs of every process (default: a new temporary directory)")
    p.add_argument("--out-md", type=Path, default=Path("bench/results/kv_regions.md"))
    args = p.parse_args(argv)
    if not 0.0 <= args.abroad <= 1.0:
        p.error("--abroad must be within 0-1")
    started = time.time()
    result = run(systems=args.systems, rates=[float(x) for x in args.rates.split(",")],
                 seeds=[int(x) for x in args.seeds.split(",")], duration_s=args.duration_s, abroad=args.abroad,
                 tenants=args.tenants, replicas=args.replicas, time_scale=args.time_scale,
                 kv_cache_tokens=args.kv_cache_tokens,
                 run_dir=args.run_dir or Path(tempfile.mkdtemp(prefix="skylb-kv-regions-")))
    write_result(result, args.out_md, module="bench.live.kv_regions", argv=argv, started=started, render=format_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
