"""The cost of coordination at eight-region scale, measured on the real code (wall clock, not simulated time).

Entry point: ``.venv/bin/python -m bench.micro.coordination [--replicas 200] [--peers 8] [--decisions 5000]
[--repeats 3] [--out-md PATH] [--out-json PATH]`` (also ``skylb bench coordination ...``); :func:`main`
``(argv) -> int``.

What is measured, for shapes of one balancer's state: the worst case asked for (200 local replicas and 8 peers: one
balancer in front of the whole fleet, still with peers), SkyLB's shape in the eight-region scenario (25 local
replicas, 7 peers; bench/sim/eight_regions.py) and one region of the paper's deployment (12 replicas, 2 peers), that
one also with every replica reporting a KV cache of :data:`KV_CAPACITY_TOKENS` (as vLLM and SGLang replicas do: the
replica trie is then bounded per replica by it and evicts as it goes, skylb/core/prefix_trie.py
``set_target_bound``), and the worst case again with its replicas measured (each answer reported at the replica's
own speed, ``decision_times`` ``measured``):

* Routing decision: a real ``skylb.core.Router`` built by ``skylb.core.build_router`` from the live defaults
  (policy ``skylb``), its replicas and peers filled through ``observe_replica`` / ``observe_peer`` with values
  drawn as a loaded fleet shows them (pending 0-2, running 4-48, KV usage 0.2-0.95; peers with 0-25 available
  replicas, queues 0-3, waits 0-400 ms, round trips 50-280 ms, 2-48 requests per replica), and its prefix trie
  filled by routing :data:`WARM_REQUESTS` prompts of the real Mooncake trace (prompts x1/8,
  bench/sim/workloads.py ``mooncake``).
  Then, per decision: enqueue one trace prompt, time ``Router.dispatch(now)`` with ``time.perf_counter_ns``,
  release the decision (``Router.finished``); every 100 decisions a probe round re-observes every replica and
  peer (100 decisions per 100 ms probe interval). p50 / p99 per repetition; the report gives the mean with
  [min, max] over repetitions.
* Peer status: ``Router.status(now)`` packed by ``skylb.balancer.protocol.encode_status`` (msgpack, what ``GET
  /skylb/v1/status`` sends) and unpacked by ``decode_status`` (what the prober does): size in bytes, median
  encode and decode time over many rounds.
* Probe traffic per balancer per second at the default intervals (skylb/config.py: probe interval 100 ms for
  replicas and peers; a replica's model list every 30 s, skylb/balancer/probers.py): requests/s and bytes/s of
  ``GET /metrics`` (the body the emulator's vLLM personality serves, bench/emulator/personalities/vllm.py, read
  from a replica that has served requests), ``GET /v1/models`` and ``GET /skylb/v1/status``, each with the HTTP/1.1
  request and response headers as aiohttp sends them (:data:`REQUEST_HEADERS_B`, :data:`RESPONSE_HEADERS_B`).
  A real vLLM's /metrics also carries latency histograms and is several times larger; the emulator's body is a
  lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.replay.report import markdown_table

__all__ = ["build_router_state", "decision_times", "status_message", "probe_traffic", "measure", "render", "main",
           "WARM_REQUESTS"]

#: Trace prompts routed before measuring, to fill the prefix trie.
WARM_REQUESTS = 2000
#: Bytes of an aiohttp GET request line and headers (Host, Accept, Accept-Encoding, User-Agent, token) and of a
#: response's status line and headers (Content-Type, Content-Length, Date, Server), counted on aiohttp 3.x output.
REQUEST_HEADERS_B = 190
RESPONSE_HEADERS_B = 170
RESULTS = Path(__file__).resolve().parents[1] / "results"
#: KV-cache tokens per replica of the bounded-trie shape: the emulator's Llama-3.1-8B on an L4 (2,048 blocks of 16;
#: bench/emulator/model.py ``kv_cache_tokens``).
KV_CAPACITY_TOKENS = 32768
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts of the real Mooncake trace (x1/8, in trace order), or synthetic ones when it is absent."""
    from bench.sim.eight_regions_bench import find_trace
    from bench.sim.workloads import mooncake
    trace = find_trace()
    if trace.is_file():
        texts = [r.text for r in mooncake(seed=seed, path=trace, window_s=3600.0).arrivals]
    else:
        from bench.replay.workload import VOCABULARY
        rng = random.Random(seed)
        texts = [" ".join(rng.choices(VOCABULARY, k=rng.randint(200, 3000))) for _ in range(200)]
    return [texts[i % len(texts)] for i in range(n)]


