"""One prefill model for every replica: seconds to a first token as a fixed part plus a per-token part, fitted online
from every response by a bounded regression.

Source: the engines' schedulers. vLLM V1 and SGLang admit prompts first come, first served and prefill them in
chunks of a step's token budget (vLLM ``max_num_batched_tokens``), so a request's time to first token on a replica
that had room when it arrived is about ``fixed_s + s_per_token x x``, where ``x`` is the prompt tokens that replica
had to prefill up to and including this request's own (the backlog queued ahead of it plus its uncached tokens) and
``fixed_s`` holds what does not grow with tokens (a step's weight read, scheduling, the HTTP hop to the engine).
Decision 10 of the design: the same model prices a local replica and a peer's, and is learned from all responses,
not only from those that were alone on their replica (under load those are rare, and a TTFT taken behind other
requests then inflated a per-token rate learned as ``TTFT / tokens``).

The fit is weighted least squares with exponential forgetting (each new sample multiplies the old weights by
``forget``, so about ``1 / (1 - forget)`` recent samples count: the bound), over sufficient statistics (five
floats: O(1) memory and time per sample). It starts from a prior line, given as pseudo-samples of total weight
``prior_weight`` at two token counts, so a replica with few samples stays near the prior and one with many follows
its data. Each replica's prior is its class's fit (the replicas of one balancer serving the same models with the
same engine: identical hardware is the common case, and pooling gives a new replica a measured figure at once); the
class's prior is the configured figures (``fixed_s``, ``tokens_per_s``). Both coefficients are kept non-negative.

Units: tokens, seconds. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PrefillLine", "PrefillFit", "PrefillBook"]


@dataclass(frozen=True)
class PrefillLine:
    """A prefill model: ``fixed_s + s_per_token x tokens`` seconds.

    Attributes: fixed_s: the part that does not grow with tokens, s; s_per_token: seconds per prompt token.
    """

    fixed_s: float
    s_per_token: float

    def seconds(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` (clamped at 0) from a standing start: fixed part included."""
        return self.fixed_s + self.s_per_token * max(0.0, tokens)


@dataclass
class PrefillFit:
    """Exponentially forgetting weighted least squares of ``ttft_s`` on ``tokens`` with a prior line.

    Args:
        forget: each sample multiplies the earlier samples' weights by this, in (0, 1); about ``1 / (1 - forget)``
            recent samples carry the fit.
        prior_weight: the prior's weight, in samples.
        span_tokens: the token count at which the prior's second pseudo-sample sits (its first is at 0): about a
            typical prompt, so the prior pins both the intercept and the slope.
    """

    forget: float = 0.98
    prior_weight: float = 4.0
    span_tokens: float = 2048.0
    # Sufficient statistics of the data alone (the prior is added when solving, so it can move).
    _w: float = field(default=0.0, repr=False)
    _x: float = field(default=0.0, repr=False)
    _y: float = field(default=0.0, repr=False)
    _xx: float = field(default=0.0, repr=False)
    _xy: float = field(default=0.0, repr=False)
    samples: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        """Learn one response: ``tokens`` prefilled up to its first token (backlog ahead + its own), ``seconds``
        from dispatch to its first token. Negative or non-finite inputs are ignored."""
        if not (tokens >= 0 and seconds >= 0) or tokens == float("inf") or seconds == float("inf"):
            return
        f = self.forget
        self._w = self._w * f + 1.0
        self._x = self._x * f + tokens
        self._y = self._y * f + seconds
        self._xx = self._xx * f + tokens * tokens
        self._xy = self._xy * f + tokens * seconds
        self.samples += 1

    def line(self, prior: PrefillLine) -> PrefillLine:
        """The fitted line given ``prior`` (the prior alone before any sample); coefficients kept >= 0."""
        if not self.samples:
            return prior
        half = self.prior_weight / 2.0
        x1 = self.span_tokens
        y0, y1 = prior.fixed_s, prior.seconds(x1)
        w = self._w + 2 * half
        sx = self._x + half * x1
        sy = self._y + half * (y0 + y1)
        sxx = self._xx + half * x1 * x1
        sxy = self._xy + half * x1 * y1
        det = w * sxx - sx * sx
        if det <= 1e-12:
            return prior
        slope = (w * sxy - sx * sy) / det
        if slope < 0.0:
            # Flat data (every sample the same length) cannot say the slope: keep the prior's and refit the mean.
            slope = prior.s_per_token
        intercept = (sy - slope * sx) / w
        if intercept < 0.0:
            # A line through the origin instead (weighted least squares with no intercept).
            return PrefillLine(0.0, max(0.0, sxy / sxx) if sxx > 0 else prior.s_per_token)
        return PrefillLine(intercept, slope)


class PrefillBook:
    """The prefill models of one balancer's replicas: one fit per replica class and one per replica.

    Args:
        prior: the configured line (the engine's and GPU's figures) that every class starts from.
        forget, prior_weight, span_tokens: as in PrefillFit.
    """

    def __init__(self, prior: PrefillLine, *, forget: float = 0.98, prior_weight: float = 4.0,
                 span_tokens: float = 2048.0):
        self.prior = prior
        self._kw = {"forget": forget, "prior_weight": prior_weight, "span_tokens": span_tokens}
        self._classes: dict[object, PrefillFit] = {}
        self._replicas: dict[str, PrefillFit] = {}
        self._cache: dict[tuple[str, object], tuple[int, int, PrefillLine]] = {}

    def _fit(self, table: dict, key) -> PrefillFit:
        fit = table.get(key)
        if fit is None:
            fit = table[key] = PrefillFit(**self._kw)
        return fit

    def observe(self, replica_id: str, klass: object, tokens: float, seconds: float) -> None:
        """Learn one response of replica ``replica_id`` (of class ``klass``, any hashable): PrefillFit.add."""
        self._fit(self._classes, klass).add(tokens, seconds)
        self._fit(self._replicas, replica_id).add(tokens, seconds)

    def class_line(self, klass: object) -> PrefillLine:
        """The fitted line of class ``klass`` (the configured prior before any sample)."""
        fit = self._classes.get(klass)
        return self.prior if fit is None else fit.line(self.prior)

    def line(self, replica_id: str, klass: object) -> PrefillLine:
        """The fitted line of replica ``replica_id``, its class's fit being its prior (cached until a sample)."""
        fit, cfit = self._replicas.get(replica_id), self._classes.get(klass)
        stamp = (fit.samples if fit else 0, cfit.samples if cfit else 0)
        cached = self._cache.get((replica_id, klass))
        if cached is not None and cached[:2] == stamp:
            return cached[2]
        prior = self.class_line(klass)
        line = prior if fit is None else fit.line(prior)
        self._cache[(replica_id, klass)] = (*stamp, line)
        return line

    def forget_replica(self, replica_id: str) -> None:
        """Drop what was learned of ``replica_id`` (it left membership)."""
        self._replicas.pop(replica_id, None)
        for key in [k for k in self._cache if k[0] == replica_id]:
            del self._cache[key]
