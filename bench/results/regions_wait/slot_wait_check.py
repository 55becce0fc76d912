"""How well a push's predicted wait for a place in its holder's batch matches the wait it got (simulated).

``python bench/results/regions_wait/slot_wait_check.py CELL SEED`` from the repository root (with ``PYTHONPATH=.``):
runs the default on one robustness-matrix cell (bench.sim.ab's ``run_cluster``) with the push rule wrapped so that
each push records ``skylb.core.cost.slot_wait_s`` of its holder at the decision, then prints, for the pushes sent in
the measurement window, the mean predicted and realized wait (the engine's ``FinishedRequest.queue_s``: submitted to
first scheduled), the deciles of realized / predicted (each + 50 ms), and both means by bins of the prediction
(< 0.5 s, < 2, < 5, < 10, more). A reading aid for bench/results/regions_wait/README.md, not a benchmark.
"""

from __future__ import annotations

import statistics
import sys

from bench.sim.ab import run_cluster
from skylb.core.cost import slot_wait_s
from skylb.core.plugins import push_to_holder

BINS = (0.5, 2.0, 5.0, 10.0)


def main(cell: str, seed: int) -> None:
    predicted: dict[str, float] = {}
    decide = push_to_holder.PushToPrefixHolder.decide

    def recording(self, c, picked):
        out = decide(self, c, picked)
        if out is not None and hasattr(out, "capacity") and out.rates.overall.service_s is not None:
            predicted[c.request.id] = slot_wait_s(out, out.rates.overall.service_s)
        return out

    push_to_holder.PushToPrefixHolder.decide = recording
    cluster, _, start = run_cluster((cell, "SkyLB", seed))
    pairs = []
    for f in cluster.records:
        d = f.peer_decision or f.origin_decision
        if f.sent_at >= start and f.result is not None and d is not None and d.rule == "push_to_holder" \
                and d.request.id in predicted:
            pairs.append((predicted[d.request.id], f.result.queue_s))
    print(f"{cell} seed {seed}: {len(pairs)} pushes")
    if len(pairs) < 2:
        return
    print(f"predicted mean {statistics.fmean(p for p, _ in pairs):.2f} s, realized mean "
          f"{statistics.fmean(r for _, r in pairs):.2f} s")
    print("realized / predicted deciles", [round(q, 2) for q in statistics.quantiles(
        [(r + 0.05) / (p + 0.05) for p, r in pairs], n=10)])
    for i, hi in enumerate((*BINS, float("inf"))):
        lo = BINS[i - 1] if i else 0.0
        sel = [(p, r) for p, r in pairs if lo <= p < hi]
        if sel:
            print(f"predicted {lo:g}-{hi:g} s: {len(sel)} pushes, predicted {statistics.fmean(p for p, _ in sel):.2f}"
                  f" s, realized {statistics.fmean(r for _, r in sel):.2f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
