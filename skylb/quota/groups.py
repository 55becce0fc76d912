"""Model groups: choose which model of a group serves a request, by weighted deficit round robin (WDRR) gated per
model by its limits (tokens-per-minute bucket, concurrency cap) and by the model being served somewhere.

Source: the LLM-Load-Balancer README, "Iteration 1" ("Scheduling Model (WDRR + Concurrency + TPM)") and
"Iteration 2" C/D (age bonus, jittered waits aligned to the refill tick).

Two layers:

* Pure arithmetic (no I/O, no clock: time is an argument): :class:`Wdrr` (deficits and the round-robin pointer of
  one group), :func:`blocked_by_elder` (the age bonus), :func:`jittered_wait_ms` ("Iteration 2" D).
* The gate, async: :class:`ModelGate` tries the group's models in WDRR order through the LimitBackend
  (``balancer.limits``), charging the tenant's and the model's buckets (``Quotas.limits_for``), and either admits
  one (an :class:`Admitted`, to be released when the request ends) or says how long until capacity may be back.

WDRR as implemented (the README's "Iteration 1", with two deliberate differences):

* Rounds a request cannot be served in are skipped at once (closed form) instead of one round per schedule call,
  so WDRR alone never makes a request wait while a model has room: only the limits do.
* The quantum of a round is the estimated tokens of the request that needs it times ``weight / lightest weight``,
  credited to every admissible model at once: one round serves the lightest model one request of that size and a
  model of weight 3 three (short runs, not the bursts of Q / size requests a fixed quantum of Q tokens gives), and
  every round credits the models in proportion to their weights, so tokens served follow the weights.
A model refused by its limits is treated as an empty queue of classic DRR: its deficit is reset to 0 (it cannot
take its share now, so it does not bank credit for a burst later).

Age bonus ("Iteration 2" C, "so large tasks do not starve"): a request waiting in the balancer earns
``AGE_BONUS_TOKENS_PER_S`` tokens of credit per second waited; once its credit covers its estimated tokens it is
*ripe*, and while the oldest ripe waiter of a (group, tenant) waits, younger requests of that (group, tenant) are
not admitted ahead of it. Small requests pass large ones at first (size-aware), yet a large one waits at most about
``tokens / AGE_BONUS_TOKENS_PER_S`` s plus the time its bucket takes to refill.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from skylb.quota.buckets import Grant, LimitBackend
from skylb.quota.limits import Limit, Quotas

__all__ = ["Wdrr", "Waiter", "blocked_by_elder", "jittered_wait_ms", "ModelGate", "Admitted", "Refused",
           "AGE_BONUS_TOKENS_PER_S", "SLOT_RETRY_S", "TICK_MS", "MIN_WAIT_MS"]

#: Credit a waiting request earns per second waited (tokens/s): the age bonus of LLM-Load-Balancer's "Iteration 2" C.
AGE_BONUS_TOKENS_PER_S = 1000.0
#: Retry delay when the refusal is a concurrency cap, whose release time nobody can predict (s; the LLM-Load-Balancer
#: README's SHORT_BACKOFF_MS "100-250 ms"). A release on this balancer wakes its waiters sooner.
SLOT_RETRY_S = 0.2
#: The refill tick waits are aligned to (ms; LLM-Load-Balancer "Iteration 2" D, "next 100 ms boundary").
TICK_MS = 100
#: The smallest wait returned (ms; LLM-Load-Balancer "Iteration 2" D, ``max(50, aligned_wait_ms)``).
MIN_WAIT_MS = 50


class Wdrr:
    """The WDRR state of one group: a deficit per model (tokens) and the model the pointer is at.

    ``pick`` chooses, ``charge`` debits the model that admitted, ``refused`` resets a model its limits refused.
    Pure: no I/O, no clock.
    """

    def __init__(self) -> None:
        self.deficits: dict[str, float] = {}
        self.current: str | None = None

    def pick(self, members: Mapping[str, float], tokens: int, admissible: Collection[str]) -> str | None:
        """The model to try next for a request of ``tokens`` estimated tokens, among ``admissible`` members
        ({model: weight > 0}); None when no member is admissible. Adds the quanta of the rounds it runs to the
        admissible models' deficits (the caller then ``charge``s the model that admitted, or reports it
        ``refused``)."""
        order = sorted(members)
        candidates = [m for m in order if m in admissible]
        if not candidates:
            return None
        for gone in [m for m in self.deficits if m not in members]:
            del self.deficits[gone]
        tokens = max(1, tokens)
        d = self.deficits
        if self.current in candidates and d.get(self.current, 0.0) >= tokens:
            return self.current  # DRR: the pointer stays while the deficit lasts
        lightest = min(members[m] for m in candidates)
        # Rotation order: the candidates after the pointer first.
        start = 0
        if self.current is not None:
            start = next((i for i, m in enumerate(candidates) if m > self.current), 0)
        rotation = candidates[start:] + candidates[:start]
        if not any(d.get(m, 0.0) >= tokens for m in candidates):
            # Run the rounds needed for some candidate to reach ``tokens`` at once (closed form), each round
            # crediting every candidate its quantum.
            quantum = {m: tokens * members[m] / lightest for m in candidates}
            rounds = max(1, min(math.ceil((tokens - d.get(m, 0.0)) / quantum[m]) for m in candidates))
            for m in candidates:
                d[m] = d.get(m, 0.0) + rounds * quantum[m]
        model = next(m for m in rotation if d.get(m, 0.0) >= tokens)
        self.current = model
        return model

    def charge(self, model: str, tokens: int) -> None:
        """``model`` admitted a request of ``tokens`` tokens: debit its deficit."""
        self.deficits[model] = self.deficits.get(model, 0.0) - max(1, tokens)

    def refused(self, model: str) -> None:
        """``model``'s limits refused: reset its deficit (an empty queue in classic DRR) and move the pointer on."""
        self.deficits[model] = 0.0


