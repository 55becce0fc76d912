"""A burst behind one prefix is spread while the region is light (a first Rule of the default profile).

When several requests behind the same prefix arrive together (a tree of thought's branches, an agent's parallel
tool calls), the default's other rules send them one after another to the replica holding the prefix, because each
one's cache hit makes that replica the cheapest by its estimate: the estimate is read between probes and does not
see that the requests just sent there are still prefilling, so the last branch waits behind every other's prefill.
A scheduler with a fresh look at every replica before each placement places at most one request per replica per
look and none where the engine has one waiting (the SkyLB paper's selective pushing, §3.3, read at every
placement): on the closed-loop trees at 0.5x-1x that rule's P90 time to first token is 0.23-0.27 s against the
default's 0.35-0.40 (simulated; the matrix's oracle, bench/results/oracle_gap.md).

This rule gives the default that look where it pays. For a request whose prompt two or more local replicas hold
(``PrefixLocality.held_fractions`` over the replicas with room and the full ones: the best at least the locality's
threshold, another within ``delta`` of the best, whatever its own holding), while the region is light (the mean
batch occupancy over its usable replicas, (running + pending + sent since the probe) / learned admission limit,
below ``below_occupancy``), only the replicas with room to which this balancer has sent nothing since their latest
probe stay candidates; the full ones are left out too, so the push of a cache hit into its holder's batch
(push_to_holder.py) cannot reach a holder that was just sent a request either. With none left the request waits in
this balancer's queue until a probe shows where the burst's requests went (``HOLD``). The capped replicas are
marked ``probe_wanted``, so a balancer whose adaptive probing has lengthened their interval (up to 8 probe
intervals where its answers are foreseen: skylb/balancer/probe_backoff.py) probes them at its next round, and the
cap lasts at most about one probe interval, as in the simulator, which probes every replica every interval. Under
load the gate is shut: spreading a burst then stalls more decodes than it saves prefill waits (closed-loop trees,
per ``bench.sim.ttft_parts``: time per output token 85 -> 90 ms at 1x when spread), and the rule has no opinion.

Measured (simulated, the robustness matrix's 36 cells, SkyLB and RegionLocal rerun, bench/results/option_sweep.md):
gated at occupancy 0.5 against no rule, check 1 met in 20 / 22 / 19 cells on the development split, the validation
split and with first-come engines (20 / 22 / 18 without it), P90 TTFT geometric mean 0.989 / 0.994 / 0.989,
throughput 0.996 / 0.997 / 0.996. Gated at 0.7 the P90 falls further (0.971-0.976) for 0.8% of the throughput on
every split, and check 1 loses a cell on two splits; ungated, the light trees reach the oracle's P90 but the
closed-loop trees at 2x-5x lose 2.5-5% of their throughput (bench/results/spread_cap.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from skylb.core.candidates import Candidates
from skylb.core.plugins.prefix_locality import PrefixLocality
from skylb.core.profile import HOLD
from skylb.core.state import ReplicaState

__all__ = ["SpreadCap", "mean_occupancy"]


def mean_occupancy(replicas: Sequence[ReplicaState]) -> float:
    """The mean over ``replicas`` of (running + pending + sent since the latest probe) / learned admission limit
    (skylb/core/capacity.py), a fraction (above 1 where requests wait in engines); replicas without a learned limit
    are left out; 0.0 when none has one."""
    parts = []
    for r in replicas:
        limit = r.capacity.limit if r.capacity is not None else None
        if limit:
            parts.append(((r.running or 0) + r.pending + r.sent_since_probe) / limit)
    return sum(parts) / len(parts) if parts else 0.0


class SpreadCap:
    """Rule: narrow ``c.local`` to the replicas not sent a request since their probe, for a prompt two or more
    replicas hold while the region is light, and hold the request when none is left (module docstring); else no
    opinion and the candidates unchanged. It changes ``c.local`` in place: run it before every other rule.

    Args:
        locality: the replica trie (and the block index where KV-cache events are live).
        below_occupancy: the gate, a mean batch occupancy (fraction; 0: the rule is off).
        delta: how far below the best holding another replica's holding may be and still count, a fraction of the
            prompt (0-1).

    Raises:
        ValueError: a negative gate or a delta outside 0-1.
    """

    def __init__(self, locality: PrefixLocality, *, below_occupancy: float, delta: float):
        if below_occupancy < 0 or not 0 <= delta <= 1:
            raise ValueError(f"spread cap: below_occupancy must be >= 0 and delta within 0-1, got {below_occupancy}"
                             f" and {delta}")
        self.locality, self.below_occupancy, self.delta = locality, below_occupancy, delta

    def decide(self, c: Candidates, picked: ReplicaState | None) -> object | None:
        """``HOLD`` when the cap applies and leaves no candidate, else None (``c.local`` narrowed when it applies)."""
        if not c.local or self.below_occupancy <= 0:
            return None
        pool = [*c.local, *c.busy]
        held = self.locality.held_fractions(c.request, pool)
        best = max(held, default=0.0)
        if best < self.locality.threshold or sum(1 for h in held if h >= best - self.delta) < 2:
            return None
        if mean_occupancy(pool) >= self.below_occupancy:
            return None
        free = []
        for r in c.local:
            if not r.sent_since_probe:
                free.append(r)
            elif not r.probe_wanted:  # the cap lifts at its next probe: ask for one at the next round
                r.probe_wanted = True
        if not free:
            return HOLD
        c.local = free
        return None