def _observe(router, rng: random.Random, now: float, peers: list[str], kv_capacity_tokens: int | None = None) -> None:
    """One probe round: every replica and peer observed with loaded-fleet values (module docstring), the replicas'
    KV-cache capacity (tokens) ``kv_capacity_tokens`` when given."""
    from skylb.core import PeerStatus
    for rid in router.replicas:
        router.observe_replica(rid, now=now, healthy=True, pending=rng.choice((0, 0, 0, 1, 2)),
                               running=rng.randint(4, 48), kv_usage=rng.uniform(0.2, 0.95),
                               kv_capacity_tokens=kv_capacity_tokens)
    for region in peers:
        status = PeerStatus(region=region, available_replicas=rng.randint(0, 25), replicas=25,
                            queue_len=rng.randint(0, 3), models={"openai": {MODEL: rng.randint(0, 25)}},
                            wait_ms=rng.uniform(0, 400), queue_age_ms=rng.uniform(0, 500),
                            dispatch_rate=rng.uniform(5, 60), load_per_replica=rng.uniform(2, 48))
        router.observe_peer(region, now=now, status=status, rtt_s=rng.uniform(0.05, 0.28))


def build_router_state(replicas: int, peers: int, *, seed: int = 0, placement: str = "estimate",
                       kv_capacity_tokens: int | None = None):
    """A Router with ``replicas`` local replicas and ``peers`` peers, observed once (with ``kv_capacity_tokens``),
    its ``skylb`` policy with ``placement`` (skylb/core/policies/skylb.py); returns (router, peer names)."""
    from skylb.config import BalancerConfig
    from skylb.core import build_router
    router = build_router("r0", BalancerConfig(policy="skylb", policies={"skylb": {"placement": placement}}),
                          max_queue=10 ** 6)
    router.set_replicas([(f"r0-{i}", f"http://10.0.0.{i % 250}:{8000 + i}", "vllm") for i in range(replicas)])
    for rid in router.replicas:  # as the prober learns it from GET /v1/models; the status then lists the model
        router.set_replica_models(rid, [MODEL])
    names = [f"r{k + 1}" for k in range(peers)]
    router.set_peers([(n, f"http://{n}.lb:8080") for n in names])
    _observe(router, random.Random(seed), 0.0, names, kv_capacity_tokens)
    return router, names


