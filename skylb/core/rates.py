"""Measured speed per replica and model: exponential moving averages (EMAs) of time per token, learned from what
each response reports, and the estimated wait built on them.

Source: the OllamaRouter paper ("Adaptive Load Balancing for Distributed LLM Inference Using Ollama") §3
eq. (1)-(2) and §4.3 "Parameter Updating". For a request
with ``p`` prompt characters on replica ``i``:

* ``T^ = p x f`` tokens, where ``f`` (the token-estimation factor) is an EMA of (prompt + output tokens) / prompt
  characters over every response (characters counted with runs of whitespace as one, as the paper does);
* ``W^(i) = (gamma_i x q_i x f + T^) x t^_i`` seconds, where ``q_i`` is the prompt characters of the requests this
  balancer has in flight on ``i``, ``t^_i`` the EMA of seconds per token (prompt + output) on ``i`` for the
  request's model, and ``gamma_i`` in [0, 2] the queue weight;
* after each response: ``t^ <- a x W/T + (1 - a) x t^``, ``f <- a x T/p + (1 - a) x f``, and
  ``gamma <- clip(gamma x (1 + a x (W/W^ - 1)), 0, 2)`` (``gamma <- 1`` when there was no estimate W^).

One refinement: when the engine reports its own durations (Ollama's ``prompt_eval_duration`` + ``eval_duration``),
``t^`` learns from that service time rather than from the measured end-to-end time, so queueing in the engine is
counted once (by ``gamma x q``), not also inside ``t^``; ``gamma`` still learns from the measured end-to-end time
against the estimate made at dispatch. Besides the paper's ``t^``, each replica keeps EMAs of prefill seconds per
prompt token and decode seconds per output token; the prefill rate is what skylb/core/estimate.py's WaitModel uses in
place of its configured constant once a replica is measured (one estimator, shared).

Units: tokens, characters, seconds. Pure: no clock, no I/O (durations are arguments).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Usage", "ModelRates", "InFlight", "ReplicaRates", "RateBook", "prompt_chars", "request_chars", "no_load",
           "DEFAULT_TOKEN_FACTOR"]

#: Tokens per prompt character before any response was measured: about 4 characters per token for English BPE
#: vocabularies (skylb/core/estimate.py CHARS_PER_TOKEN), prompt only.
DEFAULT_TOKEN_FACTOR = 0.25


#: ASCII whitespace as ``str.isspace`` defines it (space, \t \n \v \f \r and the separators \x1c-\x1f), mapped to
#: spaces: ``prompt_chars``'s fast path for ASCII text.
_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())
_TO_SPACE = bytes.maketrans(_ASCII_SPACE, b" " * len(_ASCII_SPACE))
_DOUBLE_SPACE = re.compile(rb"  ")
_SPACE_RUN = re.compile(rb"  +")


def prompt_chars(text: str) -> int:
    """Characters of ``text`` with each run of whitespace counted once, ends stripped (OllamaRouter §3)."""
    if not text.isascii():
        # str.split() and a regex's \s agree on what whitespace is (both use str.isspace); split and join are 5x
        # faster than re.sub on a long prompt.
        return len(" ".join(text.split()))
    # ASCII: bytes.translate and sre run in C without building a list of words (a 32k-token prompt: 0.1 ms
    # instead of 1.0 ms); the result is the same. The literal search scans with memchr, 4x faster than
    # ``b"  " in data`` (its search stops at every space) and 5x faster than the substitution finding nothing, so
    # the common prompt without a double space pays only the search.
    data = text.encode("ascii").translate(_TO_SPACE).strip(b" ")
    if _DOUBLE_SPACE.search(data) is None:
        return len(data)
    return len(_SPACE_RUN.sub(b" ", data))


def request_chars(request: Any) -> int:
    """``prompt_chars`` of a ``skylb.core.Request``'s text, computed once per request (cached in ``chars``)."""
    if request.chars is None:
        request.chars = prompt_chars(request.text)
    return request.chars


