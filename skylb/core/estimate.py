"""How long a new request would wait on a replica before its prefill starts, from what a balancer knows.

Source: the engines' schedulers (a load signal that sees prefill backlog and KV pressure): vLLM V1 and
SGLang run prompts in FCFS order with chunked prefill, so a new request's first token waits for the prompts queued
ahead of it on that replica, plus its own prefill. What the balancer knows exactly is its own share of that queue:
the prompts it sent that have not streamed a first token yet (``ReplicaState.unprefilled``, less the prefix it
expects the engine to have cached). Requests the engine reports pending beyond those (sent by another balancer)
are counted at ``default_prompt_tokens`` each. Tokens become seconds at the replica's prefill rate: the one measured
on that replica (``ReplicaState.rates``, an EMA of prefill seconds per prompt token learned from responses;
OllamaRouter §4.3, skylb/core/rates.py) once it is measured, else the configured ``prefill_tokens_per_s``.

That rate is measured only from a response that was alone on its replica; an unmeasured replica beside measured ones
is priced at the fastest measured rate (optimism, so a new replica is tried). Under load a replica can stay
unmeasured for good, and on mixed hardware it is then priced as fast as the fastest. With ``pace_class_ratio`` r, an
unmeasured replica whose pace, measured from every response (time per token and inter-token latency,
``ModelRates.itl_s``), is at least r times the fastest candidate's in both is priced at the fastest measured rate
times the smaller of its two slowdowns: a replica of a slower hardware class, at :data:`PACE_CLASS_RATIO` as the
default's stall term classes it (skylb/core/plugins/estimated_ttft.py).

Units: tokens, tokens/s, seconds. Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from skylb.core.rates import ModelRates
from skylb.core.request import Request
from skylb.core.state import ReplicaState

__all__ = ["WaitModel", "prompt_tokens", "text_tokens", "kv_wait_s", "pace_slowdowns", "pace_classes_apart",
           "CHARS_PER_TOKEN", "PACE_CLASS_RATIO"]

#: How many times slower, in time per token and in inter-token latency both, a replica must be than the fastest
#: candidate to be of a slower class (the stall term's classes, skylb/core/plugins/estimated_ttft.py, and the pricing
#: of an unmeasured replica's prefill, module docstring). Between the spread of identical replicas and that of
#: hardware classes: in the simulated matrix, on identical replicas (the conversation trace at 2x, Arena at 4x, seed
#: 0) the candidates' spread reached 1.5x in 5-17% of decisions, 2x in under 0.5% and 2.5x in 0.2%; OllamaRouter's
#: Table 3 puts a CPU host 3.4-4.5x behind a GPU host.
PACE_CLASS_RATIO = 2.5

def pace_slowdowns(paces: Sequence[ModelRates | None]) -> list[float | None]:
    """For each candidate's measured rates (None: unmeasured), how many times slower its pace is than the fastest
    candidate's: the smaller of its time-per-token and inter-token-latency ratios to the least of each among the
    candidates with both measured (1.0 for the fastest); None for a candidate without both, and for all when fewer
    than two have them. A candidate is of a slower class at :data:`PACE_CLASS_RATIO` or more."""
    paced = [m for m in paces if m is not None and m.itl_s is not None and m.time_per_token_s is not None]
    if len(paced) < 2:
        return [None] * len(paces)
    tpt, itl = min(m.time_per_token_s for m in paced), min(m.itl_s for m in paced)
    if tpt <= 0 or itl <= 0:
        return [None] * len(paces)
    return [None if m is None or m.itl_s is None or m.time_per_token_s is None
            else min(m.time_per_token_s / tpt, m.itl_s / itl) for m in paces]


def pace_classes_apart(paces: Sequence[ModelRates | None], ratio: float) -> bool:
    """Whether any of ``paces`` may be of a slower class (:func:`pace_slowdowns` at least ``ratio``): False when
    fewer than two have both paces, or when the slowest of them is less than ``ratio`` x the fastest in time per
    token or in inter-token latency, so no slowdown (the smaller of the two ratios) can reach ``ratio``. Two
    passes and no division per candidate: the common case (one hardware class) costs the decision little."""
    tpts = [m.time_per_token_s for m in paces if m is not None and m.itl_s is not None
            and m.time_per_token_s is not None]
    if len(tpts) < 2:
        return False
    itls = [m.itl_s for m in paces if m is not None and m.itl_s is not None and m.time_per_token_s is not None]
    tpt, itl = min(tpts), min(itls)
    if tpt <= 0 or itl <= 0:
        return False
    return max(tpts) / tpt >= ratio and max(itls) / itl >= ratio


#: Characters per token when a request's length is known only as text: about 4 for English BPE vocabularies
#: (OpenAI's rule of thumb; Llama 3 and Gemma tokenizers are within 10% on chat text).
CHARS_PER_TOKEN = 4


def text_tokens(text: str) -> int:
    """The balancer's token count of ``text``: its characters / ``CHARS_PER_TOKEN``, rounded up (a partial token is
    a token), at least 1. The one estimator of the balancer (routing and quotas) and of the simulator, which builds
    its requests from the prompt text as the balancer does; the benchmark workloads' vocabulary (bench/replay/workload.py
    ``VOCABULARY``: 3-character words, one separator each) makes it equal the emulator's word count for the
    completions they replay. A chat request's text carries ``"role: "`` and a newline per message
    (skylb/balancer/api.py), 1-2 tokens more per message than the emulator's one role token
    (bench/emulator/model.py ``chat_tokens``); real chat templates add 4-5 (Llama 3 header and end-of-turn tokens)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def prompt_tokens(request: Request) -> int:
    """``request``'s prompt length in tokens: ``prompt_tokens`` when the caller knows it, else
    :func:`text_tokens` of its text."""
    if request.prompt_tokens is not None:
        return max(1, request.prompt_tokens)
    return text_tokens(request.text)


