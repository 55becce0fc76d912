"""Routing decision time of two checkouts, measured interleaved so that both see the same machine.

Entry point: ``.venv/bin/python -m bench.micro.decision_ab BASE_DIR NEW_DIR [--replicas 200] [--peers 8]
[--rounds 30] [--batch 300] [--trace PATH] [--kv-capacity TOKENS]``; :func:`main` ``(argv) -> int``. Each
directory is a checkout of this repository (for instance ``git worktree add /tmp/base <commit>``); its own code is
measured, with this interpreter. Each worker finds the trace where bench/sim/workloads.py ``DEFAULT_TRACE``
points from its own checkout: a checkout elsewhere needs the trace there too (or both the same ``--trace``), else
its worker routes generated prompts and the two sides no longer compare.

Why: this machine's speed drifts by 1.5x between minutes (bench/results/coordination-notes.md), so two runs of
bench/micro/coordination.py a few minutes apart compare the minutes more than the code. Here one worker process per
checkout builds the state of coordination.py (``build_router_state``: ``--replicas`` replicas, ``--peers`` peers,
the Mooncake trace's prompts, 2,000 untimed decisions), then the two workers take turns: each round, each times
``--batch`` decisions (``Router.dispatch``, one request each, a probe round every 100 as in coordination.py), the
order alternating between rounds. Printed: per checkout, p50 / p90 / p99 / mean over all its timed decisions (us),
and the median over rounds of the ratio of the two checkouts' round p50 (new / base) with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["main"]

#: The worker: run in a checkout's root with its code first on the path; reads a count per line, answers the
#: decision times (us) of that many decisions as a JSON list.
_WORKER = """
import json, random, sys, time
sys.path.insert(0, ".")
from bench.micro.coordination import MODEL, _observe, _prompts, build_router_state
from skylb.core import Request
replicas, peers, warm = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kv = {"kv_capacity_tokens": int(sys.argv[4])} if len(sys.argv) > 4 else {}
prompts = _prompts(2000, 0)
router, names = build_router_state(replicas, peers, seed=0, **kv)
rng, k, now = random.Random(0), 0, 0.0

def run(count):
    global k, now
    times = []
    for _ in range(count):
        if k % 100 == 0:
            now += 0.1
            _observe(router, rng, now, names, **kv)
        router.enqueue(Request(id=f"q{k}", text=prompts[(k * 7) % len(prompts)], arrived_at=now, model=MODEL,
                               session_key=f"s{k % 500}"))
        t0 = time.perf_counter_ns()
        out = router.dispatch(now)
        times.append((time.perf_counter_ns() - t0) / 1000.0)
        for d in out:
            router.finished(d)
        for request in list(router.queue):
            router.cancel(request.id)
        k += 1
    return times

run(warm)
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(run(int(line))), flush=True)
"""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def measure(base: str, new: str, *, replicas: int, peers: int, rounds: int, batch: int, warm: int = 2000,
            trace: str | None = None, kv_capacity_tokens: int | None = None) -> dict:
    """Both checkouts' decision times, interleaved (module docstring); ``warm`` untimed decisions first; ``trace``:
    the Mooncake-format trace whose prompts are routed (None: coordination.py's, the workspace's real trace, or
    generated prompts where it is absent); ``kv_capacity_tokens``: the KV-cache capacity every replica reports
    (coordination.py ``build_router_state``; both checkouts' coordination.py must take it). Returns the figures
    printed."""
    roots = [base, new]
    env = dict(os.environ, **({"SKYLB_TRACE": trace} if trace is not None else {}))
    extra = [str(kv_capacity_tokens)] if kv_capacity_tokens is not None else []
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(replicas), str(peers), str(warm), *extra], cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for root in roots]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker did not start (see its error above)")
        times: list[list[float]] = [[], []]
        medians: list[list[float]] = [[], []]
        for r in range(rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                workers[i].stdin.write(f"{batch}\n")
                workers[i].stdin.flush()
                got = json.loads(workers[i].stdout.readline())
                times[i] += got
                medians[i].append(statistics.median(got))
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=60)
    ratios = [n / b for b, n in zip(*medians)]
    return {"replicas": replicas, "peers": peers, "rounds": rounds, "batch": batch,
            "checkouts": {name: {"p50_us": _quantile(t, 0.5), "p90_us": _quantile(t, 0.9),
                                 "p99_us": _quantile(t, 0.99), "mean_us": statistics.fmean(t)}
                          for name, t in zip(("base", "new"), times)},
            "round_p50_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the figures (and JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m bench.micro.decision_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="checkout measured first in even rounds (the reference)")
    p.add_argument("new", help="checkout compared with it")
    p.add_argument("--replicas", type=int, default=200, help="local replicas (default 200)")
    p.add_argument("--peers", type=int, default=8, help="peers (default 8)")
    p.add_argument("--rounds", type=int, default=30, help="rounds of turns (default 30)")
    p.add_argument("--batch", type=int, default=300, help="timed decisions per checkout per round (default 300)")
    p.add_argument("--trace", default=None, help="a Mooncake-format trace whose prompts both workers route (default: "
                   "the workspace's, found from each checkout)")
    p.add_argument("--kv-capacity", type=int, default=None, metavar="TOKENS",
                   help="every replica reports this KV-cache capacity (the trie then bounded per replica by it)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    result = measure(args.base, args.new, replicas=args.replicas, peers=args.peers, rounds=args.rounds,
                     batch=args.batch, kv_capacity_tokens=args.kv_capacity, trace=args.trace)
    result["date"] = started
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    kv = f", KV capacity {args.kv_capacity} tokens" if args.kv_capacity is not None else ""
    print(f"{args.replicas} replicas, {args.peers} peers{kv}, {args.rounds} rounds x {args.batch} decisions "
          f"({started})")
    for name, root in (("base", args.base), ("new", args.new)):
        f = result["checkouts"][name]
        print(f"  {name} {root}: p50 {f['p50_us']:.1f} us, p90 {f['p90_us']:.1f}, p99 {f['p99_us']:.1f}, "
              f"mean {f['mean_us']:.1f}")
    r = result["round_p50_ratio"]
    print(f"  round p50 new/base: median {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