def no_load(replica: Any, model: str) -> float:
    """No load time known: every model counts as loaded (0 s)."""
    return 0.0


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1.0 - alpha) * old


@dataclass(frozen=True)
class Usage:
    """What one response said about its work (skylb/balancer/usage.py reads it from Ollama's final object or an
    OpenAI ``usage``).

    Attributes:
        prompt_tokens: the prompt's tokens (Ollama ``prompt_eval_count``; OpenAI ``prompt_tokens``).
        prefilled_tokens: the prompt tokens the engine computed, the cached ones excluded (OpenAI ``prompt_tokens``
            less ``prompt_tokens_details.cached_tokens``; Ollama reports only those in ``prompt_eval_count``).
        output_tokens: generated tokens (Ollama ``eval_count``; OpenAI ``completion_tokens``).
        prompt_s, decode_s: the engine's own prefill and decode durations, s (Ollama ``prompt_eval_duration``,
            ``eval_duration``, ns on the wire); None when the engine does not say (OpenAI servers).
    """

    prompt_tokens: int | None = None
    prefilled_tokens: int | None = None
    output_tokens: int | None = None
    prompt_s: float | None = None
    decode_s: float | None = None


@dataclass
class ModelRates:
    """EMAs for one replica and model (or every model together). None: not measured yet.

    Attributes:
        time_per_token_s: the paper's t^: service seconds per token, prompt and output together.
        prefill_s_per_token: seconds per prefilled prompt token; decode_s_per_token: seconds per output token
            (from a response that was alone there, or the engine's own decode time).
        itl_s: seconds between output tokens after the first, from every streamed response (the inter-token
            latency in whatever batch it ran: the replica's decode pace under its load, which needs no lone
            response, so a replica that is never alone under load is still measured).
        service_s: seconds from dispatch to the end of a response (how long a request holds its place in the
            batch, its wait in the engine's queue included).
        samples: responses learned from.
    """

    time_per_token_s: float | None = None
    prefill_s_per_token: float | None = None
    decode_s_per_token: float | None = None
    itl_s: float | None = None
    service_s: float | None = None
    samples: int = 0


@dataclass(frozen=True)
class InFlight:
    """A request this balancer sent to a replica, as the estimate saw it at dispatch.

    Attributes: model; chars: its prompt characters (``prompt_chars``); estimate_s: W^ at dispatch, s (None: the
    replica was not measured for the model); alone: nothing else of this balancer's was in flight there.
    """

    model: str
    chars: int
    estimate_s: float | None
    alone: bool


