"""The block index at 10^6 blocks: its memory (RSS), and the speed of what feeds and reads it.

``.venv/bin/python -m bench.micro.kv_index_memory [--blocks 1000000] [--replicas 16] [--json PATH]`` prints:

* RSS (``/proc/self/status`` VmRSS) of a fresh process before the index, with the index filled to its bound
  (random 64-bit hashes, as vLLM's events carry; a quarter of the blocks held by two replicas), and after twice as
  many more blocks were stored (the bound must hold: the index stays at ``--blocks`` blocks and RSS flat);
* store speed (blocks/s), the lookup the router makes (``matched_tokens`` for a 32k-token prompt = 2048 blocks of
  16 tokens, the prompt's prefix held by one replica: p50/p99 in ms, wall-clock and CPU time), a drop of one
  replica and the sweep;
* decoding of vLLM-format batches (:mod:`skylb.engines.kv_wire`, batches of 16 blocks like one engine step's store)
  and vLLM's default block hashing in Python (pickle + SHA-256, :mod:`bench.emulator.kv_hash`) for a 32k prompt.

Run it alone on a quiet machine: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench.emulator import kv_hash
from bench.emulator.kv_publisher import encode_batch
from skylb.core.kv_events import BlockRemoved, BlockStored
from skylb.core.kv_index import BlockIndex
from skylb.engines.kv_wire import decode_batch

__all__ = ["measure", "main"]


def rss_mib() -> float:
    """This process's resident set size, MiB (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _fill(index: BlockIndex, rng: random.Random, blocks: int, replicas: list[str]) -> float:
    """Store ``blocks`` random hashes in runs of 16 (one engine step's store); a quarter also on a second replica.
    Returns the blocks stored per second."""
    began = time.perf_counter()
    stored = 0
    while stored < blocks:
        run = [rng.getrandbits(64) for _ in range(16)]
        owner = rng.randrange(len(replicas))
        index.store(replicas[owner], run, block_size=16, medium="GPU")
        if rng.random() < 0.25:
            index.store(replicas[(owner + 1) % len(replicas)], run, block_size=16, medium="GPU")
        stored += len(run)
    return stored / (time.perf_counter() - began)


def _lookup_ms(index: BlockIndex, rng: random.Random, replica: str, rounds: int = 400) -> dict:
    """p50 and p99 (ms) of matched_tokens for a 2048-block prompt whose first 1536 blocks ``replica`` holds, in
    wall-clock time and in this thread's CPU time (the latter leaves out time the OS gave other processes)."""
    prompt = [rng.getrandbits(64) for _ in range(2048)]
    index.store(replica, prompt[:1536], block_size=16, medium="GPU")
    wall, cpu = [], []
    for _ in range(rounds):
        began, began_cpu = time.perf_counter(), time.thread_time()
        matched = index.matched_tokens(prompt)
        cpu.append((time.thread_time() - began_cpu) * 1000)
        wall.append((time.perf_counter() - began) * 1000)
    assert matched[replica] == 1536 * 16, matched
    p99 = int(0.99 * (rounds - 1))
    wall.sort()
    cpu.sort()
    return {"wall_p50_ms": round(statistics.median(wall), 3), "wall_p99_ms": round(wall[p99], 3),
            "cpu_p50_ms": round(statistics.median(cpu), 3), "cpu_p99_ms": round(cpu[p99], 3)}


def _codec_speed(rng: random.Random, batches: int = 2000) -> dict:
    """Decode rate of vLLM-format batches (one BlockStored of 16 blocks and one BlockRemoved each)."""
    payloads = [encode_batch(time.time(), [BlockStored([rng.getrandbits(64) for _ in range(16)], None,
                                                       list(range(256)), 16), BlockRemoved([rng.getrandbits(64)])])
                for _ in range(batches)]
    began = time.perf_counter()
    for p in payloads:
        decode_batch(p)
    elapsed = time.perf_counter() - began
    return {"batches_per_s": batches / elapsed, "events_per_s": 2 * batches / elapsed,
            "us_per_batch": elapsed / batches * 1e6}


def _hash_speed(rng: random.Random, rounds: int = 5) -> dict:
    """vLLM's default block hashing (pickle + SHA-256) of a 32k-token prompt, in Python."""
    ids = [rng.randrange(128_000) for _ in range(32_768)]
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        kv_hash.block_hashes(ids, 16)
        times.append(time.perf_counter() - began)
    best = min(times)
    return {"ms_per_32k_prompt": best * 1000, "us_per_block": best / 2048 * 1e6}


def measure(blocks: int = 1_000_000, replicas: int = 16, seed: int = 0) -> dict:
    """Run every measurement once; a JSON-ready dict (MiB, blocks/s, ms)."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(replicas)]
    before = rss_mib()
    index = BlockIndex(blocks)
    for name in names:
        index.mark_live(name)
    store_rate = _fill(index, rng, blocks, names)
    full = rss_mib()
    at_bound = len(index)
    _fill(index, rng, 2 * blocks, names)
    after = rss_mib()
    lookup = _lookup_ms(index, rng, names[0])
    began = time.perf_counter()
    index.drop(names[1])
    drop_ms = (time.perf_counter() - began) * 1000
    began = time.perf_counter()
    index.sweep()
    sweep_ms = (time.perf_counter() - began) * 1000
    return {"blocks_bound": blocks, "replicas": replicas, "rss_before_mib": round(before, 1),
            "rss_full_mib": round(full, 1), "rss_after_3x_blocks_mib": round(after, 1),
            "index_blocks_at_bound": at_bound, "index_blocks_after_3x": len(index), "evicted": index.evicted,
            "bytes_per_block": round((full - before) * 2**20 / blocks, 1),
            "store_blocks_per_s": round(store_rate), "matched_tokens_32k_prompt": lookup,
            "drop_replica_ms": round(drop_ms, 3),
            "sweep_ms": round(sweep_ms, 1), "decode": _codec_speed(rng), "hash": _hash_speed(rng)}


def main(argv: list[str] | None = None) -> int:
    """Measure and print (and write ``--json``); returns 0, or 1 when the index exceeded its bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="the index's bound (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=16, help="replicas storing blocks (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures there")
    args = parser.parse_args(argv)
    result = measure(args.blocks, args.replicas)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0 if result["index_blocks_after_3x"] <= args.blocks else 1


if __name__ == "__main__":
    raise SystemExit(main())