@dataclass(eq=False)
class Waiter:
    """A request waiting in the balancer for a group: its estimated ``tokens`` and when it started waiting (s).
    Compared by identity: two waiters of the same size arriving at the same instant are still two."""

    tokens: int
    since: float


def blocked_by_elder(waiters: Sequence[Waiter], me: Waiter | None, now: float,
                     rate: float = AGE_BONUS_TOKENS_PER_S) -> bool:
    """True when ``me`` (None: a caller that holds no place, as /skylb/v1/schedule) must let an older *ripe* waiter
    go first: ripe means its age bonus ``rate * (now - since)`` (tokens) covers its ``tokens``. Among ripe waiters
    the oldest goes first. Pure."""
    ripe = [w for w in waiters if w is not me and rate * (now - w.since) >= w.tokens]
    if not ripe:
        return False
    if me is None:
        return True
    return any(w.since < me.since or (w.since == me.since and id(w) < id(me)) for w in ripe)


def jittered_wait_ms(base_s: float, rand: float, *, tick_ms: int = TICK_MS, min_ms: int = MIN_WAIT_MS) -> int:
    """The wait to return for a minimal wait of ``base_s`` seconds (LLM-Load-Balancer "Iteration 2" D):
    jittered by ±10 % (``rand`` uniform in [0, 1)), rounded up to the next ``tick_ms`` boundary, at least
    ``min_ms``. Returns ms."""
    base_ms = max(0.0, base_s) * 1000.0
    jittered = base_ms + (rand * 2.0 - 1.0) * 0.1 * base_ms
    aligned = math.ceil(jittered / tick_ms - 1e-9) * tick_ms
    return int(max(min_ms, aligned))


@dataclass
class Admitted:
    """An admission: the ``model`` chosen, the buckets charged (release them once), the tokens charged."""

    model: str
    buckets: list[tuple[str, Limit]]
    tokens: int
    released: bool = False


@dataclass
class Refused:
    """No member admitted now: ``wait_s`` until capacity may be back (s), and the last refusal's ``reason`` and
    bucket ``key`` (None when no member is served)."""

    wait_s: float
    reason: str | None = None
    key: str | None = None
    served: bool = True


@dataclass
class _Group:
    wdrr: Wdrr = field(default_factory=Wdrr)
    waiters: list[Waiter] = field(default_factory=list)


