"""Held-out variants of a Mooncake-format trace: the same requests with one property changed at a time.

The defaults were chosen on a few workloads (bench/sim/matrix.py); a variant of a real trace asks whether they hold
when one thing the development split never varied changes, while the rest (the lengths, the trace's load) stays:

* ``--unique-blocks``: every block id is new, so no two requests share a prefix (no prefix cache to keep; what is
  left is load balancing, as in traces without prefix information such as Azure's LLM inference traces or
  BurstGPT, which give lengths and times only);
* ``--arrivals poisson`` or ``--arrivals gamma --cv C``: the arrival times are redrawn as a renewal process with
  the trace's own mean gap (its span over its request count) and a coefficient of variation of 1 (Poisson) or
  ``C`` (a Gamma process of shape 1/C^2: bursts of near-simultaneous requests between long lulls, as in BurstGPT,
  "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems", Wang et al., 2024, section 3); the
  requests keep their order;
* ``--time-scale S``: every timestamp times ``S`` (S > 1 spreads the load: the same requests over a longer span);
* ``--output-scale K``: every output length times ``K`` (decode-heavy work, as from reasoning models), rounded.

Rows keep the format of bench/replay/workload.py ``read_trace``: ``timestamp`` (ms), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (ids of the prompt's 512-token blocks). Replay a variant in the simulator
with ``TRACE=OUT python -m bench.sim.ab mooncake,mooncake_2x 'SkyLB;LL;SGL;Oracle' 0,1,2 2``.

``python -m bench.sim.trace_variants SRC OUT [options]``; ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench.replay.workload import TraceError, TraceRow, read_trace

__all__ = ["vary", "main"]


def vary(rows: list[TraceRow], *, unique_blocks: bool = False, arrivals: str = "keep", cv: float = 1.0,
         time_scale: float = 1.0, output_scale: float = 1.0, seed: int = 0) -> list[dict]:
    """The variant of ``rows`` (module docstring), as JSON-ready dicts in the trace's order.

    ``arrivals``: "keep", "poisson" or "gamma" (with coefficient of variation ``cv`` of the gaps, > 0).
    Raises ValueError for an unknown ``arrivals``, a ``cv``, ``time_scale`` or ``output_scale`` that is not positive,
    or fewer than two rows to redraw arrivals from."""
    if arrivals not in ("keep", "poisson", "gamma"):
        raise ValueError(f"arrivals must be keep, poisson or gamma, not {arrivals!r}")
    if cv <= 0 or time_scale <= 0 or output_scale <= 0:
        raise ValueError("cv, time scale and output scale must be positive")
    times = [r.timestamp_ms for r in rows]
    if arrivals != "keep":
        if len(rows) < 2:
            raise ValueError("redrawing arrivals needs at least two requests")
        mean_gap = (times[-1] - times[0]) / (len(rows) - 1)
        shape = 1.0 if arrivals == "poisson" else 1.0 / (cv * cv)
        rng = random.Random(seed)
        t, times = times[0], []
        for _ in rows:
            times.append(t)
            t += rng.gammavariate(shape, mean_gap / shape)
    next_id = max((i for r in rows for i in r.hash_ids), default=-1) + 1
    out = []
    for r, t in zip(rows, times):
        ids = list(r.hash_ids)
        if unique_blocks:
            ids = list(range(next_id, next_id + len(ids)))
            next_id += len(ids)
        out.append({"timestamp": int(round(t * time_scale)), "input_length": r.input_length,
                    "output_length": int(round(r.output_length * output_scale)), "hash_ids": ids})
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the variant of ``SRC`` to ``OUT``; prints its request count and span. 2 on bad arguments or a bad
    trace."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim.trace_variants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a Mooncake-format trace (JSON lines)")
    parser.add_argument("out", type=Path, help="where to write the variant")
    parser.add_argument("--unique-blocks", action="store_true", help="give every block a new id (no shared prefix)")
    parser.add_argument("--arrivals", choices=("keep", "poisson", "gamma"), default="keep",
                        help="keep the trace's arrival times, or redraw them (default: keep)")
    parser.add_argument("--cv", type=float, default=3.0,
                        help="coefficient of variation of the gaps for --arrivals gamma (default: 3)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every timestamp (default: 1)")
    parser.add_argument("--output-scale", type=float, default=1.0, help="multiply every output length (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the redrawn arrivals (default: 0)")
    args = parser.parse_args(argv)
    try:
        rows = vary(read_trace(args.src), unique_blocks=args.unique_blocks, arrivals=args.arrivals, cv=args.cv,
                    time_scale=args.time_scale, output_scale=args.output_scale, seed=args.seed)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0
    print(f"{len(rows)} requests over {span:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