@dataclass
class ReplicaRates:
    """What has been measured on one replica (``ReplicaState.rates``).

    Attributes:
        models: model -> its EMAs on this replica; overall: EMAs over every model (for backlogs mixing models).
        gamma: the queue weight, in [0, 2] (OllamaRouter §3; 1 until learned).
        inflight: request id -> InFlight; queued_chars: the sum of their ``chars`` (the paper's q_i).
    """

    models: dict[str, ModelRates] = field(default_factory=dict)
    overall: ModelRates = field(default_factory=ModelRates)
    gamma: float = 1.0
    inflight: dict[str, InFlight] = field(default_factory=dict)
    queued_chars: int = 0

    def for_model(self, model: str) -> ModelRates | None:
        """The EMAs for ``model`` when at least one response of it was measured here, else None."""
        rates = self.models.get(model)
        return rates if rates is not None and rates.samples and rates.time_per_token_s is not None else None

    def summary(self) -> dict:
        """For operators (the status page): {"samples", "gamma", "in_flight_chars", "models": {model: {
        "samples", "ms_per_token", "prefill_ms_per_token", "decode_ms_per_token", "itl_ms"}}}, times in ms (None:
        unmeasured; ``itl_ms`` is the inter-token latency, ``ModelRates.itl_s``)."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000.0, 4)
        return {"samples": self.overall.samples, "gamma": round(self.gamma, 4), "in_flight_chars": self.queued_chars,
                "models": {m: {"samples": r.samples, "ms_per_token": ms(r.time_per_token_s),
                               "prefill_ms_per_token": ms(r.prefill_s_per_token),
                               "decode_ms_per_token": ms(r.decode_s_per_token), "itl_ms": ms(r.itl_s)}
                           for m, r in self.models.items()}}

    @property
    def prefill_s_per_token(self) -> float | None:
        """Measured prefill seconds per prompt token on this replica, every model together (None: unmeasured)."""
        return self.overall.prefill_s_per_token


class RateBook:
    """The learning rule and the estimate, over the ``ReplicaRates`` of each replica (one per balancer: policies
    hold it as ``Profile.rates``, the Router feeds it).

    Args:
        alpha: EMA smoothing factor in (0, 1]: the weight of the newest response.
        gamma: None: the queue weight is learned per replica (OllamaRouter §4.3); a number in [0, 2]: fixed.
        token_factor: None: ``f`` is learned (starting at DEFAULT_TOKEN_FACTOR); a number: fixed, tokens per char.
    """

    def __init__(self, *, alpha: float = 0.3, gamma: float | None = None, token_factor: float | None = None):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if gamma is not None and not 0.0 <= gamma <= 2.0:
            raise ValueError(f"gamma must be in [0, 2], got {gamma}")
        if token_factor is not None and token_factor <= 0:
            raise ValueError(f"token_factor must be > 0, got {token_factor}")
        self.alpha = alpha
        self.fixed_gamma = gamma
        self.fixed_factor = token_factor
        self.learned_factor: float | None = None
        #: Model load time: ``load_s(replica, model)`` -> seconds before ``model`` could start on ``replica`` (a
        #: ReplicaState) because it must be loaded first; added to W^ by policies/measured_wait.py
        #: ``pick_by_estimated_wait``. With ``ollama_fleet.hot_preference`` on, the Router sets it to
        #: skylb/core/fleet_rules.py ``load_s`` (0 where hot); else it stays 0.
        self.load_s: Callable[[Any, str], float] = no_load

    # -- the estimate ---------------------------------------------------------------------------------------------
    @property
    def token_factor(self) -> float:
        """``f``: tokens (prompt + output) per prompt character."""
        if self.fixed_factor is not None:
            return self.fixed_factor
        return self.learned_factor if self.learned_factor is not None else DEFAULT_TOKEN_FACTOR

    def gamma(self, rates: ReplicaRates) -> float:
        """The queue weight in use for a replica with ``rates``."""
        return self.fixed_gamma if self.fixed_gamma is not None else rates.gamma

    def queue_tokens(self, rates: ReplicaRates) -> float:
        """The seed's q_i x f: tokens of this balancer's requests in flight on the replica."""
        return rates.queued_chars * self.token_factor

    def estimate_s(self, rates: ReplicaRates, model: str, chars: int) -> float | None:
        """W^ (OllamaRouter eq. 1): seconds until a new ``model`` request of ``chars`` prompt characters would be
        answered by the replica with ``rates``; None when the replica is unmeasured for ``model``."""
        measured = rates.for_model(model)
        return None if measured is None else self.estimate_measured_s(rates, measured, chars)

    def estimate_measured_s(self, rates: ReplicaRates, measured: ModelRates, chars: int) -> float:
        """:meth:`estimate_s` with the model's EMAs ``measured`` (``rates.for_model(model)``, not None) at hand."""
        f = self.token_factor
        return (self.gamma(rates) * rates.queued_chars * f + chars * f) * measured.time_per_token_s

    def queue_wait_s(self, rates: ReplicaRates, model: str | None = None) -> float | None:
        """The queue part of W^ (gamma x q x f x t^), s: how long a new request waits behind this balancer's
        requests in flight there; ``model`` None: t^ over every model. None when unmeasured."""
        measured = rates.overall if model is None else rates.for_model(model)
        if measured is None or measured.time_per_token_s is None:
            return None
        return self.gamma(rates) * self.queue_tokens(rates) * measured.time_per_token_s

    # -- bookkeeping ----------------------------------------------------------------------------------------------
    def dispatched(self, rates: ReplicaRates, request_id: str, model: str, text: str, *,
                   chars: int | None = None) -> None:
        """A request (id, model, prompt ``text``; ``chars``: its ``prompt_chars`` when already counted) was sent
        to the replica with ``rates``: note W^ and its place in the queue (idempotent per request id)."""
        if request_id in rates.inflight:
            return
        chars = prompt_chars(text) if chars is None else chars
        rates.inflight[request_id] = InFlight(model, chars, self.estimate_s(rates, model, chars),
                                              alone=not rates.inflight)
        rates.queued_chars += chars

    def released(self, rates: ReplicaRates, request_id: str) -> InFlight | None:
        """The request's response ended (any outcome): it leaves the replica's queue. Returns its record."""
        flight = rates.inflight.pop(request_id, None)
        if flight is not None:
            rates.queued_chars = max(0, rates.queued_chars - flight.chars)
        return flight

    def observe(self, rates: ReplicaRates, request_id: str, usage: Usage, *, ttft_s: float | None,
                e2e_s: float) -> bool:
        """Learn from request ``request_id``'s response on the replica with ``rates`` (OllamaRouter §4.3).

        ``usage``: what the response reported; ``ttft_s``: dispatch to first byte, s (None: not streamed);
        ``e2e_s``: dispatch to the end of the response, s (the paper's measured W). Call before ``released``.
        Returns False (nothing learned) for a request not in flight there or a response without token counts.
        """
        flight = rates.inflight.get(request_id)
        prompt = usage.prompt_tokens if usage.prompt_tokens is not None else usage.prefilled_tokens
        out = usage.output_tokens
        if flight is None or prompt is None or out is None or prompt + out <= 0 or e2e_s < 0:
            return False
        a = self.alpha
        total = prompt + out
        prefilled = usage.prefilled_tokens if usage.prefilled_tokens is not None else prompt
        engine_timed = usage.prompt_s is not None and usage.decode_s is not None
        service_s = usage.prompt_s + usage.decode_s if engine_timed else e2e_s
        per_token = service_s / total
        # Prefill and decode rates: the engine's durations, else the measured times when nothing of ours was
        # queued ahead (a TTFT behind other requests is queueing, not prefill).
        prefill = decode = None
        if usage.prompt_s is not None and prefilled > 0:
            prefill = usage.prompt_s / prefilled
        elif ttft_s is not None and flight.alone and prefilled > 0:
            prefill = ttft_s / prefilled
        if usage.decode_s is not None and out > 0:
            decode = usage.decode_s / out
        elif ttft_s is not None and flight.alone and out > 1:
            decode = max(0.0, e2e_s - ttft_s) / (out - 1)
        itl = (usage.decode_s / out if usage.decode_s is not None and out > 0 else
               max(0.0, e2e_s - ttft_s) / (out - 1) if ttft_s is not None and out > 1 else None)
        for m in (rates.models.setdefault(flight.model, ModelRates()), rates.overall):
            m.time_per_token_s = _ema(m.time_per_token_s, per_token, a)
            if itl is not None:
                m.itl_s = _ema(m.itl_s, itl, a)
            m.service_s = _ema(m.service_s, e2e_s, a)
            if prefill is not None:
                m.prefill_s_per_token = _ema(m.prefill_s_per_token, prefill, a)
            if decode is not None:
                m.decode_s_per_token = _ema(m.decode_s_per_token, decode, a)
            m.samples += 1
        if flight.chars > 0:
            self.learned_factor = _ema(self.learned_factor, total / flight.chars, a)
        if not flight.estimate_s:
            rates.gamma = 1.0
        else:
            rates.gamma = max(0.0, min(2.0, rates.gamma * (1.0 + a * (e2e_s / flight.estimate_s - 1.0))))
        return True
