"""The cost of the queue with priority classes against the plain FCFS queue (in process, no I/O).

``.venv/bin/python -m bench.micro.queue_classes [--requests 10000] [--tenants 100]``: fills a router's queue with
``--requests`` requests spread over ``--tenants`` tenants and three classes (high, normal, low), then places them
one at a time on a one-slot replica (expiring overdue ones at every pass, as the dispatcher does), and prints the
mean time per placement, µs, for the FCFS queue and for the class queue (skylb/core/queue.py). The placement
itself (the policy's choice of replica, the prefix trie) is in both figures; the difference is the queue's cost.
"""

from __future__ import annotations

import argparse
import time

from skylb.core import AvailabilityRules, Request, Router, make_policy

CLASSES = ("high", "normal", "low")


def placement_us(*, priorities: bool, requests: int, tenants: int) -> float:
    """Mean µs per placement draining ``requests`` queued requests of ``tenants`` tenants."""
    router = Router(region="us", policy=make_policy("skylb"), rules=AvailabilityRules(max_dispatch_per_probe=0),
                    priorities=priorities, aging_s=60.0)
    router.set_replicas([("r0", "http://r0", "vllm")], max_concurrency={"r0": 1})
    for i in range(requests):
        router.enqueue(Request(f"q{i}", f"prompt {i % 97} " * 8, arrived_at=i * 1e-4, tenant=f"t{i % tenants}",
                               priority=CLASSES[i % len(CLASSES)]))
    placed = 0
    started = time.perf_counter()
    while router.queue:
        router.observe_replica("r0", now=1.0, healthy=True, pending=0, running=0)
        router.expire(1.0, 600.0)
        for decision in router.dispatch(1.0):
            router.finished(decision)
            placed += 1
    return (time.perf_counter() - started) / placed * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=100)
    args = parser.parse_args(argv)
    for priorities in (False, True):
        us = placement_us(priorities=priorities, requests=args.requests, tenants=args.tenants)
        print(f"{'classes' if priorities else 'fcfs':8s} {args.requests} requests, {args.tenants} tenants: "
              f"{us:.1f} us per placement")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