def _answer(router, decision, speed: dict[str, float]) -> None:
    """Report ``decision``'s response as an OpenAI server would (token counts, no engine timings), timed at its
    replica's speed (``speed``: replica -> factor on an L4's 0.48 ms per prompt token and 54 ms per output token,
    bench/emulator/model.py), so that the router measures each replica's rates (skylb/core/rates.py)."""
    from skylb.core.rates import Usage
    prompt, out, factor = max(1, len(decision.request.text) // 4), 100, speed[decision.target]
    ttft = factor * 0.00048 * prompt
    router.observe_response(decision, Usage(prompt_tokens=prompt, output_tokens=out), ttft_s=ttft,
                            e2e_s=ttft + factor * 0.054 * (out - 1))


def decision_times(replicas: int, peers: int, *, decisions: int, prompts: list[str], seed: int,
                   warm: int = WARM_REQUESTS, placement: str = "estimate",
                   kv_capacity_tokens: int | None = None, measured: bool = False) -> dict:
    """One repetition: the trie warmed with ``warm`` prompts (routed, untimed), then ``decisions`` timed
    ``Router.dispatch`` calls (one request each); returns p50 / p99 / mean in microseconds and the routes taken. With
    ``kv_capacity_tokens`` every replica reports that KV-cache capacity, and the trie is bounded per replica by it.
    With ``measured`` every response is reported (``_answer``) at a speed of the replica's own, 0.8-1.25x an L4's,
    so replicas are measured as in a fleet that has served for a while (OllamaRouter's time per token; prefill
    rates only from lone responses, which these loaded replicas never give); without, no replica is ever measured
    and every idle one ties on the estimate. The heap built so far is frozen as the balancer freezes its own before
    serving (skylb/gc_pauses.py; unless ``SKYLB_GC_FREEZE=0``), and unfrozen at the end."""
    import gc
    from skylb.core import Request
    from skylb.gc_pauses import freeze_startup_heap
    router, names = build_router_state(replicas, peers, seed=seed, placement=placement,
                                       kv_capacity_tokens=kv_capacity_tokens)
    freeze_startup_heap()
    rng = random.Random(seed)
    speed = {rid: random.Random(f"{seed}:{rid}").uniform(0.8, 1.25) for rid in router.replicas}
    now, times, routes = 0.0, [], {"local": 0, "peer": 0, "none": 0}
    for k in range(warm + decisions):
        if k % 100 == 0:
            now += 0.1
            _observe(router, rng, now, names, kv_capacity_tokens)
        text = prompts[(k * 7 + seed) % len(prompts)]
        router.enqueue(Request(id=f"q{k}", text=text, arrived_at=now, model=MODEL, session_key=f"s{k % 500}"))
        t0 = time.perf_counter_ns()
        out = router.dispatch(now)
        elapsed = time.perf_counter_ns() - t0
        for d in out:
            if measured and d.route == "local":
                _answer(router, d, speed)
            router.finished(d)
        if k >= warm:
            times.append(elapsed / 1000.0)
            routes[out[0].route if out else "none"] += 1
        if not out:
            for request in list(router.queue):  # cancel, so the router forgets them too
                router.cancel(request.id)
    gc.unfreeze()
    times.sort()
    return {"p50_us": times[len(times) // 2], "p99_us": times[int(0.99 * (len(times) - 1))],
            "mean_us": statistics.fmean(times), "routes": routes}


def status_message(replicas: int, peers: int, *, rounds: int = 5000) -> dict:
    """The peer status of such a router: msgpack size (bytes), median encode / decode time (us), round trip ok."""
    from skylb.balancer.protocol import decode_status, encode_status
    router, _ = build_router_state(replicas, peers)
    status = router.status(0.05)
    data = encode_status(status)
    enc, dec = [], []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        encode_status(status)
        t1 = time.perf_counter_ns()
        decode_status(data)
        dec.append((time.perf_counter_ns() - t1) / 1000.0)
        enc.append((t1 - t0) / 1000.0)
    return {"bytes": len(data), "encode_us": statistics.median(enc), "decode_us": statistics.median(dec),
            "round_trip_ok": decode_status(data) == status}


def _metrics_body() -> int:
    """Bytes of the emulator's vLLM ``GET /metrics`` body, read from an engine that served a few requests."""
    from prometheus_client import CollectorRegistry, generate_latest
    from bench.emulator.model import EngineModel
    from bench.emulator.personalities.vllm import _VllmCollector
    model = EngineModel()
    for i in range(4):
        model.submit(f"x{i}", ["word"] * 300, 20, ignore_eos=True, now=0.0)
    now = 0.0
    while (step := model.start_step(now)) is not None:
        model.complete_step(step)
        now = step.end
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_VllmCollector(model, MODEL))
    return len(generate_latest(registry))


def probe_traffic(replicas: int, peers: int, status_bytes: int) -> dict:
    """Probe requests/s and bytes/s (both directions, HTTP/1.1 headers included) of one balancer at the defaults."""
    from skylb.config import BalancerConfig
    interval_s = BalancerConfig().probe_interval_ms / 1000.0
    models_refresh_s = 30.0
    models_body = len(json.dumps({"object": "list", "data": [{"id": MODEL,
                                                              "object": "model", "owned_by": "vllm",
                                                              "max_model_len": 32768}]}))
    metrics_body = _metrics_body()
    hdr = REQUEST_HEADERS_B + RESPONSE_HEADERS_B
    rows = {"replica /metrics": (replicas / interval_s, metrics_body + hdr),
            "replica /v1/models": (replicas / models_refresh_s, models_body + hdr),
            "peer /skylb/v1/status": (peers / interval_s, status_bytes + hdr)}
    out = {k: {"requests_per_s": n, "bytes_per_request": b, "bytes_per_s": n * b} for k, (n, b) in rows.items()}
    out["total"] = {"requests_per_s": sum(v["requests_per_s"] for v in out.values()),
                    "bytes_per_s": sum(v["bytes_per_s"] for v in out.values())}
    out["metrics_body_bytes"] = metrics_body
    return out


def _spread(values: list[float], fmt: str = "{:.1f}") -> str:
    text = fmt.format(statistics.fmean(values))
    return text if len(values) == 1 else f"{text} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def measure(shapes: list[tuple[int, int, int | None, bool]], *, decisions: int, repeats: int,
            placement: str = "estimate") -> list[dict]:
    """Every figure for each (replicas, peers, KV-cache tokens per replica or None, replicas measured) shape;
    decision times once per repetition (seeds 0..repeats-1), with the ``skylb`` policy's ``placement``."""
    prompts = _prompts(WARM_REQUESTS + decisions, 0)
    out = []
    for replicas, peers, kv, measured in shapes:
        reps = [decision_times(replicas, peers, decisions=decisions, prompts=prompts, seed=s, placement=placement,
                               kv_capacity_tokens=kv, measured=measured) for s in range(repeats)]
        status = status_message(replicas, peers)
        out.append({"replicas": replicas, "peers": peers, "kv_capacity_tokens": kv, "measured": measured,
                    "repetitions": reps, "status": status, "probes": probe_traffic(replicas, peers, status["bytes"])})
    return out


def _variant(s: dict) -> bool:
    """Whether a shape repeats another's replicas and peers (its status and probes are the same)."""
    return bool(s.get("kv_capacity_tokens") or s.get("measured"))