def kv_wait_s(replica: ReplicaState, tokens: float, backlog_tokens: float) -> float:
    """Seconds a request needing ``tokens`` new KV-cache tokens waits on ``replica`` for room in its KV cache: 0
    while they fit in what is free (its capacity x (1 - usage) at the latest probe, less the ``backlog_tokens``
    queued ahead of it, which will take their share first), else the replica's measured service time (a running
    request must finish and free its blocks; 0 while unmeasured).

    Source: the engines' admission. vLLM V1's scheduler admits a waiting request only when its KV blocks can be
    allocated (``KVCacheManager.allocate_slots`` returning None leaves it waiting) and SGLang's only when its prompt
    plus reserved output tokens fit in the pool (``PrefillAdder``); a request larger than what is free waits in the
    engine's queue however few requests run. With prompts near a replica's whole KV cache (the conversation trace
    at its real lengths: 35,000-token prompts in a 36,000-token cache) the batch's request count says nothing of
    this, and a replica with one running request had no room for a second.
    """
    cap, usage = replica.kv_capacity_tokens, replica.kv_usage
    if cap is None or usage is None:
        return 0.0
    if tokens <= cap * (1.0 - usage) - backlog_tokens:
        return 0.0
    return replica.rates.overall.service_s or 0.0


@dataclass(frozen=True)
class WaitModel:
    """Converts a replica's prefill backlog into seconds.

    Args:
        prefill_tokens_per_s: one replica's prefill throughput, tokens/s (Llama-3.1-8B on an L4: the paper's 512
            tokens in about 300 ms, less the 53.5 ms weight read, is 0.48 ms per token, about 2000 tokens/s).
        default_prompt_tokens: the length assumed for a pending request this balancer did not send, tokens.
        measured: use a replica's measured prefill rate (``ReplicaState.rates.prefill_s_per_token``) in place of
            ``prefill_tokens_per_s`` once it has one (False: always the configured constant).
        pace_class_ratio: price an unmeasured replica of a slower class at the fastest measured rate times its
            slowdown (module docstring; None: at the fastest measured rate, as any unmeasured replica).
    """

    prefill_tokens_per_s: float = 2000.0
    default_prompt_tokens: int = 512
    measured: bool = True
    pace_class_ratio: float | None = None

    def backlog_tokens(self, replica: ReplicaState) -> float:
        """Prompt tokens queued for prefill on ``replica`` ahead of a new request: this balancer's own unprefilled
        ones, plus ``default_prompt_tokens`` for each request the engine reports pending beyond those."""
        unknown = max(0, replica.pending - len(replica.unprefilled))
        return replica.backlog_tokens + unknown * self.default_prompt_tokens

    def prefill_s(self, tokens: float, replica: ReplicaState | None = None,
                  prior_s_per_token: float | None = None) -> float:
        """Seconds to prefill ``tokens`` uncached prompt tokens on ``replica`` (at its measured rate when it has
        one and ``measured``); on an unmeasured replica at ``prior_s_per_token`` (s/token) when given, else (and
        for ``replica`` None) at the configured ``prefill_tokens_per_s``."""
        per_token = replica.rates.prefill_s_per_token if replica is not None and self.measured else None
        if per_token is None:
            per_token = prior_s_per_token if self.measured and prior_s_per_token else 1.0 / self.prefill_tokens_per_s
        return max(0.0, tokens) * per_token

    def wait_s(self, replica: ReplicaState, prior_s_per_token: float | None = None) -> float:
        """Estimated seconds before a new request's prefill starts on ``replica`` (its backlog's prefill time;
        ``prior_s_per_token`` as in :meth:`prefill_s`)."""
        return self.prefill_s(self.backlog_tokens(replica), replica, prior_s_per_token)

    def ttft_s(self, replicas: Sequence[ReplicaState], uncached_tokens: Sequence[float],
               prior_s_per_token: float | None = None) -> list[float]:
        """For each replica and its uncached prompt tokens: ``wait_s(replica) + prefill_s(uncached, replica)``, s
        (``prior_s_per_token`` as in :meth:`prefill_s`). The same arithmetic as those two, in one pass: it is the
        routing decision's inner loop (200 replicas cost about 0.1 ms this way, several times that through calls)."""
        rates = [r.rates.overall.prefill_s_per_token for r in replicas] if self.measured else None
        return self._ttft(replicas, uncached_tokens, rates, prior_s_per_token)

    def ttft_among_s(self, replicas: Sequence[ReplicaState], uncached_tokens: Sequence[float],
                     stalls: list[float] | None = None, stall_weight: float = 0.0) -> list[float]:
        """``ttft_s(replicas, uncached_tokens, prior_s_per_token(replicas))``, each replica's measured rate read
        once for both. With ``stalls`` (a list), each estimate plus ``stall_weight`` x the replica's batch (running
        at its probe plus sent since, or this balancer's in flight there if more) x its uncached prefill time is
        appended to it, in the same pass (the generation stall the prefill causes the requests decoding there:
        skylb/core/plugins/estimated_ttft.py, "Generation stalls")."""
        if not self.measured:
            return self._ttft(replicas, uncached_tokens, None, None, stalls, stall_weight)
        rates = [r.rates.overall.prefill_s_per_token for r in replicas]
        known = [rate for rate in rates if rate is not None]
        fastest = min(known) if known else None
        if fastest is not None and self.pace_class_ratio and len(known) < len(rates):
            self._price_slower_classes(replicas, rates, fastest, self.pace_class_ratio)
        return self._ttft(replicas, uncached_tokens, rates, fastest, stalls, stall_weight)

    @staticmethod
    def _price_slower_classes(replicas: Sequence[ReplicaState], rates: list[float | None], fastest: float,
                              ratio: float) -> None:
        """Fill in ``rates`` (prefill s/token per replica, None: unmeasured) for the unmeasured replicas of a
        slower class: ``fastest`` x their ``pace_slowdowns`` when at least ``ratio`` (module docstring)."""
        paces = [r.rates.overall for r in replicas]
        if not pace_classes_apart(paces, ratio):
            return
        for i, slowdown in enumerate(pace_slowdowns(paces)):
            if rates[i] is None and slowdown is not None and slowdown >= ratio:
                rates[i] = fastest * slowdown

    def _ttft(self, replicas: Sequence[ReplicaState], uncached_tokens: Sequence[float],
              rates: list[float | None] | None, prior_s_per_token: float | None,
              stalls: list[float] | None = None, stall_weight: float = 0.0) -> list[float]:
        """:meth:`ttft_s`'s loop; ``rates``: each replica's measured prefill s/token (None: unmeasured), or None
        when ``measured`` is off; ``stalls``, ``stall_weight``: as in :meth:`ttft_among_s`."""
        measured, unknown_tokens = self.measured, self.default_prompt_tokens
        fallback = prior_s_per_token if measured and prior_s_per_token else 1.0 / self.prefill_tokens_per_s
        out = []
        for r, tokens, per_token in zip(replicas, uncached_tokens, rates or itertools.repeat(None)):
            if per_token is None:
                per_token = fallback
            unknown = r.pending - len(r.unprefilled)
            backlog = r.backlog_tokens + unknown * unknown_tokens if unknown > 0 else r.backlog_tokens
            # max(0.0, x) as conditionals: the same values (0.0 at or below zero), without two calls per replica.
            cost = (backlog if backlog > 0 else 0.0) * per_token + (tokens if tokens > 0 else 0.0) * per_token
            if r.kv_capacity_tokens is not None and r.kv_usage is not None:
                cost += kv_wait_s(r, tokens, backlog)
            out.append(cost)
            if stalls is not None:  # the batch: max(running + sent since the probe, outstanding), without calls
                batch = (r.running or 0) + len(r.dispatch_times)
                if r.outstanding > batch:
                    batch = r.outstanding
                stalls.append(cost + stall_weight * batch * (tokens if tokens > 0 else 0.0) * per_token)
        return out

    def prior_s_per_token(self, replicas) -> float | None:
        """The fastest measured prefill rate among ``replicas`` (s/token), the estimate for an unmeasured one beside
        them; None when none is measured or ``measured`` is off. Optimistic on purpose, as OllamaRouter tries an
        unmeasured replica first: with the configured constant (often slower than a measured replica) a new or
        failed-over replica lost every idle-time tie and stayed unmeasured until the others were busy."""
        if not self.measured:
            return None
        rates = [rate for r in replicas if (rate := r.rates.overall.prefill_s_per_token) is not None]
        return min(rates) if rates else None
