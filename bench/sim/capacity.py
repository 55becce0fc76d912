"""How many outstanding requests one replica runs before requests start to wait: a closed-loop client sweep.

The SkyLB paper (§3.3, "Selective pushing by limiting outstanding requests") observed that "for Llama 3.1 8B on a
L4 GPU, the max number of outstanding requests can range from 20 to 50 for the same dataset". This module puts N
closed-loop clients on ONE simulated replica (``bench.emulator.model.make_engine``; SGLang admission by default,
as the paper's replicas ran SGLang) and measures, per N, the time-weighted mean of the engine's running and waiting
counts. With no think time every client always has one request outstanding, so N is the outstanding count.

Workload: WildChat-like multi-turn conversations (``bench.sim.workloads.WILDCHAT``, ``conversations()``), each
client one user running conversations back to back. Each request asks for exactly its answer length:
``max_tokens`` = the turn's output length with ``ignore_eos``, which is what SGLang's own benchmark client sends
(sgl-project/sglang v0.4.3 ``python/sglang/bench_serving.py``: ``"max_tokens": request_func_input.output_len`` and
``"ignore_eos": not args.disable_ignore_eos``, the output length taken from the dataset's completion in
``sample_sharegpt_requests``). The SkyLB paper does not say what max_tokens its clients sent.

First-wait point (exact definition): the smallest N in the sweep whose time-weighted mean waiting count over the
measurement window (after ``warmup_s``) exceeds ``wait_threshold`` requests (default 0.5); None if none does.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tabulate import tabulate

from bench.emulator.model import EngineParams, make_engine
from bench.sim.engine import EventLoop
from bench.sim.workloads import ARENA, WILDCHAT, ConversationShape, conversations

__all__ = ["CapacityPoint", "CapacitySweep", "measure", "sweep", "first_wait_outstanding", "main"]

DEFAULT_CLIENTS = (5, 10, 15, 20, 25, 30, 35, 40, 50, 60, 80)


@dataclass(frozen=True)
class CapacityPoint:
    """One client count's result. Means are time-weighted over the measurement window (requests)."""

    clients: int
    mean_running: float
    mean_waiting: float
    max_running: int
    #: Fraction of the window's time with at least one request waiting (0-1).
    wait_fraction: float
    #: Requests finished in the window per second.
    throughput_rps: float
    retractions: int


@dataclass(frozen=True)
class CapacitySweep:
    """A sweep's points and its first-wait point (module docstring)."""

    points: tuple[CapacityPoint, ...]
    first_wait_clients: int | None
    wait_threshold: float


def measure(clients: int, *, params: EngineParams, shape: ConversationShape = WILDCHAT, seed: int = 0,
            warmup_s: float = 120.0, window_s: float = 300.0, start_spread_s: float = 5.0) -> CapacityPoint:
    """Run ``clients`` closed-loop users against one engine for ``warmup_s + window_s`` simulated seconds.

    Raises ValueError when ``clients`` < 1 or a duration is not positive.
    """
    if clients < 1 or warmup_s < 0 or window_s <= 0:
        raise ValueError("clients must be >= 1, warmup_s >= 0 and window_s > 0")
    loop, engine = EventLoop(), make_engine(params)
    specs = conversations(shape, {"us": clients}, seed=seed).clients
    rng = random.Random(seed)
    end_s, start_w = warmup_s + window_s, warmup_s
    acc = {"running": 0.0, "waiting": 0.0, "waited": 0.0, "finished": 0, "max_running": 0}
    state = {"busy": False}
    programs: dict[str, list] = {}
    progress: dict[str, tuple[int, int]] = {}  # client -> (program index, request index)

    def send(cid: str) -> None:
        k, i = progress[cid]
        prog = programs[cid]
        if i >= len(prog):
            k, i = k + 1, 0
            prog = programs[cid] = next_program(cid, k)
        progress[cid] = (k, i + 1)
        req = prog[i]
        engine.submit(f"{req.id}", req.tokens, req.max_tokens or req.output_tokens, ignore_eos=True, now=loop.now,
                      output_len=req.output_tokens)
        owner[req.id] = cid
        if not state["busy"]:
            start()

    def next_program(cid: str, k: int) -> list:
        prog = spec_by_id[cid].programs(k)
        return prog if prog else []

    def start() -> None:
        step = engine.start_step(loop.now)
        if step is None:
            state["busy"] = False
            return
        state["busy"] = True
        t0, t1 = max(step.start, start_w), min(step.end, end_s)
        if t1 > t0:  # the part of the step inside the window, weighted by its duration
            w = t1 - t0
            waiting = engine.num_waiting
            acc["running"] += engine.num_running * w
            acc["waiting"] += waiting * w
            acc["waited"] += w if waiting else 0.0
            acc["max_running"] = max(acc["max_running"], engine.num_running)
        loop.at(step.end, complete, step)

    def complete(step) -> None:
        engine.complete_step(step)
        for f in step.finished:
            if loop.now >= start_w:
                acc["finished"] += 1
            loop.at(loop.now, send, owner.pop(f.request_id))
        start()

    owner: dict[str, str] = {}
    spec_by_id = {s.id: s for s in specs}
    for s in specs:
        programs[s.id] = next_program(s.id, 0)
        progress[s.id] = (0, 0)
        loop.at(rng.uniform(0.0, start_spread_s), send, s.id)
    loop.run(until=end_s)
    return CapacityPoint(clients=clients, mean_running=acc["running"] / window_s,
                         mean_waiting=acc["waiting"] / window_s, max_running=acc["max_running"],
                         wait_fraction=acc["waited"] / window_s, throughput_rps=acc["finished"] / window_s,
                         retractions=engine.num_preemptions)


