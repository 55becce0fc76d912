"""Admission capacity learned from probes: how many requests a replica runs at once, so that selective pushing
sends up to that many between two probes and no more.

An engine runs a continuous batch whose size is bounded by a slot count (vLLM ``max_num_seqs``, SGLang
``max_running_requests``, TGI ``max_batch_size``, llama.cpp ``--parallel``) and by its KV cache (vLLM preempts,
SGLang retracts, both put the request back in their waiting queue). Only llama.cpp reports its slots
(``total_slots`` in ``GET /props``); the others report how many requests run and how many wait (vLLM
``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, SGLang ``sglang:num_running_reqs`` /
``sglang:num_queue_reqs``, TGI ``tgi_batch_current_size`` / ``tgi_queue_size``). A probe showing requests waiting
says the engine admitted no more than the ones running; a probe showing the batch at the limit and nothing waiting
says the limit may be higher. A preemption or retraction shows as a waiting request, so it lowers the limit too.

The rule, additive increase and multiplicative decrease after TCP's congestion control (RFC 5681 §3.1, slow start
and congestion avoidance), per replica:

* Start at ``initial`` (2): a replica with a batch of 2 never gets a request it cannot run.
* Requests waiting (pending > 0) at every probe for at least ``settle_s`` (0.5 s), the most running in the batch
  at those probes being ``running``: limit = max(running, limit // 2). A request sent a moment ago waits until the
  engine's next step, and a step holding a long chunked prefill lasts hundreds of ms (2048 tokens at 0.48 ms per
  token on an L4), so waiting seen at one probe, or a few in a row, proves nothing (measured on the emulator: a
  batch of 32 read as 2); waiting that outlasts a step does. The sample is the batch the engine actually kept;
  the halving bounds the fall, for a long prompt held back by the step's token budget (vLLM
  ``max_num_batched_tokens``) beside a half-empty batch.
* The batch at the limit (running >= limit) and nothing waiting: the engine took everything sent, so the limit
  grows. Before requests have waited (slow start) by a quarter (at least 1) per probe, so a batch of 4 sees at
  most 1 request waiting and a batch of 256 is reached in about 25 probes; after that by an eighth (at least 1), at
  most once per ``hold_s`` (congestion avoidance: the KV cache's share of the limit moves with request lengths, so
  it is retested now and then). A retest is undone at the first probe that shows requests waiting while the batch
  is no larger than before it, and kept at the first that shows a larger batch: without that, waiting that ended
  within ``settle_s`` (a batch of 4 turns over every few hundred ms) never lowered the limit, and it crept up with
  one more request waiting in the engine at every retest (measured live: 1.3 requests waiting on average, where
  HAProxy's per-server ``maxconn`` left 0.3).
  ``hold_s`` is 1 s, not the 5 s it was: after a fall (a burst of cold prompts filling the KV cache early in a run
  halved one limit to 15 where the engine later ran 90), growing by an eighth per 5 s took over a minute to
  return, while the balancer queued hundreds of requests for engines with room (simulated 150-tenant workload at
  2x, validation seed: P90 TTFT 41.6 s at 5 s, 0.66 s at 1 s); an undone retest costs one request waiting for a
  step, now at most once a second.

Between probes the balancer counts what it sent (skylb/core/state.py): a replica is full when the probe's running
count plus the requests sent since that probe, or this balancer's own requests in flight there, reach the limit
plus ``pending_allowance`` (one by default: a request waiting in the engine fills a freed slot at its next step, and
the waiting it shows at each probe keeps the limit on the engine's true batch), but no allowance on room a retest or
slow start added that no probe proved, nor while a request waits beside the batch slow start grew from
(``AdmissionCapacity.allowance_ok``).

A bound the operator states (the replica's ``max_concurrency``: vLLM ``--max-num-seqs``, SGLang
``--max-running-requests``, TGI ``--max-batch-size``) is the limit's ``ceiling``: the limit starts there, proven,
instead of at ``initial`` (slow start is what a balancer does when it does not know the batch; knowing it, the
first burst fills every batch at once, as HAProxy's per-server ``maxconn`` does), and it never grows past it.
Probes still lower it when requests wait beside a smaller batch (a KV cache that holds fewer long prompts than the
slots), and it grows back up to the ceiling as above.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdmissionCapacity"]


@dataclass
class AdmissionCapacity:
    """One replica's learned admission capacity (requests it runs at once).

    Attributes:
        limit: the current estimate, requests (>= 1).
        saturated: requests have waited for ``settle_s`` at least once (slow start is over).
        waiting_since: time of the first of the consecutive probes, up to the latest, that showed requests waiting,
            s (None: the latest showed none); streak_running: the most running at those probes.
        settle_s: how long requests must be seen waiting before the batch is taken as full, s.
        held_since: time of the latest decrease or congestion-avoidance increase, s (None: never); the limit
            grows again only ``hold_s`` after it.
        hold_s: see ``held_since``, s.
        trial_from: the limit before the retest under way (None: none is).
        grown_from: during slow start, the limit before its latest growth, until a probe shows the engine running
            more than that (None: the limit is proven, or no growth is under way).
        waited_at: the ``grown_from`` that a probe showing requests waiting beside no larger a batch ended, until a
            probe shows a larger batch or nothing waiting, or waiting settles the limit (see ``allowance_ok``).
        ceiling: the batch bound the operator stated (requests; None: none stated), see ``state_ceiling``.
        full_at: the ``waited_at`` that a probe with nothing waiting ended while the batch was still no larger and
            one of this balancer's requests there had ended since the wait was seen: the waiting request may have
            taken that request's place, not a slot above the batch, so the room above this batch is not known to
            exist, until a probe shows the engine running more or the limit falls to it. With none ended, the
            request got in through a place of its own (it waited for the engine's next step) and nothing is marked.
            Read only by the ranking of free slots (skylb/core/state.py ``below_waited_batch``); the limit and the
            pending allowance do not read it. Measured: bench/results/concurrency.md.
        ended_at_wait: the replica's count of this balancer's requests ended there (``ReplicaState.ended``) when
            ``waited_at`` was set.
        in_old_batch: the requests waiting when ``waited_at`` was set fit beside the running ones in the batch slow
            start grew from (running + pending <= ``grown_from``): one of that batch ended and the request sent to
            its place waited for the engine's next step.
        untried_at: the ``waited_at`` of such a wait that a probe with nothing waiting ended, with none of this
            balancer's requests ended since: the waiting request took the place in the old batch, so the place above
            it was never tried (read as proven, it took a request live that waited 4 s for its batch of 4 to turn
            over, bench/results/concurrency.md). Ended as ``full_at`` is; read only by the ranking of free slots,
            which weighs it by the batch's turnover (skylb/core/state.py ``below_waited_batch``).
    """

    limit: int = 2
    saturated: bool = False
    waiting_since: float | None = None
    streak_running: int = 0
    held_since: float | None = None
    hold_s: float = 1.0
    settle_s: float = 0.5
    trial_from: int | None = None
    grown_from: int | None = None
    waited_at: int | None = None
    ceiling: int | None = None
    full_at: int | None = None
    ended_at_wait: int = 0
    in_old_batch: bool = False
    untried_at: int | None = None

    def state_ceiling(self, ceiling: int | None) -> None:
        """Take ``ceiling`` (requests, >= 1; None: no bound stated) as the engine's batch bound: before any request
        has waited the limit is set to it, proven; after, the learned limit is kept below it. Removing the bound
        keeps the limit as it is, to be learned from there. Calling it again with the same bound changes nothing."""
        if ceiling is not None and ceiling < 1:
            raise ValueError(f"a batch bound is at least 1 request, not {ceiling}")
        if ceiling == self.ceiling:
            return
        self.ceiling = ceiling
        if ceiling is None:
            return
        self.limit = min(self.limit, ceiling) if self.saturated else ceiling
        self.trial_from = self.grown_from = self.waited_at = self.full_at = self.untried_at = None

    @property
    def proven_limit(self) -> int:
        """The limit less what a retest or slow start added and no probe has shown the engine running yet: the
        slots known to exist (requests). Selective pushing fills these first (skylb/core/state.py
        ``has_free_slot``); the rest are tried only when every replica's proven slots are taken."""
        unproven = self.trial_from if self.trial_from is not None else self.grown_from
        return self.limit if unproven is None else min(self.limit, unproven)

    @property
    def allowance_ok(self) -> bool:
        """True when a request may wait in the engine's queue beyond the limit (``pending_allowance``): the limit is
        proven, and no request waits beside a batch no larger than the one before slow start's latest growth.
        Such waiting is either a request waiting for the engine's next step (the slot exists) or one behind a full
        batch (it does not); until a probe tells which, one more request on top would wait behind a full batch in
        the second case (measured live, 4 replicas of batch 4 at 16 concurrent streams: at start-up, one request
        in 160 went to a batch of 4 as its fifth and waited 4 s)."""
        return self.waited_at is None and self.proven_limit >= self.limit

    def observe(self, now: float, pending: int, running: int, ended: int | None = None) -> None:
        """Learn from one probe at ``now`` (s) showing ``pending`` requests waiting and ``running`` in the batch;
        ``ended``: how many of this balancer's requests have ended on the replica so far (None: not counted, and
        ``full_at`` is never set)."""
        if self.waited_at is not None and (running > self.waited_at or pending == 0):
            if running <= self.waited_at and ended is not None:
                if ended > self.ended_at_wait:
                    self.full_at = self.waited_at  # nothing waits, but the engine never ran more: maybe no room above
                elif self.in_old_batch:
                    self.untried_at = self.waited_at  # it took a place in the old batch: the one above is untried
            self.waited_at = None  # the batch grew past it, or nothing waits: the room is the engine's
        if self.full_at is not None and (running > self.full_at or self.limit <= self.full_at):
            self.full_at = None  # the engine ran more, or the limit is back at that batch
        if self.untried_at is not None and (running > self.untried_at or self.limit <= self.untried_at):
            self.untried_at = None
        if self.grown_from is not None and (running > self.grown_from or pending > 0):
            if running <= self.grown_from:
                self.waited_at = self.grown_from  # waiting beside the old batch: maybe for a step, maybe a slot
                self.ended_at_wait = ended or 0
                # The waiting requests fit in the old batch (one of it ended, its successor waits for a step):
                # however it ends, the place above that batch was not tried.
                self.in_old_batch = running + pending <= self.grown_from
            self.grown_from = None  # proven by a larger batch, or the growth ends here (waiting is being judged)
        if self.trial_from is not None:
            if running > self.trial_from:
                self.trial_from = None  # the engine ran more than before the retest: the raise holds
            elif pending > 0:
                self.limit, self.trial_from, self.held_since = self.trial_from, None, now
                return
        if pending > 0:
            if self.waiting_since is None:
                self.waiting_since, self.streak_running = now, running
            self.streak_running = max(self.streak_running, running)
            if now - self.waiting_since >= self.settle_s:
                self.limit = self._capped(max(1, self.streak_running, self.limit // 2))
                self.saturated = True
                self.held_since = now
                self.waited_at = self.full_at = self.untried_at = None  # the limit is measured now
            return
        self.waiting_since = None
        if running < self.limit or (self.ceiling is not None and self.limit >= self.ceiling):
            return  # room left, or the stated bound reached: nothing to learn by growing
        if not self.saturated:
            self.grown_from = max(running, self.limit)
            self.limit = self._capped(self.grown_from + max(1, self.limit // 4))
        elif self.held_since is None or now - self.held_since >= self.hold_s:
            self.trial_from = max(running, self.limit)
            self.limit = self._capped(self.trial_from + max(1, self.limit // 8))
            self.held_since = now

    def _capped(self, limit: int) -> int:
        return limit if self.ceiling is None else min(limit, self.ceiling)