def _shape(s: dict) -> str:
    """A shape's label in the report."""
    kv = s.get("kv_capacity_tokens")
    return (f"{s['replicas']} replicas, {s['peers']} peers" + (f", KV caches of {kv:,} tokens" if kv else "")
            + (", replicas measured" if s.get("measured") else ""))


def target_us(replicas: int) -> float:
    """The decision p99 target for a state of ``replicas`` local replicas, us: 0.5 ms up to 12 (one region of the
    paper's deployment), 1 ms beyond."""
    return 500.0 if replicas <= 12 else 1000.0


def render(result: dict) -> str:
    """The Markdown report."""
    meta = result["meta"]
    lines = ["# Cost of coordination (real code, wall clock)", "",
             f"Commit {meta['commit']}, {meta['date']}, `{meta['command']}`; {meta['cores']} CPU cores "
             f"({meta['machine']}), Python {meta['python']}. {meta['decisions']} timed decisions per repetition, "
             f"{meta['repeats']} repetitions: mean [min, max] over repetitions. Method: bench/micro/coordination.py.", "",
             "## Routing decision (Router.dispatch, one request)", ""]
    rows = []
    for s in result["shapes"]:
        reps = s["repetitions"]
        routes = {k: sum(r["routes"][k] for r in reps) for k in reps[0]["routes"]}
        rows.append([_shape(s), _spread([r["p50_us"] for r in reps]),
                     _spread([r["p99_us"] for r in reps]), _spread([r["mean_us"] for r in reps]),
                     ", ".join(f"{k} {v}" for k, v in routes.items()),
                     f"{target_us(s['replicas']) / 1000:g} ms: "
                     + ("met" if max(r["p99_us"] for r in reps) <= target_us(s["replicas"]) else "MISSED")])
    lines += [markdown_table(["State", "p50 us", "p99 us", "mean us", "Routes taken", "p99 target"], rows), "",
              "## Peer status message (msgpack, GET /skylb/v1/status)", ""]
    lines += [markdown_table(["State", "Bytes", "Encode us (median)", "Decode us (median)", "Decodes to the same"],
                             [[_shape(s), str(s["status"]["bytes"]),
                               f"{s['status']['encode_us']:.1f}", f"{s['status']['decode_us']:.1f}",
                               str(s["status"]["round_trip_ok"])] for s in result["shapes"]
                              if not _variant(s)]), "",
              "## Probe traffic per balancer (default intervals, HTTP/1.1 headers included)", ""]
    for s in result["shapes"]:
        if _variant(s):  # the same probes as the shape without
            continue
        p = s["probes"]
        lines += [f"{s['replicas']} replicas, {s['peers']} peers (emulator vLLM /metrics body: "
                  f"{p['metrics_body_bytes']} B):", "",
                  markdown_table(["Probe", "Requests/s", "Bytes/request", "kB/s"],
                                 [[k, f"{v['requests_per_s']:.1f}", str(v.get("bytes_per_request", "-")),
                                   f"{v['bytes_per_s'] / 1000:.1f}"] for k, v in p.items()
                                  if isinstance(v, dict)]), ""]
    if result.get("notes"):
        lines += [result["notes"].rstrip(), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.micro.coordination", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=200, help="local replicas of the worst case (default 200)")
    p.add_argument("--peers", type=int, default=8, help="peers of the worst case (default 8)")
    p.add_argument("--decisions", type=int, default=5000, help="timed decisions per repetition")
    p.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--out-md", default=str(RESULTS / "coordination.md"), help="report ('' for none)")
    p.add_argument("--out-json", default=None, help="JSON (default beside the report)")
    p.add_argument("--notes", default=None, help="a Markdown file appended to the report")
    p.add_argument("--placement", default="estimate", choices=("estimate", "predicted-ttft"),
                   help="the skylb policy's placement rule (default: estimate, the policy's default)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure and write the report and JSON; returns the exit status."""
    from bench.sim.eight_regions_bench import _commit
    args = build_parser().parse_args(argv)
    shapes = [(args.replicas, args.peers, None, False), (args.replicas, args.peers, None, True), (25, 7, None, False),
              (12, 2, None, False), (12, 2, KV_CAPACITY_TOKENS, False)]
    result = {"shapes": measure(shapes, decisions=args.decisions, repeats=args.repeats, placement=args.placement)}
    command = "python -m bench.micro.coordination " + " ".join(argv if argv is not None else sys.argv[1:])
    result["meta"] = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": command.strip(),
                      "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "decisions": args.decisions, "repeats": args.repeats}
    result["notes"] = Path(args.notes).read_text() if args.notes else ""
    if args.out_md:
        Path(args.out_md).write_text(render(result))
        Path(args.out_json or Path(args.out_md).with_suffix(".json")).write_text(json.dumps(result, indent=1))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
