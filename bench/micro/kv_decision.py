"""What routing by KV-cache events costs per request: hashing (before the queue) and the decision (with the index).

``.venv/bin/python -m bench.micro.kv_decision [--blocks 1000000] [--replicas 8] [--tokens 32768] [--n 300]`` prints, as
JSON, p50/p99 in ms of:

* ``hash_ms``: a request's block hashes from its token ids (skylb/core/kv_hash.py, vLLM's pickle + SHA-256
  chain, blocks of 16), the CPU part of the tokenize step; the /tokenize round trip to the engine comes on top and is
  the balancer's ``skylb_kv_tokenize_seconds`` histogram (tokenizing is the engine's work);
* ``hash_new_ms`` and ``hash_turn_ms``: the same through the balancer's block hash cache (skylb/core/kv_hash.py
  ``BlockHashCache``, as skylb/balancer/kv_routing.py keeps one): a prompt none of whose blocks it holds, and a
  conversation's next turn whose first three quarters (the previous turn) it holds;
* ``prepare_ms``: ``Router.enqueue``, the rest of the per-request work done once as the request is queued (its
  character count, its prompt cut into the prefix trie's chunks), outside the decision every queued request waits
  on, as hashing is;
* ``decision_ms``: one routing decision of the default policy (``Router.dispatch``, the request placed), as
  bench/micro/coordination.py times it, with the block index at ``--blocks`` blocks and ``--replicas`` live
  replicas, for a prompt of ``--tokens`` tokens whose prefix one replica holds; ``decision_trie_ms``: the same
  request without block hashes (the prefix trie alone). Until 2026-11-30 ``decision_ms`` included ``prepare_ms``.

Run it alone on a quiet machine: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from skylb.config import BalancerConfig
from skylb.core import Request, build_router
from skylb.core.kv_index import BlockIndex
from skylb.core.kv_hash import BlockHashCache, request_block_hashes

__all__ = ["measure", "main"]


def _pct(samples: list[float]) -> dict:
    samples = sorted(samples)
    return {"p50": round(statistics.median(samples), 3), "p99": round(samples[int(0.99 * (len(samples) - 1))], 3)}


def _router(index: BlockIndex, replicas: int):
    router = build_router("us", BalancerConfig(), kv_index=index)
    router.set_replicas([(f"r{i}", f"sim://r{i}", "vllm") for i in range(replicas)])
    for i in range(replicas):
        router.observe_replica(f"r{i}", now=0.0, healthy=True, pending=0, running=0)
    return router


def measure(*, blocks: int, replicas: int, tokens: int, n: int, seed: int = 0) -> dict:
    """The figures of the module docstring for an index of ``blocks`` blocks over ``replicas`` replicas."""
    rng = random.Random(seed)
    index = BlockIndex(blocks)
    for i in range(replicas):
        index.mark_live(f"r{i}")
        index.store(f"r{i}", (rng.getrandbits(64) for _ in range(blocks // replicas)), block_size=16)
    ids = [rng.randrange(32000) for _ in range(tokens)]
    hash_ms, new_ms, turn_ms = [], [], []
    previous = len(ids) * 3 // 4
    for _ in range(max(3, n // 30)):
        started = time.perf_counter()
        hashes = request_block_hashes(ids, 16)
        hash_ms.append((time.perf_counter() - started) * 1000)
        cache = BlockHashCache()
        started = time.perf_counter()
        request_block_hashes(ids[:previous], 16, cache=cache)  # the previous turn, never seen before
        new_ms.append((time.perf_counter() - started) * 1000 * len(ids) / previous)  # per 32k tokens, as hash_ms
        started = time.perf_counter()
        request_block_hashes(ids, 16, cache=cache)
        turn_ms.append((time.perf_counter() - started) * 1000)
    index.store("r3", hashes[: len(hashes) // 2], block_size=16)  # half the prompt cached on one replica
    router = _router(index, replicas)
    text = " ".join(f"w{t}" for t in ids)[: tokens * 4]
    timings: dict[str, list[float]] = {"prepare_ms": [], "decision_ms": [], "decision_trie_ms": []}
    held = {}
    for k in range(n):
        now = k * 1e-4  # probes stay fresh (stale after 5 intervals of 100 ms)
        for name, block_hashes in (("decision_ms", hashes), ("decision_trie_ms", None)):
            request = Request(id=f"{name}{k}", text=f"{k} {text}", arrived_at=now, model="",
                              prompt_tokens=tokens, block_hashes=block_hashes)
            started = time.perf_counter()
            router.enqueue(request)
            queued = time.perf_counter()
            decisions = router.dispatch(now)
            timings[name].append((time.perf_counter() - queued) * 1000)
            if block_hashes is not None:
                timings["prepare_ms"].append((queued - started) * 1000)
            if len(decisions) != 1:
                raise RuntimeError(f"request {k} was not placed at once: {decisions}")
            router.finished(decisions[0])
            held[name] = held.get(name, 0) + (decisions[0].target == "r3")
    return {"placed_on_holder": held, "blocks": len(index), "replicas": replicas, "prompt_tokens": tokens, "requests": n,
            "hash_ms": _pct(hash_ms), "hash_new_ms": _pct(new_ms), "hash_turn_ms": _pct(turn_ms),
            **{name: _pct(v) for name, v in timings.items()}}


def main(argv: list[str] | None = None) -> int:
    """Command line: print the figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.micro.kv_decision", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args(argv)
    print(json.dumps(measure(blocks=args.blocks, replicas=args.replicas, tokens=args.tokens, n=args.n), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
