"""Scratch (kept for the README's figures): one run's P90 TTFT, the engines' preemptions (SGLang's retractions) and
the mean seconds its measured requests waited in the engines' own waiting queues.

``TRACE=... python bench/results/heldout_variants/engine_queue.py SCENARIO SYSTEM SEED`` from the repository root.
"""
import statistics
import sys

sys.path.insert(0, ".")
from bench.sim.ab import run_cluster  # noqa: E402

cell, spec, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster, summary, start = run_cluster((cell, spec, seed))
preemptions = sum(getattr(r.engine, "num_preemptions", 0) for r in cluster.replicas.values())
sent = [f for f in cluster.records if start <= f.sent_at < cluster.stop_at and f.result is not None]
print(spec, f"p90 {summary.ttft_p90:.2f} preemptions {preemptions} "
      f"engine-queue mean {statistics.fmean(f.result.queue_s for f in sent):.3f}")