class ModelGate:
    """Admission of requests to a model or a model group, per tenant, through a LimitBackend.

    Args (callables, read on every use, so quotas applied at runtime and a replaced backend take effect):
        quotas: the Quotas in force; limits: the LimitBackend; served: the set of models some replica or peer
        serves now in API dialect ``api`` ("openai", "ollama"), or None while no probe has said (then every member
        counts as served); now: the clock (s).
    """

    def __init__(self, *, quotas: Callable[[], Quotas], limits: Callable[[], LimitBackend],
                 served: Callable[[str], Collection[str] | None], now: Callable[[], float]):
        self.quotas = quotas
        self.limits = limits
        self.served = served
        self.now = now
        self._groups: dict[tuple[str, str], _Group] = {}
        self._released = asyncio.Event()

    def members(self, name: str) -> dict[str, float]:
        """{model: weight} of group ``name``, or ``{name: 1.0}`` for a plain model."""
        group = self.quotas().groups.get(name)
        return dict(group) if group else {name: 1.0}

    def is_group(self, name: str) -> bool:
        """True when ``name`` is a group alias in the quotas in force."""
        return name in self.quotas().groups

    def _group(self, name: str, tenant: str) -> _Group:
        return self._groups.setdefault((name, tenant), _Group())

    async def try_admit(self, name: str, tokens: int, tenant: str, *, waiter: Waiter | None = None,
                        api: str = "openai") -> Admitted | Refused:
        """One attempt, without waiting: admit a request of ``tokens`` estimated tokens of ``tenant`` to a model of
        ``name`` (a group alias or a model), or say how long until one may admit."""
        now = self.now()
        group = self._group(name, tenant)
        if blocked_by_elder(group.waiters, waiter, now):
            return Refused(TICK_MS / 1000.0, "age_precedence")
        members = self.members(name)
        served = self.served(api)
        admissible = {m for m in members if served is None or m in served}
        if not admissible:
            return Refused(SLOT_RETRY_S, "not_served", served=False)
        quotas, limits = self.quotas(), self.limits()
        refusals: list[Grant] = []
        while True:
            model = group.wdrr.pick(members, tokens, admissible)
            if model is None:
                break
            buckets = quotas.limits_for(tenant, model)
            grant = await limits.acquire(buckets, tokens, self.now()) if buckets else Grant(True)
            if grant.ok:
                group.wdrr.charge(model, tokens)
                return Admitted(model, buckets, tokens)
            group.wdrr.refused(model)
            admissible.discard(model)
            refusals.append(grant)
        # The soonest any member may admit: a refill it can compute, or a slot's release (unknown: a short retry).
        best = min(refusals, key=lambda g: SLOT_RETRY_S if g.wait_s is None else g.wait_s)
        return Refused(SLOT_RETRY_S if best.wait_s is None else max(best.wait_s, 0.0), best.reason, best.key)

    async def admit(self, name: str, tokens: int, tenant: str, wait_s: float, *,
                    api: str = "openai") -> Admitted | Refused:
        """Admit, waiting up to ``wait_s`` seconds while no member admits (woken by releases on this balancer, or
        when the soonest refill is due); the last Refused when the time is up or no member is served."""
        loop_start = self.now()
        group = self._group(name, tenant)
        me = Waiter(tokens, loop_start)
        group.waiters.append(me)
        try:
            while True:
                released = self._released  # taken before trying, so a release during the try still wakes us
                outcome = await self.try_admit(name, tokens, tenant, waiter=me, api=api)
                if isinstance(outcome, Admitted) or not outcome.served:
                    return outcome
                left = loop_start + wait_s - self.now()
                if left <= 0:
                    return outcome
                try:
                    await asyncio.wait_for(released.wait(), timeout=min(outcome.wait_s, left) + 0.001)
                except TimeoutError:
                    pass
        finally:
            group.waiters.remove(me)

    async def release(self, admitted: Admitted, *, refund_tokens: int = 0) -> None:
        """The request admitted as ``admitted`` ended: free its slot and give back ``refund_tokens`` (at most the
        tokens charged). Idempotent: a second call does nothing."""
        if admitted.released:
            return
        admitted.released = True
        if admitted.buckets:
            await self.limits().release(admitted.buckets, self.now(),
                                        refund_tokens=max(0, min(refund_tokens, admitted.tokens)))
        released, self._released = self._released, asyncio.Event()
        released.set()

    def wait_ms(self, refused: Refused, rng: random.Random | None = None) -> int:
        """``refused``'s wait as the admission API returns it: jittered ±10 % and aligned to the refill tick (ms)."""
        return jittered_wait_ms(refused.wait_s, (rng or random).random())