def sweep(client_counts: Sequence[int] = DEFAULT_CLIENTS, *, params: EngineParams | None = None,
          wait_threshold: float = 0.5, **kwargs) -> CapacitySweep:
    """``measure`` each client count (same seed and params) and find the first-wait point.

    ``params`` None: ``EngineParams(admission="sglang")`` (SGLang v0.4.3 defaults, Llama-3.1-8B on one L4).
    """
    params = params or EngineParams(admission="sglang")
    points = tuple(measure(n, params=params, **kwargs) for n in client_counts)
    first = next((p.clients for p in points if p.mean_waiting > wait_threshold), None)
    return CapacitySweep(points=points, first_wait_clients=first, wait_threshold=wait_threshold)


#: The client counts the calibration sweeps (outstanding requests on one replica).
CALIBRATION_CLIENTS = (10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 70, 80)


def first_wait_outstanding(seeds: Sequence[int] = (0, 1, 2)) -> tuple[list[tuple[str, float]], str]:
    """The calibration table's capacity cell: per dataset of the calibrated regime (bench/sim/regime.yaml: its
    engine, its Arena and WildChat shapes with the clients' max_tokens), the first-wait point averaged over
    ``seeds``. Returns ([(label, outstanding requests)], how it was measured)."""
    from bench.sim.regime import engine_params, shape
    params = engine_params()
    values, spreads = [], []
    for name in ("arena", "wildchat"):
        firsts = [sweep(CALIBRATION_CLIENTS, params=params, shape=shape(name), seed=s).first_wait_clients
                  for s in seeds]
        got = [f if f is not None else CALIBRATION_CLIENTS[-1] + 10 for f in firsts]
        values.append((f"{name} [{min(got)}, {max(got)}]", sum(got) / len(got)))
        spreads.append(name)
    how = (f"one replica of the regime's engine ({params.admission} admission, {params.kv_cache_tokens} KV tokens), "
           f"closed-loop clients {CALIBRATION_CLIENTS[0]}-{CALIBRATION_CLIENTS[-1]}; the first count whose mean "
           f"waiting exceeds 0.5, mean [min, max] over seeds {', '.join(map(str, seeds))} (bench/sim/capacity.py)")
    return values, how


def table(result: CapacitySweep) -> str:
    """The sweep as a GitHub-markdown table."""
    rows = [[p.clients, f"{p.mean_running:.1f}", f"{p.mean_waiting:.1f}", p.max_running,
             f"{p.wait_fraction:.0%}", f"{p.throughput_rps:.2f}", p.retractions] for p in result.points]
    return tabulate(rows, headers=["clients (outstanding)", "mean running", "mean waiting", "max running",
                                   "time with waiting", "finished/s", "retractions"], tablefmt="github")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the sweep table and the first-wait point."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS))
    parser.add_argument("--admission", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--shape", choices=("wildchat", "arena"), default="wildchat",
                        help="conversation lengths: bench.sim.workloads WILDCHAT or ARENA")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="SGLang admission: override the 0.88 default (KV capacity follows)")
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--window-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-threshold", type=float, default=0.5)
    args = parser.parse_args(argv)
    params = EngineParams(admission=args.admission)
    if args.mem_fraction_static is not None:
        params = replace(params, mem_fraction_static=args.mem_fraction_static, kv_cache_tokens=None)
    shape = WILDCHAT if args.shape == "wildchat" else ARENA
    result = sweep(args.clients, params=params, wait_threshold=args.wait_threshold, seed=args.seed,
                   warmup_s=args.warmup_s, window_s=args.window_s, shape=shape)
    print(f"{args.admission} admission, KV {params.kv_cache_tokens} tokens, {args.shape} conversations, "
          f"seed {args.seed}")
    print(table(result))
    print(f"first wait (mean waiting > {result.wait_threshold}): {result.first_wait_clients} clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
