"""Room in the KV cache for this request (a per-request Filter of the default profile).

An engine admits a waiting request only when the KV cache can take it, and a request it cannot take holds up the
others behind it:

* SGLang (``managers/schedule_policy.py`` ``PrefillAdder``): the prompt's uncached tokens plus the output tokens it
  reserves, ``min(max_new_tokens, 4096)``, must fit in the free and evictable tokens less what the running batch
  has reserved; a request refused for want of tokens marks the batch full, and no request is admitted until one of
  the running ones finishes (``batch_is_full``).
* vLLM V1 (``v1/core/sched/scheduler.py``): the prompt's uncached blocks must be allocatable
  (``KVCacheManager.allocate_slots``); when they are not, the first-come queue stops at that request.

A replica's free KV cache is ``capacity x (1 - usage)`` at its latest probe (skylb/core/state.py
``kv_capacity_tokens``, ``kv_usage``: tokens held by running requests), less the prompt tokens this balancer sent
there that have not started (``backlog_tokens``), and, on an engine that reserves output, less what it keeps
reserved for the running requests' outputs (``ReplicaState.decode_reserve_tokens``: SGLang's ``new_token_ratio``,
from its probe, x what is left of the ``max_tokens`` of this balancer's requests there, clipped as below, after the
tokens each has generated at the replica's measured pace; the engine's other requests at their mean). A request
needs its uncached prompt tokens there (the profile's estimate, ``uncached``) plus, on such an engine
(``output_reserve_tokens``), its ``max_tokens`` clipped at that figure (the figure itself when the request gives
none, as SGLang does). Measured (simulated, bench/results/decode_reserve.md): the running reserve took the
long-output variant with first-come engines from 1.13x to 1.06x one SGLang router's P90 TTFT; the matrix's P90
geometric mean 0.988 (development) and 0.985 (validation), throughput unchanged.

The filter keeps the candidates that can admit the request now, when at least one can; when none can, it keeps them
all, and the picker prices the wait for room (skylb/core/estimate.py ``kv_wait_s``). Holding such a request in
this balancer's queue instead would hold up every request of its model behind it (the queue is first come, first
served per model) until some replica drains, where the engine's queue holds up only that replica. Replicas that
report no KV cache, and idle ones (an engine with nothing running admits what fits at all), always pass.

Measured (simulated, SGLang engines, bench/results/kv_admission.md): the conversation trace with outputs x6 at 2x,
P90 TTFT 2.78 -> 2.60 s (one SGLang router: 2.65); the robustness matrix's P90 geometric mean 0.999 (development
split) and 0.996 (validation); the worst cell, the conversation trace at 1x, 1.05x. Keeping only the admitting
replicas even when none admits (holding or forwarding the request) gained more on the conversation trace at real
prompt lengths but cost a saturated cell 21% P90.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from skylb.core.estimate import prompt_tokens
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["KVAdmission"]


class KVAdmission:
    """Per-request filter: only replicas whose KV cache can admit the request now, when any can.

    Args:
        uncached: (request, replica id) -> the prompt tokens the replica must prefill (the profile's estimate).
    """

    def __init__(self, uncached: Callable[[Request, str], int]):
        self.uncached = uncached

    def admits(self, request: Request, replica: ReplicaState, now: float | None = None) -> bool:
        """True when ``replica``'s KV cache can take ``request`` at ``now`` (s) (module docstring), or cannot be
        judged."""
        capacity, usage = replica.kv_capacity_tokens, replica.kv_usage
        if capacity is None or usage is None:
            return True
        if max((replica.running or 0) + replica.pending + len(replica.dispatch_times), replica.outstanding) == 0:
            return True
        clip = replica.output_reserve_tokens
        reserve = min(request.max_tokens or clip, clip) if clip else 0
        free = capacity * (1.0 - usage) - replica.backlog_tokens
        bound = replica.decode_reserve_bound()
        if prompt_tokens(request) + reserve <= free - bound:  # fits uncached beside the most reserved: no lookups
            return True
        need = self.uncached(request, replica.id) + reserve
        if need <= free - bound or need > free:
            return need <= free
        return need <= free - replica.decode_reserve_tokens(now)

    def narrow(self, request: Request, local: Sequence[ReplicaState], free: Sequence[ReplicaState],
               now: float | None = None) -> tuple[Sequence[ReplicaState], Sequence[ReplicaState]]:
        """(``local``, ``free``) narrowed to the replicas that admit ``request`` at ``now`` (s), when any of
        ``local`` does; else both unchanged. ``free``: those of ``local`` with a free slot."""
        admitting = [r for r in local if self.admits(request, r, now)]
        if not admitting or len(admitting) == len(local):
            return local, free
        ids = {r.id for r in admitting}
        return admitting, [r for r in free if r.id in ids]
