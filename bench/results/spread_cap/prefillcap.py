"""Scratch experiment (not product code): at most PC_K of this balancer's requests awaiting their first token on one
replica (``ReplicaState.unprefilled``, which the balancer knows exactly from the streams it relays: no probe
needed); beyond it the replica is unavailable ("prefilling"), so a request goes to another replica with room or
waits in the balancer's queue, and the push of a cache hit may still reach it as a busy replica. PC_PROBED=1 counts
only those sent since the replica's latest probe (then the rule is ``max_dispatch_per_probe`` counted on requests
still prefilling).

Run from the repository root: ``PC_K=1 python bench/results/spread_cap/prefillcap.py CELLS SkyLB 0 2`` (the
arguments of ``python -m bench.sim.ab``).
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from skylb.core.state import AvailabilityRules  # noqa: E402

K = int(os.environ.get("PC_K", "1"))
PROBED = os.environ.get("PC_PROBED") == "1"
_reason = AvailabilityRules.replica_unavailable_reason


def reason(self, r, now):
    why = _reason(self, r, now)
    if why is not None:
        return why
    prefilling = len(r.unprefilled)
    if PROBED:
        prefilling = min(prefilling, r.sent_since_probe)
    return "prefilling" if prefilling >= K else None


AvailabilityRules.replica_unavailable_reason = reason

if __name__ == "__main__":
    from bench.sim import ab
    sys.exit(ab.main())
